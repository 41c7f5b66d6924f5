"""Symmetric int8 with per-row scales: the arithmetic behind :class:`~jaxmp.fp8.Int8Scaling`.

AQT's int8 training (MaxText's ``int8`` quantization): a canonical operand ``(B, R, C)``
(:mod:`~jaxmp._src.fp8.layout`: batch, rows, contracted) gets one float32 scale per
row, ``max|row| / 127``; its elements become ``clip(round(x / scale), -127, 127)`` as
int8 (ties to even); two such operands multiply with ``preferred_element_type=int32``,
which is exact (every partial sum is an integer below ``C * 127**2``), and the int32
product, converted to float32, is multiplied by the outer product of the row scales
(:func:`dot`).
On TPU v5e, v5p and v6e this is an int8 matrix-unit GEMM at about half bfloat16's
cycles (:mod:`~jaxmp._src.fp8.support`).

**Non-finite rows.** int8 has no inf or NaN, so the overflow has to travel in the
scale: a row holding inf or NaN has amax inf (:func:`~.grouped.amax`), hence scale inf,
and its elements quantize to 0 (finite ones: ``x / inf``; inf and NaN: set to 0); the
product's row is then ``0 * inf`` = NaN, and loss scaling sees the overflow. An
all-zero row has scale 1 (its elements are 0 either way), and so does a row whose
``amax / 127`` underflows float32 to 0.

Example:
  >>> from jaxmp._src.fp8 import int8
  >>> x = int8.quantize(jnp.array([[[1.0, -0.5, 0.25]]]))
  >>> x.data, x.scale * 127
  (Array([[[127, -64,  32]]], dtype=int8), Array([[[1.]]], dtype=float32))
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.fp8 import chips
from jaxmp._src.fp8 import grouped
from jaxmp._src.fp8 import scaled_gemm

INT8 = np.dtype(np.int8)
INT32 = np.dtype(np.int32)
"""The accumulator of an int8 GEMM (:func:`dot`)."""
F32 = np.dtype(np.float32)
INT8_MAX = 127
"""The symmetric int8 range is ``[-127, 127]`` (AQT's; -128 is never produced)."""


def row_amax(x: jax.Array) -> jax.Array:
  """``max|row|`` of every row of ``x`` (``(B, R, C)``), float32, ``(B, R, 1)``; inf if NaN.

  :func:`~.grouped.amax` per row, reduced on the bits (:func:`~.grouped.max_magnitude`).
  """
  return grouped.max_magnitude(x, 2, keepdims=True)


def _scales(amax: jax.Array) -> jax.Array:
  # Divide by a select, not by a broadcast constant: XLA rewrites ``a / broadcast(127)``
  # into ``a * broadcast(1 / 127)``, which differs from ``a / 127`` in the last bit.
  scale = amax / jnp.where(amax > 0, np.float32(INT8_MAX), np.float32(1))
  return jnp.where(scale > 0, scale, np.float32(1))


def scales(x: jax.Array) -> jax.Array:
  """``max|row| / 127`` of every row of ``x`` (``(B, R, C)``), float32, ``(B, R, 1)``.

  1 where that is zero (an all-zero row, or an amax that small); inf for a row holding
  inf or NaN.
  """
  return _scales(row_amax(x))


def _codes(x: jax.Array, scale: jax.Array) -> jax.Array:
  # A NaN quotient (inf or NaN in x, whose row's scale is inf) converts to 0: XLA's
  # float-to-int conversion saturates and maps NaN to 0. Selecting 0 explicitly would
  # do the same, but on TPU v5e it made XLA lay the int8 operand out so that the GEMM
  # ran at the bfloat16 rate (libtpu's cost model).
  return jnp.clip(jnp.round(x.astype(F32) / scale), -INT8_MAX, INT8_MAX).astype(INT8)


def quantize(x: jax.Array) -> grouped.Quantized:
  """``x`` (``(B, R, C)``, any float dtype) as int8 data and row scales.

  ``clip(round(float32(x) / scale), -127, 127)``, ties to even; inf and NaN become 0
  (their row's scale is inf).
  """
  scale = scales(x)
  return grouped.Quantized(_codes(x, scale), scale)


def quantize_swapped(x: jax.Array) -> grouped.Quantized:
  """``quantize(swapaxes(x, 1, 2))``, bit for bit, computed in ``x``'s own layout.

  The scales are ``x``'s column scales (amax along the rows), the codes are divided
  out in ``x``'s layout, and only the int8 codes are swapped. The same values as
  swapping first; but for TPU v5e XLA then quantizes both ways from one read of ``x``
  and moves int8 rather than a float32 copy of ``x`` (swapping first, it widened ``x``
  to float32 once for both quantizations and transposed that copy): the Llama-shaped
  layer's int8 train step 8% fewer cycles by libtpu's cost model (benchmarks/RESULTS.md).

  Example:
    >>> from jaxmp._src.fp8 import int8
    >>> x = jnp.array([[[1.0, -0.5], [0.25, 2.0]]])
    >>> q = int8.quantize_swapped(x)
    >>> q.data, q.scale * 127
    (Array([[[127,  32],
            [-32, 127]]], dtype=int8), Array([[[1.],
            [2.]]], dtype=float32))
  """
  scale = _scales(grouped.max_magnitude(x, 1, keepdims=True))    # (B, 1, C)
  return grouped.Quantized(jnp.swapaxes(_codes(x, scale), 1, 2), jnp.swapaxes(scale, 1, 2))


def grouping(recipe: Any, role: str) -> grouped.Grouping:
  """One scale per row along the contracted dimension, every operand."""
  del recipe, role
  return grouped.ROW


def element_format(recipe: Any, role: str) -> np.dtype:
  """int8, every operand."""
  del recipe, role
  return INT8


def quantize_operand(x: jax.Array, recipe: Any, role: str) -> grouped.Quantized:
  """:func:`quantize` (the recipe has no options)."""
  del recipe, role
  return quantize(x)


def quantize_swapped_operand(x: jax.Array, recipe: Any, role: str) -> grouped.Quantized:
  """:func:`quantize_swapped` (the recipe has no options)."""
  del recipe, role
  return quantize_swapped(x)


def dot(a: grouped.Quantized, b: grouped.Quantized, out_dtype: Any) -> jax.Array:
  """``(B, P, C) x (B, Q, C) -> (B, P, Q)`` for int8 operands with row scales.

  ``float32(dot_general(a, b, preferred_element_type=int32)) * (scale_a * scale_b.T)``
  cast to ``out_dtype``: the accumulation is exact, then one float32 rounding (of the
  int32 sum, above ``2**24``), one of the scale product and one of the rescale.

  Example:
    >>> from jaxmp._src.fp8 import int8
    >>> a = int8.quantize(jnp.array([[[1.0, 127.0]]]))  # scale 1: exact
    >>> b = int8.quantize(jnp.array([[[2.0, 254.0], [0.0, 0.0]]]))  # scales 2, 1
    >>> int8.dot(a, b, jnp.float32)
    Array([[[32260.,     0.]]], dtype=float32)
  """
  acc = jax.lax.dot_general(a.data, b.data, scaled_gemm.CANONICAL, preferred_element_type=INT32)
  return (acc.astype(F32) * scaled_gemm.outer(a.scale, b.scale)).astype(out_dtype)


def gemm_operands(a: grouped.Quantized, b: grouped.Quantized, recipe: Any, call: Any
                  ) -> jax.Array:
  """:func:`dot` for a GEMM ``call``."""
  del recipe
  return dot(a, b, call.out_dtype)


def lowering(recipe: Any, target: chips.Target) -> chips.Lowering:
  """An int8 GEMM where it runs faster than bfloat16 (:attr:`~.chips.Target.int8`)."""
  del recipe
  if target.int8 is None:
    return chips.Lowering("unknown", f"int8 GEMM speed on {target.description} is not "
                          "described")
  if target.int8:
    return chips.Lowering("int8", "an int8 GEMM with int32 accumulation")
  return chips.Lowering("fallback", "int8 GEMMs at the bfloat16 rate (libtpu's cost model): "
                        "only the quantization's cost is added")


__all__ = ("INT8", "INT8_MAX", "INT32", "dot", "element_format", "gemm_operands", "grouping",
           "lowering", "quantize", "quantize_operand", "quantize_swapped",
           "quantize_swapped_operand", "row_amax", "scales")
