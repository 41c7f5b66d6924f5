"""An fp8 matmul with a recipe per GEMM: the custom VJP behind :class:`~jaxmp.fp8.GemmRecipes`.

A layer's product ``y = dot_general(x, w)`` runs three GEMMs in training, each under
its own recipe (or in the compute dtype when the recipe is ``None``), on canonical
operands (:mod:`~jaxmp._src.fp8.layout`: ``x`` as ``(B, M, K)``, ``w`` as ``(B, N, K)``,
the output gradient ``g`` as ``(B, M, N)``):

=============  ==============================  ====================================
GEMM           operands (role)                 contracted
=============  ==============================  ====================================
forward        ``x`` (input), ``w`` (kernel)   ``K``: per token / per out channel
input grad     ``g`` (gradient), ``w.T``       ``N``: per token / per in channel
weight grad    ``g.T`` (gradient), ``x.T``     ``M``: per channel, along the tokens
=============  ==============================  ====================================

Each operand is quantized along the dimension its GEMM contracts, as the recipe of
its role (``recipe.for_role(role)``: the GEMM's one recipe, or an
:class:`~jaxmp.fp8.OperandRecipes`' recipe for that operand) prepares it, and the two
are multiplied by the GEMM recipe's product: both from the recipe's entry in the fp8
ops table (:mod:`~jaxmp._src.fp8.ops`: :func:`grouping`, :func:`fp8_format`,
:func:`quantize`, the entry's ``gemm``). The
forward pass quantizes ``x`` and ``w`` for the forward GEMM and, for the backward
GEMMs, ``w.T`` and ``x.T`` along their own contracted dimensions; the backward pass
keeps those (fp8 data and scales, or the operand itself for a compute-dtype GEMM) as
residuals and quantizes the output gradient twice, once per backward GEMM.

Example:
  >>> from jaxmp import fp8
  >>> recipe = fp8.GemmRecipes(fp8.RowwiseScaling(), fp8.RowwiseScaling(), None)
  >>> x, w = jnp.ones((4, 8)), jnp.full((8, 2), 0.5)
  >>> fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), recipe=recipe)[0]
  Array([4., 4.], dtype=float32)
"""

from __future__ import annotations

import functools
from typing import Any
from typing import NamedTuple
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import sharding
from jaxmp._src.fp8 import chips
from jaxmp._src.fp8 import grouped
from jaxmp._src.fp8 import layout as layout_lib
from jaxmp._src.fp8 import ops
from jaxmp._src.fp8 import recipes as recipes_lib
from jaxmp._src.fp8 import scaled_gemm

INPUT, KERNEL, GRADIENT = recipes_lib.ROLES

Operand = grouped.Quantized | jax.Array


class Config(NamedTuple):
  """Everything static about one per-GEMM fp8 matmul (hashable)."""
  recipes: recipes_lib.GemmRecipes
  dimension_numbers: tuple
  lhs: layout_lib.Layout
  rhs: layout_lib.Layout
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype
  out_dtype: np.dtype
  target: chips.Target
  lhs_varying: frozenset = frozenset()
  rhs_varying: frozenset = frozenset()


def grouping(recipe: recipes_lib.GemmRecipe, role: str) -> grouped.Grouping:
  """Which elements of an operand in ``role`` share a scale under ``recipe``."""
  operand = recipe.for_role(role)
  return ops.operand_ops(operand).grouping(operand, role)


def fp8_format(recipe: recipes_lib.GemmRecipe, role: str) -> np.dtype:
  """The narrow format of an operand in ``role`` under ``recipe`` (int8 for int8)."""
  operand = recipe.for_role(role)
  return ops.operand_ops(operand).element_format(operand, role)


def quantize(x: jax.Array, recipe: recipes_lib.GemmRecipe | None, role: str) -> Operand:
  """A canonical operand prepared for a GEMM under ``recipe`` (itself for ``None``)."""
  operand = None if recipe is None else recipe.for_role(role)
  if operand is None:
    return x
  entry = ops.operand_ops(operand)
  if entry.quantize is not None:
    return entry.quantize(x, operand, role)
  group, fmt = entry.grouping(operand, role), entry.element_format(operand, role)
  scaled = cast(ops.AmaxScaled, operand)
  scale = grouped.scales(x, group, fmt, scaled.margin, scaled.power_of_two)
  return grouped.quantize(x, group, fmt, scale)


def quantize_swapped(x: jax.Array, recipe: recipes_lib.GemmRecipe | None, role: str
                     ) -> Operand:
  """``quantize(layout.swap(x), recipe, role)``: ``x`` as a backward GEMM reads it.

  A recipe may compute it another way (its entry's ``quantize_swapped``: int8 quantizes
  in ``x``'s layout and swaps the codes, the same values in fewer passes on TPUs);
  every other recipe swaps first.
  """
  operand = None if recipe is None else recipe.for_role(role)
  swapped = None if operand is None else ops.operand_ops(operand).quantize_swapped
  if swapped is not None:
    return swapped(x, operand, role)
  return quantize(layout_lib.swap(x), recipe, role)


def _gemm(a: Operand, b: Operand, recipe: recipes_lib.GemmRecipe | None, roles: tuple,
          shape: tuple, out_dtype: Any, cfg: Config) -> jax.Array:
  """``(B, P, C) x (B, Q, C) -> (B, P, Q)`` under ``recipe``, or in the operands' dtype."""
  if recipe is None:
    # A GEMM without a recipe gets its operands unquantized (see ``_quantize``).
    a, b = cast(jax.Array, a), cast(jax.Array, b)
    dtype = jnp.result_type(a.dtype, b.dtype)
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), scaled_gemm.CANONICAL,
                               preferred_element_type=out_dtype)
  a, b = cast(grouped.Quantized, a), cast(grouped.Quantized, b)
  # The gradient GEMMs accumulate without cuBLASLt's fast accumulation, as in Flax and
  # TransformerEngine (scaled_gemm.rescaled_dot).
  call = ops.GemmCall(roles, (grouping(recipe, roles[0]), grouping(recipe, roles[1])),
                      np.dtype(out_dtype), cfg.target, roles[0] == GRADIENT)
  gemm = ops.of(recipe).gemm
  assert gemm is not None  # register_recipe requires one of a GEMM recipe
  p, q_ = shape
  return gemm(a, b, recipe, call)[:, :p, :q_]


def _product(q_x: Operand, q_w: Operand, cfg: Config) -> jax.Array:
  """The forward GEMM of quantized canonical operands, in the output's shape."""
  out = _gemm(q_x, q_w, cfg.recipes.gemms[0], (INPUT, KERNEL), (cfg.lhs.rows, cfg.rhs.rows),
              cfg.out_dtype, cfg)
  return jnp.reshape(out, layout_lib.output_shape(cfg.lhs, cfg.rhs))


def _primal(lhs: jax.Array, rhs: jax.Array, cfg: Config) -> jax.Array:
  """The product when nothing differentiates it: the forward GEMM's operands only."""
  forward = cfg.recipes.gemms[0]
  x, w = cfg.lhs.to_canonical(lhs), cfg.rhs.to_canonical(rhs)
  return _product(quantize(x, forward, INPUT), quantize(w, forward, KERNEL), cfg)


def _canonical_on_gpus(operand: Operand, cfg: Config) -> Operand:
  """A quantized operand's data laid out as its GEMM reads it on CUDA, contracted minor.

  Where the target's fp8 GEMMs read K-major operands (``cfg.target.k_major_fp8``, Hopper;
  scaled_gemm.in_own_layout_on_gpus decides). Chosen by XLA, the forward pass's
  quantizations of a Dense kernel were written transposed and its two amaxes read a
  transposed int16 copy of its magnitudes. Only the forward pass's: pinning the output
  gradient's quantizations too changed nothing (compiled H100 HLO). On a B200, whose
  fp8 GEMMs read any layout, XLA's own choice was as good or better.
  """
  if not isinstance(operand, grouped.Quantized):
    return operand  # a compute-dtype GEMM's operand: cuBLAS reads any layout
  (data,) = scaled_gemm.in_own_layout_on_gpus(cfg.target.k_major_fp8, operand.data)
  return operand._replace(data=data)


def _forward(lhs: jax.Array, rhs: jax.Array, cfg: Config):
  forward, input_grad, weight_grad = cfg.recipes.gemms
  x, w = cfg.lhs.to_canonical(lhs), cfg.rhs.to_canonical(rhs)  # (B, M, K), (B, N, K)
  q_x, q_w = quantize(x, forward, INPUT), quantize(w, forward, KERNEL)
  w_t = quantize_swapped(w, input_grad, KERNEL)   # (B, K, N)
  x_t = quantize_swapped(x, weight_grad, INPUT)   # (B, K, M)
  # Every quantization of this op's operands is done here, in the forward pass. Left
  # where XLA placed them (the kernel's for the input-gradient GEMM may run as late as
  # the backward pass), a train step with its state donated copied every fp8 kernel
  # before updating it in place (compiled H100 HLO, Llama-3-8B layer, rowwise: 7
  # float32 kernels copied, 7.18 ms estimated; behind the barrier none, 6.73 ms). The
  # values are the same either way. Only here: a barrier keeps all its operands, so
  # the product without a gradient (_primal) would compute the residuals for nothing.
  q_x, q_w, w_t, x_t = jax.lax.optimization_barrier(
      tuple(_canonical_on_gpus(o, cfg) for o in (q_x, q_w, w_t, x_t)))
  return _product(q_x, q_w, cfg), (w_t, x_t)


def _backward(cfg: Config, residuals, g):
  _, input_grad, weight_grad = cfg.recipes.gemms
  w_t, x_t = residuals
  m, n, k = cfg.lhs.rows, cfg.rhs.rows, cfg.lhs.contracted
  g = jnp.reshape(g, (cfg.lhs.batch, m, n))
  d_lhs = _gemm(quantize(g, input_grad, GRADIENT), w_t, input_grad, (GRADIENT, KERNEL),
                (m, k), cfg.lhs_dtype, cfg)                                  # (B, M, K)
  d_rhs = _gemm(quantize_swapped(g, weight_grad, GRADIENT), x_t, weight_grad,
                (GRADIENT, INPUT), (n, k), cfg.rhs_dtype, cfg)               # (B, N, K)
  d_lhs = sharding.like_primal(cfg.lhs.from_canonical(d_lhs), cfg.lhs_varying, jax.lax.psum)
  d_rhs = sharding.like_primal(cfg.rhs.from_canonical(d_rhs), cfg.rhs_varying, jax.lax.psum)
  return d_lhs, d_rhs


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dot(lhs, rhs, cfg):
  return _primal(lhs, rhs, cfg)


_dot.defvjp(_forward, _backward)
dot = jax.jit(_dot, static_argnums=(2,))
"""``dot(lhs, rhs, cfg)``: the per-GEMM fp8 matmul (jitted: one dispatch outside jit)."""


def config(lhs: jax.Array, rhs: jax.Array, dimension_numbers: tuple,
           recipes: recipes_lib.GemmRecipes, out_dtype: np.dtype,
           target: chips.Target) -> Config:
  """The static configuration of ``dot(lhs, rhs, ...)`` on ``target``."""
  (lc, rc), (lb, rb) = dimension_numbers
  return Config(recipes, dimension_numbers, layout_lib.Layout.of(lhs.shape, lc, lb),
                layout_lib.Layout.of(rhs.shape, rc, rb), np.dtype(lhs.dtype),
                np.dtype(rhs.dtype), np.dtype(out_dtype), target,
                sharding.varying_axes(lhs), sharding.varying_axes(rhs))


__all__ = ("Config", "config", "dot", "fp8_format", "grouping", "quantize", "quantize_swapped")
