"""The fp8 ops table: what the fp8 core does with each recipe type, in one place.

A recipe (:mod:`~jaxmp._src.fp8.recipes`) is configuration only. Everything that varies
by recipe, namely how its operands are grouped and quantized, how two quantized operands
multiply, what that lowers to on each chip, and whether it keeps state, is its type's
:class:`RecipeOps` entry here, written in the recipe's own module:

================  ==========================  =================  =========================
recipe            operands (:class:`OperandOps`)  GEMM           per-tensor op, state
================  ==========================  =================  =========================
DelayedScaling    (per tensor, in the op)     (in the op)        :mod:`.delayed`, state
CurrentScaling    :mod:`.current`             outer-scaled       :mod:`.current`
RowwiseScaling    :mod:`.rowwise`             outer-scaled       none
BlockScaling      :mod:`.block`               :mod:`.block`      none
MXScaling         :mod:`.mx`                  :mod:`.mx`         none
Int8Scaling       :mod:`.int8`                :mod:`.int8`       none
OperandRecipes    (each role's recipe's)      outer-scaled       none
================  ==========================  =================  =========================

("outer-scaled": :func:`~jaxmp._src.fp8.scaled_gemm.outer_scaled_gemm`, for scales that
do not vary along the contracted dimension.) The call sites do one lookup: the
per-tensor op (:mod:`~jaxmp._src.fp8.dot_general`) takes :attr:`RecipeOps.per_tensor`,
the per-GEMM op (:mod:`~jaxmp._src.fp8.per_gemm`) a GEMM recipe's
:attr:`RecipeOps.operand` and :attr:`RecipeOps.gemm`, the fallback warning
(:mod:`~jaxmp._src.fp8.support`) :attr:`RecipeOps.lowering`, the state functions
(:mod:`~jaxmp._src.fp8.state`) the per-tensor op's state. A new recipe is a config class
(derived from :class:`~jaxmp.fp8.GemmRecipe`), its functions and one entry
(:func:`register_recipe`); no call site changes.

Example:
  >>> from jaxmp._src.fp8 import ops
  >>> ops.of(jaxmp.fp8.Int8Scaling()).narrow, ops.narrow_type(jaxmp.fp8.GemmRecipes(
  ...     jaxmp.fp8.Int8Scaling(), jaxmp.fp8.RowwiseScaling()))
  ('int8', 'fp8 and int8')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import Protocol

import jax
import numpy as np

from jaxmp._src.fp8 import block
from jaxmp._src.fp8 import chips
from jaxmp._src.fp8 import current
from jaxmp._src.fp8 import delayed
from jaxmp._src.fp8 import grouped
from jaxmp._src.fp8 import int8
from jaxmp._src.fp8 import mx
from jaxmp._src.fp8 import recipes as recipes_lib
from jaxmp._src.fp8 import rowwise
from jaxmp._src.fp8 import scaled_gemm


class GemmCall(NamedTuple):
  """One GEMM of canonical operands, as a recipe's :attr:`RecipeOps.gemm` is given it.

  Attributes:
    roles: the two operands' roles (``"input"``, ``"kernel"``, ``"output_grad"``).
    groupings: the two operands' :class:`~jaxmp._src.fp8.grouped.Grouping`.
    out_dtype: the product's dtype.
    target: the chip being compiled for (:class:`~jaxmp._src.fp8.chips.Target`).
    accumulate_exactly_on_gpus: no fast accumulation on CUDA (the gradient GEMMs, as
      Flax and TransformerEngine).
  """

  roles: tuple[str, str]
  groupings: tuple[grouped.Grouping, grouped.Grouping]
  out_dtype: np.dtype
  target: chips.Target
  accumulate_exactly_on_gpus: bool


Quantize = Callable[[jax.Array, Any, str], grouped.Quantized]
"""``quantize(x, recipe, role)``: a canonical ``(B, R, C)`` operand, quantized."""


class AmaxScaled(Protocol):
  """A recipe whose groups are scaled by their own amax (:attr:`OperandOps.quantize` ``None``)."""

  margin: int
  power_of_two: bool


@dataclasses.dataclass(frozen=True)
class OperandOps:
  """How a recipe prepares one canonical GEMM operand ``(B, R, C)`` in a role.

  Attributes:
    grouping: ``grouping(recipe, role)``: which elements share a scale.
    element_format: ``element_format(recipe, role)``: the narrow dtype of the elements.
    quantize: ``quantize(x, recipe, role)``; ``None`` scales each group by its own amax
      (``jaxmp._src.fp8.grouped.scales``, with the recipe's ``margin`` and
      ``power_of_two``) in ``element_format``.
    quantize_swapped: ``quantize_swapped(x, recipe, role)``: the operand with its rows
      and contracted dimension swapped (as a backward GEMM reads it); ``None`` swaps,
      then quantizes.
  """

  grouping: Callable[[Any, str], grouped.Grouping]
  element_format: Callable[[Any, str], np.dtype]
  quantize: Quantize | None = None
  quantize_swapped: Quantize | None = None


@dataclasses.dataclass(frozen=True)
class PerTensorOps:
  """How a per-tensor recipe scales ``fp8_dot_general``'s one op (one quantization of each
  tensor serves every GEMM that reads it; :mod:`~jaxmp._src.fp8.dot_general`).

  Attributes:
    forward: ``forward(lhs, rhs, state, cfg) -> (q_lhs, q_rhs, x_scale, k_scale, carry)``;
      where ``cfg.fused_quantize``, ``q_lhs`` is a ``(codes, transposed)`` pair
      (``jaxmp._src.fp8.fused_quantize``).
    backward: ``backward(g, x_scale, k_scale, carry, cfg) -> (q_g, g_scale, new_state)``,
      ``new_state`` the state's new values in its fields' order, or ``None``; ``q_g`` a
      pair where ``cfg.fused_quantize``.
    primal: ``primal(lhs, rhs, state, cfg) -> (q_lhs, q_rhs, scale)`` when nothing
      differentiates the op; ``None`` takes ``forward``'s.
    state_type: the NamedTuple of its state, or ``None`` (no state).
    init_state: ``init_state(recipe)``, the state's initial value.
    check_state: ``check_state(state, recipe)``, the state as the op reads it, or a
      TypeError/ValueError.
  """

  forward: Callable[..., Any]
  backward: Callable[..., Any]
  primal: Callable[..., Any] | None = None
  state_type: type | None = None
  init_state: Callable[[Any], Any] | None = None
  check_state: Callable[[Any, Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class RecipeOps:
  """Everything the fp8 core does with one recipe type: its entry in the table.

  Attributes:
    narrow: what its GEMMs multiply, ``"fp8"`` or ``"int8"`` (for messages).
    lowering: ``lowering(recipe, target) -> Lowering``: what one of its GEMMs runs as
      on a chip (``jaxmp._src.fp8.chips``), for the fallback warning and the docs.
    operand: how it prepares an operand (a recipe one GEMM or operand may use).
    gemm: ``gemm(a, b, recipe, call: GemmCall)``: the product of two of its quantized
      operands, ``(B, P', Q')`` before the padding is sliced off.
    per_tensor: how it scales ``fp8_dot_general``'s per-tensor op, for a recipe that
      runs as a layer's whole recipe there (``DelayedScaling``, ``CurrentScaling``);
      other layer recipes ``r`` run as ``GemmRecipes(r, r, r)``.
  """

  narrow: str
  lowering: Callable[[Any, chips.Target], chips.Lowering]
  operand: OperandOps | None = None
  gemm: Callable[..., jax.Array] | None = None
  per_tensor: PerTensorOps | None = None


def _fp8_gemm(recipe: Any, target: chips.Target) -> chips.Lowering:
  del recipe
  return chips.fp8_gemm(target)


_TABLE: dict[type, RecipeOps] = {
    recipes_lib.DelayedScaling: RecipeOps(
        "fp8", delayed.lowering,
        per_tensor=PerTensorOps(delayed.forward, delayed.backward, delayed.primal,
                                delayed.DelayedScalingState, delayed.init_state,
                                delayed.check_state)),
    recipes_lib.CurrentScaling: RecipeOps(
        "fp8", current.lowering, OperandOps(current.grouping, current.fp8_format),
        scaled_gemm.outer_scaled_gemm, PerTensorOps(current.forward, current.backward)),
    recipes_lib.RowwiseScaling: RecipeOps(
        "fp8", _fp8_gemm, OperandOps(rowwise.grouping, rowwise.fp8_format),
        scaled_gemm.outer_scaled_gemm),
    recipes_lib.BlockScaling: RecipeOps(
        "fp8", block.lowering, OperandOps(block.grouping, block.fp8_format), block.gemm),
    recipes_lib.MXScaling: RecipeOps(
        "fp8", mx.lowering, OperandOps(mx.grouping, mx.fp8_format, mx.quantize_operand),
        mx.gemm_operands),
    recipes_lib.Int8Scaling: RecipeOps(
        "int8", int8.lowering,
        OperandOps(int8.grouping, int8.element_format, int8.quantize_operand,
                   int8.quantize_swapped_operand),
        int8.gemm_operands),
    # Each operand is prepared by its role's recipe (OperandRecipes.for_role).
    recipes_lib.OperandRecipes: RecipeOps("fp8", _fp8_gemm, None,
                                          scaled_gemm.outer_scaled_gemm),
}


def register_recipe(recipe_type: type, ops: RecipeOps) -> None:
  """Adds a recipe type to the fp8 ops table: from then on, every fp8 op runs it.

  The extension point for a new recipe: a frozen dataclass derived from
  :class:`~jaxmp.fp8.GemmRecipe` (a recipe for one GEMM, usable as a layer's whole
  recipe too: it then runs as ``GemmRecipes(r, r, r)``), and its :class:`RecipeOps`
  with ``operand`` and ``gemm``. Registering is not importing: call it where the recipe
  is defined, once.

  Args:
    recipe_type: the recipe's class.
    ops: its entry.

  Raises:
    TypeError: if ``recipe_type`` is not a frozen dataclass derived from
      :class:`~jaxmp.fp8.GemmRecipe`, or ``ops`` is not a :class:`RecipeOps` with
      ``operand`` and ``gemm``.
    ValueError: if the type already has an entry.

  Example:
    >>> import dataclasses
    >>> from jaxmp import fp8
    >>> from jaxmp._src.fp8 import ops, rowwise
    >>> @dataclasses.dataclass(frozen=True)
    ... class Rows(fp8.GemmRecipe):  # RowwiseScaling, renamed
    ...   margin: int = 0
    ...   power_of_two: bool = True
    ...   gradient_format: str = "e4m3"
    >>> ops.register_recipe(Rows, ops.RecipeOps(
    ...     "fp8", ops.of(fp8.RowwiseScaling()).lowering,
    ...     ops.OperandOps(rowwise.grouping, rowwise.fp8_format), ops.outer_scaled_gemm))
    >>> x, w = jnp.ones((2, 4)), jnp.ones((4, 3))
    >>> fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), recipe=Rows())[0]
    Array([4., 4., 4.], dtype=float32)
  """
  if not (isinstance(recipe_type, type) and issubclass(recipe_type, recipes_lib.GemmRecipe)
          and dataclasses.is_dataclass(recipe_type)
          and recipe_type.__dataclass_params__.frozen):  # pyright: ignore[reportAttributeAccessIssue]
    raise TypeError(
        f"register_recipe: recipe_type must be a frozen dataclass derived from "
        f"jaxmp.fp8.GemmRecipe (hashable, so that it can be a static argument of jit), got "
        f"{recipe_type!r}.")
  if not isinstance(ops, RecipeOps) or ops.operand is None or ops.gemm is None:
    raise TypeError(
        f"register_recipe: ops must be a jaxmp.fp8.RecipeOps with operand (an OperandOps) "
        f"and gemm, got {ops!r}.")
  if recipe_type in _TABLE:
    raise ValueError(f"register_recipe: {recipe_type.__name__} already has an entry in the "
                     f"fp8 ops table: {_TABLE[recipe_type]!r}.")
  _TABLE[recipe_type] = ops


def of(recipe: Any) -> RecipeOps:
  """The table entry of ``recipe``'s type (or of the nearest registered base class).

  Raises:
    TypeError: for a type with no entry, naming it and how to add one.
  """
  for cls in type(recipe).__mro__:
    entry = _TABLE.get(cls)
    if entry is not None:
      return entry
  raise TypeError(
      f"fp8: {type(recipe).__name__} has no entry in the fp8 ops table, so no fp8 op can run "
      f"{recipe!r}; add one with jaxmp.fp8.register_recipe({type(recipe).__name__}, "
      f"jaxmp.fp8.RecipeOps(...)).")


def operand_ops(recipe: Any) -> OperandOps:
  """How ``recipe`` (one operand's, after ``for_role``) prepares an operand."""
  entry = of(recipe).operand
  if entry is None:
    raise TypeError(f"fp8: {recipe!r} prepares no GEMM operand of its own.")
  return entry


def per_tensor(recipe: Any) -> PerTensorOps | None:
  """``recipe``'s per-tensor op, or ``None`` (a recipe that runs per GEMM)."""
  if isinstance(recipe, recipes_lib.GemmRecipes):
    return None
  return of(recipe).per_tensor


def state_type(recipe: Any) -> type | None:
  """The NamedTuple of ``recipe``'s state, or ``None`` for a recipe that keeps none."""
  scaling = per_tensor(recipe)
  return None if scaling is None else scaling.state_type


def gemms(recipe: Any) -> tuple:
  """``(forward, input_grad, weight_grad)`` of any layer recipe (a per-tensor one serves all)."""
  if isinstance(recipe, recipes_lib.GemmRecipes):
    return recipe.gemms
  return (recipe, recipe, recipe)


def narrow_type(recipe: Any) -> str:
  """What a layer's or one GEMM's recipe quantizes to: ``"int8"``, ``"fp8"`` or both.

  For messages (a rule's recipe, a fallback warning).

  Example:
    >>> from jaxmp._src.fp8 import ops
    >>> ops.narrow_type(jaxmp.fp8.Int8Scaling())
    'int8'
  """
  found = {of(r).narrow for r in gemms(recipe) if r is not None}
  return " and ".join(sorted(found))


def check(recipe: Any, where: str) -> Any:
  """``recipe`` if it is a jaxmp recipe with an entry here; a TypeError naming ``where`` if not.

  The check of a recipe where a user gives one (a rule, a layer, ``fp8_dot_general``);
  what runs it later is not checked again.
  """
  return check_registered(recipes_lib.check_recipe(recipe, where), where)


def check_registered(recipe: Any, where: str) -> Any:
  """``recipe`` (a checked layer recipe), or a TypeError if a recipe in it has no entry.

  For :class:`~jaxmp.fp8.GemmRecipes`, each GEMM's recipe and each operand's.
  """
  for gemm_recipe in gemms(recipe):
    if gemm_recipe is None:
      continue
    operands = ({gemm_recipe.for_role(role) for role in recipes_lib.ROLES} - {None}
                if isinstance(gemm_recipe, recipes_lib.GemmRecipe) else set())
    try:
      for r in (gemm_recipe, *operands):
        of(r)
    except TypeError as e:
      raise TypeError(f"{where}: {e}") from None
  return recipe


outer_scaled_gemm = scaled_gemm.outer_scaled_gemm
"""The GEMM of operands whose scales do not vary along the contraction (per tensor, per row)."""


__all__ = (
    "AmaxScaled",
    "GemmCall",
    "Quantize",
    "OperandOps",
    "PerTensorOps",
    "RecipeOps",
    "check",
    "check_registered",
    "gemms",
    "narrow_type",
    "of",
    "operand_ops",
    "outer_scaled_gemm",
    "per_tensor",
    "register_recipe",
    "state_type",
)
