"""Symmetric int8 with per-row scales: the arithmetic behind :class:`~jaxmp.fp8.Int8Scaling`.

AQT's int8 training (MaxText's ``int8`` quantization): a canonical operand ``(B, R, C)``
(:mod:`~jaxmp._src.fp8.layout`: batch, rows, contracted) gets one float32 scale per
row, ``max|row| / 127``; its elements become ``clip(round(x / scale), -127, 127)`` as
int8 (ties to even); two such operands multiply with ``preferred_element_type=int32``,
which is exact (every partial sum is an integer below ``C * 127**2``), and the int32
product, converted to float32, is multiplied by the outer product of the row scales
(:func:`jaxmp._src.fp8.scaled_gemm.gemm`).
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

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.fp8 import grouped

INT8 = np.dtype(np.int8)
INT32 = np.dtype(np.int32)
"""The accumulator of an int8 GEMM (:func:`jaxmp._src.fp8.scaled_gemm.gemm`)."""
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


__all__ = ("INT8", "INT8_MAX", "INT32", "quantize", "quantize_swapped", "row_amax",
           "scales")
