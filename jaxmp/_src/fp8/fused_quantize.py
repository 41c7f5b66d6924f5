"""One pass over a tensor for its fp8 codes in both layouts and its amax (Mosaic GPU).

On Hopper, cuBLASLt's fp8 GEMMs read both operands with the contracted dimension minor
(:attr:`~jaxmp._src.fp8.chips.Target.k_major_fp8`), so every tensor of a Dense layer's
fp8 step is needed in two layouts: the input ``x`` ``(T, K)`` row-major for the forward
GEMM and transposed ``(K, T)`` for the weight gradient's, the output gradient ``g``
``(T, N)`` row-major for the input gradient's and transposed for the weight
gradient's, the kernel ``(K, N)`` transposed for the forward GEMM and row-major for
the input gradient's. XLA makes the transposed copies with fusions that cast and
transpose, which an H200 ran at 0.3-1.8 TB/s where its other fusions reached 3-4.4
(benchmarks/RESULTS.md). This module's kernel reads the tensor once and writes

- its codes ``quantize(x, fp8_dtype, scale)`` (:func:`~jaxmp._src.fp8.quantize.quantize`,
  the same formula: :func:`~jaxmp._src.fp8.quantize.saturate` of the float32 quotient),
- the same codes transposed, ``codes.T`` of the 2-D view ``(rows, cols)`` (leading
  dimensions flattened into the rows),
- its amax ``max|x|`` in float32 (:func:`~jaxmp._src.fp8.quantize.amax`): delayed
  scaling records it in its history in the same pass.

**The kernel** (Pallas, Mosaic GPU back end): a grid of ``128 x 128`` tiles
(:data:`TILE`), one warpgroup per tile. Pallas' pipeline loads each tile into shared
memory with TMA (``cp.async.bulk.tensor``); the warpgroup reads it into registers in
the ``WGMMA`` layout, computes the codes (``cvt.rn.satfinite.e4m3x2.f32`` or its E5M2
form), stores them to a shared-memory tile that TMA writes out, converts the input
tile's registers to the ``WGMMA_TRANSPOSED`` layout (one warp shuffle per register:
each thread then holds, for every ``2 x 2`` block, one column instead of one row),
computes the codes again from those and stores them through a transposed view of
the second output tile, which TMA writes at the transposed tile position. The tile's
amax (a NaN-propagating ``max``) goes to one float32 per tile, and XLA reduces those
(``rows * cols / 16384`` values). The arithmetic is the XLA fusion's on the same chip
(compiled for an H100, both use ``div.full.f32``, ``min.NaN.f32``/``max.NaN.f32`` and
``cvt.rn.satfinite``), so the codes and amax are XLA's bit for bit; a NaN code is a
NaN, whatever its sign bit. One difference in form: for E5M2, Mosaic GPU contracts
:func:`~jaxmp._src.fp8.quantize.saturate`'s ``clipped + x * 2**-126`` into one
``fma.rn.f32`` where XLA rounds the product first (``mul.rn``, ``add.rn``). Both sums
round back to ``clipped`` (or stay inf or NaN) under saturate's own condition, a scale
below ``2**101``, so the codes are the same there too.

**Shapes.** Both dimensions of the 2-D view must be multiples of the tile
(:func:`supports`); other shapes are refused (a padded copy would cost the pass this
kernel saves), and the caller keeps XLA's path for them.

**Interpret mode** (``interpret=True``, any platform; for tests and doctests): Pallas'
interpreter runs the same kernel body on each tile, with the register layouts left to
it (no layout casts), the transposed tile stored as the tile's ``.T``, and the shared
memory tiles unswizzled. The tiling, the transposed tile positions and the amax
reduction are the kernel's. (Mosaic GPU's own interpreter, ``InterpretGPUParams``, takes
no kernel whose blocks are windows of a larger array, as these are, in jax 0.10.2.)

Where it is used is a chip's table entry (:attr:`~jaxmp._src.fp8.chips.Target.fused_quantize`,
off for every chip until a device measures it faster than XLA's fusions):
``fp8_dot_general``'s per-tensor op (:mod:`~jaxmp._src.fp8.dot_general`) then quantizes
a Dense product's input and output gradient with :func:`quantize`, and the weight
gradient's GEMM reads both transposed codes as written. The weight stays XLA's: a
float32 parameter is cast on its way in, and XLA quantizes it in that same pass.

Measured figures: none yet (no device has run it; ``benchmarks/bench_quantize.py``'s
``fused`` variant measures it against XLA's fusions, ``gpu_measure.py``'s "fp8
per-tensor, fused quantize + causal attention" the Llama layer's step).

Example:
  >>> from jaxmp._src.fp8 import fused_quantize, quantize as q
  >>> x = jnp.arange(128 * 256, dtype=jnp.float32).reshape(128, 256) / 64 - 200
  >>> codes, transposed, amax = fused_quantize.quantize_2d(
  ...     x, q.E4M3, jnp.float32(0.5), interpret=True)
  >>> bool((codes == q.quantize(x, q.E4M3, 0.5)).all()), bool((transposed == codes.T).all())
  (True, True)
  >>> amax
  Array(311.98438, dtype=float32)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src import jax_compat
from jaxmp._src.fp8 import quantize as q

F32 = np.dtype(np.float32)

TILE = (128, 128)
"""The ``(rows, cols)`` tile one warpgroup quantizes: the smallest whose fp8 codes fill
whole 128-byte swizzled rows in both layouts (TMA's widest swizzle)."""

INPUT_DTYPES = (np.dtype(jnp.bfloat16), F32)
"""What the kernel reads: bfloat16 or float32 (its register transpose moves 16- or
32-bit values)."""

SWIZZLE = 128
"""Bytes per swizzled shared-memory row (TMA's widest; no bank conflicts)."""


class Quantized(NamedTuple):
  """A tensor's fp8 codes in both layouts, and its amax.

  Attributes:
    codes: the codes, in the tensor's shape.
    transposed: the codes of the 2-D view ``(rows, cols)``, transposed: ``(cols, rows)``.
    amax: ``max|x|``, float32.
  """

  codes: jax.Array
  transposed: jax.Array
  amax: jax.Array


def view_2d(shape: Sequence[int]) -> tuple[int, int]:
  """The ``(rows, cols)`` a tensor is quantized as: its leading dimensions flattened.

  Example:
    >>> jaxmp._src.fp8.fused_quantize.view_2d((4, 32, 256))
    (128, 256)
  """
  return math.prod(shape[:-1]), shape[-1]


def supports(shape: Sequence[int], dtype: Any) -> bool:
  """Whether the kernel quantizes a tensor of ``shape`` and ``dtype``.

  At least two dimensions, bfloat16 or float32, and both dimensions of the 2-D view
  (:func:`view_2d`) positive multiples of :data:`TILE`.

  Example:
    >>> from jaxmp._src.fp8 import fused_quantize
    >>> fused_quantize.supports((2, 64, 256), jnp.bfloat16), fused_quantize.supports(
    ...     (100, 256), jnp.bfloat16)
    (True, False)
  """
  if len(shape) < 2 or np.dtype(dtype) not in INPUT_DTYPES:
    return False
  rows, cols = view_2d(shape)
  return rows > 0 and cols > 0 and rows % TILE[0] == 0 and cols % TILE[1] == 0


def available() -> bool:
  """Whether the installed JAX has the Mosaic GPU pieces the kernel uses
  (:func:`~jaxmp._src.jax_compat.pallas_mosaic_gpu`)."""
  return jax_compat.pallas_mosaic_gpu() is not None


def _codes(x: jax.Array, scale: jax.Array, fp8_dtype: Any) -> jax.Array:
  """:func:`~jaxmp._src.fp8.quantize.quantize`'s formula, on one tile's values."""
  x = x.astype(F32)
  return q.saturate(x / scale, x, fp8_dtype)


def _kernel(scale_ref, x_ref, codes_ref, transposed_ref, amax_ref, *, fp8_dtype, interpret):
  """One tile: its codes, its codes transposed, its amax (see the module docstring)."""
  plgpu = None if interpret else jax_compat.pallas_mosaic_gpu()
  x = x_ref[...]
  if plgpu is not None:
    x = plgpu.layout_cast(x, plgpu.Layout.WGMMA)
  scale = scale_ref[0]
  codes_ref[...] = _codes(x, scale, fp8_dtype)
  if plgpu is None:
    transposed_ref[...] = _codes(x, scale, fp8_dtype).T
  else:
    # The register transpose moves the input's 16- or 32-bit values (not the 8-bit
    # codes), and the codes are computed again from them: the ALUs have time to
    # spare in a kernel bound by memory.
    x_t = plgpu.layout_cast(x, plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.transpose_ref(transposed_ref, (1, 0))[...] = _codes(x_t, scale, fp8_dtype)
  # Mosaic GPU reduces one axis at a time; max is exact, so the order does not matter.
  magnitudes = jnp.abs(x.astype(F32))
  pallas = _pallas()
  amax_ref[pallas.program_id(0), pallas.program_id(1)] = jnp.max(
      jnp.max(magnitudes, axis=1), axis=0)


def _tiled(dtype: Any, plgpu: Any) -> tuple:
  """Shared-memory transforms of a tile: 128-byte swizzled rows, (8, row) tiles."""
  if plgpu is None:
    return ()
  per_row = SWIZZLE // np.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, per_row)), plgpu.SwizzleTransform(SWIZZLE))


def quantize_2d(x: jax.Array, fp8_dtype: Any, scale: jax.Array, *, interpret: bool = False,
                tile: tuple[int, int] = TILE) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The kernel: ``(codes, codes.T, amax)`` of a 2-D ``x``, in one pass.

  Args:
    x: ``(rows, cols)``, bfloat16 or float32, both multiples of ``tile``.
    fp8_dtype: ``E4M3`` or ``E5M2``.
    scale: the dequantization multiplier, a float32 scalar (> 0, as ``quantize``'s).
    interpret: run in Pallas' interpreter (any platform; see the module docstring).
    tile: the tile of one warpgroup, :data:`TILE` by default; multiples of 128.

  Returns:
    ``(codes (rows, cols), transposed (cols, rows), amax)``.

  Raises:
    ValueError: for a shape, dtype or tile the kernel does not take, naming what it takes.
    RuntimeError: compiling (not interpreting) with a JAX whose Mosaic GPU back end
      lacks what the kernel uses (:func:`available`).
  """
  x = jnp.asarray(x)
  fp8_dtype = np.dtype(fp8_dtype)
  q.fp8_max(fp8_dtype)  # an fp8 dtype, or a ValueError saying so
  if x.ndim != 2 or not supports(x.shape, x.dtype) or any(
      n % t for n, t in zip(x.shape, tile)) or any(t % TILE[0] for t in tile):
    raise ValueError(
        f"fused_quantize: the kernel takes a 2-D bfloat16 or float32 array whose dimensions "
        f"are multiples of the tile {tile} (tiles multiples of {TILE[0]}), got shape "
        f"{tuple(x.shape)} of dtype {x.dtype} with tile {tuple(tile)}; quantize other "
        "shapes with jaxmp._src.fp8.quantize.quantize.")
  plgpu = None if interpret else jax_compat.pallas_mosaic_gpu()
  if plgpu is None and not interpret:
    raise RuntimeError(
        f"fused_quantize: {jax_compat.jax_version()} has no usable Pallas Mosaic GPU back end "
        f"({jax_compat.PALLAS_MOSAIC_GPU_NAMES_TEXT}); check fused_quantize.available() "
        "first.")
  spec_of = _block_specs(plgpu)
  rows, cols = x.shape
  grid = (rows // tile[0], cols // tile[1])
  row_block, col_block = tile
  codes, transposed, partial_amax = _pallas().pallas_call(
      functools.partial(_kernel, fp8_dtype=fp8_dtype, interpret=interpret),
      out_shape=(jax.ShapeDtypeStruct((rows, cols), fp8_dtype),
                 jax.ShapeDtypeStruct((cols, rows), fp8_dtype),
                 jax.ShapeDtypeStruct(grid, F32)),
      grid=grid,
      in_specs=[spec_of.whole(), spec_of.tile((row_block, col_block), lambda i, j: (i, j),
                                              x.dtype)],
      out_specs=(spec_of.tile((row_block, col_block), lambda i, j: (i, j), fp8_dtype),
                 spec_of.tile((col_block, row_block), lambda i, j: (j, i), fp8_dtype),
                 spec_of.whole()),
      compiler_params=None if plgpu is None else plgpu.CompilerParams(),
      interpret=interpret,
      name="jaxmp_fused_fp8_quantize",
  )(jnp.reshape(jnp.asarray(scale, F32), (1,)), x)
  return codes, transposed, jnp.max(partial_amax)


class _Specs(NamedTuple):
  whole: Any  # () -> a BlockSpec of a whole array left in global memory
  tile: Any  # (block, index_map, dtype) -> a BlockSpec of a tile in shared memory


def _block_specs(plgpu: Any) -> _Specs:
  """How :func:`quantize_2d` describes its blocks: Mosaic GPU's ``BlockSpec`` with
  swizzled tiles where it compiles, Pallas' plain ``BlockSpec`` where it interprets."""
  pallas = _pallas()
  if plgpu is None:
    return _Specs(lambda: pallas.BlockSpec(memory_space=pallas.ANY),
                  lambda block, index_map, dtype: pallas.BlockSpec(block, index_map))
  return _Specs(lambda: pallas.BlockSpec(memory_space=plgpu.GMEM),
                lambda block, index_map, dtype: plgpu.BlockSpec(
                    block, index_map, transforms=_tiled(dtype, plgpu)))


def _pallas():
  """``jax.experimental.pallas``, imported on first use (it is not needed to import jaxmp)."""
  from jax.experimental import pallas  # pylint: disable=g-import-not-at-top
  return pallas


def _xla(x: jax.Array, scale: jax.Array, *, fp8_dtype: Any) -> Quantized:
  """What XLA computes without the kernel: the same three values."""
  codes = q.quantize(x, fp8_dtype, scale)
  return Quantized(codes, jnp.reshape(codes, view_2d(x.shape)).T, q.amax(x))


def _on_cuda(x: jax.Array, scale: jax.Array, *, fp8_dtype: Any) -> Quantized:
  codes, transposed, amax = quantize_2d(jnp.reshape(x, view_2d(x.shape)), fp8_dtype, scale)
  return Quantized(jnp.reshape(codes, x.shape), transposed, amax)


@functools.cache
def _kernel_unless_batched(fp8_dtype: np.dtype) -> Any:
  """:func:`_on_cuda`, with XLA's path under ``vmap``: Mosaic GPU lowers no batched
  ``pallas_call`` (jax 0.10.2 asserts that its grid has no vmapped dimension)."""

  @jax.custom_batching.custom_vmap
  def run(x, scale):
    return tuple(_on_cuda(x, scale, fp8_dtype=fp8_dtype))

  @run.def_vmap
  def _batched(axis_size, in_batched, x, scale):
    x, scale = (v if batched else jnp.broadcast_to(v, (axis_size, *v.shape))
                for v, batched in zip((x, scale), in_batched))
    out = jax.vmap(functools.partial(_xla, fp8_dtype=fp8_dtype))(x, scale)
    return tuple(out), (True, True, True)

  return run


def quantize(x: jax.Array, fp8_dtype: Any, scale: jax.Array) -> Quantized:
  """``x``'s codes in both layouts and its amax: the kernel on CUDA, XLA elsewhere.

  A ``lax.platform_dependent`` choice, so a function traced with the kernel still lowers
  for any platform; off CUDA the values are XLA's (the same values), and so they are
  under ``vmap`` (Mosaic GPU lowers no batched kernel).

  Args:
    x: a tensor :func:`supports` takes.
    fp8_dtype: ``E4M3`` or ``E5M2``.
    scale: a float32 scalar scale.

  Returns:
    A :class:`Quantized`.

  Raises:
    ValueError: for a tensor :func:`supports` does not take.

  Example:
    >>> from jaxmp._src.fp8 import fused_quantize, quantize as q
    >>> out = fused_quantize.quantize(jnp.ones((2, 64, 128)), q.E5M2, jnp.float32(2.0))
    >>> out.codes.shape, out.transposed.shape, out.amax
    ((2, 64, 128), (128, 128), Array(1., dtype=float32))
  """
  if not supports(x.shape, x.dtype):
    raise ValueError(
        f"fused_quantize: a tensor of shape {tuple(x.shape)} and dtype {x.dtype} is not one the "
        f"kernel takes (bfloat16 or float32, leading dimensions times the last both multiples "
        f"of {TILE[0]}).")
  fp8_dtype = np.dtype(dtypes_lib.float_format(fp8_dtype).dtype)
  scale = jnp.asarray(scale, F32)
  return Quantized(*jax.lax.platform_dependent(
      x, scale, cuda=_kernel_unless_batched(fp8_dtype),
      default=lambda x, scale: tuple(_xla(x, scale, fp8_dtype=fp8_dtype))))


__all__ = ("INPUT_DTYPES", "SWIZZLE", "TILE", "Quantized", "available", "quantize",
           "quantize_2d", "supports", "view_2d")
