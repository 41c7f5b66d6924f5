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
implementation, which of jaxmp's block-scaled fp8 kernels ``BlockScaling`` uses
(:attr:`Target.block_fp8_kernels`), whether quantized operands are pinned row-major
(:attr:`Target.k_major_fp8`), and whether the per-tensor recipes quantize with the
fused kernel (:attr:`Target.fused_quantize`, off on every chip unless
``compile_target(..., fused_quantize=True)``), and all are wrapped in
``lax.platform_dependent``, so a
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

import contextvars
import dataclasses
import warnings
from typing import Any

import jax

from jaxmp._src import dtypes
from jaxmp._src.fp8 import chips
from jaxmp._src.fp8 import ops


class Fp8FallbackWarning(UserWarning):
  """A recipe's GEMMs do not run as fp8 (or MX) GEMMs on the target, or, for
  :class:`~jaxmp.fp8.Int8Scaling`, int8 GEMMs run no faster than bfloat16 there."""


Target = chips.Target
Lowering = chips.Lowering
TARGETS = chips.TARGETS
target_for_device = chips.target_for_device
_OVERRIDE: contextvars.ContextVar = contextvars.ContextVar("jaxmp_fp8_target", default=None)


class CompileTarget:
  """What :func:`~jaxmp.fp8.compile_target` returns: the chip, while entered (``with``).

  Entering sets the override (clearing JAX's caches where it changes the target, see
  :func:`~jaxmp.fp8.compile_target`) and yields the :class:`~jaxmp.fp8.Target`; leaving
  restores the previous one. It may be entered again, nested too. One that is dropped
  without ever being entered warns (``RuntimeWarning``), as a coroutine never awaited
  does: called as a plain function, ``compile_target`` changes nothing.
  """

  def __init__(self, name: str, target: Target):
    self._name = name
    self.target = target
    self._entered = False
    self._restore: list[tuple[contextvars.Token, bool]] = []

  def __enter__(self) -> Target:
    self._entered = True
    changes_target = current_target() != self.target
    if changes_target:
      jax.clear_caches()
    self._restore.append((_OVERRIDE.set(self.target), changes_target))
    return self.target

  def __exit__(self, *exc_info: Any) -> None:
    token, changes_target = self._restore.pop()
    _OVERRIDE.reset(token)
    if changes_target:
      jax.clear_caches()

  def __repr__(self) -> str:
    return f"jaxmp.fp8.compile_target({self._name!r})"

  def __del__(self) -> None:
    if not getattr(self, "_entered", True):
      warnings.warn(
          f"{self!r} was never entered, so it changed nothing: it names the chip only inside "
          f"`with {self!r}:`.", RuntimeWarning, stacklevel=2)


def compile_target(name: str | Target, *, fused_quantize: bool | None = None) -> CompileTarget:
  """Makes fp8 ops traced inside ``with compile_target(name):`` treat ``name`` as the chip.

  For deviceless compiles (``JAX_PLATFORMS=cpu``), where the local device is not the
  chip: ``jaxmp.tools.audit(..., target=name)`` uses it. The previous target comes back
  on exit. Only the ``with`` block names the chip: called alone it changes nothing, and
  the object it returns warns (``RuntimeWarning``) when dropped without being entered.

  A :class:`~jaxmp.fp8.Target` may be given instead of a name: a chip of the table with
  a choice changed, e.g. ``dataclasses.replace(TARGETS["h100"], block_fp8_kernels=
  ("mosaic",))`` to compile ``BlockScaling`` with the Mosaic GPU kernel (the
  benchmarks compare jaxmp's kernels so).

  JAX caches each function's trace by the function and its argument types, which do not
  include this override: a function traced before for another chip would come back
  with that chip's choices, and one traced inside would keep the named chip's after the
  block. So where the override changes the target, JAX's caches are cleared
  (``jax.clear_caches()``) on entry and on exit: functions traced before or inside are
  traced and compiled again on their next call.

  Args:
    name: one of ``TARGETS`` (case-insensitive), or a :class:`~jaxmp.fp8.Target`.
    fused_quantize: overrides the chip's :attr:`~jaxmp.fp8.Target.fused_quantize` (the
      fused fp8 quantization kernel; ``None`` keeps the table's choice), so that
      benchmarks and tests compile both forms for one chip. Only where the chip has
      ``k_major_fp8`` (Hopper): elsewhere no GEMM needs the transposed codes.

  Returns:
    A :class:`~jaxmp._src.fp8.support.CompileTarget`, a context manager whose ``with`` yields the
    :class:`~jaxmp.fp8.Target`.

  Raises:
    TypeError: if ``name`` is neither a string nor a ``Target``.
    ValueError: for an unknown name (the message lists the accepted ones), or
      ``fused_quantize=True`` for a chip without ``k_major_fp8``.
  """
  if isinstance(name, Target):
    name, target = name.name, name
  elif isinstance(name, str):
    target = TARGETS.get(name.lower())
  else:
    raise TypeError(f"compile_target: name must be a string, one of {sorted(TARGETS)}, or a "
                    f"jaxmp.fp8.Target, got {name!r} of type {type(name).__name__}.")
  if target is None:
    raise ValueError(f"compile_target: unknown target {name!r}; accepted targets are "
                     f"{', '.join(sorted(TARGETS))}.")
  if fused_quantize is not None:
    if not isinstance(fused_quantize, bool):
      raise TypeError(f"compile_target: fused_quantize must be a bool or None, got "
                      f"{fused_quantize!r}.")
    if fused_quantize and not target.k_major_fp8:
      raise ValueError(
          f"compile_target: fused_quantize=True needs a chip whose fp8 GEMMs read both "
          f"operands with the contracted dimension minor (k_major_fp8: "
          f"{', '.join(n for n, t in sorted(TARGETS.items()) if t.k_major_fp8)}); "
          f"{name!r} has none.")
    target = dataclasses.replace(target, fused_quantize=fused_quantize)
  return CompileTarget(name, target)


def current_target() -> Target:
  """The chip fp8 ops are being traced for: the :func:`compile_target` override, or the
  device JAX computes on by default (``jax.default_device``'s, else the default
  backend's first)."""
  override = _OVERRIDE.get()
  return override if override is not None else target_for_device(dtypes.default_device())


def lowering(recipe: Any, target: Target) -> Lowering:
  """What a GEMM under ``recipe`` (one GEMM's recipe, or ``None``) runs as on ``target``.

  The recipe's entry in the fp8 ops table says (:attr:`~jaxmp._src.fp8.ops.RecipeOps.lowering`),
  except on a CPU, where every recipe is emulated.
  """
  if recipe is None:
    return Lowering("compute dtype", "a GEMM in the operands' dtype, as asked")
  if target.platform == "cpu":
    return Lowering("emulated", "fp8 values widened to float32 by XLA:CPU")
  return ops.of(recipe).lowering(recipe, target)


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
  for name, gemm_recipe in zip(_GEMM_NAMES, ops.gemms(recipe)):
    found = lowering(gemm_recipe, target)
    if found.kind == "fallback":
      fallbacks.setdefault((ops.narrow_type(gemm_recipe), found.detail),
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
    "CompileTarget",
    "Fp8FallbackWarning",
    "Lowering",
    "Target",
    "compile_target",
    "current_target",
    "lowering",
    "target_for_device",
    "warn_on_fallback",
)
