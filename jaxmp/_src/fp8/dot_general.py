"""``fp8_dot_general`` and ``fp8_einsum``: fp8 matmuls as pure functions.

Forward: the input (lhs) and the kernel (rhs) are quantized to E4M3 with their
scales, multiplied in fp8 with float32 accumulation (``preferred_element_type``),
and the float32 product is multiplied by ``input_scale * kernel_scale`` and cast to
the caller's output dtype. Backward: the output gradient is quantized to E5M2 with
its scale, and the two transposed products (against the fp8 kernel for the input
gradient, against the fp8 input for the kernel gradient) are computed the same way.
Only the fp8 operands and the scales are kept for the backward pass (one byte per
element instead of the operands' two or four). On CUDA GPUs a bfloat16 product takes
the form XLA folds into one fp8 GEMM writing bfloat16, with the combined scale rounded
to bfloat16 as Flax's is (:func:`~jaxmp._src.fp8.scaled_gemm.rescaled_dot`); on every
other platform the float32 product is scaled in float32 as described.

Where the scales come from is the recipe's per-tensor op in the fp8 ops table
(:mod:`~jaxmp._src.fp8.ops`): with :class:`~jaxmp.fp8.DelayedScaling`
(:mod:`~jaxmp._src.fp8.delayed`) from the amax histories in ``state``, the updated
state coming back as the cotangent of ``state`` (see :mod:`jaxmp.fp8.state`); with
:class:`~jaxmp.fp8.CurrentScaling` (:mod:`~jaxmp._src.fp8.current`) from each tensor's
own amax, with no state. The other recipes run per GEMM
(:mod:`~jaxmp._src.fp8.per_gemm`).

Example:
  >>> from jaxmp import fp8
  >>> recipe = fp8.DelayedScaling(amax_history_length=4)
  >>> state = fp8.init_state(recipe)
  >>> x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.5)
  >>> dims = (((1,), (0,)), ((), ()))
  >>> fp8.fp8_dot_general(x, w, dims, state=state, recipe=recipe)
  Array([[1.5, 1.5, 1.5, 1.5],
         [1.5, 1.5, 1.5, 1.5]], dtype=float32)
"""

from __future__ import annotations

import functools
import string
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxmp._src import jax_compat
from jaxmp._src import sharding
from jaxmp._src.fp8 import delayed
from jaxmp._src.fp8 import fused_quantize
from jaxmp._src.fp8 import maxgrad
from jaxmp._src.fp8 import ops
from jaxmp._src.fp8 import per_gemm as per_gemm_lib
from jaxmp._src.fp8 import recipes as recipes_lib
from jaxmp._src.fp8 import scaled_gemm
from jaxmp._src.fp8 import support

F32 = np.dtype(np.float32)


class _Config(NamedTuple):
  """Everything static about one fp8 matmul (hashable)."""
  dimension_numbers: tuple
  recipe: Any  # a per-tensor recipe (ops.per_tensor): DelayedScaling, CurrentScaling
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype
  out_dtype: np.dtype
  out_sharding: Any
  # (shape, dtype) of each state leaf, to hand the new state back in the same form.
  state_avals: tuple | None
  # The shard_map mesh axes lhs, rhs and each state leaf vary over (empty outside
  # shard_map): each cotangent must vary over exactly its primal's axes.
  lhs_varying: frozenset = frozenset()
  rhs_varying: frozenset = frozenset()
  state_varying: tuple | None = None
  # Whether the quantized operands are written row-major on CUDA (chips.Target).
  k_major_fp8: bool = False
  # Whether the operands are quantized by the fused kernel, each into both layouts
  # (chips.Target.fused_quantize, for a Dense product the kernel takes: _fuses).
  fused_quantize: bool = False


def _check_operand(name: str, x: jax.Array) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
        f"fp8_dot_general: {name} must be a floating-point array, got dtype {x.dtype}: "
        "fp8 quantizes float operands only (integer and complex matmuls have no fp8 form).")


def _canonical_dimension_numbers(dimension_numbers: Any) -> tuple:
  try:
    (lc, rc), (lb, rb) = dimension_numbers
    return ((tuple(int(i) for i in lc), tuple(int(i) for i in rc)),
            (tuple(int(i) for i in lb), tuple(int(i) for i in rb)))
  except (TypeError, ValueError) as e:
    raise ValueError(
        "fp8_dot_general: dimension_numbers must be ((lhs_contract, rhs_contract), "
        f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}.") from e


def _check_axes(dimension_numbers: tuple, lhs: jax.Array, rhs: jax.Array) -> None:
  """Refuses an axis an operand does not have (scales are per row along the contracted axes)."""
  (lc, rc), (lb, rb) = dimension_numbers
  for name, role, x, axes in (("lhs", "the input", lhs, lc + lb),
                              ("rhs", "the kernel", rhs, rc + rb)):
    bad = [a for a in axes if not 0 <= a < x.ndim]
    if bad:
      raise ValueError(
          f"fp8_dot_general: dimension_numbers {dimension_numbers!r} name axis {bad[0]} of "
          f"{name} ({role}), which has shape {tuple(x.shape)}: accepted axes are 0 to "
          f"{x.ndim - 1} (the scales are taken per row along the contracted axes, so each "
          "must be an axis of its operand).")


def _output_dtype(lhs, rhs, preferred_element_type) -> np.dtype:
  if preferred_element_type is None:
    return np.dtype(jnp.result_type(lhs.dtype, rhs.dtype))
  dtype = np.dtype(preferred_element_type)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        "fp8_dot_general: preferred_element_type must be a floating-point dtype, got "
        f"{dtype.name}.")
  return dtype


def _write(x: jax.Array, aval: tuple) -> jax.Array:
  """A float32 value in the shape and dtype of the state leaf it replaces."""
  shape, dtype = aval
  x = jnp.reshape(x, shape)
  if maxgrad.is_max_float32(dtype):
    return jax.lax.convert_element_type(x, dtype)
  return x.astype(dtype)


def _remaining(ndim: int, *removed: Sequence[int]) -> list:
  gone = set(i for dims in removed for i in dims)
  return [i for i in range(ndim) if i not in gone]


def _transposed_out_sharding(primal: jax.Array, axes: Sequence[int]) -> Any:
  # Under an explicit-sharding mesh the gradient of an operand should be laid out
  # like the operand; the transposed product produces it with its axes permuted.
  sharding = getattr(jax.typeof(primal), "sharding", None)
  if sharding is None or getattr(sharding.mesh, "empty", True):
    return None
  spec = tuple(sharding.spec) + (None,) * (primal.ndim - len(sharding.spec))
  return sharding.update(spec=jax.sharding.PartitionSpec(*(spec[a] for a in axes)))


def _operand_grad(g: jax.Array, other: jax.Array, primal: jax.Array, dimension_numbers: tuple,
                  primal_is_lhs: bool, scale: jax.Array, dtype: np.dtype,
                  exact_scale: bool) -> jax.Array:
  """The gradient of one dot_general operand, for fp8 ``g`` and ``other``.

  ``dimension_numbers`` are the forward ones, from ``primal``'s point of view
  (``primal`` first). The forward output is laid out as [batch, lhs-free, rhs-free];
  contracting ``g`` with ``other`` over ``other``'s free dimensions and its batch
  dimensions gives [batch, primal-free, other's contracting dims], which is then
  permuted back into ``primal``'s layout. Where ``other`` first and ``g`` second
  give ``primal``'s layout itself ([batch, other's contracting dims, primal-free]:
  a Dense kernel's gradient), the GEMM takes them in that order, so that no
  permutation follows it (on GPUs XLA does not fold one into a cuBLAS GEMM's
  output: a kernel of its own, seen in compiled H100 HLO). The float32 product is
  multiplied by ``scale`` and cast to ``dtype`` *before* any permutation: ``dot ->
  multiply -> convert`` is the chain XLA folds into one scaled fp8 GEMM on GPUs, and
  the permutation then moves the narrow result. With power-of-two scales
  (``exact_scale``) a bfloat16 gradient comes out of the GEMM directly
  (:func:`~jaxmp._src.fp8.scaled_gemm.rescaled_dot`). On CUDA GPUs the GEMM runs
  without cuBLASLt's fast accumulation, as the gradient GEMMs of Flax and
  TransformerEngine do.
  """
  (p_contract, o_contract), (p_batch, o_batch) = dimension_numbers
  p_free = _remaining(primal.ndim, p_contract, p_batch)
  o_free = _remaining(other.ndim, o_contract, o_batch)
  n_batch = len(p_batch)
  if primal_is_lhs:
    g_other_free = range(n_batch + len(p_free), n_batch + len(p_free) + len(o_free))
  else:
    g_other_free = range(n_batch, n_batch + len(o_free))
  # Each GEMM operand with its (contracting, batch) dims.
  g_side = (g, (tuple(g_other_free), tuple(range(n_batch))))
  other_side = (other, (tuple(o_free), tuple(o_batch)))
  # Other's remaining axes are its contracting dims in increasing order; map each to
  # the primal dimension it was contracted with.
  p_contract_in_result = [p_contract[i] for i in np.argsort(o_contract)]
  result_axes = list(p_batch) + p_free + p_contract_in_result
  swapped_axes = list(p_batch) + p_contract_in_result + p_free
  if result_axes != sorted(result_axes) and swapped_axes == sorted(swapped_axes):
    (a, a_dims), (b, b_dims), result_axes = other_side, g_side, swapped_axes
  else:
    (a, a_dims), (b, b_dims) = g_side, other_side
  dims = ((a_dims[0], b_dims[0]), (a_dims[1], b_dims[1]))
  out = scaled_gemm.rescaled_dot(
      a, b, dims, scale, dtype, exact_scale=exact_scale,
      out_sharding=_transposed_out_sharding(primal, result_axes),
      accumulate_exactly_on_gpus=True)  # as Flax and TransformerEngine's gradient GEMMs
  out_axes = tuple(int(i) for i in np.argsort(result_axes))
  return out if out_axes == tuple(range(out.ndim)) else jax.lax.transpose(out, out_axes)


def _scaled_product(q_lhs: jax.Array, q_rhs: jax.Array, scale: jax.Array, cfg: _Config
                    ) -> jax.Array:
  """The forward GEMM of the quantized operands, rescaled by ``scale`` (input x kernel)."""
  return scaled_gemm.rescaled_dot(q_lhs, q_rhs, cfg.dimension_numbers, scale, cfg.out_dtype,
                                  exact_scale=cfg.recipe.power_of_two,
                                  out_sharding=cfg.out_sharding)


def _primal(lhs, rhs, state, cfg: _Config):
  """The product when nothing differentiates it (an eval step, say): the recipe's
  ``primal`` where it has one (delayed scaling leaves out what only training needs)."""
  scaling = ops.per_tensor(cfg.recipe)
  assert scaling is not None  # _Config holds a per-tensor recipe
  if scaling.primal is None:
    return _forward(lhs, rhs, state, cfg)[0]
  q_lhs, q_rhs, scale = scaling.primal(lhs, rhs, state, cfg)
  return _scaled_product(q_lhs, q_rhs, scale, cfg)


def _forward(lhs, rhs, state, cfg: _Config):
  scaling = ops.per_tensor(cfg.recipe)
  assert scaling is not None  # _Config holds a per-tensor recipe
  q_lhs, q_rhs, x_scale, k_scale, carry = scaling.forward(lhs, rhs, state, cfg)
  if cfg.fused_quantize:
    # The input as a (codes, transposed) pair: the forward GEMM reads it row-major,
    # the backward pass keeps it transposed (the weight gradient's operand).
    (q_lhs, q_lhs_t) = q_lhs
    return (_scaled_product(q_lhs, q_rhs, x_scale * k_scale, cfg),
            (q_lhs_t, q_rhs, x_scale, k_scale, carry))
  out = _scaled_product(q_lhs, q_rhs, x_scale * k_scale, cfg)
  return out, (q_lhs, q_rhs, x_scale, k_scale, carry)


def _fuses(lhs: jax.Array, rhs: jax.Array, dimension_numbers: tuple, out_dtype: np.dtype,
           out_sharding: Any) -> bool:
  """Whether the fused quantization kernel quantizes this product's input and output
  gradient, the two tensors the weight gradient's GEMM reads transposed: a Dense
  product (``lhs`` ``(..., K)`` times ``rhs`` ``(K, N)``, no batch dimensions, outside
  ``shard_map`` and explicit shardings) whose input and output gradient (``lhs``'s
  shape with ``N`` last, in ``out_dtype``) it
  :func:`~jaxmp._src.fp8.fused_quantize.supports`.

  The kernel (the weight) stays XLA's: a float32 parameter is cast to the compute dtype
  on its way in, and XLA quantizes it in the same pass, where the kernel would need
  the cast written out first (compiled H100 HLO of the Llama-3-8B layer: 336 MiB more
  per weight, 10% more non-GEMM bytes with all three tensors in the kernel)."""
  dense = (rhs.ndim == 2 and lhs.ndim >= 2
           and dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ())))
  plain = (out_sharding is None and not sharding.varying_axes(lhs)
           and not sharding.varying_axes(rhs)
           and _transposed_out_sharding(lhs, range(lhs.ndim)) is None
           and _transposed_out_sharding(rhs, range(2)) is None)
  grad_shape = (*lhs.shape[:-1], rhs.shape[-1])
  fits = (dense and plain and fused_quantize.supports(lhs.shape, lhs.dtype)
          and fused_quantize.supports(grad_shape, out_dtype))
  if fits and not fused_quantize.available():
    jax_compat.warn_unavailable(
        f"usable Pallas Mosaic GPU back end ({jax_compat.PALLAS_MOSAIC_GPU_NAMES_TEXT})",
        "fp8 operands are quantized by XLA's fusions, not the fused kernel the target "
        "asks for (the same values)", stacklevel=4)
  return fits and fused_quantize.available()


def _dense_product(a: jax.Array, b: jax.Array, scale: jax.Array, dtype: np.dtype, recipe: Any,
                   accumulate_exactly_on_gpus: bool) -> jax.Array:
  """``a (..., C) x b (Q, C) -> (..., Q)`` of fp8 operands, both contracted along their
  minor dimension (as cuBLASLt's fp8 GEMMs read them on Hopper), rescaled."""
  return scaled_gemm.rescaled_dot(
      a, b, (((a.ndim - 1,), (1,)), ((), ())), scale, dtype, exact_scale=recipe.power_of_two,
      accumulate_exactly_on_gpus=accumulate_exactly_on_gpus)


def _fused_backward(q_g: Any, residuals: tuple, g_scale: jax.Array, cfg: _Config):
  """The two gradient GEMMs from the fused kernel's layouts (the kernel's codes as XLA
  wrote them), each operand contracted along its minor dimension: no transposed copy
  of the input or the output gradient for XLA to make."""
  q_x_t, q_k, x_scale, k_scale, _ = residuals
  q_g, q_g_t = q_g
  d_lhs = _dense_product(q_g, q_k, k_scale * g_scale, cfg.lhs_dtype, cfg.recipe,
                         accumulate_exactly_on_gpus=True)
  d_rhs = _dense_product(q_x_t, q_g_t, x_scale * g_scale, cfg.rhs_dtype, cfg.recipe,
                         accumulate_exactly_on_gpus=True)
  return d_lhs, d_rhs


def _backward(cfg: _Config, residuals, g):
  q_lhs, q_rhs, x_scale, k_scale, carry = residuals
  scaling = ops.per_tensor(cfg.recipe)
  assert scaling is not None  # _Config holds a per-tensor recipe
  q_g, g_scale, new_values = scaling.backward(g, x_scale, k_scale, carry, cfg)
  if cfg.fused_quantize:
    d_lhs, d_rhs = _fused_backward(q_g, residuals, g_scale, cfg)
  else:
    (lc, rc), (lb, rb) = cfg.dimension_numbers
    pow2 = cfg.recipe.power_of_two
    d_lhs = _operand_grad(q_g, q_rhs, q_lhs, cfg.dimension_numbers, primal_is_lhs=True,
                          scale=k_scale * g_scale, dtype=cfg.lhs_dtype, exact_scale=pow2)
    d_rhs = _operand_grad(q_g, q_lhs, q_rhs, ((rc, lc), (rb, lb)), primal_is_lhs=False,
                          scale=x_scale * g_scale, dtype=cfg.rhs_dtype, exact_scale=pow2)
  d_lhs = sharding.like_primal(d_lhs, cfg.lhs_varying, jax.lax.psum)
  d_rhs = sharding.like_primal(d_rhs, cfg.rhs_varying, jax.lax.psum)
  if cfg.state_avals is None or cfg.state_varying is None or new_values is None:
    return d_lhs, d_rhs, None
  assert scaling.state_type is not None  # new state comes only from a recipe with state
  new_state = scaling.state_type(*(
      _write(sharding.like_primal(v, axes, jax.lax.pmax), aval)
      for v, aval, axes in zip(new_values, cfg.state_avals, cfg.state_varying)))
  return d_lhs, d_rhs, new_state


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_dot(lhs, rhs, state, cfg):
  return _primal(lhs, rhs, state, cfg)


_fp8_dot.defvjp(_forward, _backward)

# Outside jit, running the quantize/dot/rescale ops one by one costs a dispatch (and
# on first use a compilation) each; one jitted call costs one. Inside jit it inlines.
_fp8_dot_jit = jax.jit(_fp8_dot, static_argnums=(3,))


def fp8_dot_general(lhs: jax.Array, rhs: jax.Array,
                    dimension_numbers: jax.lax.DotDimensionNumbers,
                    precision: jax.lax.PrecisionLike = None,
                    preferred_element_type: DTypeLike | None = None, out_sharding: Any = None, *,
                    state: delayed.DelayedScalingState | None = None,
                    recipe: recipes_lib.Recipe | None = None) -> jax.Array:
  """``jax.lax.dot_general`` computed in fp8, under any jaxmp fp8 recipe.

  A drop-in ``dot_general``: ``functools.partial(fp8_dot_general, state=...,
  recipe=...)`` can be passed wherever ``lax.dot_general`` is called, e.g.
  ``nn.Dense(dot_general=...)``. ``lhs`` is treated as the input (activation) and
  ``rhs`` as the kernel, as Flax's dense layers pass them.

  Per-tensor recipes (:class:`~jaxmp.fp8.DelayedScaling`,
  :class:`~jaxmp.fp8.CurrentScaling`) quantize each tensor once for every GEMM that
  reads it. With delayed scaling the cotangent of ``state`` under ``jax.grad`` is the
  state to use on the next step (see :mod:`jaxmp.fp8.state` for how to apply it
  soundly). The finer recipes and :class:`~jaxmp.fp8.GemmRecipes` quantize each
  GEMM's operands along that GEMM's contracted dimension
  (``jaxmp._src.fp8.per_gemm``). A recipe whose GEMMs do not run as fp8 GEMMs on
  the chip being compiled for warns while tracing
  (:class:`~jaxmp.fp8.Fp8FallbackWarning`, :func:`~jaxmp.fp8.compile_target`).

  Args:
    lhs: the input, any floating-point dtype.
    rhs: the kernel, any floating-point dtype.
    dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.
    precision: accepted for signature compatibility and ignored: fp8 products have a
      single precision (fp8 operands, float32 accumulation).
    preferred_element_type: the output dtype; defaults to the result type of the
      operands, as for ``lax.dot_general`` (a bfloat16 model gets bfloat16 out).
      Accumulation is float32 either way.
    out_sharding: forwarded to the forward product's ``lax.dot_general`` (Flax NNX
      passes it); the backward products lay gradients out like their operands.
      Per-tensor recipes only.
    state: a :class:`~jaxmp.fp8.DelayedScalingState` (or a mapping with its six
      variable names) for delayed scaling, float32 or converted with
      :func:`jaxmp.fp8.state.for_grad`; ``None`` for current scaling.
    recipe: :class:`~jaxmp.fp8.DelayedScaling` (the default),
      :class:`~jaxmp.fp8.CurrentScaling`, :class:`~jaxmp.fp8.RowwiseScaling`,
      :class:`~jaxmp.fp8.BlockScaling`, :class:`~jaxmp.fp8.MXScaling` or
      :class:`~jaxmp.fp8.GemmRecipes`.

  Returns:
    The product, of ``lhs``/``rhs``'s result dtype or ``preferred_element_type``.

  Raises:
    TypeError: for integer or complex operands, a non-float
      ``preferred_element_type``, a recipe that is not a jaxmp recipe, or state of
      the wrong type.
    ValueError: for dimension numbers naming an axis an operand does not have, missing
      state under delayed scaling, state given with a recipe
      that keeps none, state whose history length does not match the recipe, or an
      ``out_sharding`` with a recipe other than per tensor.

  Example:
    >>> from jaxmp import fp8
    >>> x = jnp.array([[1.0, 2.0]], jnp.bfloat16)
    >>> w = jnp.array([[1.0], [2.0]], jnp.bfloat16)
    >>> fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), recipe=fp8.CurrentScaling())
    Array([[5]], dtype=bfloat16)
  """
  del precision  # fp8 products have one precision.
  return dot_general(lhs, rhs, dimension_numbers, preferred_element_type, out_sharding,
                     state=state, recipe=checked_recipe(recipe, "fp8_dot_general"))


def checked_recipe(recipe: Any, where: str) -> recipes_lib.Recipe:
  """``recipe`` (``DelayedScaling()`` for ``None``), checked: a jaxmp recipe with an entry
  in the fp8 ops table. Raises a TypeError naming ``where`` otherwise."""
  return recipes_lib.DelayedScaling() if recipe is None else ops.check(recipe, where)


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                preferred_element_type: DTypeLike | None = None, out_sharding: Any = None, *,
                state: Any, recipe: recipes_lib.Recipe) -> jax.Array:
  """:func:`fp8_dot_general` for a recipe checked where it was given (a rule, a layer).

  The fp8 layers call this while tracing; the recipe is not checked again.
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  _check_operand("lhs", lhs)
  _check_operand("rhs", rhs)
  dimension_numbers = _canonical_dimension_numbers(dimension_numbers)
  _check_axes(dimension_numbers, lhs, rhs)
  out_dtype = _output_dtype(lhs, rhs, preferred_element_type)
  target = support.current_target()
  support.warn_on_fallback(recipe, target)  # the recipe as the user wrote it
  recipe = recipes_lib.per_gemm(recipe)
  scaling = ops.per_tensor(recipe)
  if scaling is not None and scaling.check_state is not None:
    state = scaling.check_state(state, recipe)
    state_avals = tuple((x.shape, x.dtype) for x in state)
    state_varying = tuple(sharding.varying_axes(x) for x in state)
  else:
    if state is not None:
      raise ValueError(
          f"fp8_dot_general: {recipe!r} keeps no state, but state= was given; pass "
          "state=None, or use DelayedScaling for stateful scaling.")
    state_avals = state_varying = None
  if scaling is None:  # a recipe per GEMM
    if out_sharding is not None:
      raise ValueError(
          f"fp8_dot_general: out_sharding={out_sharding!r} is supported by the per-tensor "
          f"recipes only, not by {recipe!r}; shard the operands instead.")
    cfg = per_gemm_lib.config(lhs, rhs, dimension_numbers,
                              cast(recipes_lib.GemmRecipes, recipe), out_dtype, target)
    return per_gemm_lib.dot(lhs, rhs, cfg)
  cfg = _Config(dimension_numbers, recipe, np.dtype(lhs.dtype), np.dtype(rhs.dtype),
                out_dtype, out_sharding, state_avals, sharding.varying_axes(lhs),
                sharding.varying_axes(rhs), state_varying, target.k_major_fp8,
                target.fused_quantize and _fuses(lhs, rhs, dimension_numbers, out_dtype,
                                                 out_sharding))
  return _fp8_dot_jit(lhs, rhs, state, cfg)


def _expand_ellipsis(spec: str, ndim: int, ell_labels: str, operand: str) -> str:
  if "..." not in spec:
    if len(spec) != ndim:
      raise ValueError(
          f"fp8_einsum: {operand} has {ndim} dimensions but its subscripts {spec!r} name "
          f"{len(spec)}.")
    return spec
  n_ell = ndim - (len(spec) - 3)
  if n_ell < 0:
    raise ValueError(
        f"fp8_einsum: {operand} has {ndim} dimensions, fewer than its subscripts {spec!r} name.")
  return spec.replace("...", ell_labels[len(ell_labels) - n_ell:] if n_ell else "")


def _parse_einsum(eqn: str, lhs_ndim: int, rhs_ndim: int) -> tuple:
  spec = eqn.replace(" ", "")
  inputs, arrow, out = spec.partition("->")
  operands = inputs.split(",")
  if len(operands) != 2:
    raise ValueError(f"fp8_einsum takes exactly two operands, got equation {eqn!r}.")
  for part in (*operands, out):
    letters = part.replace("...", "")
    if not all(c in string.ascii_letters for c in letters):
      raise ValueError(f"fp8_einsum: subscripts must be letters (and '...'), got {eqn!r}.")
  n_ell = max(nd - (len(s) - 3) if "..." in s else 0
              for s, nd in zip(operands, (lhs_ndim, rhs_ndim)))
  unused = [c for c in string.ascii_letters if c not in spec]
  ell_labels = "".join(unused[:n_ell])
  lhs_spec = _expand_ellipsis(operands[0], lhs_ndim, ell_labels, "lhs")
  rhs_spec = _expand_ellipsis(operands[1], rhs_ndim, ell_labels, "rhs")
  if not arrow:  # implicit output: ellipsis dims, then labels used once, sorted.
    counts = {c: (lhs_spec + rhs_spec).count(c) for c in set(lhs_spec + rhs_spec)}
    out = ell_labels + "".join(sorted(c for c, n in counts.items()
                                      if n == 1 and c not in ell_labels))
  else:
    if "..." in out:
      out = out.replace("...", ell_labels)
  for name, labels in (("lhs", lhs_spec), ("rhs", rhs_spec), ("output", out)):
    if len(set(labels)) != len(labels):
      raise ValueError(
          f"fp8_einsum: repeated subscripts within the {name} of {eqn!r} (diagonals and "
          "traces) have no fp8 form.")
  missing = set(out) - set(lhs_spec) - set(rhs_spec)
  if missing:
    raise ValueError(f"fp8_einsum: output subscripts {sorted(missing)} of {eqn!r} appear in "
                     "no operand.")
  return lhs_spec, rhs_spec, out


def fp8_einsum(eqn: str, lhs: jax.Array, rhs: jax.Array, *,
               state: delayed.DelayedScalingState | None = None,
               recipe: recipes_lib.Recipe | None = None,
               preferred_element_type: DTypeLike | None = None,
               precision: jax.lax.PrecisionLike = None, out_sharding: Any = None) -> jax.Array:
  """A two-operand ``jnp.einsum`` computed as one :func:`fp8_dot_general`.

  ``lhs`` is the input and ``rhs`` the kernel, as in ``nn.Einsum`` (whose kernel is
  the second operand). Unlike passing an fp8 dot_general to ``jnp.einsum(...,
  _dot_general=...)``, which may call it with the operands swapped and so apply the
  input's scale to the kernel, the roles here are fixed. Labels found in one
  operand only and not in the output are summed out before quantization.

  Args:
    eqn: e.g. ``"btd,dnh->btnh"``; ``...`` and implicit outputs are accepted.
    lhs: the input.
    rhs: the kernel.
    state: as for :func:`fp8_dot_general`.
    recipe: as for :func:`fp8_dot_general`.
    preferred_element_type: as for :func:`fp8_dot_general`.
    precision: accepted and ignored, as for :func:`fp8_dot_general`.
    out_sharding: accepted, as ``jnp.einsum`` takes it (Flax's einsum layers pass it
      on), and must be ``None``: the fp8 einsum lays its output out from the operands'
      shardings.

  Returns:
    The einsum, as ``jnp.einsum(eqn, lhs, rhs)`` lays it out.

  Raises:
    ValueError: for an equation without exactly two operands, repeated subscripts
      within an operand, operands whose sizes disagree on a shared subscript, or an
      ``out_sharding``.
    TypeError: as for :func:`fp8_dot_general`.

  Example:
    >>> from jaxmp import fp8
    >>> x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
    >>> fp8.fp8_einsum("btd,dh->bth", x, w, recipe=fp8.CurrentScaling()).shape
    (2, 3, 5)
  """
  del precision  # fp8 products have one precision.
  return einsum(eqn, lhs, rhs, state=state, recipe=checked_recipe(recipe, "fp8_einsum"),
                preferred_element_type=preferred_element_type, out_sharding=out_sharding)


def einsum(eqn: str, lhs: jax.Array, rhs: jax.Array, *, state: Any,
           recipe: recipes_lib.Recipe, preferred_element_type: DTypeLike | None = None,
           out_sharding: Any = None) -> jax.Array:
  """:func:`fp8_einsum` for a recipe checked where it was given (a rule, a layer)."""
  if out_sharding is not None:
    raise ValueError(f"fp8_einsum does not take out_sharding, got {out_sharding!r}; shard the "
                     f"einsum's inputs instead.")
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  lhs_spec, rhs_spec, out = _parse_einsum(eqn, lhs.ndim, rhs.ndim)
  for c in set(lhs_spec) & set(rhs_spec):
    if lhs.shape[lhs_spec.index(c)] != rhs.shape[rhs_spec.index(c)]:
      raise ValueError(
          f"fp8_einsum: subscript {c!r} of {eqn!r} has size {lhs.shape[lhs_spec.index(c)]} "
          f"in lhs and {rhs.shape[rhs_spec.index(c)]} in rhs.")

  def sum_unique(x, spec, other):
    axes = tuple(i for i, c in enumerate(spec) if c not in other and c not in out)
    if not axes:
      return x, spec
    x = jnp.sum(x, axis=axes, dtype=F32).astype(x.dtype)
    return x, "".join(c for c in spec if c in other or c in out)

  lhs, lhs_spec = sum_unique(lhs, lhs_spec, rhs_spec)
  rhs, rhs_spec = sum_unique(rhs, rhs_spec, lhs_spec)
  batch = [c for c in out if c in lhs_spec and c in rhs_spec]
  contract = [c for c in lhs_spec if c in rhs_spec and c not in out]
  dims = ((tuple(lhs_spec.index(c) for c in contract), tuple(rhs_spec.index(c) for c in contract)),
          (tuple(lhs_spec.index(c) for c in batch), tuple(rhs_spec.index(c) for c in batch)))
  y = dot_general(lhs, rhs, dims, preferred_element_type, state=state, recipe=recipe)
  y_spec = ("".join(batch) + "".join(c for c in lhs_spec if c not in rhs_spec)
            + "".join(c for c in rhs_spec if c not in lhs_spec))
  perm = tuple(y_spec.index(c) for c in out)
  return y if perm == tuple(range(len(perm))) else jnp.transpose(y, perm)


__all__ = (
    "checked_recipe",
    "dot_general",
    "einsum",
    "fp8_dot_general",
    "fp8_einsum",
)
