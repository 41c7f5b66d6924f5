"""Block-wise 8-bit quantization with the dynamic (tree) map of 8-bit optimizers.

Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (2021), store each
optimizer moment as one byte per value: a code into a table of 256 float32 values,
the *dynamic map*, times one float32 scale per block of consecutive values. This is
the arithmetic of torchao's ``AdamW8bit`` (``torchao/optim/quant_utils.py``), bit for
bit:

* **The maps.** For exponents ``i = 0..6`` the map holds the midpoints of ``n_i + 1``
  evenly spaced points from 0.1 to 1, times ``10**(i - 6)``: ``n_i = 2**i`` for the
  signed map (each value also negated), ``2**(i + 1)`` for the unsigned one; then 0 and
  1. Each decade has twice the points of the one below, so small values keep their
  relative precision (the signed map spans ``[-0.993, 1]``, the unsigned ``[0, 1]``,
  each 256 values, sorted). The arithmetic is torchao's in float32: the points are
  ``start + i * step`` (or ``end - (n - i) * step`` for the upper half) rounded once,
  as PyTorch's CPU ``linspace`` computes them with a fused multiply-add; the
  midpoints ``(a + b) / 2`` and the products with ``float32(10**(i - 6))`` are float32
  operations.
* **Scales.** The values are cut into blocks of ``block_size`` consecutive values of
  the flattened (row-major) array; a block's scale is its largest magnitude, at least
  ``float32(1e-12)``, and the block is divided by it (float32 division), so it lies
  in ``[-1, 1]``.
* **Codes.** A scaled value ``x`` gets the code ``c`` of the largest map value at
  most ``x`` (0 below the map; torchao finds it by a branchless binary search), then
  ``c + 1`` (at most 255) if ``x - map[c] >= (map[c + 1] - map[c]) * 0.5``: the
  nearest map value, ties upward.
* **Dequantization** is ``map[code] * scale`` (float32).

What the steps give at the edges: zeros (and ``-0.0``) have the code of 0 and come
back ``+0.0``; an all-zero block has scale ``1e-12``; a value below half the map's
smallest positive value (``2.75e-7`` of its block's scale signed, ``1.6e-7``
unsigned; subnormals included) becomes 0; the block's largest magnitude comes back
exactly when it is positive (``map[255] == 1``), and as ``0.993`` times itself when it
is negative in a signed block (the signed map ends at ``-0.993``); the unsigned map
has no negative values, so a negative value becomes 0. A NaN makes its block's scale
NaN and every value of the block NaN; an infinity makes the scale infinite and the
block's values NaN (the infinity itself ``-inf`` in a signed block: ``inf / inf`` is
NaN, which has code 0).

**No table lookups.** Inside ``jit`` the map is computed, not indexed: a lookup is a
gather, and a gather in an optimizer wrapped by :func:`jaxmp.loss_scaling` keeps the
skip a conditional (XLA turns a conditional into a select only when its branches are
elementwise operations, reductions and reshapes), whose float32 outputs (updates,
masters) are then written to memory: on the Llama-3-8B-shaped layer's step with
master weights compiled for an H100, lookups in the decoding alone raise the peak from
2.06 to 4.08 GiB (``docs/guides/memory.md``). So:

* *decoding* (:func:`map_values`): the values strictly between 0 and 1 are, in order,
  decade after decade, ``m = 2**i`` (signed) or ``2**(i + 1)`` (unsigned) values each.
  A code's position ``e`` among them (from 1) gives its decade's size ``m``, the
  largest power of two at most ``e`` (signed) or ``e + 1`` (unsigned), by counting
  leading zeros, and its index ``j`` in the decade. In units of ``2**-31`` the
  linspace's start (``float32(0.1)``), end (1) and step (``float32(0.9) / m``) are
  integers, so each point is an exact integer converted to float32 once: torchao's
  single rounding. The midpoint's sum is torchao's float32 addition, its halving and
  the ``2**-31`` exact, and the product with the decade's factor torchao's float32
  product.
* *encoding* (:func:`encode`): the magnitude's decade by comparisons with each
  decade's smallest value; its index in the decade estimated from the even spacing
  (the estimate errs by less than a thousandth of a step, so it is the index or one
  above) and settled by one comparison with the exact value; then torchao's rounding
  test with the exact neighbours (for a negative value the negated neighbours, so
  that its ties round toward zero, as torchao's do).

Every product of these that meets an addition is exact, passes a select first, or
only feeds the estimate (which the comparison settles), so compilers that fuse
multiply-adds (XLA on GPUs; on CPUs with FMA) give the same codes and values.
``tests/optim/test_dynamic_map.py`` checks the values of all 256 codes and, against
the NumPy port of torchao, the codes of every float32 at and just below each step of
the code, of 65 float32 across each interval between neighbouring map values (either
sign), of each map value and its neighbours, and of random values.

Block shapes: the scales are kept in the array's own shape with its trailing axes
merged and divided into blocks (:func:`scale_shape`): ``(rows, cols // block_size)``
when the last axis is a multiple of the block, so that a sharded array's scales are
sharded along the same leading axes.

Example:
  >>> from jaxmp._src.optim import dynamic_map
  >>> x = jnp.array([0.5, -1.0, 0.0, 2.0, 0.375, -0.125, 0.25, 0.5])
  >>> codes, scale = dynamic_map.quantize(x, signed=True, block_size=4)
  >>> codes, scale
  (Array([201,  35, 127, 255, 237,  53, 219, 255], dtype=uint8), Array([2. , 0.5], dtype=float32))
  >>> dynamic_map.dequantize(codes, scale, signed=True)  # each block's largest exactly
  Array([ 0.49531248, -1.0015625 ,  0.        ,  2.        ,  0.37695312,
         -0.12382812,  0.25039062,  0.5       ], dtype=float32)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

CODE_DTYPE = np.dtype(np.uint8)
SCALE_DTYPE = np.dtype(np.float32)
MIN_SCALE = np.float32(1e-12)
_EXPONENTS = 7  # the decades 10**-6 .. 10**0
_F32 = np.float32
_ZERO_CODE = 127  # of the signed map; the unsigned map's zero is code 0


def _linspace(n: int) -> np.ndarray:
  """``n`` points from 0.1 to 1 in float32, each rounded once (PyTorch's CPU linspace)."""
  start, end = _F32(0.1), _F32(1.0)
  step = (end - start) / _F32(n - 1)
  i = np.arange(n)
  # float64 holds start + i * step exactly here (27 bits at most), so one cast rounds
  # once, as a fused multiply-add does.
  low = np.float64(start) + np.float64(step) * i
  high = np.float64(end) - np.float64(step) * (n - 1 - i)
  return np.where(i < n // 2, low, high).astype(_F32)


def _factor(decade: int) -> np.float32:
  """``float32(10**(decade - 6))``: the factor of a decade's midpoints."""
  return _F32(10.0 ** (decade - _EXPONENTS + 1))


def _decade_size(decade: int, signed: bool) -> int:
  """How many values of the map (positive ones, for the signed map) a decade holds."""
  return 2**decade if signed else 2 ** (decade + 1)


def _dynamic_map(signed: bool) -> np.ndarray:
  """The 256 sorted float32 values of the signed or unsigned dynamic map."""
  parts = [np.array([0.0, 1.0], _F32)]
  for i in range(_EXPONENTS):
    points = _linspace(_decade_size(i, signed) + 1)
    midpoints = (points[:-1] + points[1:]) / _F32(2)
    decade = _factor(i) * midpoints
    parts += [decade, -decade] if signed else [decade]
  values = np.sort(np.concatenate(parts))
  assert values.shape == (256,) and np.all(np.diff(values) > 0)
  return values


SIGNED_MAP = _dynamic_map(signed=True)
"""The signed dynamic map: 256 sorted float32 values in ``[-0.993, 1]`` (torchao's
``create_dynamic_map(signed=True)``)."""
UNSIGNED_MAP = _dynamic_map(signed=False)
"""The unsigned dynamic map: 256 sorted float32 values in ``[0, 1]``."""


def table(signed: bool) -> np.ndarray:
  """The signed or unsigned dynamic map."""
  return SIGNED_MAP if signed else UNSIGNED_MAP


def scale_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...] | None:
  """The shape of the scales of an array of ``shape``, or ``None`` if it has no blocks.

  The leading axes are kept and the fewest trailing axes merged whose size is a
  multiple of ``block_size``, then divided by it: ``(64, 512)`` in blocks of 256 has
  scales ``(64, 2)``, ``(64, 128)`` has ``(32,)``. ``None`` when the array's size is
  not a positive multiple of ``block_size``, or for a scalar.

  Example:
    >>> from jaxmp._src.optim import dynamic_map
    >>> dynamic_map.scale_shape((64, 512), 256), dynamic_map.scale_shape((64, 128), 256)
    ((64, 2), (32,))
  """
  size = math.prod(shape)
  if not shape or size == 0 or size % block_size:
    return None
  for axis in range(len(shape) - 1, -1, -1):
    merged = math.prod(shape[axis:])
    if merged % block_size == 0:
      return (*shape[:axis], merged // block_size)
  raise AssertionError("unreachable: the whole array is a multiple of the block")  # axis 0


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
  """``x`` as ``scale_shape + (block_size,)``: its blocks along a new last axis."""
  shape = scale_shape(x.shape, block_size)
  if shape is None:
    raise ValueError(f"an array of shape {x.shape} (size {x.size}) has no blocks of "
                     f"{block_size}: it must have an axis and a size that is a positive "
                     "multiple of the block.")
  return x.reshape(*shape, block_size)


def block_scales(x: jax.Array, block_size: int) -> jax.Array:
  """The float32 scales of ``x``'s blocks: each block's largest magnitude, at least 1e-12.

  Raises:
    ValueError: if the size of ``x`` is not a positive multiple of ``block_size``.
  """
  return jnp.maximum(jnp.max(jnp.abs(_blocks(x, block_size)), axis=-1), MIN_SCALE)


def _spread(scale: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The block scales broadcast to the values' ``shape`` (each value beside its scale).

  The values keep their shape and the scales are reshaped instead: XLA's GPU cost
  model counts a fused array once per reshape of it, and a reshaped moment inside the
  codes' pass made it write the moment to memory rather than compute it there.
  """
  block = math.prod(shape) // scale.size
  return jnp.broadcast_to(scale[..., None], (*scale.shape, block)).reshape(shape)


# The linspace in units of 2**-31, where its start, end and steps are integers:
# float32(0.1) = 13421773 * 2**-27 and float32(1 - float32(0.1)) = 15099494 * 2**-24,
# divided by a decade's m = 2**k (k <= 7).
_START = 13421773 * 2**4
_END = 2**31
_SPAN = 15099494 * 2**7  # the step of m = 1; of m = 2**k it is _SPAN >> k
_UNIT = _F32(2.0**-32)   # 2**-31 for a point, halved for a midpoint
assert np.float64(_F32(0.1)) == _START * 2.0**-31
assert np.float64(_F32(_F32(1.0) - _F32(0.1))) == _SPAN * 2.0**-31


def _pick(decade: jax.Array, values: list) -> jax.Array:
  """``values[decade]`` for each element (a chain of selects, no lookup)."""
  out = jnp.full(decade.shape, values[0])
  for i in range(1, len(values)):
    out = jnp.where(decade >= i, values[i], out)
  return out


class _Decade(NamedTuple):
  """Where a value lies in the map: its decade and the constants the decade uses."""

  log2_size: jax.Array  # k, the decade holding m = 2**k values
  factor: jax.Array     # float32(10**(decade - 6))


def _decade(log2_size: jax.Array, signed: bool) -> _Decade:
  decade = log2_size if signed else log2_size - 1
  return _Decade(log2_size, _pick(decade, [_factor(i) for i in range(_EXPONENTS)]))


def _point(j: jax.Array, decade: _Decade) -> jax.Array:
  """The decade's linspace point ``j`` (``0 <= j <= m``), times 2**31, in float32.

  An exact integer converted once: torchao's one rounding of ``start + j * step``
  below the middle point and of ``end - (m - j) * step`` from it.
  """
  k = decade.log2_size.astype(jnp.uint32)
  m = jnp.left_shift(jnp.uint32(1), k)
  step = jnp.right_shift(jnp.uint32(_SPAN), k)
  j = j.astype(jnp.uint32)
  low = jnp.uint32(_START) + step * j
  high = jnp.uint32(_END) - step * (m - j)
  return jnp.where(j < jnp.right_shift(m + 1, 1), low, high).astype(jnp.float32)


def _value(j: jax.Array, decade: _Decade) -> jax.Array:
  """The decade's value ``j``: ``factor * (p[j] + p[j + 1]) / 2`` in float32."""
  return decade.factor * ((_point(j, decade) + _point(j + 1, decade)) * _UNIT)


def _log2_floor(n: jax.Array) -> jax.Array:
  """``floor(log2(n))`` of positive integers (counting leading zeros)."""
  return (jnp.iinfo(n.dtype).bits - 1) - jax.lax.clz(n)


def map_values(codes: jax.Array, *, signed: bool, index_dtype: jax.typing.DTypeLike = jnp.int32
               ) -> jax.Array:
  """``table(signed)[codes]`` in float32, computed without a lookup (module docstring).

  Args:
    codes: uint8 codes.
    signed: which map.
    index_dtype: the signed integer type of the codes' arithmetic: ``int32``, or
      ``int16`` for the same values by a computation that XLA does not merge with the
      ``int32`` one.

  Returns:
    A float32 array of the codes' shape.
  """
  code = codes.astype(index_dtype)
  zero = _ZERO_CODE if signed else 0
  position = jnp.abs(code - zero)  # among the map's values above 0, from 1; 1.0 is last
  # Counted so that each decade starts at its size m (the unsigned decades hold 2, 4, ...).
  counted = jnp.maximum(position if signed else position + 1, 1)
  log2_size = _log2_floor(counted)
  value = _value(counted - jnp.left_shift(jnp.ones_like(counted), log2_size),
                 _decade(log2_size, signed))
  value = jnp.where(position == 0, _F32(0), jnp.where(position == 255 - zero, _F32(1), value))
  return jnp.where(code < zero, -value, value)


def _positive(signed: bool) -> np.ndarray:
  """The map's values above 0, sorted (1.0 last)."""
  values = table(signed)
  return values[values > 0]


def _decade_starts(signed: bool) -> list:
  """Each decade's smallest value (the first of its ``m`` values among the positive ones)."""
  offset = 0 if signed else 1
  return [_positive(signed)[_decade_size(i, signed) - offset - 1] for i in range(_EXPONENTS)]


def _count_at_least(x: jax.Array, bounds: list) -> jax.Array:
  """How many of ``bounds`` each element of ``x`` is at least (int32)."""
  count = jnp.zeros(x.shape, jnp.int32)
  for bound in bounds:
    count = count + (x >= bound).astype(jnp.int32)
  return count


def _codes(scaled: jax.Array, signed: bool) -> jax.Array:
  """torchao's codes of values already divided by their block scales (module docstring)."""
  nan = jnp.isnan(scaled)
  magnitude = jnp.where(nan, _F32(0), jnp.abs(scaled))
  starts = _decade_starts(signed)
  below_map = magnitude < starts[0]  # between 0 and the smallest value
  one = magnitude >= _F32(1)
  index = _count_at_least(magnitude, starts[1:])  # the decade, from 0
  offset = 0 if signed else 1
  decade = _decade(index + offset, signed)
  size = jnp.left_shift(jnp.ones_like(index), decade.log2_size)
  # The values of a decade lie near factor * (0.1 + (j + 0.5) * 0.9 / m), so this is j + 1/2
  # at the j-th value, within 1e-4 for every float32 (and any rounding of it): its floor is
  # the index of the largest value at most the magnitude, or one more.
  inverse = _pick(index, [_F32(1 / 10.0 ** (i - _EXPONENTS + 1)) for i in range(_EXPONENTS)])
  spacing = size.astype(jnp.float32) * _F32(1 / 0.9)
  estimate = jnp.clip(jnp.floor((magnitude * inverse - _F32(0.1)) * spacing).astype(jnp.int32),
                      0, size - 1)
  at_estimate = _value(estimate, decade)
  fits = at_estimate <= magnitude
  next_start = _pick(index, starts[1:] + [_F32(1)])
  above = jnp.where(estimate + 1 == size, next_start,
                    _value(jnp.minimum(estimate + 1, size - 1), decade))
  below = _value(jnp.maximum(estimate - 1, 0), decade)
  # The value at most the magnitude (low) and the next one (high), by their positions
  # among the map's values above 0 (from 1; the decade's first is at m, or m - 1 unsigned).
  position = size - offset + estimate - jnp.where(fits, 0, 1)
  low = jnp.where(fits, at_estimate, below)
  high = jnp.where(fits, above, at_estimate)
  top = 255 - (_ZERO_CODE if signed else 0)
  position = jnp.where(below_map, 0, jnp.where(one, top, position))
  low = jnp.where(below_map, _F32(0), jnp.where(one, _F32(1), low))
  high = jnp.where(below_map, starts[0], high)
  half_gap = (high - low) * _F32(0.5)
  up = (magnitude - low >= half_gap) & ~one
  rounded = position + up.astype(jnp.int32)
  if not signed:
    return jnp.where(nan | (scaled < 0), 0, rounded).astype(CODE_DTYPE)
  # A negative value's neighbours are -high (its code's) and -low; ties round toward zero.
  down = jnp.where(magnitude == low, position,
                   position + 1 - (high - magnitude >= half_gap).astype(jnp.int32))
  negative = jnp.where(magnitude > _positive(signed)[-2], 0, _ZERO_CODE - down)
  return jnp.where(nan, 0, jnp.where(scaled < 0, negative, _ZERO_CODE + rounded)
                   ).astype(CODE_DTYPE)


def encode(x: jax.Array, scale: jax.Array, *, signed: bool) -> jax.Array:
  """The uint8 codes of ``x`` divided by its block scales (``block_scales(x)``).

  Args:
    x: a float32 array.
    scale: its block scales.
    signed: which map.

  Returns:
    uint8 codes of ``x``'s shape.
  """
  spread = _spread(scale, x.shape)
  # XLA compiles x / broadcast(s) as x * broadcast(1 / s), which rounds twice. A divisor
  # that depends on x elementwise keeps the division: s + x * 0 is s for a finite x, and
  # NaN for an infinite or NaN x, whose quotient x / s is NaN anyway (s is then infinite
  # or NaN).
  return _codes(x / (spread + x * _F32(0)), signed)


def quantize(x: jax.Array, *, signed: bool, block_size: int) -> tuple[jax.Array, jax.Array]:
  """Codes and block scales of a float32 array (see the module docstring).

  Args:
    x: a float32 array whose size is a positive multiple of ``block_size``.
    signed: the signed map (any sign) or the unsigned one (non-negative values).
    block_size: values per scale.

  Returns:
    ``(codes, scale)``: uint8 codes of ``x``'s shape, float32 scales of
    :func:`scale_shape`.

  Raises:
    ValueError: if the size of ``x`` is not a positive multiple of ``block_size``.
  """
  scale = block_scales(x, block_size)
  return encode(x, scale, signed=signed), scale


def dequantize(codes: jax.Array, scale: jax.Array, *, signed: bool,
               index_dtype: jax.typing.DTypeLike = jnp.int32) -> jax.Array:
  """The float32 values ``map[codes] * scale`` of :func:`quantize`'s output.

  Args:
    codes: uint8 codes.
    scale: their float32 block scales, of ``scale_shape(codes.shape, block_size)``.
    signed: which map the codes index.
    index_dtype: as :func:`map_values`'s.

  Returns:
    A float32 array of the codes' shape.
  """
  values = map_values(codes, signed=signed, index_dtype=index_dtype)
  return values * _spread(scale, codes.shape)


__all__ = (
    "CODE_DTYPE",
    "MIN_SCALE",
    "SCALE_DTYPE",
    "SIGNED_MAP",
    "UNSIGNED_MAP",
    "dequantize",
    "map_values",
    "quantize",
    "scale_shape",
    "table",
)
