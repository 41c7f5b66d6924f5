"""A block-scaled fp8 GEMM that runs on Hopper's fp8 tensor cores (DeepGEMM's scheme).

``BlockScaling``'s scales vary along the contracted dimension, one per 128 elements,
so no fp8 GEMM of XLA's can apply them in its epilogue. DeepSeek-V3's kernels
(DeepGEMM) apply them while accumulating: for every 128-element block of the
contracted dimension the tensor cores multiply the fp8 tiles into a fresh float32
partial product, which is multiplied by the block's scales and added to a float32
accumulator on the CUDA cores. This module is that kernel, written in Pallas for the
Triton back end: for canonical operands ``a`` ``(B, P, C)`` and ``b`` ``(B, Q, C)``
with one scale per row and 128-element block (``a.scale`` ``(B, P, C / 128)``; ``b``'s
``128 x 128`` block scales are repeated to one per row),

  ``out[p, q] = sum_k  a.scale[p, k] * b.scale[q, k] * (a[p, kblk] . b[q, kblk])``

in float32, rounded once to the output dtype. Every product of two fp8 values is exact
in float32; the only difference from the dequantized GEMM is the order and precision of
the sums: within a block, the tensor cores' own accumulation (on Hopper, fewer bits
than float32 keeps, as in DeepSeek-V3, which promotes to float32 every 128 elements
for that reason), across blocks a float32 sum of the scaled partial products.

**What makes it an fp8 GEMM.** Triton lowers an fp8 ``tt.dot`` to Hopper's ``wgmma``
(fp8 operands, float32 accumulator) only if the dot may accumulate at least 32 products
in the tensor cores' own precision (its ``max_num_imprecise_acc``); Pallas' own
``dot`` leaves that at 0, and the dot is then an Ampere-style ``mma.sync`` on operands
widened to float16 (compiled for an H100: 128 ``mma.sync...f16`` and 192
``cvt.rn.f16x2.e4m3x2`` instead of 4 ``wgmma...e4m3.e4m3`` per block). So the kernel's
dot is a primitive of this module whose Triton lowering rule asks for 128 (one block,
promoted to float32 after it, DeepGEMM's choice). The rule is registered with Pallas
when a kernel is first traced for Triton (not on import, nor in interpret mode); it
uses Pallas' Triton lowering module, which is not public API.

**Its schedule** (measured on an H200, benchmarks/RESULTS.md: 0.94-1.03x a bf16 GEMM at
the Llama-3-8B layer's shapes, from 0.71-0.86x before): each block's scales are loaded
as vectors, the next block's before this block's ``wgmma`` is issued; a 128 x 128-blocked
weight has one scale per tile; three pipeline stages; and programs run 16 column
tiles at a time. What keeps it from beating bf16: Triton waits for each block's
``wgmma`` before scaling it, so the scaling never overlaps the tensor cores' work
(DeepGEMM overlaps them with two warpgroups taking turns).

**Its place.** jaxmp's other kernel for the same product,
:mod:`~jaxmp._src.fp8.block_gemm_mosaic`, is written for Pallas' Mosaic GPU back end,
the Triton back end's successor (deprecated from jax 0.11), with what this one lacks:
TMA loads, a producer warpgroup and two math warpgroups taking turns. This kernel is
kept as the fallback: it is the one measured on a chip, so the chip table
(:data:`~jaxmp._src.fp8.chips.HOPPER_BLOCK_FP8_KERNELS`) runs it first on Hopper until
a GPU measures the Mosaic kernel at least as fast; after that, it runs where this JAX's
Mosaic GPU API lacks a name the other kernel uses (that API is experimental and
changes between releases), for as long as this JAX has the private Triton pieces it
needs (:func:`available`).

Example:
  >>> from jaxmp._src.fp8 import block_gemm, grouped, quantize as q
  >>> x = jnp.ones((1, 2, 128))
  >>> a = grouped.quantize(x, grouped.Grouping(1, 128), q.E4M3, jnp.full((1, 2, 1), 0.5))
  >>> b = grouped.quantize(x, grouped.Grouping(1, 128), q.E4M3, jnp.full((1, 2, 1), 2.0))
  >>> block_gemm.gemm(a, b, grouped.Grouping(1, 128), jnp.float32, interpret=True)
  Array([[[128., 128.],
          [128., 128.]]], dtype=float32)
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.core
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from jaxmp._src import jax_compat
from jaxmp._src.fp8 import grouped

BLOCK = 128
"""The contracted block of the kernel: the recipes' ``block_size`` it runs."""

TILE = (64, 128)
"""The output tile each program computes (rows of ``a``, rows of ``b``).

One warpgroup multiplies it with ``wgmma`` m64n128k32. Measured on an H200 at the
Llama-3-8B layer's GEMMs (benchmarks/RESULTS.md, ``bench_block_gemm.py``) it ran as fast
as 128 x 128 tiles on two warpgroups (8 warps) or faster, and 1.2-1.9x faster than
64 x 256 or 128 x 256 ones.
"""

NUM_WARPS = 4
"""One warpgroup (``wgmma`` is issued by 4 warps together)."""

NUM_STAGES = 3
"""Triton's software pipelining depth: loads of the next blocks overlap the current one.

Three stages (72 KiB of shared memory per program) beat two and four on an H200 at the
Llama layer's GEMMs (0.98-1.00x bf16's speed against 0.94x and 0.91x, geometric means).
"""

GROUP_COLUMNS = 16
"""Column tiles whose programs run together (:func:`_grouped_order`).

Measured on an H200 at the Llama layer's GEMMs: 4, 8 and 16 within 2% of one another
(16 the fastest), and 2-8% faster than one column at a time, by shape.
"""

IMPRECISE_ACCUMULATION = BLOCK
"""Products the tensor cores may sum in their own precision before float32 (one block)."""

F32 = np.dtype(np.float32)
_CANONICAL_2D = (((1,), (1,)), ((), ()))


def supports(recipe: Any) -> bool:
  """Whether a ``BlockScaling`` GEMM runs as this kernel on a Hopper GPU.

  For ``block_size`` :data:`BLOCK`, and scales that are not rounded to powers of two:
  power-of-two scales make the bfloat16 GEMM on dequantized operands exact, and on an
  H200 a bfloat16 GEMM ran as fast as this kernel or up to 1.2x faster (0.94-1.03x at
  the forward GEMMs, 0.83-0.95x at the weight gradient's; benchmarks/RESULTS.md), while
  the float32 GEMM that other scales need instead is several times slower.
  And only where this JAX has the Pallas Triton internals the kernel's dot uses
  (:func:`available`).
  """
  return recipe.block_size == BLOCK and not recipe.power_of_two and available()


def available() -> bool:
  """Whether this JAX has what the kernel's dot is built from (private Pallas modules).

  Pallas' Triton lowering rules, and Triton's ``tt.dot`` builder taking
  ``max_num_imprecise_acc`` (:func:`jaxmp._src.jax_compat.pallas_triton`, checked once).
  Where a JAX release moves them, ``BlockScaling`` keeps the dequantized GEMM (and says
  so in its fallback warning) rather than failing.
  """
  return jax_compat.pallas_triton() is not None


@functools.cache
def _fp8_dot_primitive() -> jax.extend.core.Primitive:
  """``(m, k) x (n, k) -> (m, n)`` float32, lowered by Triton to an fp8 ``wgmma`` on Hopper.

  Built and registered with Pallas' Triton lowering once, on first use.
  """
  # Private modules: Pallas has no public way to set a dot's max_num_imprecise_acc.
  internals = jax_compat.pallas_triton()
  assert internals is not None  # only built where available() (supports) said so
  triton_lowering, tt, ir = internals

  primitive = jax.extend.core.Primitive("jaxmp_fp8_block_dot")
  primitive.def_abstract_eval(
      lambda a, b: jax.core.ShapedArray((a.shape[0], b.shape[0]), F32))

  def lower(ctx, a, b):
    del ctx
    b = tt.trans(b, (1, 0))  # (k, n): tt.dot's layout; Triton keeps both K-major for wgmma
    m, n = ir.RankedTensorType(a.type).shape[0], ir.RankedTensorType(b.type).shape[1]
    zeros = triton_lowering._zeros(ir.RankedTensorType.get([m, n], ir.F32Type.get()))  # pylint: disable=protected-access
    return tt.dot(a, b, zeros, max_num_imprecise_acc=IMPRECISE_ACCUMULATION)

  triton_lowering.register_lowering(primitive)(lower)
  return primitive


def _triton_dot(a: jax.Array, b: jax.Array) -> jax.Array:
  return _fp8_dot_primitive().bind(a, b)


def _reference_dot(a: jax.Array, b: jax.Array) -> jax.Array:
  return jax.lax.dot_general(a, b, _CANONICAL_2D, preferred_element_type=F32)


def _kernel(a_ref, b_ref, sa_ref, sb_ref, out_ref, *, blocks: int, dot, prefetch: bool):
  """One ``TILE`` of the product: a float32 sum over the contracted blocks."""
  pallas = _pallas()

  def block_scales(k):
    # As vectors (a's one per row, b's one per column or per tile): each thread then
    # loads its few distinct scales, not one scale per accumulator element (128 loads
    # per block in PTX when read as a (64, 1) column and a (1, 128) row).
    return sa_ref[:, k], sb_ref[k, :]

  def scaled_block(k, scales):
    cols = pallas.ds(k * BLOCK, BLOCK)
    partial = dot(a_ref[:, cols], b_ref[:, cols])
    sa, sb = scales
    return partial * (sa[:, None] * sb[None, :])  # the outer product scales the block

  def step(k, carry):
    acc, scales = carry
    if prefetch:
      # The next block's scales are loaded before this block's GEMM is issued, so their
      # latency hides behind the tensor cores' work.
      this, scales = scales, block_scales(jnp.minimum(k + 1, blocks - 1))
    else:
      this = block_scales(k)
    return acc + scaled_block(k, this), scales

  acc, _ = jax.lax.fori_loop(0, blocks, step,
                             (jnp.zeros(out_ref.shape, F32), block_scales(0)))
  out_ref[...] = acc.astype(out_ref.dtype)


def _grouped_order(tiles_p: int, tiles_q: int, group: int):
  """Maps a program's number to its ``(row tile, column tile)``, ``group`` columns at a time.

  Programs start roughly in order of their number. Consecutive ones share ``group``
  column tiles of ``b`` and sweep ``a``'s row tiles, so a wave of programs reads a few
  tiles of each operand, not one tile of ``b`` and all of ``a`` (which at the
  Llama layer's down projection, 8192 x 14336 in fp8, is larger than the L2 and would
  come from HBM once per column tile). ``group=1`` sweeps all rows for each column.
  """
  def order(t):
    per_group = group * tiles_p
    first = (t // per_group) * group
    columns = jnp.minimum(tiles_q - first, group)
    within = t % per_group
    return within // columns, first + within % columns
  return order


def _pallas():
  """``jax.experimental.pallas``, imported on first use (it is not needed to import jaxmp)."""
  from jax.experimental import pallas  # pylint: disable=g-import-not-at-top
  return pallas


def gemm(a: grouped.Quantized, b: grouped.Quantized, grouping_b: grouped.Grouping,
         out_dtype: Any, *, interpret: bool = False, tile: tuple[int, int] = TILE,
         num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
         one_b_scale_per_tile: bool = True, group_columns: int = GROUP_COLUMNS,
         prefetch: bool = True) -> jax.Array:
  """``(B, P, C) x (B, Q, C) -> (B, P, Q)`` of two block-scaled fp8 operands.

  ``a`` is tiled ``1 x 128`` (activations, gradients), ``b`` ``1 x 128`` or ``128 x 128``
  (weights); both padded along ``C`` to whole blocks, as :func:`~.grouped.quantize`
  leaves them. Rows are padded to whole tiles here (the product is sliced back).

  Args:
    a: the first operand (``grouped.Quantized``, ``Grouping(1, 128)``).
    b: the second operand.
    grouping_b: ``b``'s grouping, ``Grouping(1, 128)`` or ``Grouping(128, 128)``.
    out_dtype: the product's dtype (the float32 accumulator is rounded once to it).
    interpret: run the kernel in Pallas' interpreter, with an ordinary float32 dot in
      place of the tensor-core one (any platform; for tests).
    tile: the output tile of one program, :data:`TILE` by default (benchmarks try
      others; ``wgmma`` wants multiples of 64 rows with 4 warps per 64).
    num_warps: Triton's warps per program.
    num_stages: Triton's pipelining depth.
    one_b_scale_per_tile: load ``b``'s scales as one per block and tile (for a
      ``128 x 128``-blocked ``b`` whose blocks are the tile's columns) rather than
      repeated per row: the same products, bit for bit, with one scale loaded per
      block instead of ``tile[1]`` and one multiplication per element fewer (with
      ``prefetch``, 0.99-1.07x the speed without it on an H200, by shape). Where
      ``b``'s blocks are not the tile's columns (a ``b`` tiled ``1 x 128``, a wider
      tile), its scales stay one per row.
    group_columns: column tiles whose programs run together (:func:`_grouped_order`).
    prefetch: load the next block's scales before this block's GEMM is issued (1.1x
      faster on an H200 than loading them after it).

  Returns:
    ``(B, P, Q)`` in ``out_dtype``, ``P`` and ``Q`` as ``a`` and ``b`` hold them.
  """
  pallas = _pallas()
  batch, p, c = a.data.shape
  q_ = b.data.shape[1]
  tile_p, tile_q = tile
  rows_p, rows_q = -(-p // tile_p) * tile_p, -(-q_ // tile_q) * tile_q
  blocks = c // BLOCK
  sa = grouped.pad_rows(a.scale, rows_p)                                  # (B, P', C/128)
  if one_b_scale_per_tile and grouping_b.rows == tile_q:
    sb, sb_columns = jnp.swapaxes(b.scale, 1, 2), 1                # (B, C/128, Q'/128)
  else:
    sb, sb_columns = jnp.swapaxes(grouped.row_scales(b, grouping_b, rows_q), 1, 2), tile_q
  kernel = functools.partial(_kernel, blocks=blocks, prefetch=prefetch,
                             dot=_reference_dot if interpret else _triton_dot)
  tiles_p, tiles_q = rows_p // tile_p, rows_q // tile_q
  order = _grouped_order(tiles_p, tiles_q, group_columns)  # t -> (row tile, column tile)
  out = pallas.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((batch, rows_p, rows_q), out_dtype),
      grid=(batch, tiles_p * tiles_q),
      in_specs=[
          pallas.BlockSpec((None, tile_p, c), lambda n, t: (n, order(t)[0], 0)),
          pallas.BlockSpec((None, tile_q, c), lambda n, t: (n, order(t)[1], 0)),
          pallas.BlockSpec((None, tile_p, blocks), lambda n, t: (n, order(t)[0], 0)),
          pallas.BlockSpec((None, blocks, sb_columns), lambda n, t: (n, 0, order(t)[1])),
      ],
      out_specs=pallas.BlockSpec((None, tile_p, tile_q), lambda n, t: (n, *order(t))),
      compiler_params=_compiler_params(num_warps, num_stages),
      interpret=interpret,
      name="jaxmp_block_fp8_gemm",
  )(grouped.pad_rows(a.data, rows_p), grouped.pad_rows(b.data, rows_q), sa, sb)
  return out[:, :p, :q_]


def _compiler_params(num_warps: int, num_stages: int) -> Any:
  from jax.experimental.pallas import triton as pallas_triton  # pylint: disable=g-import-not-at-top
  return pallas_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


__all__ = ("BLOCK", "TILE", "gemm", "supports")
