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
  nearest map value, ties upward. Here the code is the number of 255 precomputed
  thresholds at most ``x``, the same code for every float32 (``_thresholds``).
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

import jax
import jax.numpy as jnp
import numpy as np

CODE_DTYPE = np.dtype(np.uint8)
SCALE_DTYPE = np.dtype(np.float32)
MIN_SCALE = np.float32(1e-12)
_EXPONENTS = 7  # the decades 10**-6 .. 10**0
_F32 = np.float32


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


def _dynamic_map(signed: bool) -> np.ndarray:
  """The 256 sorted float32 values of the signed or unsigned dynamic map."""
  parts = [np.array([0.0, 1.0], _F32)]
  for i in range(_EXPONENTS):
    points = _linspace(2**i + 1 if signed else 2 ** (i + 1) + 1)
    midpoints = (points[:-1] + points[1:]) / _F32(2)
    decade = _F32(10.0 ** (i - _EXPONENTS + 1)) * midpoints
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


def _ordered(x: np.float32) -> int:
  """A float32 as an integer of the same order (-0.0 and 0.0 alike)."""
  bits = int(np.array(x, _F32).view(np.int32))
  return bits if bits >= 0 else -(bits & 0x7FFFFFFF)


def _from_ordered(k: int) -> np.float32:
  bits = k if k >= 0 else (-k) | 0x80000000
  return _F32(np.array(bits & 0xFFFFFFFF, np.uint32).view(_F32))


def _rounds_up(x: np.float32, below: np.float32, above: np.float32) -> bool:
  """torchao's rounding test between neighbouring map values, in float32."""
  return bool(_F32(x - below) >= _F32(above - below) * _F32(0.5))


def _thresholds(values: np.ndarray) -> np.ndarray:
  """``t[k - 1]``, for codes ``k = 1..255``: the smallest float32 whose code is ``k`` or more.

  torchao's code of ``x`` is ``c`` (the largest index with ``values[c] <= x``, or 0),
  plus one where ``x - values[c] >= (values[c + 1] - values[c]) * 0.5`` in float32.
  Within ``[values[c], values[c + 1]]`` that test switches once, from false to true
  (``x - values[c]`` rounds monotonically), so the code never decreases as ``x`` grows
  and is the number of thresholds at most ``x``; NaN is at most none, code 0, as in
  torchao. Each threshold is found by bisection over the float32 values of its interval.
  """
  out = []
  with np.errstate(over="ignore"):
    for below, above in zip(values[:-1], values[1:]):
      low, high = _ordered(below), _ordered(above)  # below never rounds up, above does
      while high - low > 1:
        mid = (low + high) // 2
        if _rounds_up(_from_ordered(mid), below, above):
          high = mid
        else:
          low = mid
      out.append(_from_ordered(high))
  return np.array(out, _F32)


_THRESHOLDS = {True: _thresholds(SIGNED_MAP), False: _thresholds(UNSIGNED_MAP)}


def block_scales(x: jax.Array, block_size: int) -> jax.Array:
  """The float32 scales of ``x``'s blocks: each block's largest magnitude, at least 1e-12.

  Raises:
    ValueError: if the size of ``x`` is not a positive multiple of ``block_size``.
  """
  return jnp.maximum(jnp.max(jnp.abs(_blocks(x, block_size)), axis=-1), MIN_SCALE)


def _scaled(x: jax.Array, scale: jax.Array) -> jax.Array:
  """``x`` divided by its block scales, in blocks (``scale.shape + (block_size,)``)."""
  blocks = x.reshape(*scale.shape, -1)
  # XLA compiles x / broadcast(s) as x * broadcast(1 / s), which rounds twice. A divisor
  # that depends on x elementwise keeps the division: s + x * 0 is s for a finite x,
  # and NaN for an infinite or NaN x, whose quotient x / s is NaN anyway (s is then
  # infinite or NaN).
  return blocks / (scale[..., None] + blocks * _F32(0))


def _padded(signed: bool) -> np.ndarray:
  """The thresholds indexed by code: ``[-inf, t(1), ..., t(255)]``."""
  return np.concatenate([[-np.inf], _THRESHOLDS[signed]]).astype(_F32)


def coarse_codes(x: jax.Array, scale: jax.Array, *, signed: bool) -> jax.Array:
  """The codes of ``x`` (divided by ``scale``) rounded down to a multiple of 16, as uint8.

  The first of :func:`encode`'s two steps: how many of every 16th threshold are at most
  the value, times 16 (at most 240).
  """
  padded = _padded(signed)
  scaled = _scaled(x, scale)
  group = sum((scaled >= padded[16 * j]).astype(jnp.uint8) for j in range(1, 16))
  return (group * jnp.uint8(16)).reshape(x.shape)


def encode(x: jax.Array, scale: jax.Array, *, signed: bool,
           coarse: jax.Array | None = None) -> jax.Array:
  """The uint8 codes of ``x`` divided by its block scales (``block_scales(x)``).

  torchao finds a code by a binary search through the map and rounds it; the number of
  thresholds at most the value is the same code (``_thresholds``). It is counted in two
  steps of 15 comparisons: against every 16th threshold (:func:`coarse_codes`), then
  against the 15 after the last one passed, looked up by the first count. XLA's GPU
  compiler fuses neither a chain of lookups (a search) nor 255 comparisons into one
  pass with the values' computation, nor a lookup whose index that pass computes;
  given ``coarse`` from a pass of its own, it fuses the rest.

  Args:
    x: a float32 array.
    scale: its block scales.
    signed: which map.
    coarse: ``coarse_codes(x, scale, signed=signed)``, if computed already.

  Returns:
    uint8 codes of ``x``'s shape.
  """
  if coarse is None:
    coarse = coarse_codes(x, scale, signed=signed)
  scaled = _scaled(x, scale)
  first = coarse.reshape(scaled.shape)
  table = jnp.asarray(_padded(signed))
  fine = sum((scaled >= jnp.take(table, first + jnp.uint8(i), mode="clip")).astype(jnp.uint8)
             for i in range(1, 16))  # first + 15 is at most 255
  return (first + fine).reshape(x.shape)


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


def dequantize(codes: jax.Array, scale: jax.Array, *, signed: bool) -> jax.Array:
  """The float32 values ``map[codes] * scale`` of :func:`quantize`'s output.

  Args:
    codes: uint8 codes.
    scale: their float32 block scales, of ``scale_shape(codes.shape, block_size)``.
    signed: which map the codes index.

  Returns:
    A float32 array of the codes' shape.
  """
  values = jnp.take(jnp.asarray(table(signed)), codes.astype(jnp.int32))
  # The scales' shape is the codes' leading axes and then the blocks (scale_shape).
  return (values.reshape(*scale.shape, -1) * scale[..., None]).reshape(codes.shape)


__all__ = (
    "CODE_DTYPE",
    "MIN_SCALE",
    "SCALE_DTYPE",
    "SIGNED_MAP",
    "UNSIGNED_MAP",
    "dequantize",
    "quantize",
    "scale_shape",
    "table",
)
