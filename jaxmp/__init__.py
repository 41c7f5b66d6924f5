"""jaxmp: mixed-precision training for JAX, Flax and Optax.

Precision policies with per-module overrides for Flax models, dynamic loss scaling as
an Optax transform, and fp8 matmuls with delayed scaling. Everything is a pure
function or an immutable pytree, so it composes with ``jit``, ``grad``, sharding,
``remat`` and checkpointing.

Example:
  >>> import jaxmp
  >>> policy = jaxmp.get_policy("params=float32,compute=bfloat16,output=float32")
"""

from jaxmp import diagnostics
from jaxmp import fp8
from jaxmp import hardware
from jaxmp import linen
from jaxmp import monitor
from jaxmp import nnx
from jaxmp import train
from jaxmp.diagnostics import sensitivity
from jaxmp.diagnostics import underflow_report
from jaxmp.dtypes import FloatFormat
from jaxmp.dtypes import float_format
from jaxmp.dtypes import half_dtype
from jaxmp.dtypes import parse_dtype
from jaxmp.hardware import device_capabilities
from jaxmp.hardware import recommended_policy
from jaxmp.loss_scale import DynamicLossScale
from jaxmp.loss_scale import LossScale
from jaxmp.loss_scale import NoOpLossScale
from jaxmp.loss_scale import StaticLossScale
from jaxmp.monitor import Monitor
from jaxmp.monitor import training_metrics
from jaxmp.policy import Policy
from jaxmp.policy import get_policy
from jaxmp.policy import to_jmp
from jaxmp.rules import PolicyRules
from jaxmp.rules import Rule
from jaxmp.summary import summary
from jaxmp.transforms import LossScalingState
from jaxmp.transforms import get_loss_scale
from jaxmp.transforms import loss_scaling
from jaxmp.transforms import loss_scaling_metrics
from jaxmp.tree import all_finite
from jaxmp.tree import cast_tree
from jaxmp.tree import select_tree

__version__ = "0.1.0"

__all__ = (
    "DynamicLossScale",
    "FloatFormat",
    "LossScale",
    "LossScalingState",
    "Monitor",
    "NoOpLossScale",
    "Policy",
    "PolicyRules",
    "Rule",
    "StaticLossScale",
    "all_finite",
    "cast_tree",
    "device_capabilities",
    "diagnostics",
    "float_format",
    "fp8",
    "get_loss_scale",
    "get_policy",
    "half_dtype",
    "hardware",
    "linen",
    "loss_scaling",
    "loss_scaling_metrics",
    "monitor",
    "nnx",
    "parse_dtype",
    "recommended_policy",
    "select_tree",
    "sensitivity",
    "summary",
    "to_jmp",
    "train",
    "training_metrics",
    "underflow_report",
)
