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
  most ``x`` (0 below the map; a branchless binary search, as torchao's), then
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


def _search(x: jax.Array, values: jax.Array) -> jax.Array:
  """The index of the largest map value ``<= x`` (0 if none, or for NaN), as torchao's."""
  codes = jnp.where(x >= values[128], 128, 0)
  for step in (64, 32, 16, 8, 4, 2, 1):
    codes = codes + jnp.where(x >= jnp.take(values, codes + step), step, 0)
  return codes


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
  blocks = _blocks(x, block_size)
  scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), MIN_SCALE)
  # XLA compiles x / broadcast(s) as x * broadcast(1 / s), which rounds twice. A divisor
  # that depends on x elementwise keeps the division: s + x * 0 is s for a finite x,
  # and NaN for an infinite or NaN x, whose quotient x / s is NaN anyway (s is then
  # infinite or NaN).
  scaled = blocks / (scale[..., None] + blocks * _F32(0))
  values = jnp.asarray(table(signed))
  codes = _search(scaled, values)
  up = jnp.minimum(codes + 1, 255)
  below, above = jnp.take(values, codes), jnp.take(values, up)
  codes = jnp.where(scaled - below >= (above - below) * _F32(0.5), up, codes)
  return codes.astype(CODE_DTYPE).reshape(x.shape), scale


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
