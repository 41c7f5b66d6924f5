"""What a device computes fast, and the mixed-precision set-up to use on it.

:func:`device_capabilities` describes a device: its platform, kind, CUDA compute
capability, and which of bfloat16, float16 and fp8 it computes natively (at more than
float32's speed, rather than by converting to float32). :func:`recommended_policy`
turns that into a set-up, with the reasons:

======================================  =========================================  ===============
device                                  policy (params, compute, output)           loss scale
======================================  =========================================  ===============
TPU v7, v5e, v5p, v6e (and older)       float32, bfloat16, float32                 none
GPU, compute capability >= 8.0, ROCm    float32, bfloat16, float32 (fp8 >= 8.9)    none
GPU, compute capability < 8.0           float32, float16, float32                  dynamic
CPU and other platforms                 float32, float32, float32                  none
======================================  =========================================  ===============

bfloat16 has float32's range, so it needs no loss scale; float16 does. fp8 matmuls
(``jaxmp.fp8``) are suggested on GPUs with fp8 tensor cores, never switched on: they
change a model's numerics per layer, so they are an opt-in by rule. On TPU v7, whose
matrix units run fp8 at about twice the bfloat16 rate, they are not suggested: no whole
train step compiled for it so far is estimated faster in fp8 (``TPU_V7_FP8_STEPS``);
:func:`jaxmp.tools.recommend_precision` asks the compiler about a given step.

Where fp8 pays (``benchmarks/RESULTS.md``, estimates from compiled HLO, no hardware):
on an H100 an fp8 GEMM has twice the bfloat16 peak, so large GEMMs gain (a Dense
8192^3 forward + backward: about 1.4-1.7x bfloat16's estimated time), while small
ones and the memory-bound rest of a step do not (the demo transformer at
``--preset gpu``: no gain). On TPUs the compiler keeps fp8 operands in fp8 but its
cost model runs them at the bfloat16 rate on v5e, v5p and v6e (1.01-1.09x bfloat16's
cycles: no gain) and at about twice the rate only on v7 (0.48x); int8 is the fast
narrow type on v5e and v5p (0.5x) and v6e (0.76x), not on v7 (``jaxmp.fp8.Int8Scaling``).
Whether a narrow type makes a given step faster (its scaling passes cost too):
:func:`jaxmp.tools.recommend_precision`. On a CPU XLA has no bfloat16 or float16
arithmetic: it converts operands to float32 and results back, so half precision is
slower than float32 there (``benchmarks/RESULTS.md``, 2-core CPU: float32 took
0.87-0.92 of bfloat16's time for a Dense step and 0.70-0.94 for a transformer block).
The CPU recommendation is therefore float32; use a half-precision policy on a CPU
only to preview its numerics.

The answers agree with :func:`jaxmp.half_dtype` wherever a 16-bit dtype is
recommended; ``half_dtype`` (float16 on a CPU, as jmp) answers "which 16-bit dtype"
and is reported as :attr:`DeviceCapabilities.half_dtype`.

Example:
  >>> cpu = jax.devices("cpu")[0]
  >>> caps = jaxmp.tools.device_capabilities(cpu)
  >>> caps.platform, caps.supports_bf16, caps.supports_fp8
  ('cpu', False, False)
  >>> print(jaxmp.tools.recommended_policy(cpu).policy)
  params=float32,compute=float32,output=float32
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src import dynamic_loss_scale
from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src import policy as policy_lib
from jaxmp._src.fp8 import chips as chips_lib
from jaxmp._src.fp8 import recipes as recipes_lib

# The chip table's thresholds (jaxmp._src.fp8.chips, where each is stated once).
BF16_MIN_COMPUTE_CAPABILITY = chips_lib.BF16_MIN_COMPUTE_CAPABILITY
FP16_MIN_COMPUTE_CAPABILITY = chips_lib.FP16_MIN_COMPUTE_CAPABILITY
FP8_MIN_COMPUTE_CAPABILITY = chips_lib.FP8_MIN_COMPUTE_CAPABILITY


# Whole train steps compiled deviceless for TPU v7, by libtpu's cost model (estimates,
# not measurements; benchmarks/RESULTS.md, "TPU: the demo's train step" and "The
# Llama-shaped layer on TPUs"): bf16's summed kernel cycles over fp8's. Every one is
# below 1: the scaling passes cost more than the faster fp8 matmuls save.
TPU_V7_FP8_STEPS = (
    ("the demo's train step (width 768, per-tensor fp8)", 0.86),
    ("a Llama-3-8B-shaped layer's train step (1 x 1024 tokens, rowwise fp8)", 0.62),
)


def _tpu_fp8_fast(device_kind: str) -> bool:
  """Whether the chip table says this TPU's matrix units run fp8 faster than bfloat16."""
  chip = chips_lib.chip_of(device_kind)
  return chip is not None and bool(chip.target.fp8)


@dataclasses.dataclass(frozen=True)
class DeviceCapabilities:
  """What a device computes natively; built by :func:`device_capabilities`.

  Attributes:
    platform: ``"cpu"``, ``"gpu"``, ``"tpu"`` (or another platform name).
    device_kind: e.g. ``"NVIDIA H100 80GB HBM3"``, ``"TPU v5 lite"``, ``"cpu"``.
    compute_capability: a CUDA GPU's ``(major, minor)``; ``None`` elsewhere
      (ROCm GPUs report none).
    supports_bf16: bfloat16 matmuls run natively, faster than float32.
    supports_fp16: float16 matmuls run natively, faster than float32.
    supports_fp8: fp8 (E4M3/E5M2) matmuls run natively, as ``jaxmp.fp8`` uses them.
    half_dtype: :func:`jaxmp.half_dtype` of the device.
    explanation: why, in a sentence or two per dtype.
  """

  platform: str
  device_kind: str
  compute_capability: tuple[int, int] | None
  supports_bf16: bool
  supports_fp16: bool
  supports_fp8: bool
  half_dtype: np.dtype
  explanation: str

  def __str__(self) -> str:
    capability = ("" if self.compute_capability is None
                  else f", compute capability {'.'.join(map(str, self.compute_capability))}")
    yes_no = lambda flag: "yes" if flag else "no"
    return (f"{self.platform} ({self.device_kind}{capability}): bfloat16 "
            f"{yes_no(self.supports_bf16)}, float16 {yes_no(self.supports_fp16)}, fp8 "
            f"{yes_no(self.supports_fp8)}\n{self.explanation}")


def device_capabilities(device: Any = None) -> DeviceCapabilities:
  """Which reduced-precision dtypes ``device`` computes natively, and why.

  Rules: TPUs compute bfloat16 natively (their matrix units are bfloat16), not float16;
  fp8 only on v7 (``device_kind`` "TPU7x"), whose matrix units run fp8 at about twice
  the bfloat16 rate; v5e, v5p and v6e accept fp8 operands but run them at the
  bfloat16 rate (TPU cost model, the chip table's ``fp8_matmul_cycles``:
  ``jaxmp._src.fp8.chips.CHIPS``). CUDA GPUs compute float16 on tensor cores
  from compute capability 7.0, bfloat16 from 8.0 and fp8 from 8.9. ROCm GPUs (no
  compute capability) are taken to compute bfloat16 and float16, as
  :func:`jaxmp.half_dtype` does, with fp8 unknown (``False``). CPUs and other
  platforms compute none of them natively: XLA converts to float32 and back.

  Args:
    device: a ``jax.Device``, or any object with a ``platform`` string (and, for GPUs,
      ``device_kind`` and ``compute_capability`` like ``"8.9"``); the first local
      device when omitted.

  Returns:
    A :class:`DeviceCapabilities`.

  Raises:
    TypeError: if ``device`` has no ``platform`` string.
    ValueError: if a GPU's ``compute_capability`` is not ``"major.minor"``.

  Example:
    >>> import types
    >>> a100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100",
    ...                              compute_capability="8.0")
    >>> caps = jaxmp.tools.device_capabilities(a100)
    >>> caps.supports_bf16, caps.supports_fp8, caps.compute_capability
    (True, False, (8, 0))
  """
  device = dtypes_lib.check_device(device, "device_capabilities")
  platform = device.platform
  kind = str(getattr(device, "device_kind", platform))
  capability = (dtypes_lib.gpu_compute_capability(device, "device_capabilities")
                if platform == "gpu" else None)
  if platform == "tpu":
    bf16, fp16 = True, False
    fp8 = _tpu_fp8_fast(kind)
    why = ("TPU matrix units multiply bfloat16 natively; float16 is not a native TPU type. " + (
        f"{kind} runs fp8 matmuls at about twice the bfloat16 rate (TPU cost model)." if fp8
        else f"{kind} takes fp8 operands but runs them at the bfloat16 rate (TPU cost model: "
        "fp8 pays on v7 only), so fp8 saves memory, not time."))
  elif platform == "gpu" and capability is None:
    bf16, fp16, fp8 = True, True, False
    why = ("A GPU without a CUDA compute capability (ROCm): taken to compute bfloat16 and "
           "float16 natively, as jaxmp.half_dtype does; fp8 support unknown.")
  elif platform == "gpu" and capability is not None:
    cc = ".".join(map(str, capability))
    bf16 = capability >= BF16_MIN_COMPUTE_CAPABILITY
    fp16 = capability >= FP16_MIN_COMPUTE_CAPABILITY
    fp8 = capability >= FP8_MIN_COMPUTE_CAPABILITY
    why = " ".join([
        f"bfloat16 tensor cores need compute capability >= 8.0 (this GPU: {cc})." if not bf16
        else f"Compute capability {cc} >= 8.0: bfloat16 tensor cores.",
        "float16 tensor cores need >= 7.0." if not fp16 else "float16 tensor cores (>= 7.0).",
        "fp8 tensor cores (>= 8.9)." if fp8 else "fp8 tensor cores need >= 8.9.",
    ])
  else:
    bf16, fp16, fp8 = False, False, False
    why = (f"On {platform!r} XLA has no native bfloat16, float16 or fp8 arithmetic: it "
           "converts operands to float32 and results back, so half precision saves memory "
           "but is not faster than float32.")
  return DeviceCapabilities(platform=platform, device_kind=kind, compute_capability=capability,
                            supports_bf16=bf16, supports_fp16=fp16, supports_fp8=fp8,
                            half_dtype=dtypes_lib.half_dtype(device), explanation=why)


@dataclasses.dataclass(frozen=True, eq=False)
class RecommendedPolicy:
  """A mixed-precision set-up for a device; built by :func:`recommended_policy`.

  Attributes:
    device: the :class:`DeviceCapabilities` it is for.
    policy: the :class:`jaxmp.Policy` (float32 params and output, compute dtype per
      device); give it to ``jaxmp.linen.mixed_precision`` / ``jaxmp.nnx.mixed_precision``.
    loss_scale: the loss scale for :func:`jaxmp.loss_scaling`:
      ``DynamicLossScale()`` with float16 compute, ``NoOpLossScale()`` otherwise
      (the wrapper still skips non-finite steps).
    fp8: an fp8 recipe (``jaxmp.fp8.DelayedScaling()``) to try by rule on a GPU with
      fp8 tensor cores, else ``None``. Not part of ``policy``.
    reason: why, in words.
  """

  device: DeviceCapabilities
  policy: policy_lib.Policy
  loss_scale: loss_scale_lib.LossScale
  fp8: Any
  reason: str

  def __str__(self) -> str:
    lines = [f"policy:     {self.policy}", f"loss scale: {self.loss_scale!r}",
             f"fp8:        {'-' if self.fp8 is None else repr(self.fp8)}",
             f"device:     {self.device.platform} ({self.device.device_kind})",
             f"why:        {self.reason}"]
    return "\n".join(lines)


def recommended_policy(device: Any = None) -> RecommendedPolicy:
  """The mixed-precision policy, loss scale and fp8 option to use on ``device``.

  * TPU, or GPU with bfloat16 tensor cores (compute capability >= 8.0, and ROCm):
    compute in bfloat16, no loss scale (bfloat16 has float32's exponent range); on
    compute capability >= 8.9 also suggest fp8 matmuls with delayed scaling (they pay
    for large GEMMs: measured on an H200). Not on TPUs: on v5e/v5p/v6e they run at
    the bfloat16 rate, and on v7, where they run at about twice it, every whole train
    step compiled so far is estimated slower in fp8 (``TPU_V7_FP8_STEPS``).
  * GPU below 8.0: compute in float16 with dynamic loss scaling (float16 underflows
    small gradients without it).
  * CPU and other platforms: float32; half precision is emulated through float32
    there and runs slower (see the module docstring).

  Params and the model's output stay float32 in every case.

  Args:
    device: a ``jax.Device`` or a description of one (see
      :func:`device_capabilities`); the first local device when omitted.

  Returns:
    A :class:`RecommendedPolicy`; ``print`` it for the explanation.

  Raises:
    TypeError: if ``device`` has no ``platform`` string.

  Example:
    >>> import types
    >>> v100 = types.SimpleNamespace(platform="gpu", device_kind="Tesla V100",
    ...                              compute_capability="7.0")
    >>> recommended = jaxmp.tools.recommended_policy(v100)
    >>> print(recommended.policy)
    params=float32,compute=float16,output=float32
    >>> type(recommended.loss_scale).__name__
    'DynamicLossScale'
  """
  caps = device_capabilities(dtypes_lib.check_device(device, "recommended_policy"))
  f32 = np.dtype(np.float32)
  fp8 = None
  if caps.supports_bf16:
    compute = np.dtype(dtypes_lib.POLICY_DTYPE_ALIASES["bfloat16"])
    loss_scale: loss_scale_lib.LossScale = loss_scale_lib.NoOpLossScale()
    reason = (f"{caps.device_kind} computes bfloat16 natively; bfloat16 has float32's "
              f"exponent range, so no loss scale is needed.")
    if caps.supports_fp8 and caps.platform == "tpu":
      steps = ", ".join(f"{what} at {speed:.2f}x" for what, speed in TPU_V7_FP8_STEPS)
      reason += (f" Its matrix units run fp8 at about twice the bfloat16 rate, but by "
                 f"libtpu's cost model every whole train step compiled for it so far is "
                 f"slower in fp8 than in bfloat16 ({steps} bfloat16's speed; "
                 "benchmarks/RESULTS.md): the scaling passes cost more than the matmuls "
                 "save, so fp8 is not suggested. jaxmp.tools.recommend_precision(..., "
                 "target='v7') estimates it for your step.")
    elif caps.supports_fp8:
      fp8 = recipes_lib.DelayedScaling()
      reason += (" It also has fp8 tensor cores (about twice the bfloat16 rate): try fp8 "
                 "matmuls by rule where GEMMs are large, e.g. PolicyRules(policy, "
                 "[Rule('head'), Rule(nn.Dense, fp8=DelayedScaling())]), compare the loss "
                 "with bfloat16's, and check with jaxmp.tools.audit that the GEMMs run in fp8.")
  elif caps.platform == "gpu":
    compute = np.dtype(np.float16)
    loss_scale = dynamic_loss_scale.DynamicLossScale()
    reason = (f"{caps.device_kind} has no bfloat16 tensor cores (compute capability < 8.0); "
              f"float16 needs dynamic loss scaling so that small gradients do not flush to "
              f"zero.")
    if not caps.supports_fp16:
      reason += (" It has no float16 tensor cores either (< 7.0): float16 halves activation "
                 "memory, but expect little speed-up.")
  else:
    compute = f32
    loss_scale = loss_scale_lib.NoOpLossScale()
    reason = (f"XLA on {caps.platform!r} computes half precision through float32 "
              f"(converting operands and results), so float32 is faster. Use a bfloat16 "
              f"policy here only to preview its numerics.")
  return RecommendedPolicy(device=caps, policy=policy_lib.Policy(f32, compute, f32),
                           loss_scale=loss_scale, fp8=fp8, reason=reason)


__all__ = ("DeviceCapabilities", "RecommendedPolicy", "device_capabilities",
           "recommended_policy")
