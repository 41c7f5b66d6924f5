"""fp8 recipes: how each matmul operand's scale is chosen.

An fp8 matmul divides each operand by scales so that its values fit the narrow fp8
range, multiplies in fp8 with a wide (float32) accumulator, and multiplies the result
back. A recipe says where the scales come from and which elements share one:

- per tensor: :class:`DelayedScaling` (TransformerEngine's and Flax's default; the
  scale comes from the amaxes of *previous* steps, kept as state) and
  :class:`CurrentScaling` (torchao's default, Qwix: from this step's amax, no state);
- :class:`RowwiseScaling` (torchao "rowwise"): one scale per row of each GEMM operand
  along the contracted dimension (per token, per output channel);
- :class:`BlockScaling` (DeepSeek-V3): 1x128 tiles of activations and gradients,
  128x128 blocks of weights;
- :class:`MXScaling` (OCP Microscaling MXFP8): 32-element blocks along the contracted
  dimension sharing a power-of-two E8M0 scale;
- :class:`Int8Scaling` (AQT's int8): symmetric int8 with one scale per row along the
  contracted dimension, int32 accumulation (the fast narrow type on TPU v5e, v5p, v6e).

The per-tensor recipes quantize the input and kernel to E4M3 (``float8_e4m3fn``, max
448) and the output gradient to E5M2 (``float8_e5m2``, max 57344); the finer recipes
use E4M3 everywhere by default, as their authors do. All scale arithmetic is float32
whatever the compute dtype, and accumulation is float32. Which recipe each of a
layer's three GEMMs (forward, input gradient, weight gradient) uses, or whether it
stays in the compute dtype, is :class:`~jaxmp.fp8.GemmRecipes`' business
(:mod:`jaxmp._src.fp8.per_gemm`).

Recipes are frozen, hashable dataclasses: they can be static arguments of ``jit`` and
fields of Flax modules.

Example:
  >>> from jaxmp import fp8
  >>> fp8.DelayedScaling(amax_history_length=16, amax_compute="most_recent")
  DelayedScaling(amax_history_length=16, margin=0, amax_compute='most_recent', power_of_two=False)
  >>> fp8.RowwiseScaling()
  RowwiseScaling(margin=0, power_of_two=True, gradient_format='e4m3')
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from jaxmp._src import checks

AMAX_COMPUTE_ALGORITHMS = ("max", "most_recent")

FORMATS = ("e4m3", "e5m2")
"""The fp8 element formats a recipe's gradient may use: ``float8_e4m3fn``, ``float8_e5m2``."""

SCALE_ROUNDINGS = ("floor", "ceil", "rceil", "even")
"""How :class:`MXScaling` rounds a block's scale to a power of two (torchao's names)."""

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
  if int(margin) > MAX_MARGIN:
    raise ValueError(
        f"{cls_name}: margin must be in [0, {MAX_MARGIN}] (beyond it the product of two "
        f"scales, amax * 2**margin / 448 each, overflows float32 for amaxes up to 2**16 "
        f"and fp8 would run unscaled), got {margin!r}.")


def _check_power_of_two(recipe: Any) -> None:
  object.__setattr__(recipe, "power_of_two", checks.flag(
      recipe.power_of_two, "power_of_two", where=type(recipe).__name__))


def _check_choice(recipe: Any, name: str, accepted: tuple) -> None:
  value = getattr(recipe, name)
  if not isinstance(value, str):
    raise TypeError(f"{type(recipe).__name__}: {name} must be a string, one of "
                    f"{accepted}, got {value!r} of type {type(value).__name__}.")
  if value not in accepted:
    raise ValueError(f"{type(recipe).__name__}: unknown {name} {value!r}; accepted "
                     f"values are {', '.join(repr(a) for a in accepted)}.")


def _check_format(recipe: Any) -> None:
  _check_choice(recipe, "gradient_format", FORMATS)


def _normalise_ints(recipe: Any, *names: str) -> None:
  # numpy integers become ints, so that equal recipes hash equally.
  for name in names:
    object.__setattr__(recipe, name, int(getattr(recipe, name)))


class Recipe:
  """Base of every recipe a layer, a rule or ``fp8_dot_general`` accepts.

  A recipe is configuration only: a frozen, hashable dataclass whose constructor checks
  its fields. What the fp8 core does with it (how it quantizes, multiplies, lowers and
  keeps state) is the recipe type's entry in the fp8 ops table, ``jaxmp._src.fp8.ops``.
  """

  __slots__ = ()


class GemmRecipe(Recipe):
  """Base of the recipes one GEMM of :class:`GemmRecipes` may use (current scaling, no state).

  Such a recipe is also a layer's whole recipe: it then runs as ``GemmRecipes(r, r, r)``
  (:class:`OperandRecipes` excepted: it names the operands of one particular GEMM).
  Derive a new recipe from it and give it an entry in the fp8 ops table
  (:func:`jaxmp.fp8.register_recipe`).
  """

  __slots__ = ()

  def for_role(self, role: str) -> GemmRecipe | None:
    """The recipe that quantizes this GEMM's operand in ``role``: this one, for both."""
    del role
    return self


class OperandRecipe(GemmRecipe):
  """Base of the recipes one operand of :class:`OperandRecipes` may use.

  Those whose scales do not vary along the contracted dimension, so that any two of them
  multiply in one fp8 GEMM rescaled by the outer product of their scales; each has a
  ``margin`` and says whether its scales are powers of two.
  """

  __slots__ = ()
  margin: int
  power_of_two: bool


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
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
      of headroom above the amax; an int in ``[0, 56]`` (``MAX_MARGIN``): the
      scales, and the product of two that the op dequantizes with, must stay normal
      float32 numbers for amaxes up to ``2**16``, and ``2 * (16 - log2(448) + margin)
      < 128`` gives 56.
    amax_compute: ``"max"`` (the largest amax in the history) or ``"most_recent"``
      (the amax of the previous step).
    power_of_two: round each scale up to a power of two (the quantization multiplier
      ``fp8_max / amax`` down, as torchao does). The scales then multiply exactly, and
      a 16-bit GEMM output is produced directly in its own dtype by the fp8 GEMM (no
      float32 output and separate narrowing kernel), bit-identical to scaling in
      float32. Off by default.

  Raises:
    TypeError: if ``amax_history_length`` or ``margin`` is not an int, or
      ``power_of_two`` not a bool.
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
  power_of_two: bool = False

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
    _check_power_of_two(self)
    _normalise_ints(self, "amax_history_length", "margin")


@dataclasses.dataclass(frozen=True)
class CurrentScaling(OperandRecipe):
  """Current (just-in-time) scaling: each tensor's scale comes from its own amax.

  ``scale = 1 / ((fp8_max / max|x|) / 2**margin)`` for the input and the kernel in the
  forward pass and for the output gradient in the backward pass; a tensor whose amax
  is zero or not finite uses scale 1. There is no state and no delay: nothing to
  carry between steps, at the cost of one extra reduction over each tensor before it
  is quantized.

  Attributes:
    margin: the scale is multiplied by ``2**margin``; an int in ``[0, 56]`` (see
      :class:`DelayedScaling`).
    power_of_two: round each scale up to a power of two (see :class:`DelayedScaling`).

  Raises:
    TypeError: if ``margin`` is not an int or ``power_of_two`` not a bool.
    ValueError: if ``margin`` is outside ``[0, 56]``.

  Example:
    >>> from jaxmp import fp8
    >>> fp8.CurrentScaling(margin=1)
    CurrentScaling(margin=1, power_of_two=False)
  """

  margin: int = 0
  power_of_two: bool = False

  def __post_init__(self):
    _check_margin("CurrentScaling", self.margin)
    _check_power_of_two(self)
    _normalise_ints(self, "margin")


@dataclasses.dataclass(frozen=True)
class RowwiseScaling(OperandRecipe):
  """Row-wise current scaling (torchao's "rowwise" recipe).

  Every GEMM operand gets one scale per row along the dimension the GEMM contracts:
  in the forward GEMM one per token of the input and one per output channel of the
  kernel, in the input-gradient GEMM one per token of the output gradient and one per
  input channel of the kernel, in the weight-gradient GEMM one per channel of the
  input and of the output gradient (their rows along the tokens). Each scale is
  ``1 / ((fp8_max / amax_row) / 2**margin)``, rounded up to a power of two by default
  (torchao's default for this recipe); a row whose amax is zero or not finite uses
  scale 1. The GEMM itself multiplies the fp8 operands with float32 accumulation and
  the product is multiplied by the outer product of the two operands' row scales.

  Attributes:
    margin: headroom in powers of two, an int in ``[0, 56]``.
    power_of_two: power-of-two scales (default ``True``, as torchao).
    gradient_format: the output gradient's format, ``"e4m3"`` (torchao's default for
      this recipe) or ``"e5m2"``; input and kernel are E4M3.

  Raises:
    TypeError: for a non-int ``margin``, a non-bool ``power_of_two`` or a non-string
      ``gradient_format``.
    ValueError: for a ``margin`` outside ``[0, 56]`` or an unknown ``gradient_format``.

  Example:
    >>> from jaxmp import fp8
    >>> fp8.RowwiseScaling(power_of_two=False).gradient_format
    'e4m3'
  """

  margin: int = 0
  power_of_two: bool = True
  gradient_format: str = "e4m3"

  def __post_init__(self):
    _check_margin("RowwiseScaling", self.margin)
    _check_power_of_two(self)
    _check_format(self)
    _normalise_ints(self, "margin")


@dataclasses.dataclass(frozen=True)
class BlockScaling(GemmRecipe):
  """Block-wise current scaling (DeepSeek-V3's fine-grained fp8).

  Activations and gradients are scaled per ``1 x block_size`` tile (one row, that many
  consecutive elements along the contracted dimension); weights per ``block_size x
  block_size`` block, so the same blocks serve the forward GEMM and, transposed, the
  input-gradient GEMM. In the weight-gradient GEMM (which contracts the tokens) both
  operands are tiled along the tokens. Every operand is E4M3; a group's scale is
  ``1 / ((448 / amax_group) / 2**margin)``, 1 for an all-zero or non-finite group.
  Dimensions that are not a multiple of ``block_size`` end in a partial group, scaled
  from its own elements (equivalently: zero-padded to a multiple, as zeros never raise
  an amax and add nothing to a product).

  XLA has no block-scaled fp8 GEMM. On Hopper GPUs with ``block_size`` 128 (and scales
  that are not powers of two) the product is jaxmp's own fp8 kernel (fp8 tensor-core
  products per block, scaled and summed in float32, as DeepSeek-V3's DeepGEMM);
  elsewhere it is computed from the dequantized operands (float32, or bfloat16 where
  power-of-two scales make that exact) with float32 accumulation: the same sum of the
  same fp8 products, in a wider GEMM.

  Attributes:
    block_size: the tile and block edge, an int >= 1 (DeepSeek-V3: 128).
    margin: headroom in powers of two, an int in ``[0, 56]``.
    power_of_two: round scales up to powers of two (TransformerEngine's block scaling
      does; DeepSeek-V3's paper uses ``amax / 448``). Default ``False``.

  Raises:
    TypeError: for a non-int ``block_size`` or ``margin`` or a non-bool ``power_of_two``.
    ValueError: for ``block_size < 1`` or a ``margin`` outside ``[0, 56]``.

  Example:
    >>> from jaxmp import fp8
    >>> fp8.BlockScaling().block_size
    128
  """

  block_size: int = 128
  margin: int = 0
  power_of_two: bool = False

  def __post_init__(self):
    size = self.block_size
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
      raise TypeError(f"BlockScaling: block_size must be an int >= 1, got {size!r} of type "
                      f"{type(size).__name__}.")
    if size < 1:
      raise ValueError(f"BlockScaling: block_size must be >= 1, got {size!r}.")
    _check_margin("BlockScaling", self.margin)
    _check_power_of_two(self)
    _normalise_ints(self, "block_size", "margin")


@dataclasses.dataclass(frozen=True)
class MXScaling(GemmRecipe):
  """MXFP8 (OCP Microscaling Formats v1.0): 32-element blocks with E8M0 scales.

  Every GEMM operand is split into blocks of 32 consecutive elements along the
  contracted dimension (a last partial block is zero-padded); each block shares a
  power-of-two scale ``2**e``, stored as E8M0 (the biased exponent ``e + 127``; ``0xFF``
  is NaN, for a block holding inf or NaN), and its elements are ``x / 2**e`` rounded
  to the element format and clamped to its max. An all-zero block gets the smallest
  scale, ``2**-127``. ``e`` comes from the block's amax by ``scale_rounding`` (``emax``
  is 8 for E4M3, 15 for E5M2; torchao's ``ScaleCalculationMode`` names):

  - ``"floor"``: ``e = floor(log2(amax)) - emax``, OCP MX v1.0's rule: the block's
    largest elements can exceed the format's max after scaling and saturate;
  - ``"ceil"``: ``e = ceil(log2(amax)) - emax`` (torchao CEIL): no saturation, but the
    scaled block stays under ``2**emax`` (256 in E4M3), short of the max (448);
  - ``"rceil"``: ``e = ceil(log2(amax / fp8_max))``, the smallest scale under which the
    block fits (JAX's ``jax.nn.scaled_dot_general`` quantizer, TransformerEngine's
    MXFP8, torchao RCEIL, cuBLAS): no saturation, the whole format used;
  - ``"even"``: floor's rule on amax rounded half up to the element format's precision
    (torchao EVEN): one binade above floor's only from amax ``1.9375 * 2**k`` (E4M3),
    so a block maximum on a grid point keeps its scale when it drifts by an ulp.

  CEIL and RCEIL differ for every amax whose significand is at most the format max's
  (1.75): there RCEIL's scale is half CEIL's, which only moves the block's smallest
  elements away from fp8's subnormals (the relative precision of a normal fp8 value is
  the same in every binade). Rounding up cuts the product error on Gaussian data from
  4.1% (floor) to 3.75%. See ``jaxmp._src.fp8.mx``.

  Attributes:
    gradient_format: the output gradient's element format, ``"e4m3"`` (the default, as
      TransformerEngine and Megatron) or ``"e5m2"``.
    scale_rounding: ``"floor"`` (the default, OCP), ``"ceil"``, ``"rceil"`` or
      ``"even"``.

  Raises:
    TypeError: for a non-string ``gradient_format`` or ``scale_rounding``.
    ValueError: for an unknown ``gradient_format`` or ``scale_rounding``.

  Example:
    >>> from jaxmp import fp8
    >>> fp8.MXScaling(gradient_format="e5m2", scale_rounding="rceil")
    MXScaling(gradient_format='e5m2', scale_rounding='rceil')
  """

  gradient_format: str = "e4m3"
  scale_rounding: str = "floor"

  def __post_init__(self):
    _check_format(self)
    _check_choice(self, "scale_rounding", SCALE_ROUNDINGS)


@dataclasses.dataclass(frozen=True)
class Int8Scaling(GemmRecipe):
  """Symmetric int8 with per-row current scaling (AQT's int8 training, as in MaxText).

  Every GEMM operand gets one scale per row along the dimension the GEMM contracts,
  as :class:`RowwiseScaling` (per token of the input and per output channel of the
  kernel in the forward GEMM; per token / per input channel in the input-gradient GEMM,
  per channel along the tokens in the weight-gradient GEMM). For a row ``x``:

  1. ``scale = max|x| / 127`` in float32 (1 for an all-zero row; a row holding inf or
     NaN gets a non-finite scale, so that its products are not finite and an overflow
     stays visible to loss scaling);
  2. ``q = clip(round(x / scale), -127, 127)`` as int8, rounding to nearest, ties to
     even (-128 is never used: the range is symmetric);
  3. the GEMM is ``lax.dot_general(q_a, q_b, preferred_element_type=int32)``, exact,
     and its product is multiplied in float32 by the outer product of the two
     operands' row scales, then cast to the output dtype.

  The gradient is straight-through: each backward GEMM multiplies the output gradient
  by the other operand as it is (or as that GEMM's own recipe quantizes it), as if the
  forward quantization were the identity. Used as a layer's whole recipe, all three
  GEMMs run in int8; :class:`GemmRecipes` chooses per GEMM (e.g.
  ``GemmRecipes(Int8Scaling(), None, None)``: int8 forward, compute-dtype backward).

  Example:
    >>> from jaxmp import fp8
    >>> x, w = jnp.array([[1.0, -2.0]]), jnp.array([[3.0], [0.5]])
    >>> # x -> [64, -127] * 2/127, w -> [127, 21] * 3/127: 5461 * 6/127**2 (exactly 2)
    >>> fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), recipe=fp8.Int8Scaling())
    Array([[2.031496]], dtype=float32)
  """


def concrete_types(base: type) -> tuple[type, ...]:
  """The recipe classes derived from ``base`` (recipes, not bases), in definition order.

  Every message that lists what is accepted reads it here, so a recipe registered
  later (:func:`jaxmp.fp8.register_recipe`) is listed too.

  Example:
    >>> recipes = jaxmp._src.fp8.recipes
    >>> [t.__name__ for t in recipes.concrete_types(recipes.OperandRecipe)]
    ['CurrentScaling', 'RowwiseScaling']
  """
  found: list[type] = []
  for sub in base.__subclasses__():
    candidates = (sub,) if dataclasses.is_dataclass(sub) else ()
    for t in (*candidates, *concrete_types(sub)):
      if t not in found:
        found.append(t)
  return tuple(found)


def _names(base: type) -> str:
  return ", ".join(t.__name__ for t in concrete_types(base))


ROLES = ("input", "kernel", "output_grad")
"""The operands of a layer's GEMMs (:class:`OperandRecipes` fields)."""

GEMM_ROLES = {"forward": ("input", "kernel"), "input_grad": ("output_grad", "kernel"),
              "weight_grad": ("output_grad", "input")}
"""The two operands of each of a layer's GEMMs, as :class:`GemmRecipes` names them."""


@dataclasses.dataclass(frozen=True)
class OperandRecipes(GemmRecipe):
  """A recipe for each operand of one GEMM: a :class:`GemmRecipes` field.

  Each operand of a layer's GEMM has a role: the forward GEMM multiplies the input by
  the kernel, the input-gradient GEMM the output gradient by the kernel, the
  weight-gradient GEMM the output gradient by the input. A GEMM whose field in
  :class:`GemmRecipes` is an ``OperandRecipes`` quantizes each of its two operands
  with the recipe of its role: :class:`CurrentScaling` (one scale for the tensor) or
  :class:`RowwiseScaling` (one per row along the contracted dimension), each with its
  own margin, power-of-two rounding and, for the output gradient, format. The GEMM
  multiplies the two fp8 operands with float32 accumulation and rescales the product
  by the outer product of their scales, as for one recipe:
  ``out[p, q] = sum_c a8[p, c] * b8[q, c] * scale_a[p] * scale_b[q]`` (``scale_a[p]``
  the same for every ``p`` for a per-tensor operand). The output is cast through
  bfloat16 directly only where both recipes use power-of-two scales.

  This is how torchao's ``Float8LinearConfig`` sets its casts: one ``CastConfig`` per
  operand of each GEMM (see :meth:`GemmRecipes.rowwise_with_gw_hp`).

  Attributes:
    input: the input's recipe, or ``None`` where the GEMM does not read the input.
    kernel: the kernel's recipe, or ``None``.
    output_grad: the output gradient's recipe, or ``None``.

  Raises:
    TypeError: for a field that is not ``None``, :class:`CurrentScaling` or
      :class:`RowwiseScaling` (block and MX scales vary along the contraction, and
      int8 is another GEMM: they scale both operands of a GEMM, as its one recipe).
    ValueError: unless exactly two fields are given (a GEMM has two operands).

  Example:
    >>> from jaxmp import fp8
    >>> mixed = fp8.OperandRecipes(output_grad=fp8.RowwiseScaling(),
    ...                            kernel=fp8.CurrentScaling(power_of_two=True))
    >>> mixed.roles
    ('kernel', 'output_grad')
  """

  input: OperandRecipe | None = None
  kernel: OperandRecipe | None = None
  output_grad: OperandRecipe | None = None

  def __post_init__(self):
    for role in ROLES:
      recipe = getattr(self, role)
      if recipe is not None and not isinstance(recipe, OperandRecipe):
        raise TypeError(
            f"OperandRecipes: {role} must be None or one of "
            f"{_names(OperandRecipe)} (a recipe with one "
            f"scale per row or tensor), got {recipe!r} of type {type(recipe).__name__}.")
    if len(self.roles) != 2:
      raise ValueError(f"OperandRecipes: a GEMM has two operands, so exactly two of "
                       f"{', '.join(ROLES)} take a recipe; got {list(self.roles)}.")

  @property
  def roles(self) -> tuple[str, ...]:
    """The roles given a recipe, in ``ROLES`` order."""
    return tuple(role for role in ROLES if getattr(self, role) is not None)

  def recipe(self, role: str) -> OperandRecipe:
    """The recipe of the operand in ``role`` (one of :attr:`roles`)."""
    return getattr(self, role)

  def for_role(self, role: str) -> OperandRecipe | None:
    """The recipe of the operand in ``role``, ``None`` for a role this GEMM does not read."""
    return getattr(self, role)

  @property
  def power_of_two(self) -> bool:
    """Whether both operands' scales are powers of two, which makes their product exact."""
    return all(self.recipe(role).power_of_two for role in self.roles)


@dataclasses.dataclass(frozen=True)
class GemmRecipes(Recipe):
  """A recipe for each of an fp8 layer's three GEMMs, or its compute dtype.

  A matmul layer ``y = x @ w`` runs three GEMMs in training: the forward GEMM, the
  input-gradient GEMM ``dx = g @ w.T`` and the weight-gradient GEMM ``dw = x.T @ g``.
  Each field gives one of them a current-scaling recipe (:class:`CurrentScaling`,
  :class:`RowwiseScaling`, :class:`BlockScaling`, :class:`MXScaling`,
  :class:`Int8Scaling`), a recipe per operand (:class:`OperandRecipes`, naming the
  GEMM's two operands: ``input`` and ``kernel`` for the forward GEMM, ``output_grad``
  and ``kernel`` for the input gradient, ``output_grad`` and ``input`` for the weight
  gradient) or ``None``, which computes that GEMM in the operands' own dtype (the
  compute dtype) as a plain ``dot_general`` would. A GEMM's one recipe scales both of
  its operands. A single recipe ``r`` used as a layer's recipe means
  ``GemmRecipes(r, r, r)``.

  Attributes:
    forward: the forward GEMM's recipe, or ``None``.
    input_grad: the input-gradient GEMM's recipe, or ``None``.
    weight_grad: the weight-gradient GEMM's recipe, or ``None``.

  Raises:
    TypeError: for a field that is not one of those recipes or ``None`` (e.g.
      :class:`DelayedScaling`, whose state is per tensor, shared by the GEMMs).
    ValueError: if every field is ``None`` (no GEMM in fp8: drop the fp8 rule), or an
      :class:`OperandRecipes` names operands its GEMM does not have.

  Example:
    >>> from jaxmp import fp8
    >>> recipe = fp8.GemmRecipes(forward=fp8.RowwiseScaling(), input_grad=fp8.RowwiseScaling())
    >>> recipe.weight_grad is None, hash(recipe) == hash(fp8.GemmRecipes(
    ...     fp8.RowwiseScaling(), fp8.RowwiseScaling(), None))
    (True, True)
  """

  forward: GemmRecipe | None = None
  input_grad: GemmRecipe | None = None
  weight_grad: GemmRecipe | None = None

  def __post_init__(self):
    for name, roles in GEMM_ROLES.items():
      recipe = check_recipe(getattr(self, name), f"GemmRecipes: {name}", gemm=True)
      if isinstance(recipe, OperandRecipes) and set(recipe.roles) != set(roles):
        raise ValueError(
            f"GemmRecipes: the {name} GEMM multiplies the {roles[0]} by the {roles[1]}, "
            f"so its OperandRecipes takes recipes for {roles[0]} and {roles[1]}; got "
            f"{recipe!r}.")
    if self.forward is None and self.input_grad is None and self.weight_grad is None:
      raise ValueError("GemmRecipes: every GEMM is None, so nothing would run in fp8; give "
                       "at least one GEMM a recipe, or drop the fp8 rule.")

  @property
  def gemms(self) -> tuple[GemmRecipe | None, GemmRecipe | None, GemmRecipe | None]:
    """``(forward, input_grad, weight_grad)``."""
    return (self.forward, self.input_grad, self.weight_grad)

  @classmethod
  def rowwise_with_gw_hp(cls) -> GemmRecipes:
    """torchao's ``rowwise_with_gw_hp`` recipe (``Float8LinearRecipeName.ROWWISE_WITH_GW_HP``).

    As torchao/float8/config.py sets its casts, every scale rounded to a power of two
    (``round_scales_to_power_of_2=True``):

    - forward: ``input_fp8_axiswise_dim0 @ weight_t_axiswise_dim1``, both E4M3 with one
      scale per row along the contraction (:class:`RowwiseScaling`);
    - input gradient: ``grad_output_fp8_axiswise_dim0 @ weight_fp8_tensorwise``: the
      output gradient in E4M3 per row, the kernel in E4M3 with one scale for the whole
      tensor (:class:`CurrentScaling`);
    - weight gradient: ``input_t_hp @ grad_output_hp``, in the compute dtype (``None``).

    Returns:
      ``GemmRecipes(RowwiseScaling(), OperandRecipes(output_grad=RowwiseScaling(),
      kernel=CurrentScaling(power_of_two=True)), None)``.

    Example:
      >>> from jaxmp import fp8
      >>> fp8.GemmRecipes.rowwise_with_gw_hp().input_grad.kernel
      CurrentScaling(margin=0, power_of_two=True)
    """
    rows = RowwiseScaling(power_of_two=True, gradient_format="e4m3")
    return cls(rows, OperandRecipes(output_grad=rows, kernel=CurrentScaling(power_of_two=True)),
               None)


def check_recipe(recipe: Any, where: str = "fp8", *, gemm: bool = False) -> Any:
  """Returns ``recipe`` if it is a jaxmp fp8 recipe, else raises a TypeError naming it.

  The one check of what a recipe is, for every entry point that takes one (rules,
  both adapters' fp8 layers, ``fp8_dot_general`` / ``fp8_einsum``, ``init_state``)
  and for a :class:`GemmRecipes` field.

  Args:
    recipe: the value to check.
    where: who is asking, for the error message.
    gemm: check one GEMM's recipe (a :class:`GemmRecipes` field): ``None`` (the
      compute dtype) or a :class:`GemmRecipe`, not a layer's recipe.

  Returns:
    ``recipe``.

  Raises:
    TypeError: if ``recipe`` is not an instance of one of the recipe classes (a class
      instead of an instance, a string, a Flax module, ...; for a GEMM, also
      :class:`DelayedScaling` or :class:`GemmRecipes`).

  Example:
    >>> from jaxmp import fp8
    >>> jaxmp._src.fp8.recipes.check_recipe(fp8.CurrentScaling())
    CurrentScaling(margin=0, power_of_two=False)
  """
  if gemm and (recipe is None or isinstance(recipe, GemmRecipe)):
    return recipe
  if not gemm and isinstance(recipe, Recipe) and not isinstance(recipe, OperandRecipes):
    return recipe
  hint = ""
  if isinstance(recipe, type) and issubclass(recipe, Recipe):
    hint = f" Pass an instance, e.g. {recipe.__name__}()."
  elif isinstance(recipe, OperandRecipes):
    hint = (" OperandRecipes names the operands of one GEMM: give it as a GemmRecipes "
            "field.")
  elif gemm and isinstance(recipe, DelayedScaling):
    hint = (" DelayedScaling keeps one state per tensor, shared by the GEMMs that read it: "
            "use it as the layer's whole recipe.")
  if gemm:
    accepted = f"None (the compute dtype) or one of {_names(GemmRecipe)}"
  else:
    others = [t.__name__ for t in concrete_types(Recipe)
              if t not in (DelayedScaling, OperandRecipes)]
    accepted = ("a jaxmp.fp8.DelayedScaling or another jaxmp.fp8 recipe instance "
                f"({', '.join(others)})")
  subject = where if gemm else f"{where}: recipe"
  raise TypeError(f"{subject} must be {accepted}, got {recipe!r} of type "
                  f"{type(recipe).__name__}.{hint}")


def per_gemm(recipe: Recipe) -> DelayedScaling | CurrentScaling | GemmRecipes:
  """The recipe in the form the fp8 op runs it.

  The per-tensor recipes run as they are (one quantization of each tensor serves every
  GEMM that reads it); a finer recipe ``r`` becomes ``GemmRecipes(r, r, r)``; and a
  :class:`GemmRecipes` whose three GEMMs all use the same :class:`CurrentScaling` is
  that :class:`CurrentScaling`, so the two spellings compute the same bits.

  Example:
    >>> from jaxmp import fp8
    >>> jaxmp._src.fp8.recipes.per_gemm(fp8.MXScaling())
    GemmRecipes(forward=MXScaling(gradient_format='e4m3', scale_rounding='floor'),
                input_grad=MXScaling(gradient_format='e4m3', scale_rounding='floor'),
                weight_grad=MXScaling(gradient_format='e4m3', scale_rounding='floor'))
  """
  if isinstance(recipe, (DelayedScaling, CurrentScaling)):
    return recipe
  if isinstance(recipe, GemmRecipes):
    first = recipe.forward
    if isinstance(first, CurrentScaling) and all(r == first for r in recipe.gemms):
      return first
    return recipe
  if isinstance(recipe, GemmRecipe):
    return GemmRecipes(recipe, recipe, recipe)
  raise TypeError(f"{recipe!r} is neither a per-tensor recipe nor one a GEMM can use, so no "
                  f"fp8 op runs it; derive its class from jaxmp.fp8.GemmRecipe.")


__all__ = (
    "FORMATS",
    "GEMM_ROLES",
    "MAX_MARGIN",
    "ROLES",
    "SCALE_ROUNDINGS",
    "BlockScaling",
    "CurrentScaling",
    "DelayedScaling",
    "GemmRecipe",
    "GemmRecipes",
    "Int8Scaling",
    "MXScaling",
    "OperandRecipe",
    "OperandRecipes",
    "Recipe",
    "RowwiseScaling",
    "check_recipe",
    "concrete_types",
    "per_gemm",
)
