"""The one chip table: every fact jaxmp states about a chip, and what a GEMM runs as there.

:data:`CHIPS` holds each named chip once: its :class:`Target` (what the fp8 core needs:
whether fp8, MX and int8 GEMMs run natively, and the layout and kernel choices that
depend on the generation), how a live device names it (``device_kind``, CUDA compute
capability), its paper speeds (dense peak rates, memory bandwidth, with their source),
and what a deviceless compile needs (XLA's GPU description, the TPU topology). The
fp8 core reads the targets (``jaxmp.fp8.compile_target``, the fallback warning); the
tools read the rest (``jaxmp._src.tools.targets``: compile targets and rooflines;
``jaxmp._src.tools.hardware``: what a device computes natively). A GPU's fp8 support
follows from its compute capability by the thresholds here, for the named chips and a
live device alike (:func:`gpu_target`).

A :class:`Lowering` is the answer to "what does this GEMM run as here": each recipe's
entry in :mod:`jaxmp._src.fp8.ops` gives it, and :func:`fp8_gemm` is the answer of
every recipe whose GEMMs XLA itself lowers to fp8 GEMMs (per tensor, per row).

Example:
  >>> from jaxmp._src.fp8 import chips
  >>> chips.TARGETS["h100"].k_major_fp8, chips.fp8_gemm(chips.TARGETS["v5e"]).kind
  (True, 'fallback')
  >>> chips.CHIPS["h100"].peak_tflops["fp8"], chips.CHIPS["v7"].tpu_topology
  (1978.9, 'tpu7x:1x1x1')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src import jax_compat

FP16_MIN_COMPUTE_CAPABILITY = (7, 0)
"""Volta: float16 tensor cores."""
BF16_MIN_COMPUTE_CAPABILITY = dtypes_lib.BF16_MIN_COMPUTE_CAPABILITY
"""Ampere: bfloat16 tensor cores (stated in ``jaxmp._src.dtypes``, which ``half_dtype`` reads)."""
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
"""Ada and Hopper: fp8 tensor cores."""
K_MAJOR_FP8_CAPABILITIES = ((8, 9), (9, 0))
"""Where cuBLASLt's fp8 GEMMs read both operands with the contracted dimension minor
(Ada, Hopper; Blackwell takes any layout)."""
BLOCK_FP8_CAPABILITY = (9, 0)
"""Hopper: where jaxmp's block-scaled fp8 kernels (``wgmma``) run."""
HOPPER_BLOCK_FP8_KERNELS = ("triton", "mosaic")
"""jaxmp's block-scaled fp8 kernels on Hopper, the first the recipe and this JAX allow
running (``jaxmp._src.fp8.block.KERNELS`` names them).

The Pallas Triton kernel (``block_gemm.py``) first: measured on an H200 at 0.94-1.03x
a bfloat16 GEMM (benchmarks/RESULTS.md). The Mosaic GPU kernel
(``block_gemm_mosaic.py``: TMA, warp-specialised, two math warpgroups) second, until a
GPU measures it (``benchmarks/bench_block_gemm.py``, ``make gpu-session``): it compiles
for sm_90a and matches the formula in Mosaic GPU's interpreter, but its speed is
unknown, and a kernel that has never run on the chip does not become the default.
Second, it runs where this JAX lacks the Triton kernel's private Pallas pieces (Pallas'
Triton back end is deprecated from jax 0.11). Once it is measured at least as fast,
the order is swapped here, and the Triton kernel stays as the fallback for a JAX
whose Mosaic GPU API lacks a name the kernel uses."""
MX_MIN_COMPUTE_CAPABILITY = (10, 0)
"""Blackwell: MXFP8 block-scaled GEMMs, through cuDNN from :data:`MX_MIN_CUDNN`."""
MX_MIN_CUDNN = 91000
"""cuDNN 9.10, the first XLA lowers MXFP8 dots to."""
DEVICELESS_CUDNN = 91000
"""The cuDNN version a deviceless GPU compile assumes (the one pip installs with jax)."""


@dataclasses.dataclass(frozen=True)
class Target:
  """A chip, as far as fp8 GEMMs go.

  Attributes:
    name: ``"h100"``, ``"b200"``, ``"v7"``, ``"cpu"``, or a device kind.
    platform: ``"gpu"``, ``"tpu"`` or ``"cpu"``.
    fp8: fp8 operands run on fp8 matrix units (Hopper and later, TPU v7).
    mx: MXFP8 block-scaled GEMMs run natively (Blackwell through cuDNN >= 9.10).
    description: what the chip is, for messages.
    int8: int8 GEMMs run faster than bfloat16 ones (TPU v5e, v5p, v6e by libtpu's cost
      model); ``None`` where jaxmp makes no claim.
    block_fp8_kernels: jaxmp's block-scaled fp8 kernels ``BlockScaling``'s GEMMs may
      run as, in order of preference (``chips.HOPPER_BLOCK_FP8_KERNELS`` on sm_90;
      ``jaxmp._src.fp8.block.KERNELS`` names them): the first whose ``supports``
      takes the recipe runs. Empty where none runs.
    k_major_fp8: cuBLASLt's fp8 GEMMs read both operands with the contracted dimension
      minor (Ada and Hopper, sm_89 and sm_90; Blackwell takes any layout), so jaxmp
      writes the forward pass's quantized operands row-major
      (``jaxmp._src.fp8.scaled_gemm.in_own_layout_on_gpus``).
    fused_quantize: the per-tensor recipes quantize each Dense operand with jaxmp's
      fused kernel (``jaxmp._src.fp8.fused_quantize``: codes in both layouts and the
      amax in one pass, Pallas Mosaic GPU, Hopper) instead of XLA's fusions. Off for
      every chip until a device measures it faster (``benchmarks/bench_quantize.py``,
      the ``fused`` variant; ``gpu_session.py``'s "fp8 per-tensor, fused quantize");
      ``jaxmp.fp8.compile_target(name, fused_quantize=True)`` turns it on.
  """

  name: str
  platform: str
  fp8: bool | None
  mx: bool
  description: str
  int8: bool | None = None
  block_fp8_kernels: tuple[str, ...] = ()
  k_major_fp8: bool = False
  fused_quantize: bool = False

  @property
  def block_fp8(self) -> bool:
    """Whether some block-scaled fp8 kernel of jaxmp's runs here (Hopper)."""
    return bool(self.block_fp8_kernels)


def gpu_target(name: str, device_kind: str, capability: tuple[int, int],
               cudnn: int | None) -> Target:
  """The :class:`Target` of a CUDA GPU, from its compute capability (and cuDNN, for MX).

  ``cudnn`` ``None`` (unknown) makes no claim against MX.

  Example:
    >>> jaxmp._src.fp8.chips.gpu_target("l4", "NVIDIA L4", (8, 9), None).description
    'NVIDIA L4, sm_89'
  """
  fp8 = capability >= FP8_MIN_COMPUTE_CAPABILITY
  mx = capability >= MX_MIN_COMPUTE_CAPABILITY and (cudnn is None or cudnn >= MX_MIN_CUDNN)
  description = f"{device_kind}, sm_{capability[0]}{capability[1]}"
  if mx:
    description += f", cuDNN >= {MX_MIN_CUDNN // 10000}.{MX_MIN_CUDNN // 100 % 100}"
  if not fp8:
    description += ": no fp8 tensor cores"
  kernels = HOPPER_BLOCK_FP8_KERNELS if capability == BLOCK_FP8_CAPABILITY else ()
  return Target(name, "gpu", fp8, mx, description, block_fp8_kernels=kernels,
                k_major_fp8=capability in K_MAJOR_FP8_CAPABILITIES)


@dataclasses.dataclass(frozen=True)
class Chip:
  """A named chip: its :class:`Target`, how devices name it, its speeds on paper.

  Attributes:
    target: what its fp8 GEMMs do.
    device_kinds: what ``jax.Device.device_kind`` says on it (the first is the one a
      deviceless GPU compile describes).
    compute_capability: a CUDA GPU's ``(major, minor)``; ``None`` elsewhere.
    peak_tflops: dense TFLOP/s by arithmetic: ``fp8``, ``bf16`` (also float16),
      ``tf32`` (float32 GEMMs at XLA's default precision), ``f32`` (float32 at HIGHEST
      precision, no tensor cores), ``f64``, ``int8`` (TOP/s); GPUs only.
    hbm_bytes_per_second: memory bandwidth (GPUs: the one XLA's own cost model assumes,
      within 5% of the datasheets).
    source: where the peaks come from.
    gpu_device_info: the ``gpu_device_info`` fields of XLA's GpuTargetConfigProto for a
      deviceless compile (XLA's ``xla/tools/hlo_opt/gpu_specs``), without the compute
      capability; ``None`` where jaxmp does not compile for the GPU without it.
    tpu_topology: the single-chip topology a deviceless TPU compile names.
    fp8_matmul_cycles: TPUs: a 4096^3 matmul's cycles with E4M3 operands over bfloat16's
      by libtpu's cost model (libtpu 0.0.42, jax 0.10.2: ``benchmarks/gpu_report.py
      --workloads tpu``); below 1 is faster, and it is the evidence for ``target.fp8``.
  """

  target: Target
  device_kinds: tuple[str, ...] = ()
  compute_capability: tuple[int, int] | None = None
  peak_tflops: Mapping[str, float] | None = None
  hbm_bytes_per_second: float | None = None
  source: str = ""
  gpu_device_info: str | None = None
  tpu_topology: str | None = None
  fp8_matmul_cycles: float | None = None


def _gpu(name: str, label: str, device_kind: str, capability: tuple[int, int],
         **facts: Any) -> Chip:
  return Chip(gpu_target(name, label, capability, DEVICELESS_CUDNN), (device_kind,),
              capability, **facts)


def _tpu(name: str, device_kind: str, what: str, *, fp8: bool, int8: bool,
         fp8_matmul_cycles: float, topology: str) -> Chip:
  return Chip(Target(name, "tpu", fp8, False, f"TPU {name}: {what}", int8), (device_kind,),
              tpu_topology=topology, fp8_matmul_cycles=fp8_matmul_cycles)


_H100_INFO = """\
  shared_memory_per_core: 233472
  core_count: 132
  fpus_per_core: 128
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84978434048
  shared_memory_per_block_optin: 232448
"""

CHIPS: Mapping[str, Chip] = {
    "h100": _gpu(
        "h100", "NVIDIA H100", "NVIDIA H100 80GB HBM3", (9, 0),
        peak_tflops={"fp8": 1978.9, "bf16": 989.4, "tf32": 494.7, "f32": 66.9, "f64": 66.9,
                     "int8": 1978.9},
        hbm_bytes_per_second=3.35232e12,
        source="NVIDIA H100 Tensor Core GPU datasheet, SXM5, dense",
        gpu_device_info=_H100_INFO),
    "h200": _gpu("h200", "NVIDIA H200", "NVIDIA H200", (9, 0)),
    "a100": _gpu(
        "a100", "NVIDIA A100", "NVIDIA A100-SXM4-80GB", (8, 0),
        # No fp8 tensor cores: XLA turns fp8 GEMMs into float16 ones on sm_80.
        peak_tflops={"bf16": 312.0, "tf32": 156.0, "f32": 19.5, "f64": 19.5, "int8": 624.0},
        hbm_bytes_per_second=2.03904e12,
        source="NVIDIA A100 Tensor Core GPU datasheet, SXM4 80GB, dense",
        gpu_device_info="""\
  shared_memory_per_core: 167936
  core_count: 108
  fpus_per_core: 64
  memory_bandwidth: 2039040000000
  l2_cache_size: 41943040
  clock_rate_ghz: 1.41
  device_memory_size: 85100068864
  shared_memory_per_block_optin: 166912
"""),
    "b200": _gpu(
        "b200", "NVIDIA B200", "NVIDIA B200", (10, 0),
        peak_tflops={"fp8": 4500.0, "bf16": 2250.0, "tf32": 1100.0, "f32": 75.0, "f64": 37.0,
                     "int8": 4500.0},
        hbm_bytes_per_second=7.67232e12,
        source="NVIDIA DGX B200 datasheet, per GPU, sparse figures halved",
        gpu_device_info="""\
  shared_memory_per_core: 233472
  core_count: 148
  fpus_per_core: 128
  memory_bandwidth: 7672320000000
  l2_cache_size: 132644864
  clock_rate_ghz: 1.965
  device_memory_size: 191514673152
  shared_memory_per_block_optin: 232448
"""),
    # By libtpu's cost model a 2048^3 int8 GEMM costs about 0.5x bfloat16's cycles on
    # v5e and v5p, 0.7-0.95x on v6e and 1x on v7.
    "v5e": _tpu("v5e", "TPU v5 lite", "fp8 at the bfloat16 rate", fp8=False, int8=True,
                fp8_matmul_cycles=1.01, topology="v5e:1x1"),
    "v5p": _tpu("v5p", "TPU v5", "fp8 at the bfloat16 rate", fp8=False, int8=True,
                fp8_matmul_cycles=1.01, topology="v5p:1x1x1"),
    "v6e": _tpu("v6e", "TPU v6 lite", "fp8 at the bfloat16 rate", fp8=False, int8=True,
                fp8_matmul_cycles=1.09, topology="v6e:1x1"),
    # "tpu7x" is v7 (Ironwood), whose chip is two devices (TensorCores); a deviceless
    # compile is for one of them.
    "v7": Chip(Target("v7", "tpu", True, False, "TPU v7: int8 at the bfloat16 rate", False),
               ("TPU7x", "TPU v7"), tpu_topology="tpu7x:1x1x1", fp8_matmul_cycles=0.48),
    "cpu": Chip(Target("cpu", "cpu", False, False, "CPU: fp8 emulated")),
}
"""Every chip jaxmp names, once."""

TARGETS: Mapping[str, Target] = {name: chip.target for name, chip in CHIPS.items()}
"""The targets ``jaxmp.fp8.compile_target`` accepts (``jaxmp.tools.audit``'s names)."""


def chip_of(device_kind: str) -> Chip | None:
  """The named chip a ``device_kind`` is, if any (TPUs by their exact kind)."""
  for chip in CHIPS.values():
    if device_kind in chip.device_kinds:
      return chip
  return None


def target_for_device(device: Any) -> Target:
  """The :class:`Target` of a ``jax.Device`` (duck-typed on ``platform``, ``device_kind``).

  Example:
    >>> import types
    >>> gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
    ...                             compute_capability="9.0")
    >>> jaxmp._src.fp8.chips.target_for_device(gpu).fp8
    True
  """
  platform, kind = device.platform, str(getattr(device, "device_kind", device.platform))
  if platform == "tpu":
    chip = chip_of(kind)
    return chip.target if chip is not None else Target(kind, "tpu", False, False, kind)
  if platform != "gpu":
    return Target(platform, platform, False, False, f"{kind}: fp8 emulated")
  capability = dtypes_lib.gpu_compute_capability(device, "jaxmp.fp8")
  if capability is None:  # ROCm: not described here, so no claim is made
    return Target(kind, "gpu", None, False, kind)
  return gpu_target(kind, kind, capability, jax_compat.cudnn_version())


@dataclasses.dataclass(frozen=True)
class Lowering:
  """What one GEMM runs as: ``kind`` is ``"fp8"``, ``"mx"``, ``"int8"``, ``"fallback"``,
  ``"unknown"``, ``"emulated"`` (CPU) or ``"compute dtype"`` (no recipe); ``detail``
  says more."""

  kind: str
  detail: str


def unknown_fp8(target: Target) -> Lowering | None:
  """``"unknown"`` where the target's fp8 support is not described (ROCm), else ``None``."""
  if target.fp8 is None:
    return Lowering("unknown", f"fp8 support of {target.description} is not described")
  return None


def fp8_gemm(target: Target) -> Lowering:
  """What an fp8 GEMM XLA lowers itself (per-tensor or per-row scales) runs as on ``target``."""
  unknown = unknown_fp8(target)
  if unknown is not None:
    return unknown
  if target.fp8:
    return Lowering("fp8", "an fp8 GEMM")
  if target.platform == "tpu":
    return Lowering("fallback", "fp8 GEMMs at the bfloat16 rate (no fp8 matrix units)")
  return Lowering("fallback", "16-bit GEMMs (XLA widens the fp8 operands: no fp8 tensor cores)")


__all__ = (
    "BF16_MIN_COMPUTE_CAPABILITY",
    "BLOCK_FP8_CAPABILITY",
    "CHIPS",
    "DEVICELESS_CUDNN",
    "FP16_MIN_COMPUTE_CAPABILITY",
    "FP8_MIN_COMPUTE_CAPABILITY",
    "HOPPER_BLOCK_FP8_KERNELS",
    "K_MAJOR_FP8_CAPABILITIES",
    "MX_MIN_COMPUTE_CAPABILITY",
    "MX_MIN_CUDNN",
    "TARGETS",
    "Chip",
    "Lowering",
    "Target",
    "chip_of",
    "fp8_gemm",
    "gpu_target",
    "target_for_device",
    "unknown_fp8",
)
