"""Group-scaled quantization: which elements of a GEMM operand share one scale.

A canonical operand ``(B, R, C)`` (:mod:`~jaxmp._src.fp8.layout`: batch, rows,
contracted) is cut into groups of ``rows x cols`` elements, each with its own scale:

===================  ==================  =====================================
grouping             ``(rows, cols)``    recipe
===================  ==================  =====================================
per tensor           whole tensor        ``CurrentScaling`` (batch included)
per row              ``(1, C)``          ``RowwiseScaling``
``1 x 128`` tile     ``(1, 128)``        ``BlockScaling``: activations, gradients
``128 x 128`` block  ``(128, 128)``      ``BlockScaling``: weights
``1 x 32`` block     ``(1, 32)``         ``MXScaling`` (scales in :mod:`.mx`)
===================  ==================  =====================================

**Partial groups.** Where ``R`` or ``C`` is not a multiple of the group's extent, the
operand is padded with zeros at the end up to a multiple. A zero never raises an
amax, so the last, partial group is scaled from its own elements alone, and padded
elements quantize to zero and add nothing to a product; the padded quantized operand
goes into the GEMM and the product is sliced back.

Quantization is ``clip(x / scale)`` in float32 rounded to the fp8 format, with
:func:`~jaxmp._src.fp8.quantize.saturate` keeping inf and NaN non-finite.

Example:
  >>> from jaxmp._src.fp8 import grouped
  >>> x = jnp.arange(1.0, 7.0).reshape(1, 2, 3)
  >>> grouped.amax(x, grouped.ROW)
  Array([[[3.],
          [6.]]], dtype=float32)
  >>> grouped.amax(x, grouped.Grouping(1, 2))  # tiles of 2, the last one partial
  Array([[[2., 3.],
          [5., 6.]]], dtype=float32)
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.fp8 import quantize as q

F32 = np.dtype(np.float32)


class Grouping(NamedTuple):
  """The extent of a scaling group: ``rows x cols`` (``None``: the whole dimension).

  ``Grouping(None, None)`` is the whole tensor, its batch included.
  """

  rows: int | None
  cols: int | None

  @property
  def per_tensor(self) -> bool:
    return self.rows is None and self.cols is None


TENSOR = Grouping(None, None)
ROW = Grouping(1, None)


class Quantized(NamedTuple):
  """A quantized canonical operand: padded fp8 data and one scale per group.

  Attributes:
    data: ``(B, R', C')`` fp8, ``R`` and ``C`` padded with zeros to whole groups.
    scale: ``(B, R' / rows, C' / cols)`` (``(1, 1, 1)`` per tensor): float32
      dequantization multipliers, or E8M0 for MX.
  """

  data: jax.Array
  scale: jax.Array


def _extents(shape: tuple, grouping: Grouping) -> tuple[int, int]:
  _, rows, cols = shape
  return (rows if grouping.rows is None else grouping.rows,
          cols if grouping.cols is None else grouping.cols)


def pad(x: jax.Array, grouping: Grouping) -> jax.Array:
  """``x`` (``(B, R, C)``) zero-padded at the end of ``R`` and ``C`` to whole groups."""
  r, c = _extents(x.shape, grouping)
  extra_rows, extra_cols = -x.shape[1] % r, -x.shape[2] % c
  if not (extra_rows or extra_cols):
    return x
  return jnp.pad(x, ((0, 0), (0, extra_rows), (0, extra_cols)))


def _blocks(x: jax.Array, grouping: Grouping) -> jax.Array:
  """Padded ``(B, R, C)`` viewed as ``(B, R / r, r, C / c, c)``."""
  b, rows, cols = x.shape
  r, c = _extents(x.shape, grouping)
  return jnp.reshape(x, (b, rows // r, r, cols // c, c))


def _per_element(scale: jax.Array) -> jax.Array:
  """Group scales ``(B, R/r, C/c)`` shaped to broadcast against :func:`_blocks`."""
  return scale[:, :, None, :, None]


_MAGNITUDE_BITS = {2: (np.dtype(np.int16), 0x7FFF), 4: (np.dtype(np.int32), 0x7FFFFFFF)}
"""Per float width: the signed integer of that width, and the mask that clears the sign."""


def max_magnitude(x: jax.Array, axis: Any, keepdims: bool = False) -> jax.Array:
  """``max|x|`` over ``axis``, float32, inf where a NaN is reduced.

  Reduced on the bits: with the sign bit cleared, a float's bits, read as a signed
  integer of its width, order as its magnitude, and NaN's bits lie above inf's. So the
  largest of them, capped at inf's bits, is the amax with NaN read as inf, with
  neither an ``isnan`` select nor a float ``max`` whose NaN handling varies by backend
  (XLA:CPU's skips NaN). The select cost a pass: where an operand is reduced along
  both of its dimensions (a GEMM's operand and its transpose, for per-row or block
  scales), XLA computed the NaN mask once and wrote it out, with the magnitudes,
  transposed (compiled for an H100, the rowwise Llama layer's step: 6.73 -> 6.41 ms
  estimated, and 0.34 ms less of other kernels measured on an H200; for TPU v5e, one
  more pass over an int8 GEMM's activation).

  Example:
    >>> from jaxmp._src.fp8 import grouped
    >>> grouped.max_magnitude(jnp.array([[1.0, -3.0], [jnp.nan, 2.0]]), axis=1)
    Array([ 3., inf], dtype=float32)
  """
  if x.dtype.itemsize not in _MAGNITUDE_BITS:  # fp8, float64: float32 first (monotonic)
    x = x.astype(F32)
  integer, mask = _MAGNITUDE_BITS[x.dtype.itemsize]
  magnitude = jax.lax.bitcast_convert_type(x, integer) & jnp.asarray(mask, integer)
  inf = jax.lax.bitcast_convert_type(jnp.asarray(jnp.inf, x.dtype), integer)
  top = jnp.minimum(jnp.max(magnitude, axis=axis, keepdims=keepdims), inf)
  return jax.lax.bitcast_convert_type(top, x.dtype).astype(F32)


def amax(x: jax.Array, grouping: Grouping) -> jax.Array:
  """``max|x|`` of every group, float32, ``(B, R/r, C/c)`` (``(1, 1, 1)`` per tensor).

  A group holding NaN has amax inf, so that it gets the non-finite amax's scale on
  every backend (:func:`max_magnitude`).
  """
  if grouping.per_tensor:
    return jnp.reshape(max_magnitude(x, axis=None), (1, 1, 1))
  return max_magnitude(_blocks(pad(x, grouping), grouping), axis=(2, 4))


def scales(x: jax.Array, grouping: Grouping, fp8_dtype: Any, margin: int = 0,
           power_of_two: bool = False) -> jax.Array:
  """Current-scaling scales of every group: :func:`~.quantize.scale_from_amax` of its amax.

  A group whose amax is zero or not finite gets scale 1.
  """
  return q.scale_from_amax(amax(x, grouping), jnp.ones((), F32), fp8_dtype, margin,
                           power_of_two)


def quantize(x: jax.Array, grouping: Grouping, fp8_dtype: Any, scale: jax.Array) -> Quantized:
  """``x`` (``(B, R, C)``) quantized group by group: ``clip(x / scale)`` in ``fp8_dtype``."""
  blocks = _blocks(pad(x, grouping), grouping)
  data = q.quantize(blocks, fp8_dtype, _per_element(scale))
  return Quantized(jnp.reshape(data, (blocks.shape[0], -1, blocks.shape[3] * blocks.shape[4])),
                   scale)


def dequantize(x: Quantized, grouping: Grouping, dtype: Any = F32) -> jax.Array:
  """``data * scale`` group by group, in ``dtype``, still padded: ``(B, R', C')``.

  The product is exact in ``dtype`` when the scales are powers of two (and in float32
  up to one rounding of the product of an fp8 value and a float32 scale).
  """
  blocks = _blocks(x.data, grouping).astype(dtype)
  out = blocks * _per_element(x.scale).astype(dtype)
  return jnp.reshape(out, x.data.shape)


def pad_rows(x: jax.Array, rows: int) -> jax.Array:
  """``x`` ``(B, R, C)`` with zero rows appended up to ``rows`` (a kernel's whole tiles)."""
  return x if x.shape[1] == rows else jnp.pad(x, ((0, 0), (0, rows - x.shape[1]), (0, 0)))


def row_scales(x: Quantized, grouping: Grouping, rows: int) -> jax.Array:
  """One scale per row and group of columns, ``(B, rows, C / cols)``.

  A block's scale repeated over its rows, then zero rows appended up to ``rows``
  (:func:`pad_rows`): what a GEMM kernel multiplies each row's partial products by.

  Example:
    >>> from jaxmp._src.fp8 import grouped
    >>> x = grouped.Quantized(jnp.zeros((1, 2, 4)), jnp.array([[[2.0, 3.0]]]))
    >>> grouped.row_scales(x, grouped.Grouping(2, 2), 3)[0]
    Array([[2., 3.],
           [2., 3.],
           [0., 0.]], dtype=float32)
  """
  assert grouping.rows is not None  # a tile or a block, never a whole column
  scale = x.scale if grouping.rows == 1 else jnp.repeat(x.scale, grouping.rows, axis=1)
  return pad_rows(scale, rows)


def held(*operands: Any) -> tuple[Any, ...]:
  """``operands`` (fp8 data, or :class:`Quantized`) behind an optimization barrier.

  Their fp8 rounding then stays in the program.

  XLA's GPU compiler may delete a round trip through a narrower float inside one
  program ("excess precision", on by default): a GEMM that dequantizes operands it
  quantized in the same program would then multiply the unquantized values (compiled
  for an H100, a ``BlockScaling`` or ``MXScaling`` forward kept no fp8 type at all).
  The barrier hides the fp8 data's origin from that rewrite. In training the fp8 data
  reach memory anyway, as the backward pass's residuals.
  """
  return jax.lax.optimization_barrier(operands)


__all__ = (
    "ROW",
    "TENSOR",
    "Grouping",
    "Quantized",
    "amax",
    "dequantize",
    "held",
    "pad",
    "pad_rows",
    "quantize",
    "row_scales",
    "scales",
)
