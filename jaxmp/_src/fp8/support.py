"""What runs where: whether a recipe's GEMMs become fp8 or MX GEMMs, and a warning when not.

A recipe asks for fp8; the compiler decides what runs. Compiled deviceless with
``jaxmp.tools.audit`` (jax 0.10.2, cuBLAS mode; the tool
:func:`jaxmp._src.tools.audit.compiled_gemms` compiles one cell) the GEMMs lower as
follows (the support table of docs/guides/fp8.md):

==================  ========================  ========================  =================
recipe              H100 (sm_90)              B200 (sm_100)             TPU v7
==================  ========================  ========================  =================
per tensor          fp8 GEMM (cuBLASLt)       fp8 GEMM (cuBLASLt)       fp8 GEMM
per row             fp8 GEMM (cuBLASLt)       fp8 GEMM (cuBLASLt)       fp8 GEMM
1x128 / 128x128     fp8 GEMM (jaxmp kernel)   fallback: f32/bf16 GEMM   fallback
  power-of-two      fallback: bf16 GEMM       fallback: bf16 GEMM       fallback
MXFP8               fallback: bf16 GEMM       MX GEMM (cuDNN >= 9.10)   fallback: bf16
==================  ========================  ========================  =================

A100 (sm_80) has no fp8 tensor cores (XLA widens every fp8 GEMM) and TPU v5e, v5p and
v6e run fp8 operands at the bfloat16 rate: every recipe falls back there. On a CPU
every recipe is emulated (documented, not warned about).

:class:`~jaxmp.fp8.Int8Scaling`'s GEMMs compile to int8 GEMMs on every TPU (and to
cuBLASLt int8 GEMMs on an H100); by libtpu's cost model a 2048^3 int8 GEMM costs about
0.5x bfloat16's cycles on v5e and v5p, 0.7-0.95x on v6e and 1x on v7, so int8 warns on
v7 (:attr:`Target.int8`). jaxmp makes no claim about int8 speed on GPUs (no warning).

**How a recipe learns the target.** While ``fp8_dot_general`` traces, it asks
:func:`current_target`: the innermost :func:`compile_target` override if there is one
(``jaxmp.tools.audit(..., target=...)`` sets it for its compile), else the first device
of JAX's default backend (its platform, compute capability or TPU kind). A deviceless
compile runs with ``JAX_PLATFORMS=cpu`` and would see the CPU: name the chip with
``compile_target``. The choices it makes at trace time are only the MX GEMM's
implementation, whether ``BlockScaling`` uses jaxmp's block-scaled fp8 kernel
(:attr:`Target.block_fp8`) and whether quantized operands are pinned row-major
(:attr:`Target.k_major_fp8`), and all are wrapped in ``lax.platform_dependent``, so a
function traced for one target still lowers on any other. A recipe whose GEMMs fall back on
the target warns once (:class:`Fp8FallbackWarning`), naming the target and what runs.

Example:
  >>> from jaxmp import fp8
  >>> with fp8.compile_target("b200"):
  ...   fp8.current_target().name
  'b200'
  >>> support = jaxmp._src.fp8.support
  >>> support.lowering(fp8.MXScaling(), support.TARGETS["h100"]).kind
  'fallback'
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import jax

from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src import jax_compat
from jaxmp._src.fp8 import block_gemm
from jaxmp._src.fp8 import recipes as recipes_lib


class Fp8FallbackWarning(UserWarning):
  """A recipe's GEMMs do not run as fp8 (or MX) GEMMs on the target, or, for
  :class:`~jaxmp.fp8.Int8Scaling`, int8 GEMMs run no faster than bfloat16 there."""


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
    block_fp8: ``BlockScaling``'s GEMMs run as jaxmp's block-scaled fp8 kernel
      (``jaxmp._src.fp8.block_gemm``: Triton's ``wgmma``, Hopper, sm_90) where
      ``block_gemm.supports`` the recipe.
    k_major_fp8: cuBLASLt's fp8 GEMMs read both operands with the contracted dimension
      minor (Ada and Hopper, sm_89 and sm_90; Blackwell takes any layout), so jaxmp
      writes the forward pass's quantized operands row-major
      (``jaxmp._src.fp8.scaled_gemm.in_own_layout_on_gpus``).
  """

  name: str
  platform: str
  fp8: bool | None
  mx: bool
  description: str
  int8: bool | None = None
  block_fp8: bool = False
  k_major_fp8: bool = False


TARGETS = {
    "h100": Target("h100", "gpu", True, False, "NVIDIA H100, sm_90", block_fp8=True,
                   k_major_fp8=True),
    "h200": Target("h200", "gpu", True, False, "NVIDIA H200, sm_90", block_fp8=True,
                   k_major_fp8=True),
    "b200": Target("b200", "gpu", True, True, "NVIDIA B200, sm_100, cuDNN >= 9.10"),
    "a100": Target("a100", "gpu", False, False, "NVIDIA A100, sm_80: no fp8 tensor cores"),
    "v5e": Target("v5e", "tpu", False, False, "TPU v5e: fp8 at the bfloat16 rate", True),
    "v5p": Target("v5p", "tpu", False, False, "TPU v5p: fp8 at the bfloat16 rate", True),
    "v6e": Target("v6e", "tpu", False, False, "TPU v6e: fp8 at the bfloat16 rate", True),
    "v7": Target("v7", "tpu", True, False, "TPU v7: int8 at the bfloat16 rate", False),
    "cpu": Target("cpu", "cpu", False, False, "CPU: fp8 emulated"),
}
"""The targets :func:`compile_target` accepts (``jaxmp.tools.audit``'s names)."""

_TPU_KINDS = {"TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v6 lite": "v6e", "TPU7x": "v7",
              "TPU v7": "v7"}
_OVERRIDE: contextvars.ContextVar = contextvars.ContextVar("jaxmp_fp8_target", default=None)


@contextlib.contextmanager
def compile_target(name: str) -> Iterator[Target]:
  """Makes fp8 ops traced inside treat ``name`` as the chip they compile for.

  For deviceless compiles (``JAX_PLATFORMS=cpu``), where the local device is not the
  chip: ``jaxmp.tools.audit(..., target=name)`` uses it. The previous target comes back
  on exit.

  JAX caches each function's trace by the function and its argument types, which do not
  include this override: a function traced before for another chip would come back
  with that chip's choices, and one traced inside would keep the named chip's after the
  block. So where the override changes the target, JAX's caches are cleared
  (``jax.clear_caches()``) on entry and on exit: functions traced before or inside are
  traced and compiled again on their next call.

  Args:
    name: one of ``TARGETS`` (case-insensitive).

  Yields:
    The :class:`~jaxmp._src.fp8.support.Target`.

  Raises:
    TypeError: if ``name`` is not a string.
    ValueError: for an unknown name (the message lists the accepted ones).
  """
  if not isinstance(name, str):
    raise TypeError(f"compile_target: name must be a string, one of {sorted(TARGETS)}, got "
                    f"{name!r} of type {type(name).__name__}.")
  target = TARGETS.get(name.lower())
  if target is None:
    raise ValueError(f"compile_target: unknown target {name!r}; accepted targets are "
                     f"{', '.join(sorted(TARGETS))}.")
  changes_target = current_target() != target
  if changes_target:
    jax.clear_caches()
  token = _OVERRIDE.set(target)
  try:
    yield target
  finally:
    _OVERRIDE.reset(token)
    if changes_target:
      jax.clear_caches()


def target_for_device(device: Any) -> Target:
  """The :class:`Target` of a ``jax.Device`` (duck-typed on ``platform``, ``device_kind``).

  Example:
    >>> import types
    >>> gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
    ...                             compute_capability="9.0")
    >>> jaxmp._src.fp8.support.target_for_device(gpu).fp8
    True
  """
  platform, kind = device.platform, str(getattr(device, "device_kind", device.platform))
  if platform == "tpu":
    return TARGETS.get(_TPU_KINDS.get(kind, ""), Target(kind, "tpu", False, False, kind))
  if platform != "gpu":
    return Target(platform, platform, False, False, f"{kind}: fp8 emulated")
  capability = dtypes_lib.gpu_compute_capability(device, "jaxmp.fp8")
  if capability is None:  # ROCm: not described here, so no claim is made
    return Target(kind, "gpu", None, False, kind)
  cudnn = jax_compat.cudnn_version()
  mx = capability >= (10, 0) and (cudnn is None or cudnn >= 91000)
  return Target(kind, "gpu", capability >= (8, 9), mx,
                f"{kind}, sm_{capability[0]}{capability[1]}", block_fp8=capability == (9, 0),
                k_major_fp8=capability in ((8, 9), (9, 0)))


def current_target() -> Target:
  """The chip fp8 ops are being traced for: the :func:`compile_target` override, or the
  first device of JAX's default backend."""
  override = _OVERRIDE.get()
  return override if override is not None else target_for_device(jax.devices()[0])


@dataclasses.dataclass(frozen=True)
class Lowering:
  """What one GEMM runs as: ``kind`` is ``"fp8"``, ``"mx"``, ``"fallback"``,
  ``"emulated"`` (CPU) or ``"compute dtype"`` (no recipe); ``detail`` says more."""

  kind: str
  detail: str


def lowering(recipe: Any, target: Target) -> Lowering:
  """What a GEMM under ``recipe`` (one GEMM's recipe, or ``None``) runs as on ``target``."""
  if recipe is None:
    return Lowering("compute dtype", "a GEMM in the operands' dtype, as asked")
  if target.platform == "cpu":
    return Lowering("emulated", "fp8 values widened to float32 by XLA:CPU")
  if isinstance(recipe, recipes_lib.Int8Scaling):
    return _int8_lowering(target)
  if target.fp8 is None:
    return Lowering("unknown", f"fp8 support of {target.description} is not described")
  if isinstance(recipe, recipes_lib.BlockScaling):
    if target.block_fp8 and block_gemm.supports(recipe):
      return Lowering("fp8", "jaxmp's block-scaled fp8 GEMM (a Pallas Triton kernel, wgmma)")
    if recipe.power_of_two:
      why = ("exact with power-of-two scales, and faster than jaxmp's block-scaled fp8 "
             "GEMM, which runs the other scales" if target.block_fp8 else
             f"jaxmp's block-scaled fp8 GEMM runs on Hopper GPUs, sm_90, with block_size "
             f"{block_gemm.BLOCK} and scales that are not powers of two")
      return Lowering("fallback", f"a bfloat16 GEMM on dequantized operands ({why})")
    why = ("needs Pallas Triton internals this JAX lacks"
           if target.block_fp8 and recipe.block_size == block_gemm.BLOCK else
           f"runs on Hopper GPUs, sm_90, with block_size {block_gemm.BLOCK}")
    return Lowering("fallback", f"a float32 GEMM on dequantized operands (jaxmp's "
                    f"block-scaled fp8 GEMM {why})")
  if isinstance(recipe, recipes_lib.MXScaling):
    if target.mx:
      return Lowering("mx", "cuDNN's MXFP8 block-scaled GEMM")
    return Lowering("fallback", "a bfloat16 GEMM on dequantized operands (MXFP8 GEMMs need "
                    "a Blackwell GPU with cuDNN >= 9.10)")
  if target.fp8:
    return Lowering("fp8", "an fp8 GEMM")
  if target.platform == "tpu":
    return Lowering("fallback", "fp8 GEMMs at the bfloat16 rate (no fp8 matrix units)")
  return Lowering("fallback", "16-bit GEMMs (XLA widens the fp8 operands: no fp8 tensor cores)")


def _int8_lowering(target: Target) -> Lowering:
  if target.int8 is None:
    return Lowering("unknown", f"int8 GEMM speed on {target.description} is not described")
  if target.int8:
    return Lowering("int8", "an int8 GEMM with int32 accumulation")
  return Lowering("fallback", "int8 GEMMs at the bfloat16 rate (libtpu's cost model): only "
                  "the quantization's cost is added")


def gemm_recipes(recipe: Any) -> tuple:
  """``(forward, input_grad, weight_grad)`` of any recipe (a per-tensor one serves all)."""
  if isinstance(recipe, recipes_lib.GemmRecipes):
    return recipe.gemms
  return (recipe, recipe, recipe)


_GEMM_NAMES = ("forward", "input-gradient", "weight-gradient")


def warn_on_fallback(recipe: Any, target: Target | None = None) -> None:
  """Warns (:class:`Fp8FallbackWarning`) if some of ``recipe``'s GEMMs fall back on ``target``.

  One message per recipe and chip, whichever layer traces it: the same text each time,
  so Python's warning filter shows it once rather than once per layer of a large model.

  Args:
    recipe: any fp8 recipe, as the user gave it (the message shows it).
    target: the chip; :func:`current_target` by default.
  """
  target = current_target() if target is None else target
  fallbacks = {}
  for name, gemm_recipe in zip(_GEMM_NAMES, gemm_recipes(recipe)):
    found = lowering(gemm_recipe, target)
    if found.kind == "fallback":
      fallbacks.setdefault((recipes_lib.narrow_type(gemm_recipe), found.detail),
                           []).append(name)
  for (narrow, detail), names in fallbacks.items():
    gemms = "GEMMs run" if len(names) > 1 else "GEMM runs"
    warnings.warn(
        f"jaxmp fp8: {recipe!r} does not run in {narrow} on {target.name} "
        f"({target.description}): its {', '.join(names)} {gemms} as {detail}. "
        "Name another target with jaxmp.fp8.compile_target if this is not the chip.",
        Fp8FallbackWarning, stacklevel=4)


__all__ = (
    "TARGETS",
    "Fp8FallbackWarning",
    "Lowering",
    "Target",
    "compile_target",
    "current_target",
    "gemm_recipes",
    "lowering",
    "target_for_device",
    "warn_on_fallback",
)
