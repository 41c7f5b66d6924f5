"""fp8 recipes: how each matmul operand's scale is chosen.

An fp8 matmul divides each operand by a per-tensor scale so that its values fit the
narrow fp8 range, multiplies in fp8 with a wide accumulator, and multiplies the
result by the product of the scales. A recipe says where the scales come from:

- :class:`DelayedScaling` (TransformerEngine's and Flax's default): the scale used
  this step comes from the largest absolute value (amax) seen on *previous* steps,
  kept in a per-tensor amax history that travels with the model as state.
- :class:`CurrentScaling` (torchao's default, Qwix): the scale comes from this step's
  amax of the very tensor being quantized; no state, one extra reduction per tensor.

Both quantize the forward operands (input and kernel) to E4M3 (``float8_e4m3fn``, max
448) and the output gradient to E5M2 (``float8_e5m2``, max 57344), do all scale
arithmetic in float32 whatever the compute dtype, and accumulate in float32.

Recipes are frozen, hashable dataclasses: they can be static arguments of ``jit`` and
fields of Flax modules.

Example:
  >>> from jaxmp import fp8
  >>> fp8.DelayedScaling(amax_history_length=16, amax_compute="most_recent")
  DelayedScaling(amax_history_length=16, margin=0, amax_compute='most_recent')
  >>> fp8.CurrentScaling()
  CurrentScaling(margin=0)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Union

AMAX_COMPUTE_ALGORITHMS = ("max", "most_recent")

# The largest margin whose scales stay normal float32 numbers. A scale is
# s = amax * 2**margin / fp8_max, and the op dequantizes with the product of two of them
# (s_input * s_kernel, and the gradient's with either) in float32. For the amaxes that
# matter, up to 2**16 (past float16's max, 65504: activations, weights and gradients of
# a half-precision network), and E4M3's max 448 (the smaller fp8 max, so the larger
# scale): s <= 2**(16 - log2(448) + margin) = 2**(7.19 + margin), and the product
# s * s < 2**128 (float32 overflows at 2**128) needs 2 * (7.19 + margin) < 128, i.e.
# margin <= 56. A larger margin makes the scale or the product inf, the op falls back to
# an unscaled quantization (or overflows the output), and fp8 silently runs unscaled.
_AMAX_THAT_MATTERS = 2.0**16
_E4M3_MAX = 448.0
MAX_MARGIN = math.floor(128 / 2 - math.log2(_AMAX_THAT_MATTERS / _E4M3_MAX))


def _check_margin(cls_name: str, margin: Any) -> None:
  if isinstance(margin, bool) or not isinstance(margin, numbers.Integral):
    raise TypeError(
        f"{cls_name}: margin must be a non-negative int (scales are multiplied by "
        f"2**margin), got {margin!r} of type {type(margin).__name__}.")
  if margin < 0:
    raise ValueError(f"{cls_name}: margin must be >= 0, got {margin!r}.")
  if margin > MAX_MARGIN:
    raise ValueError(
        f"{cls_name}: margin must be in [0, {MAX_MARGIN}] (beyond it the product of two "
        f"scales, amax * 2**margin / 448 each, overflows float32 for amaxes up to 2**16 "
        f"and fp8 would run unscaled), got {margin!r}.")


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
  """Delayed scaling: each tensor's scale comes from the amaxes of previous steps.

  Per tensor (input, kernel, output gradient) the state holds a scale and an amax
  history of ``amax_history_length`` entries. On each use:

  1. ``amax = max(history)`` (or ``history[0]``, the most recent step, with
     ``amax_compute="most_recent"``);
  2. ``scale = 1 / ((fp8_max / amax) / 2**margin)``, i.e. ``amax * 2**margin / fp8_max``,
     stored as the dequantization multiplier as Flax does; when ``amax`` is zero or not
     finite (no history yet, or an overflowed step) the previous scale is kept;
  3. the tensor is quantized as ``clip(x / scale, -fp8_max, fp8_max)`` with this scale;
  4. ``max|x|`` of this step is pushed into the history (``roll(history, -1)`` then
     ``history[0] = max|x|``) for the next steps.

  The new scales and histories are returned as the "gradients" of the old ones; see
  :mod:`jaxmp.fp8.state` for how a trainer turns them into the next state.

  Attributes:
    amax_history_length: entries in each amax history, >= 1. TransformerEngine and
      Flax default to 1024.
    margin: the scale is multiplied by ``2**margin``, leaving that many powers of two
      of headroom above the amax; an int in ``[0, 56]`` (:data:`MAX_MARGIN`): the
      scales, and the product of two that the op dequantizes with, must stay normal
      float32 numbers for amaxes up to ``2**16``, and ``2 * (16 - log2(448) + margin)
      < 128`` gives 56.
    amax_compute: ``"max"`` (the largest amax in the history) or ``"most_recent"``
      (the amax of the previous step).

  Raises:
    TypeError: if ``amax_history_length`` or ``margin`` is not an int.
    ValueError: if ``amax_history_length < 1``, ``margin`` is outside ``[0, 56]`` or
      ``amax_compute`` is not one of ``"max"``, ``"most_recent"``.

  Example:
    >>> from jaxmp import fp8
    >>> recipe = fp8.DelayedScaling(amax_history_length=16)
    >>> recipe == fp8.DelayedScaling(16), hash(recipe) == hash(fp8.DelayedScaling(16))
    (True, True)
  """

  amax_history_length: int = 1024
  margin: int = 0
  amax_compute: str = "max"

  def __post_init__(self):
    length = self.amax_history_length
    if isinstance(length, bool) or not isinstance(length, numbers.Integral):
      raise TypeError(
          "DelayedScaling: amax_history_length must be an int >= 1, got "
          f"{length!r} of type {type(length).__name__}.")
    if length < 1:
      raise ValueError(f"DelayedScaling: amax_history_length must be >= 1, got {length!r}.")
    _check_margin("DelayedScaling", self.margin)
    if self.amax_compute not in AMAX_COMPUTE_ALGORITHMS:
      raise ValueError(
          f"DelayedScaling: unknown amax_compute {self.amax_compute!r}; accepted values "
          f"are {', '.join(repr(a) for a in AMAX_COMPUTE_ALGORITHMS)}.")
    # Normalise numpy integers so that equal recipes hash equally.
    object.__setattr__(self, "amax_history_length", int(length))
    object.__setattr__(self, "margin", int(self.margin))


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
  """Current (just-in-time) scaling: each tensor's scale comes from its own amax.

  ``scale = 1 / ((fp8_max / max|x|) / 2**margin)`` for the input and the kernel in the
  forward pass and for the output gradient in the backward pass; a tensor whose amax
  is zero or not finite uses scale 1. There is no state and no delay: nothing to
  carry between steps, at the cost of one extra reduction over each tensor before it
  is quantized.

  Attributes:
    margin: the scale is multiplied by ``2**margin``; an int in ``[0, 56]`` (see
      :class:`DelayedScaling`).

  Raises:
    TypeError: if ``margin`` is not an int.
    ValueError: if ``margin`` is outside ``[0, 56]``.

  Example:
    >>> from jaxmp import fp8
    >>> fp8.CurrentScaling(margin=1)
    CurrentScaling(margin=1)
  """

  margin: int = 0

  def __post_init__(self):
    _check_margin("CurrentScaling", self.margin)
    object.__setattr__(self, "margin", int(self.margin))


Recipe = Union[DelayedScaling, CurrentScaling]

RECIPE_TYPES = (DelayedScaling, CurrentScaling)


def check_recipe(recipe: Any, where: str = "fp8") -> Recipe:
  """Returns ``recipe`` if it is a jaxmp fp8 recipe, else raises a TypeError naming it.

  Args:
    recipe: the value to check.
    where: who is asking, for the error message.

  Returns:
    ``recipe``.

  Raises:
    TypeError: if ``recipe`` is not a :class:`DelayedScaling` or :class:`CurrentScaling`
      instance (a class instead of an instance, a string, a Flax module, ...).

  Example:
    >>> from jaxmp import fp8
    >>> jaxmp._src.fp8.recipes.check_recipe(fp8.CurrentScaling())
    CurrentScaling(margin=0)
  """
  if isinstance(recipe, RECIPE_TYPES):
    return recipe
  hint = ""
  if isinstance(recipe, type) and issubclass(recipe, RECIPE_TYPES):
    hint = f" Pass an instance, e.g. {recipe.__name__}()."
  raise TypeError(
      f"{where}: recipe must be a jaxmp.fp8.DelayedScaling or jaxmp.fp8.CurrentScaling "
      f"instance, got {recipe!r} of type {type(recipe).__name__}.{hint}")


__all__ = (
    "MAX_MARGIN",
    "CurrentScaling",
    "DelayedScaling",
    "Recipe",
    "check_recipe",
)
