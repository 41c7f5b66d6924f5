"""Current scaling: every tensor scaled by its own amax, one scale per tensor, no state.

:class:`~jaxmp.fp8.CurrentScaling`'s part of ``fp8_dot_general``'s per-tensor op
(:mod:`~jaxmp._src.fp8.dot_general`: the input and the kernel quantized to E4M3, the
output gradient to E5M2, each tensor once for every GEMM that reads it) and of a
:class:`~jaxmp.fp8.GemmRecipes` GEMM (:mod:`~jaxmp._src.fp8.per_gemm`: a canonical
operand as one group). A scale is ``amax * 2**margin / fp8_max``
(:func:`~jaxmp._src.fp8.quantize.scale_from_amax`), 1 for an amax that is zero or not
finite.

Example:
  >>> from jaxmp._src.fp8 import current
  >>> recipe = jaxmp.fp8.CurrentScaling()
  >>> current.grouping(recipe, "input"), current.fp8_format(recipe, "output_grad")
  (Grouping(rows=None, cols=None), dtype(float8_e5m2))
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.fp8 import chips
from jaxmp._src.fp8 import fused_quantize
from jaxmp._src.fp8 import grouped
from jaxmp._src.fp8 import quantize as q
from jaxmp._src.fp8 import recipes as recipes_lib
from jaxmp._src.fp8 import scaled_gemm

F32 = np.dtype(np.float32)
GRADIENT = "output_grad"


def _scale(x: jax.Array, fp8_dtype: Any, recipe: recipes_lib.CurrentScaling) -> jax.Array:
  return q.scale_from_amax(q.amax(x), jnp.ones((), F32), fp8_dtype, recipe.margin,
                           recipe.power_of_two)


def forward(lhs: jax.Array, rhs: jax.Array, state: Any, cfg: Any):
  """The forward GEMM's quantized operands and their scales (``carry`` is ``None``);
  the input a ``(codes, transposed)`` pair with ``cfg.fused_quantize``."""
  del state  # current scaling keeps none
  x_scale = _scale(lhs, q.E4M3, cfg.recipe)
  k_scale = _scale(rhs, q.E4M3, cfg.recipe)
  q_lhs, q_rhs = scaled_gemm.forward_operands(lhs, rhs, x_scale, k_scale, cfg.k_major_fp8)
  if cfg.fused_quantize:  # the input as a (codes, transposed) pair, in one kernel
    q_lhs = fused_quantize.quantize(lhs, q.E4M3, x_scale)[:2]
  return q_lhs, q_rhs, x_scale, k_scale, None


def backward(g: jax.Array, x_scale: jax.Array, k_scale: jax.Array, carry: Any, cfg: Any):
  """The output gradient in E5M2 (a ``(codes, transposed)`` pair with
  ``cfg.fused_quantize``) and its scale; no new state (``None``)."""
  del x_scale, k_scale, carry
  g_scale = _scale(g, q.E5M2, cfg.recipe)
  if cfg.fused_quantize:
    return fused_quantize.quantize(g, q.E5M2, g_scale)[:2], g_scale, None
  return q.quantize(g, q.E5M2, g_scale), g_scale, None


def grouping(recipe: recipes_lib.CurrentScaling, role: str) -> grouped.Grouping:
  """One group: the whole tensor (batch included)."""
  del recipe, role
  return grouped.TENSOR


def fp8_format(recipe: recipes_lib.CurrentScaling, role: str) -> np.dtype:
  """E5M2 for the output gradient, E4M3 for the input and the kernel."""
  del recipe
  return q.E5M2 if role == GRADIENT else q.E4M3


def lowering(recipe: recipes_lib.CurrentScaling, target: chips.Target) -> chips.Lowering:
  """An fp8 GEMM wherever XLA lowers one (:func:`~jaxmp._src.fp8.chips.fp8_gemm`)."""
  del recipe
  return chips.fp8_gemm(target)


__all__ = ("backward", "forward", "fp8_format", "grouping", "lowering")
