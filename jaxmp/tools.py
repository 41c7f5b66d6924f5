"""Tools for looking at mixed precision: what ran, what a dtype loses, how training goes.

* :func:`summary`: the per-module precision table of one call of a model.
* :func:`audit`: what a compiled step actually runs (GEMM dtypes and backends,
  unfused converts, HBM bytes, a roofline estimate), locally or deviceless for an
  H100/A100/B200 or a TPU v5e/v5p/v6e/v7 (a TPU compile runs in a child process: a
  compiler crash raises :class:`CompileCrashError` and this process goes on).
* :func:`underflow_report` / :func:`underflow_stats`: what a dtype (and a loss scale)
  would flush, make subnormal or overflow in a tree of values;
  :func:`suggest_scale` the loss scale that brings them into range.
* :func:`sensitivity` / :func:`deviation` / :func:`relative_error`: which modules can
  compute in half precision.
* :func:`training_metrics` (inside ``jit``) and :class:`Monitor` (on the host):
  gradient norms, non-finite counts, loss-scale collapse, skip rate, loss spikes, and
  the module where a skipped step's first inf or NaN appeared.
* :class:`PrecisionController` / :func:`propose_change`: a run that keeps overflowing
  moves the module that overflows (or, with no single culprit, the model) to a wider
  dtype, by rule, with the evidence logged.
* :func:`nonfinite_report`: that module and direction, and the per-module amax table,
  from the trace of a model wrapped with ``PolicyRules(trace_nonfinite=True)``.
* :func:`device_capabilities` / :func:`recommended_policy`: what a device computes fast.
* :func:`recommend_precision`: which candidate rules (bf16, fp8, int8...) the compiler
  estimates fastest for the user's own step on a chip, never one slower than the baseline.
* :func:`memory_report`: bytes per parameter of params, master weights, gradients and
  optimizer state, and the compiled step's memory analysis.
* :func:`float_format` / :func:`parse_dtype`: dtype names and the numbers of a format.

Example:
  >>> jaxmp.tools.float_format("bf16").max
  3.3895313892515355e+38
"""

from jaxmp._src.dtypes import FloatFormat
from jaxmp._src.dtypes import float_format
from jaxmp._src.dtypes import parse_dtype
from jaxmp._src.nonfinite import NonfiniteTrace
from jaxmp._src.tools.adaptive import DivergenceError
from jaxmp._src.tools.adaptive import PrecisionChange
from jaxmp._src.tools.adaptive import PrecisionController
from jaxmp._src.tools.adaptive import propose_change
from jaxmp._src.tools.audit import AuditReport
from jaxmp._src.tools.audit import audit
from jaxmp._src.tools.hardware import DeviceCapabilities
from jaxmp._src.tools.hardware import RecommendedPolicy
from jaxmp._src.tools.hardware import device_capabilities
from jaxmp._src.tools.hardware import recommended_policy
from jaxmp._src.tools.isolated_compile import CompileCrashError
from jaxmp._src.tools.memory import CompiledMemory
from jaxmp._src.tools.memory import MemoryReport
from jaxmp._src.tools.memory import memory_report
from jaxmp._src.tools.monitor import Anomaly
from jaxmp._src.tools.monitor import Monitor
from jaxmp._src.tools.monitor import StepRecord
from jaxmp._src.tools.monitor import training_metrics
from jaxmp._src.tools.nonfinite import ModuleAmax
from jaxmp._src.tools.nonfinite import NonfiniteReport
from jaxmp._src.tools.nonfinite import Origin
from jaxmp._src.tools.nonfinite import nonfinite_report
from jaxmp._src.tools.recommend import CandidateEstimate
from jaxmp._src.tools.recommend import PrecisionRecommendation
from jaxmp._src.tools.recommend import recommend_precision
from jaxmp._src.tools.sensitivity import SensitivityReport
from jaxmp._src.tools.sensitivity import deviation
from jaxmp._src.tools.sensitivity import relative_error
from jaxmp._src.tools.sensitivity import sensitivity
from jaxmp._src.tools.summary import PrecisionSummary
from jaxmp._src.tools.summary import summary
from jaxmp._src.tools.underflow import UnderflowReport
from jaxmp._src.tools.underflow import suggest_scale
from jaxmp._src.tools.underflow import underflow_report
from jaxmp._src.tools.underflow import underflow_stats

__all__ = (
    "Anomaly",
    "AuditReport",
    "CandidateEstimate",
    "CompileCrashError",
    "CompiledMemory",
    "DeviceCapabilities",
    "DivergenceError",
    "FloatFormat",
    "MemoryReport",
    "ModuleAmax",
    "Monitor",
    "NonfiniteReport",
    "NonfiniteTrace",
    "Origin",
    "PrecisionChange",
    "PrecisionController",
    "PrecisionRecommendation",
    "PrecisionSummary",
    "RecommendedPolicy",
    "SensitivityReport",
    "StepRecord",
    "UnderflowReport",
    "audit",
    "device_capabilities",
    "deviation",
    "float_format",
    "memory_report",
    "nonfinite_report",
    "parse_dtype",
    "propose_change",
    "recommend_precision",
    "recommended_policy",
    "relative_error",
    "sensitivity",
    "suggest_scale",
    "summary",
    "training_metrics",
    "underflow_report",
    "underflow_stats",
)
