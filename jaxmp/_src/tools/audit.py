"""``audit``: what a compiled step actually runs: GEMM dtypes and backends, bytes, time.

A mixed-precision policy says what a model *should* compute in; the compiler decides
what runs. fp8 matmuls silently running as bfloat16 (or float32) GEMMs, a GEMM that
writes float32 and a separate kernel that narrows it, quantization split into several
passes over memory: none of it shows in the Python code, all of it shows in the
optimized HLO. :func:`audit` compiles a function, on the local backend or deviceless
for a GPU or TPU it does not have (:mod:`jaxmp._src.tools.targets`), and reads the
optimized HLO text:

* every GEMM (a cuBLAS/cuBLASLt call, a Triton or cuDNN GEMM fusion, a cuDNN fused
  attention call, cuDNN's MXFP8 block-scaled GEMM, a CPU dot, a TPU convolution
  fusion): the dtypes its operands hold (followed back through widening
  converts, so an fp8 tensor a CPU widens to float32 still reads as fp8), the dtypes
  the product reads, the dtype it writes, its backend and FLOPs;
* every other kernel and the HBM bytes it moves (every operand read once, every
  output written once, except an operand the fusion only slices, of which the
  slices are read, and a buffer updated in place, of which the update is written:
  :func:`~jaxmp._src.tools.hlo.kernel_bytes`); a loop's body counts its known trip
  count times, a conditional its cheapest branch;
* the converts and transposes left as kernels of their own;
* a roofline estimate of the step on GPUs: each kernel takes
  ``max(FLOPs / peak for its arithmetic, bytes / bandwidth)``, summed (no launch
  overheads, no overlap; :meth:`AuditReport.estimated_seconds_with_launches` adds a
  stated overhead per kernel launch); the peaks are in
  :mod:`~jaxmp._src.tools.targets`. float32
  GEMMs at XLA's default precision are counted at the TF32 rate (cuBLAS runs them as
  TF32), at ``HIGHEST`` at the float32 rate; jaxmp's block-scaled fp8 kernel at the
  bfloat16 rate, the speed it was measured at. On TPUs the estimate is the TPU
  compiler's own (``cost_analysis()["optimal_seconds"]``) and each kernel carries the
  cost model's ``estimated_cycles``. On a CPU there is no estimate.

Everything is an estimate from the compiler's output, never a measurement.
:func:`compiled_gemms` audits the three GEMMs of one fp8 recipe on one chip: the
evidence behind the fp8 support table that :mod:`jaxmp._src.fp8.support` states.

Example:
  >>> x = jnp.ones((64, 128), jnp.bfloat16)
  >>> w = jnp.ones((128, 32), jnp.bfloat16)
  >>> report = jaxmp.tools.audit(lambda x, w: x @ w, x, w)
  >>> [(g.operand_dtypes, g.output_dtype, g.flops) for g in report.gemms]
  [(('bfloat16', 'bfloat16'), 'float32', 524288)]
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src.fp8 import dot_general as fp8_dot_general
from jaxmp._src.fp8 import state as fp8_state
from jaxmp._src.fp8 import support as fp8_support
from jaxmp._src.tools import hlo as hlo_lib
from jaxmp._src.tools import isolated_compile
from jaxmp._src.tools import memory as memory_lib
from jaxmp._src.tools import table
from jaxmp._src.tools import targets as targets_lib

# Exact (value-preserving) conversions: each key's values are all representable in
# every type of its set, so a GEMM fed through such a convert multiplies the key's values.
_WIDER = {
    "f8e4m3fn": {"f16", "bf16", "f32", "f64"}, "f8e5m2": {"f16", "bf16", "f32", "f64"},
    "bf16": {"f32", "f64"}, "f16": {"f32", "f64"}, "f32": {"f64"},
    "s8": {"s16", "s32", "s64", "f16", "bf16", "f32", "f64"},
}
# Ops that move or replicate values without changing them.
_MOVES = frozenset({"bitcast", "copy", "transpose", "reshape", "broadcast", "slice",
                    "dynamic-slice"})
_GEMM_OPS = frozenset({"dot", "convolution", "scaled-dot"})
_CUBLAS = {"__cublas$lt$matmul$f8": "fp8 cuBLASLt", "__cublas$lt$matmul": "cuBLASLt",
           "__cublas$gemm": "cuBLAS"}
_FUSION_BACKENDS = {
    "__triton_gemm": "Triton GEMM fusion", "__triton_nested_gemm_fusion": "Triton GEMM fusion",
    "__triton_scaled_dot_fusion": "Triton scaled-dot fusion", "__cudnn$fusion": "cuDNN GEMM fusion",
    "__ynn_fusion": "CPU dot (YNNPACK)",
}
# Ops inside a kernel that only relabel or broadcast: a kernel of these plus converts
# and transposes does nothing but change a dtype or a layout.
_PLUMBING = frozenset({"parameter", "constant", "bitcast", "broadcast", "reshape", "tuple",
                       "get-tuple-element"})


_QUANTIZED = (("fp8", lambda d: d.startswith("float8")), ("int8", lambda d: d in ("int8", "uint8")))


def quantized_kind(dtypes: tuple[str, ...]) -> str | None:
  """``"fp8"`` or ``"int8"`` when every one of ``dtypes`` is of that kind, else ``None``.

  Example:
    >>> from jaxmp._src.tools import audit
    >>> audit.quantized_kind(("float8_e5m2", "float8_e4m3fn"))
    'fp8'
    >>> audit.quantized_kind(("int8", "bfloat16")) is None
    True
  """
  for kind, is_kind in _QUANTIZED:
    if dtypes and all(is_kind(d) for d in dtypes):
      return kind
  return None


def _operand_counts(gemms: tuple[Gemm, ...]) -> str:
  """The GEMMs on fp8 (and int8) operands, by what the operands hold, as the rows show it.

  A product that reads them in another type (a CPU widens fp8 to float32) says so:
  counted by the dtypes the product reads, the line would say "0 on fp8 operands" above
  rows whose operands hold fp8.
  """
  parts = []
  for kind, _ in _QUANTIZED:
    held = [g for g in gemms if quantized_kind(g.operand_dtypes) == kind]
    if kind != "fp8" and not held:
      continue
    text = f"{len(held)} on {kind} operands"
    widened = [g for g in held if quantized_kind(g.compute_dtypes) != kind]
    if widened:
      reads = "/".join(sorted({d for g in widened for d in g.compute_dtypes}))
      some = "" if len(widened) == len(held) else f"{len(widened)} of them "
      text += f", {some}read as {reads} by the product"
    parts.append(text)
  return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class Gemm:
  """One GEMM (or convolution) kernel of the compiled program.

  Attributes:
    name: the HLO instruction.
    backend: what runs it, e.g. ``"fp8 cuBLASLt"``, ``"cuBLASLt"``, ``"Triton GEMM
      fusion"``, ``"CPU dot (YNNPACK)"``, ``"TPU convolution fusion"``.
    operand_dtypes: the dtypes the two operands hold, followed back through
      widening converts (what precision the values have).
    compute_dtypes: the dtypes the product itself reads (a CPU reads fp8 and bfloat16
      operands as float32).
    output_dtype: the dtype the kernel writes to memory.
    shape: ``"MxNxK"`` (with ``"B*"`` in front for batched products).
    flops: ``2*M*N*K`` (times the batch), for every dot the kernel holds.
    bytes: operand and output bytes.
    rate: the peak the roofline used (``"fp8"``, ``"bf16"``, ``"tf32"``...), or None.
    seconds: the roofline time of one execution, or None.
    cycles: the TPU cost model's ``estimated_cycles``, or None.
    count: how often it runs per call (a loop's trip count).
  """

  name: str
  backend: str
  operand_dtypes: tuple[str, ...]
  compute_dtypes: tuple[str, ...]
  output_dtype: str
  shape: str
  flops: int
  bytes: int
  rate: str | None = None
  seconds: float | None = None
  cycles: int | None = None
  count: int = 1

  @property
  def fp8(self) -> bool:
    """Whether the product reads fp8 operands (not merely values that were fp8)."""
    return quantized_kind(self.compute_dtypes) == "fp8"


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One non-GEMM kernel: a fusion, a copy, a reduction, a non-GEMM custom call.

  Attributes:
    name: the HLO instruction.
    kind: the backend's kind for a custom fusion (``__triton``: a Triton
      softmax or reduction), else the fusion kind (``kLoop``, ``kInput``...) or the
      opcode.
    output: the result type, e.g. ``"bf16[4096,4096]"``.
    bytes: operand and output bytes.
    unfused: for a kernel that only converts and/or transposes, what it does (e.g.
      ``"convert f32->bf16"``); else None.
    seconds: ``bytes / bandwidth`` of one execution on a GPU target, else None.
    cycles: the TPU cost model's ``estimated_cycles``, or None.
    count: how often it runs per call.
  """

  name: str
  kind: str
  output: str
  bytes: int
  unfused: str | None = None
  seconds: float | None = None
  cycles: int | None = None
  count: int = 1


@dataclasses.dataclass(frozen=True, eq=False)
class AuditReport:
  """What :func:`audit` found; ``print`` it for the tables.

  Attributes:
    target: ``"h100"``, ``"v5e"``..., or the local platform (``"cpu"``).
    device_kind: the device compiled for.
    compiler_options: the XLA options the compile was given.
    gemms: every GEMM, in program order.
    kernels: every other kernel, in program order.
    spec: the GPU peaks the roofline used, or None.
    estimated_seconds: the step's estimated time (see the module docstring), or None.
    hlo: the optimized HLO text.
    memory: the compiled step's device memory by XLA's accounting
      (``memory_analysis()``; ``memory.peak_bytes``), or None (not compiled here, or
      the backend does not say).
  """

  target: str
  device_kind: str
  compiler_options: Mapping[str, Any]
  gemms: tuple[Gemm, ...]
  kernels: tuple[Kernel, ...]
  spec: targets_lib.GpuSpec | None
  estimated_seconds: float | None
  hlo: str = dataclasses.field(repr=False)
  memory: memory_lib.CompiledMemory | None = None

  @property
  def gemm_flops(self) -> int:
    return sum(g.flops * g.count for g in self.gemms)

  @property
  def non_gemm_bytes(self) -> int:
    """HBM bytes moved by kernels that are not GEMMs, per call."""
    return sum(k.bytes * k.count for k in self.kernels)

  @property
  def unfused(self) -> tuple[Kernel, ...]:
    """The kernels that only convert and/or transpose."""
    return tuple(k for k in self.kernels if k.unfused)

  @property
  def gemm_seconds(self) -> float | None:
    return _total(g.seconds for g in self.gemms for _ in range(g.count))

  @property
  def non_gemm_seconds(self) -> float | None:
    return _total(k.seconds for k in self.kernels for _ in range(k.count))

  @property
  def launches(self) -> int:
    """Kernels launched per call (every GEMM and every other kernel, a loop's per trip)."""
    return sum(g.count for g in self.gemms) + sum(k.count for k in self.kernels)

  def estimated_seconds_with_launches(self, per_launch: float) -> float | None:
    """The roofline estimate plus a fixed overhead for each of the :attr:`launches`.

    The roofline ignores launch overheads, which dominate a step of many small
    kernels (a few microseconds each on a GPU; CUDA graphs hide part of it).

    Args:
      per_launch: seconds added per kernel launch, e.g. ``2e-6``; 0 or more.

    Returns:
      ``estimated_seconds + launches * per_launch``, or None where there is no estimate.

    Raises:
      TypeError: if ``per_launch`` is not a real number.
      ValueError: if it is negative or not finite.
    """
    per_launch = check_per_launch(per_launch)
    if self.estimated_seconds is None:
      return None
    return self.estimated_seconds + self.launches * per_launch

  def __str__(self) -> str:
    header = (f"audit: {self.target} ({self.device_kind})"
              + (f", compiler options {dict(self.compiler_options)}" if self.compiler_options
                 else ""))
    rows = [(g.backend, " x ".join(g.operand_dtypes), " x ".join(g.compute_dtypes),
             g.output_dtype, g.shape + (f" (x{g.count})" if g.count > 1 else ""),
             f"{g.flops / 1e9:.3g}", _fmt_time(g.seconds, g.cycles), g.rate or "-")
            for g in self.gemms]
    lines = [header, table.text_table(
        ("GEMM backend", "operands hold", "product reads", "writes", "MxNxK", "GFLOP",
         "time", "rate"), rows, (False,) * 5 + (True, True, False))]
    lines.append(f"{len(self.gemms)} GEMMs ({_operand_counts(self.gemms)}), "
                 f"{self.gemm_flops / 1e9:.4g} GFLOP; {len(self.kernels)} other kernels moving "
                 f"{self.non_gemm_bytes / 2**20:.1f} MiB")
    unfused = self.unfused
    if unfused:
      lines.append(f"converts/transposes left as kernels ({len(unfused)}, "
                   f"{sum(k.bytes * k.count for k in unfused) / 2**20:.1f} MiB):")
      lines += [f"  {k.name}: {k.unfused} -> {k.output}" for k in unfused]
    if self.estimated_seconds is not None:
      if self.spec is not None:
        gemm, other = self.gemm_seconds, self.non_gemm_seconds
        assert gemm is not None and other is not None  # the roofline estimate is their sum
        lines.append(
            f"roofline estimate: {self.estimated_seconds * 1e3:.3f} ms (GEMMs "
            f"{gemm * 1e3:.3f} ms, other kernels {other * 1e3:.3f} "
            f"ms; peaks {_peaks(self.spec)}, HBM {self.spec.hbm_bytes_per_second / 1e12:.2f} TB/s)")
      else:
        lines.append(f"TPU cost-model estimate: {self.estimated_seconds * 1e3:.3f} ms")
    return "\n".join(lines)


def _total(values) -> float | None:
  values = list(values)
  if any(v is None for v in values):
    return None
  return float(sum(values))


def check_per_launch(per_launch: Any) -> float:
  """``per_launch`` (seconds per kernel launch) as a float, or a TypeError/ValueError."""
  if isinstance(per_launch, bool) or not isinstance(per_launch, (int, float, np.floating)):
    raise TypeError(f"per_launch must be a number of seconds (e.g. 2e-6), got "
                    f"{per_launch!r} of type {type(per_launch).__name__}.")
  if not (math.isfinite(per_launch) and per_launch >= 0):
    raise ValueError(f"per_launch must be finite and 0 or more seconds, got {per_launch!r}.")
  return float(per_launch)


def _fmt_time(seconds: float | None, cycles: int | None) -> str:
  if seconds is not None:
    return f"{seconds * 1e6:.1f} us"
  return f"{cycles} cyc" if cycles is not None else "-"


def _peaks(spec: targets_lib.GpuSpec) -> str:
  return ", ".join(f"{k} {v:g}" for k, v in spec.peak_tflops.items()) + " TFLOP/s"


# ---------------------------------------------------------------------------- HLO walk


def _held_dtype(module: hlo_lib.Module, instruction: hlo_lib.Instruction,
                caller: hlo_lib.Instruction | None) -> str:
  """The dtype whose values ``instruction`` carries, through exact conversions."""
  for _ in range(64):  # a chain of moves is short; the bound only guards cycles
    op = instruction.opcode
    if op == "parameter" and caller is not None:
      instruction, caller = module.parameter_source(instruction, caller), None
    elif op in _MOVES or (op == "convert" and _widens(module, instruction)):
      instruction = module.instruction(instruction.operands[0])
    elif op == "fusion" and module.root(instruction.called[0]).opcode in _MOVES | {"convert"}:
      instruction, caller = module.root(instruction.called[0]), instruction
    else:
      break
  return instruction.first_array[0]


def _widens(module: hlo_lib.Module, convert: hlo_lib.Instruction) -> bool:
  source = module.instruction(convert.operands[0]).first_array[0]
  return convert.first_array[0] in _WIDER.get(source, ())


def _dtype_name(hlo_dtype: str) -> str:
  return hlo_lib.DTYPE_NAMES.get(hlo_dtype, hlo_dtype)


def _shape(lhs: tuple[int, ...], out: tuple[int, ...], contracting: list[int],
           n_batch: int) -> str:
  k = math.prod(lhs[d] for d in contracting)
  batch, free = out[:n_batch], out[n_batch:]
  m = math.prod(free[:-1]) if len(free) > 1 else (free[0] if free else 1)
  n = free[-1] if len(free) > 1 else 1
  return ("*".join(map(str, batch)) + "*" if batch else "") + f"{m}x{n}x{k}"


def _rate(compute: tuple[str, ...], precision: str) -> str:
  kind = quantized_kind(compute)
  if kind is not None:
    return kind
  if any(d in ("float64",) for d in compute):
    return "f64"
  if any(d == "float32" for d in compute):
    return "f32" if "highest" in precision.lower() else "tf32"
  return "bf16"


def _cycles(instruction: hlo_lib.Instruction) -> int | None:
  found = instruction.attribute(r'"estimated_cycles":"(\d+)"')
  return int(found) if found else None


def _cublas_gemm(module: hlo_lib.Module, ins: hlo_lib.Instruction, platform: str) -> Gemm:
  a, b = (module.instruction(o) for o in ins.operands[:2])
  held = tuple(_dtype_name(_held_dtype(module, x, None)) for x in (a, b))
  compute = tuple(_dtype_name(x.first_array[0]) for x in (a, b))
  contracting = [int(d) for d in (ins.attribute(
      r'"lhs_contracting_dimensions":\[([^\]]*)\]') or "").replace('"', "").split(",") if d]
  n_batch = len([d for d in (ins.attribute(r'"lhs_batch_dimensions":\[([^\]]*)\]') or "")
                 .split(",") if d.strip('"')])
  out_dtype, out_dims = ins.first_array
  lhs_dims = a.first_array[1]
  flops = 2 * math.prod(out_dims) * math.prod(lhs_dims[d] for d in contracting)
  nbytes = sum(hlo_lib.nbytes(x.type) for x in (a, b)) + hlo_lib.nbytes(
      f"{out_dtype}[{','.join(map(str, out_dims))}]")
  precision = ins.attribute(r'"operand_precision":\[([^\]]*)\]') or ""
  target = ins.custom_call_target
  assert target is not None  # only cuBLAS custom calls come here
  return Gemm(ins.name, _CUBLAS.get(target, target), held,
              compute, _dtype_name(out_dtype), _shape(lhs_dims, out_dims, contracting, n_batch),
              flops, nbytes, _rate(compute, precision) if platform == "gpu" else None)


def _fused_attention(module, ins) -> Gemm:
  """A cuDNN fused-attention call (``jax.nn.dot_product_attention(implementation="cudnn")``).

  Its two products (scores and weighted sum) never leave the kernel. FLOPs are
  counted as FlashAttention counts them: ``4 * B * N * Tq * Tk * H`` forward, 2.5
  times that backward (five products, the scores recomputed); in cuDNN's CAUSAL mask
  mode, which skips the blocks above the diagonal, only the query-key pairs it keeps
  count (``Tq * (Tq + 1) / 2`` of them for a square score matrix, half otherwise). A
  mask handed in as a tensor (a bias operand) counts every pair.
  """
  q, k = (module.instruction(o) for o in ins.operands[:2])
  (b, tq, n, h), tk = q.first_array[1], k.first_array[1][1]
  mask = ins.attribute(r'"mask_type":\s*"([A-Z_]+)"') or "NO_MASK"
  pairs = tq * tk
  if mask == "CAUSAL":
    pairs = tq * (tq + 1) // 2 if tq == tk else pairs // 2
  forward = 4 * b * n * pairs * h
  backward = "Backward" in ins.custom_call_target
  held = tuple(_dtype_name(_held_dtype(module, x, None)) for x in (q, k))
  nbytes = sum(hlo_lib.nbytes(module.instruction(o).type) for o in ins.operands) + \
      hlo_lib.nbytes(ins.type)
  compute = tuple(_dtype_name(x.first_array[0]) for x in (q, k))
  return Gemm(ins.name, "cuDNN fused attention" + (" (backward)" if backward else ""), held,
              compute, _dtype_name(ins.first_array[0]),
              f"attention {b}*{n}*{tq}x{tk}x{h}" + (" causal" if mask == "CAUSAL" else ""),
              int(forward * (2.5 if backward else 1)), nbytes, _rate(compute, ""))


def _block_scaled_gemm(module, ins) -> Gemm:
  """cuDNN's block-scaled (MXFP8) GEMM: ``(B, M, K) x (B, N, K)`` with per-block scales.

  ``jax.nn.scaled_matmul`` on a Blackwell GPU (cuDNN >= 9.10). The operands are fp8
  (the scales, one E8M0 byte per 32 elements, are the third and fourth operands) and
  the GEMM runs at the fp8 rate.
  """
  a, b = (module.instruction(o) for o in ins.operands[:2])
  (*batch, m, k), n = a.first_array[1], b.first_array[1][-2]
  held = tuple(_dtype_name(_held_dtype(module, x, None)) for x in (a, b))
  compute = tuple(_dtype_name(x.first_array[0]) for x in (a, b))
  nbytes = sum(hlo_lib.nbytes(module.instruction(o).type) for o in ins.operands) + \
      hlo_lib.nbytes(ins.type)
  out_dtype, out_dims = ins.first_array
  return Gemm(ins.name, "MX cuDNN block-scaled GEMM", held, compute, _dtype_name(out_dtype),
              _shape((*batch, m, k), out_dims, [len(batch) + 1], len(batch)),
              2 * math.prod(batch) * m * n * k, nbytes, _rate(compute, ""))


BLOCK_FP8_KERNEL = "jaxmp_block_fp8_gemm"
"""The name of jaxmp's block-scaled fp8 kernels (``fp8/block_gemm.py``, and
``fp8/block_gemm_mosaic.py``'s, which starts with it) in a program's HLO."""

BLOCK_FP8_KERNEL_RATE = "bf16"
"""The peak the roofline prices jaxmp's block-scaled fp8 kernels at (:func:`_block_fp8_gemm`)."""

BLOCK_FP8_BACKENDS = {"__gpu$xla.gpu.triton": "jaxmp block-scaled fp8 (Triton wgmma)",
                      "mosaic_gpu_v2": "jaxmp block-scaled fp8 (Mosaic GPU wgmma)"}
"""The custom calls jaxmp's block-scaled fp8 kernels compile to, and how a GEMM row names
each (Pallas Triton's, Pallas Mosaic GPU's)."""


def _is_block_fp8_gemm(ins) -> bool:
  return (ins.custom_call_target in BLOCK_FP8_BACKENDS
          and ins.attribute(rf'op_name="([^"]*{BLOCK_FP8_KERNEL})') is not None)


def _block_fp8_gemm(module, ins) -> Gemm:
  """jaxmp's block-scaled fp8 GEMM: a Pallas kernel, ``(B, P, C) x (B, Q, C)``.

  Its first two operands are the fp8 data (the last two the scales, one per row and
  128-element block); the Triton kernel's are ``(B, P, C)`` and ``(B, Q, C)``, the
  Mosaic GPU kernel's ``(B * P, C)`` and ``(B * Q, C)``, with an output ``(B * P, Q)``.
  Both run on Hopper's fp8 tensor cores (``wgmma``, checked in their PTX by the
  tests), but they are costed at the bfloat16 rate: measured on an H200 the Triton
  kernel runs at 0.83-1.03x a bfloat16 GEMM's speed (benchmarks/RESULTS.md), half the
  fp8 peak, which would promise the train steps that use it a speed-up they do not get
  (a Llama-3-8B layer's: 1.32x bf16 at the fp8 peak, 0.85x measured); the Mosaic
  kernel has not been measured, and is priced as the Triton one until it is.
  """
  a, b = (module.instruction(o) for o in ins.operands[:2])
  lhs = a.first_array[1]
  held = tuple(_dtype_name(_held_dtype(module, x, None)) for x in (a, b))
  compute = tuple(_dtype_name(x.first_array[0]) for x in (a, b))
  nbytes = sum(hlo_lib.nbytes(module.instruction(o).type) for o in ins.operands) + \
      hlo_lib.nbytes(ins.type)
  out_dtype, out_dims = ins.first_array
  batch = len(lhs) - 2  # the Triton kernel's batch dimension; the Mosaic one's is in rows
  return Gemm(ins.name, BLOCK_FP8_BACKENDS[ins.custom_call_target], held, compute,
              _dtype_name(out_dtype), _shape(lhs, out_dims, [len(lhs) - 1], batch),
              2 * math.prod(out_dims) * lhs[-1], nbytes, BLOCK_FP8_KERNEL_RATE)


def _fused_gemm(module, ins, dots, platform: str) -> Gemm:
  dot = max(dots, key=lambda d: math.prod(d.first_array[1]))
  a, b = (module.instruction(o) for o in dot.operands[:2])
  # A fusion's parameters are its operands; a dot left unfused reads its computation's
  # own parameters (the entry's: the step's arguments), which no caller binds here.
  caller = ins if ins.opcode == "fusion" else None
  held = tuple(_dtype_name(_held_dtype(module, x, caller)) for x in (a, b))
  compute = tuple(_dtype_name(x.first_array[0]) for x in (a, b))
  flops = sum(hlo_lib.dot_flops(module, d) if d.opcode != "convolution"
              else hlo_lib.convolution_flops(module, d) for d in dots)
  if dot.opcode == "convolution":
    labels = dot.attribute(r"dim_labels=([^,\s]+)")
    shape = f"conv {labels}" if labels else "conv"
  else:
    contracting = [int(d) for d in (dot.attribute(r"lhs_contracting_dims=\{([0-9,]*)\}")
                                    or "").split(",") if d]
    n_batch = len([d for d in (dot.attribute(r"lhs_batch_dims=\{([0-9,]*)\}") or "").split(",")
                   if d])
    shape = _shape(a.first_array[1], dot.first_array[1], contracting, n_batch)
  backend = _FUSION_BACKENDS.get(ins.backend_kind or "")
  if backend is None:
    kind = "convolution" if dot.opcode == "convolution" else "dot"
    backend = {"tpu": f"TPU {kind} fusion", "cpu": f"CPU {kind}"}.get(
        platform, f"{kind} in a {ins.fusion_kind or ins.opcode} kernel (no GEMM library)")
  nbytes = sum(hlo_lib.nbytes(module.instruction(o).type) for o in ins.operands) + \
      hlo_lib.nbytes(ins.type)
  precision = dot.attribute(r"operand_precision=\{([^}]*)\}") or ""
  return Gemm(ins.name, backend, held, compute, _dtype_name(ins.first_array[0]), shape, flops,
              nbytes, _rate(compute, precision) if platform == "gpu" else None,
              cycles=_cycles(ins))


def _unfused(module, ins) -> str | None:
  body = module.body(ins.called[0]) if ins.opcode == "fusion" else [ins]
  ops = [o for o in body if o.opcode not in _PLUMBING]
  if not ops or any(o.opcode not in ("convert", "transpose", "copy") for o in ops):
    return None
  words = []
  for o in ops:
    if o.opcode == "convert":
      source = module.instruction(o.operands[0]).first_array[0]
      words.append(f"convert {source}->{o.first_array[0]}")
    elif "transpose" not in words:
      words.append("transpose")
  return " + ".join(dict.fromkeys(words))


def _kernels(module: hlo_lib.Module, computation: str, count: int, platform: str,
             gemms: list, kernels: list) -> None:
  """Appends the GEMMs and other kernels of ``computation``, run ``count`` times."""
  for ins in module.computations[computation]:
    op = ins.opcode
    if op in hlo_lib.NO_KERNEL_OPS or op.endswith("-done"):
      continue
    if op == "while":
      trips = ins.attribute(r'"known_trip_count":\{"n":"(\d+)"\}')
      body = ins.attribute(r"\bbody=%?([\w.\-]+)")
      assert body is not None  # every HLO while names its body
      _kernels(module, body, count * int(trips or 1), platform, gemms, kernels)
      continue
    if op in ("call", "async-start"):
      for called in ins.called:
        _kernels(module, called, count, platform, gemms, kernels)
      continue
    if op == "conditional":
      # One branch runs. The cheapest is taken: a rarely taken fallback (an exact
      # recheck, an overflow path) should not be charged to every step.
      branches = []
      for called in ins.called:
        branch = ([], [])
        _kernels(module, called, count, platform, *branch)
        branches.append(branch)
      cheapest = min(branches or [([], [])], key=lambda b: sum(x.bytes for x in b[0] + b[1]))
      gemms.extend(cheapest[0])
      kernels.extend(cheapest[1])
      continue
    if op == "custom-call" and ins.custom_call_target in _CUBLAS:
      gemms.append(dataclasses.replace(_cublas_gemm(module, ins, platform), count=count))
      continue
    if op == "custom-call" and ins.custom_call_target == "__cudnn$blockScaledDot":
      gemms.append(dataclasses.replace(_block_scaled_gemm(module, ins), count=count))
      continue
    if op == "custom-call" and _is_block_fp8_gemm(ins):
      gemms.append(dataclasses.replace(_block_fp8_gemm(module, ins), count=count))
      continue
    if op == "custom-call" and (ins.custom_call_target or "").startswith("__cudnn$fmha"):
      gemms.append(dataclasses.replace(_fused_attention(module, ins), count=count))
      continue
    body = module.body(ins.called[0]) if op == "fusion" and ins.called else [ins]
    dots = [o for o in body if o.opcode in _GEMM_OPS]
    if dots:
      gemms.append(dataclasses.replace(_fused_gemm(module, ins, dots, platform), count=count))
      continue
    nbytes = hlo_lib.kernel_bytes(module, ins)
    dt, dims = ins.first_array
    kind = ins.backend_kind or ins.fusion_kind or op  # e.g. __triton (a softmax), kLoop
    kernels.append(Kernel(ins.name, kind, f"{dt}[{','.join(map(str, dims))}]",
                          nbytes, _unfused(module, ins), cycles=_cycles(ins), count=count))


def analyze(text: str, platform: str, spec: targets_lib.GpuSpec | None = None,
            target: str = "", device_kind: str = "",
            compiler_options: Mapping[str, Any] | None = None,
            tpu_seconds: float | None = None) -> AuditReport:
  """An :class:`AuditReport` from optimized HLO text (what :func:`audit` compiles).

  Args:
    text: ``compiled.as_text()``.
    platform: ``"gpu"``, ``"tpu"`` or ``"cpu"``: how fusions without a named backend
      are described.
    spec: peaks for a GPU roofline estimate; None for no estimate.
    target: the report's target name.
    device_kind: the report's device.
    compiler_options: recorded in the report.
    tpu_seconds: the TPU compiler's estimate of the step, recorded as is.

  Returns:
    The report.
  """
  module = hlo_lib.Module(text)
  gemms, kernels = [], []
  _kernels(module, module.entry, 1, platform, gemms, kernels)
  estimate = tpu_seconds
  if spec is not None:
    bandwidth = spec.hbm_bytes_per_second
    peaks = spec.peak_tflops
    # A rate the chip lacks (fp8 on an A100) is costed at its bfloat16 rate.
    gemms = [dataclasses.replace(g, rate=g.rate if g.rate in peaks else "bf16", seconds=max(
        g.flops / (peaks.get(g.rate, peaks["bf16"]) * 1e12), g.bytes / bandwidth))
             for g in gemms]
    kernels = [dataclasses.replace(k, seconds=k.bytes / bandwidth) for k in kernels]
    estimate = sum(x.seconds * x.count for x in [*gemms, *kernels])
  return AuditReport(target or platform, device_kind or platform, dict(compiler_options or {}),
                     tuple(gemms), tuple(kernels), spec, estimate, text)


# ---------------------------------------------------------------------------- compile


def _abstract(tree: Any, device: Any) -> Any:
  """Every array-like leaf as a ShapeDtypeStruct placed on ``device``."""
  sharding = jax.sharding.SingleDeviceSharding(device)

  def leaf(x):
    if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, np.generic, int, float,
                      complex, bool)):
      aval = jax.typeof(x) if not isinstance(x, jax.ShapeDtypeStruct) else x
      return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding,
                                  weak_type=getattr(aval, "weak_type", False))
    return x

  return jax.tree_util.tree_map(leaf, tree)


def audit(fn: Callable[..., Any], *args: Any, target: str | None = None,
          compiler_options: Mapping[str, Any] | None = None, **kwargs: Any) -> AuditReport:
  """Compiles ``fn(*args, **kwargs)`` and reports what runs: GEMMs, bytes, time.

  ``fn`` is jitted unless it already is (a ``jax.jit`` function keeps its static
  arguments and donations). With ``target=None`` it compiles for the local backend
  with ``args`` as given (arrays or ``jax.ShapeDtypeStruct``). With a target it
  compiles deviceless for that chip: every array leaf of ``args``/``kwargs`` is
  replaced by its shape and dtype on a compile-only device, so nothing is allocated;
  GPU targets need JAX's CUDA plugin, TPU targets ``libtpu`` (``pip install
  "jax[tpu]==<this JAX's version>"``; ``make gpu-report`` builds an environment with
  both), and GPU targets on a machine without a GPU a process started with
  ``JAX_PLATFORMS=cpu``. A TPU target is compiled in a child process, which a libtpu
  crash ends without ending this one. Without a GPU XLA cannot autotune, so
  GEMM fusions get a default configuration; ``compiler_options=
  {"xla_gpu_enable_triton_gemm": False}`` turns every dot into a cuBLAS/cuBLASLt call,
  which is what a tuned H100 mostly runs.

  Args:
    fn: the function (or jitted function, or a Flax ``apply``) to compile.
    *args: its positional arguments.
    target: None (the local backend), a GPU (``"h100"``, ``"a100"``, ``"b200"``) or a
      TPU (``"v5e"``, ``"v5p"``, ``"v6e"``, ``"v7"``).
    compiler_options: XLA options for this compile, e.g.
      ``{"xla_gpu_enable_triton_gemm": False}``.
    **kwargs: its keyword arguments.

  Returns:
    An :class:`AuditReport`.

  Raises:
    TypeError: if ``fn`` is not callable, ``target`` is not a string or
      ``compiler_options`` is not a mapping.
    ValueError: for an unknown target (the message lists the accepted ones).
    ImportError: if the target's plugin is not installed.
    RuntimeError: if the CUDA plugin cannot compile deviceless in this process; for a
      TPU target, :class:`jaxmp.tools.CompileCrashError` if libtpu crashes or fails
      compiling the step, naming the chip and the arguments' shapes: TPU compiles run
      in a child process (``isolated_compile``), so a crash there ends only the child.

  Example:
    >>> x = jnp.ones((32, 64), jnp.float32)
    >>> w = jnp.ones((64, 16), jnp.float32)
    >>> fp8_dot = lambda x, w: jaxmp.fp8.fp8_dot_general(
    ...     x, w, (((1,), (0,)), ((), ())), recipe=jaxmp.fp8.CurrentScaling())
    >>> gemm, = jaxmp.tools.audit(fp8_dot, x, w).gemms
    >>> gemm.operand_dtypes, gemm.compute_dtypes
    (('float8_e4m3fn', 'float8_e4m3fn'), ('float32', 'float32'))
  """
  if not callable(fn):
    raise TypeError(f"audit: fn must be callable, got {fn!r} of type {type(fn).__name__}.")
  if compiler_options is not None and not isinstance(compiler_options, Mapping):
    raise TypeError("audit: compiler_options must be a mapping of XLA option names to "
                    f"values, got {type(compiler_options).__name__}.")
  jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
  spec, tpu_seconds = None, None
  if target is None:
    device = dtypes_lib.default_device()
    platform, name, kind = device.platform, device.platform, device.device_kind
    if platform == "gpu":
      spec = targets_lib.gpu_spec_for(kind)
  else:
    name = targets_lib.check_target(target)
    device = targets_lib.compile_device(name)
    args, kwargs = _abstract((args, kwargs), device)
    kind = device.device_kind
    platform = "tpu" if targets_lib.is_tpu(name) else "gpu"
    spec = targets_lib.GPU_TARGETS.get(name)
  options = dict(compiler_options) if compiler_options else None
  result = None
  # fp8 recipes decide at trace time what their GEMMs lower to (and warn where they
  # fall back): tell them which chip this compile is for.
  with fp8_support.compile_target(name) if name in fp8_support.TARGETS else \
      contextlib.nullcontext():
    lowered = jitted.trace(*args, **kwargs).lower()
    if platform == "tpu":  # libtpu can crash the process: compile in a child
      result = isolated_compile.compile_in_child(jitted, args, kwargs, lowered, name, kind,
                                                 options)
  if result is None:
    result = isolated_compile.read_compiled(lowered.compile(options))
  if platform == "tpu":
    tpu_seconds = result.cost.get("optimal_seconds")
    if tpu_seconds is not None and tpu_seconds < 0:  # the cost model's "unknown"
      tpu_seconds = None
  report = analyze(result.hlo, platform, spec, name, kind, compiler_options or {}, tpu_seconds)
  return dataclasses.replace(report, memory=result.memory)


def compiled_gemms(recipe: Any, target: str, size: int = 512) -> tuple[tuple[str, ...], bool]:
  """What the three GEMMs of an fp8 Dense forward + backward under ``recipe`` compile to.

  Compiles ``size``-cubed ``fp8_dot_general`` forward + backward deviceless for
  ``target`` (:func:`audit`; GPU targets in cuBLAS mode) and reads each GEMM back
  from the optimized HLO: ``"mx"`` (an MX block-scaled GEMM), ``"fp8"``, or the dtype
  it runs in instead. The evidence behind
  :func:`jaxmp._src.fp8.support.lowering`'s table (a tool: the fp8 core states the
  table, this compiles it).

  Args:
    recipe: any fp8 recipe.
    target: an :func:`audit` target (``"h100"``, ``"b200"``, ``"v7"``, ...).
    size: the GEMMs' edge.

  Returns:
    ``(kinds, warned)``: one kind per GEMM in program order, and whether using the
    recipe warned :class:`~jaxmp.fp8.Fp8FallbackWarning`.
  """
  dims = (((1,), (0,)), ((), ()))
  operand = jax.ShapeDtypeStruct((size, size), jax.numpy.bfloat16)
  state = jax.eval_shape(lambda: fp8_state.init_state(recipe))

  def forward_backward(x, w, s, g):
    f = lambda x, w, s: fp8_dot_general.fp8_dot_general(x, w, dims, state=s, recipe=recipe)
    y, vjp = jax.vjp(f, x, w, s)
    return y, vjp(g)

  options = None if targets_lib.is_tpu(target) else {"xla_gpu_enable_triton_gemm": False}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    report = audit(forward_backward, operand, operand, state, operand, target=target,
                   compiler_options=options)
  kinds = tuple(("mx" if "MX" in g.backend else "fp8") if g.fp8 else g.compute_dtypes[0]
                for g in report.gemms)
  return kinds, any(issubclass(w.category, fp8_support.Fp8FallbackWarning) for w in caught)


__all__ = ("AuditReport", "Gemm", "Kernel", "analyze", "audit", "check_per_launch",
           "compiled_gemms", "quantized_kind")
