"""A block-scaled fp8 GEMM for Hopper in Pallas' Mosaic GPU back end (DeepGEMM's scheme).

The same product as :mod:`~jaxmp._src.fp8.block_gemm` (the Pallas Triton kernel), with
the same operands: canonical ``a`` ``(B, P, C)`` tiled ``1 x 128`` and ``b``
``(B, Q, C)`` tiled ``1 x 128`` or blocked ``128 x 128``, both fp8 and padded along
``C`` to whole blocks, and

  ``out[p, q] = sum_k  a.scale[p, k] * b.scale[q, k] * (a[p, kblk] . b[q, kblk])``

in float32, rounded once to the output dtype. For every 128-element block ``k`` of the
contracted dimension the tensor cores multiply the fp8 tiles (``wgmma``, e4m3 operands
read from shared memory, a fresh float32 accumulator), and the partial product is
multiplied by the block's scales (``a``'s one per row, ``b``'s one per column: a
``128 x 128`` block's scale repeated over its rows) and added to a float32
accumulator held in registers (DeepSeek-V3's promotion to float32 every 128 elements).

**The schedule.** One program (CTA) computes one output tile of :data:`TILE`, by
default 128 x 128, in three warpgroups (``emit_pipeline_warp_specialized``): a
producer that issues the TMA loads of each block's ``a`` and ``b`` tiles and their
scale vectors into a ring of :data:`STAGES` shared-memory slots, and two consumers,
each owning half of the tile (64 x 128 by default: one ``wgmma`` m64n128k32 four times
per block), that wait for a slot, run the block's ``wgmma``, wait for it, scale it and
add it, and release the slot. While one consumer scales its partial product on the
CUDA cores, the other's ``wgmma`` runs on the tensor cores, as in DeepGEMM's kernels
(two math warpgroups taking turns); the producer keeps ``STAGES`` blocks in flight
ahead of both. The tile is written through shared memory with a TMA store. Programs
are numbered along ``b``'s column tiles in groups (``planar_snake``), so that a wave
of programs shares a few tiles of each operand in the L2.

**What is not measured.** This kernel has not run on a GPU: it was written, compiled
for an H100 (sm_90a) without one, and run in Mosaic GPU's interpreter on a CPU. Its
PTX has ``wgmma.mma_async...f32.e4m3.e4m3``, TMA loads and stores
(``cp.async.bulk.tensor``) and no fp8-to-float16 conversion; its speed against
cuBLAS's bfloat16 GEMM and the Triton kernel is for ``benchmarks/bench_block_gemm.py``
to measure, which is why the chip table (:attr:`~jaxmp._src.fp8.chips.Target.block_fp8_kernels`)
keeps the Triton kernel first on Hopper until it has.

**In the interpreter** (``interpret=True``; Mosaic GPU's interpreter, which simulates
the warpgroups, shared memory, TMA and barriers on the CPU) the kernel is the same
program except for two things the interpreter of jax 0.10.2 lacks: a ``wgmma`` whose
``b`` is a transposed view of shared memory (so ``b`` is given to it as ``(C, Q)``
and loaded as ``(128, n)`` tiles), and register layouts (the layout annotations are
left out). With tiles 256 columns wide the interpreted kernel hung in most runs, two
of its threads waiting on a pipeline barrier; there the interpreter-only ``(128, 256)``
``b`` tile spans two swizzle tiles, which the compiled kernel's ``(256, 128)`` does not
(the likely cause; not found). Those tiles are checked only as far as they compile,
and the benchmark checks their products on the chip.

Example:
  >>> from jaxmp._src.fp8 import block_gemm_mosaic, grouped, quantize as q
  >>> x = jnp.ones((1, 2, 128))
  >>> a = grouped.quantize(x, grouped.Grouping(1, 128), q.E4M3, jnp.full((1, 2, 1), 0.5))
  >>> b = grouped.quantize(x, grouped.Grouping(1, 128), q.E4M3, jnp.full((1, 2, 1), 2.0))
  >>> block_gemm_mosaic.gemm(a, b, grouped.Grouping(1, 128), jnp.float32, interpret=True)
  Array([[[128., 128.],
          [128., 128.]]], dtype=float32)
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import jax_compat
from jaxmp._src.fp8 import grouped

BLOCK = 128
"""The contracted block of the kernel: the recipes' ``block_size`` it runs."""

TILE = (128, 128)
"""The output tile of one program (rows of ``a``, rows of ``b``): DeepGEMM's 128 x 128
with two consumer warpgroups of 64 x 128 (unmeasured: the benchmark tries others)."""

STAGES = 4
"""Blocks in flight: shared-memory slots for each block's tiles (32 KiB each at
:data:`TILE`)."""

ROWS, COLUMNS = "rows", "columns"
SPLIT = ROWS
"""How the tile is shared by the two consumer warpgroups: each takes half its rows, or
half its columns."""

GROUP_COLUMNS = 8
"""Column tiles whose programs are numbered together (``plgpu.planar_snake``)."""

CONSUMERS = 2
"""Consumer (math) warpgroups per program; a third issues the loads."""

PRODUCER_REGISTERS = 40
"""Registers per thread the load-issuing warpgroup keeps (the consumers get the rest)."""

F32 = np.dtype(np.float32)


def available() -> bool:
  """Whether this JAX has the Mosaic GPU pieces the kernel is built from.

  Where a JAX release renames them, ``BlockScaling`` uses the next kernel of the chip's
  entry, or the dequantized GEMM, and the fallback warning says so.
  """
  return jax_compat.mosaic_gpu() is not None


def supports(recipe: Any) -> bool:
  """Whether a ``BlockScaling`` GEMM can run as this kernel on a Hopper GPU.

  For ``block_size`` :data:`BLOCK` and scales that are not rounded to powers of two (as
  :func:`jaxmp._src.fp8.block_gemm.supports`: with power-of-two scales the bfloat16
  GEMM on dequantized operands is exact, and on an H200 it ran as fast as the Triton
  kernel or faster), where this JAX has Mosaic GPU (:func:`available`).
  """
  return recipe.block_size == BLOCK and not recipe.power_of_two and available()


def _scales_by_block(scale: jax.Array) -> jax.Array:
  """``(B, R, C/128)`` per-row scales as ``(C/128, B * R)``: one row per block, for TMA."""
  return jnp.transpose(scale, (2, 0, 1)).reshape(scale.shape[2], -1)


def _swizzled(plgpu: Any, columns: int, dtype: Any) -> tuple:
  """The shared-memory tiling and swizzle of a tile ``columns`` wide, as ``wgmma`` and TMA
  read it (the widest swizzle the row's bytes allow)."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(columns * bits)
  return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _kernel(a_hbm, b_hbm, sa_hbm, sb_hbm, out_hbm, out_smem, *, plgpu: Any, tiles: tuple,
            tile: tuple, split: str, stages: int, group_columns: int, interpret: bool):
  """One program: the output tiles it owns, each a float32 sum over the blocks."""
  pallas = _pallas()
  batch, tiles_p, tiles_q, blocks = tiles
  tile_p, tile_q = tile
  part_p, part_q = (tile_p // CONSUMERS, tile_q) if split == ROWS else (tile_p, tile_q // CONSUMERS)
  rows_p, rows_q = tiles_p * tile_p, tiles_q * tile_q
  # Layout annotations place values in registers as wgmma writes its accumulator; the
  # interpreter has no registers (and no lowering of the annotation).
  layout = (lambda x, _: x) if interpret else plgpu.layout_cast
  acc_layout = plgpu.Layout.WGMMA
  fp8_tile = _swizzled(plgpu, BLOCK, a_hbm.dtype)
  b_spec = (plgpu.BlockSpec((BLOCK, tile_q), lambda k: (k, 0), transforms=fp8_tile)
            if interpret else
            plgpu.BlockSpec((tile_q, BLOCK), lambda k: (0, k), transforms=fp8_tile))

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(blocks,), memory_registers=PRODUCER_REGISTERS,
        in_specs=[plgpu.BlockSpec((tile_p, BLOCK), lambda k: (0, k), transforms=fp8_tile),
                  b_spec,
                  plgpu.BlockSpec((1, tile_p), lambda k: (k, 0)),
                  plgpu.BlockSpec((1, tile_q), lambda k: (k, 0))],
        wg_axis="wg", num_compute_wgs=CONSUMERS, max_concurrent_steps=stages,
        compute_context=compute_context)

  ignore = lambda *_, **__: None  # the allocations depend on the specs alone

  @functools.partial(pallas.run_scoped,
                     allocations=pipeline(ignore, ignore).get_allocations(
                         a_hbm, b_hbm, sa_hbm, sb_hbm),
                     collective_axes="wg")
  def _(allocations):
    consumer = jax.lax.axis_index("wg")
    program = jax.lax.axis_index("program")
    n, t = program // (tiles_p * tiles_q), program % (tiles_p * tiles_q)
    tp, tq = plgpu.planar_snake(t, (tiles_p, tiles_q), 1, group_columns)
    p_rows = pallas.ds(n * rows_p + tp * tile_p, tile_p)
    q_rows = pallas.ds(n * rows_q + tq * tile_q, tile_q)
    own_p = pallas.ds(consumer * part_p, part_p) if split == ROWS else slice(None)
    own_q = pallas.ds(consumer * part_q, part_q) if split == COLUMNS else slice(None)

    def block_product(a_tile, b_tile):
      def issue(acc_ref):
        b_kn = b_tile.at[:, own_q] if interpret else plgpu.transpose_ref(
            b_tile.at[own_q], (1, 0))
        plgpu.wgmma(acc_ref, a_tile.at[own_p], b_kn)
        plgpu.wgmma_wait(0)
        return acc_ref[...]
      return pallas.run_scoped(issue, plgpu.ACC((part_p, part_q), F32))

    def body(_, a_tile, b_tile, sa, sb, acc):
      partial = layout(block_product(a_tile, b_tile), acc_layout)
      row_scale = layout(sa[0, own_p], acc_layout.reduce(1))     # (part_p,)
      column_scale = layout(sb[0, own_q], acc_layout.reduce(0))  # (part_q,)
      shape = (part_p, part_q)
      return acc + (partial * jax.lax.broadcast_in_dim(row_scale, shape, (0,))
                    * jax.lax.broadcast_in_dim(column_scale, shape, (1,)))

    def compute_context(run):
      acc = run(layout(jnp.zeros((part_p, part_q), F32), acc_layout))
      out_smem[consumer] = acc.astype(out_smem.dtype)
      plgpu.commit_smem()
      out_p = pallas.ds(n * rows_p + tp * tile_p, tile_p)
      out_q = pallas.ds(tq * tile_q, tile_q)
      plgpu.copy_smem_to_gmem(out_smem.at[consumer], out_hbm.at[out_p, out_q].at[own_p, own_q])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pipeline(body, compute_context)(
        a_hbm.at[p_rows], b_hbm.at[:, q_rows] if interpret else b_hbm.at[q_rows],
        sa_hbm.at[:, p_rows], sb_hbm.at[:, q_rows], allocations=allocations)


def _pallas():
  """``jax.experimental.pallas``, imported on first use (it is not needed to import jaxmp)."""
  from jax.experimental import pallas  # pylint: disable=g-import-not-at-top
  return pallas


def _check_schedule(tile: tuple, split: str, stages: int) -> None:
  if split not in (ROWS, COLUMNS):
    raise ValueError(f"block_gemm_mosaic: split must be {ROWS!r} or {COLUMNS!r}, got {split!r}.")
  part = (tile[0] // CONSUMERS, tile[1]) if split == ROWS else (tile[0], tile[1] // CONSUMERS)
  if part[0] % 64 or part[1] % 8 or part[1] > 256:
    raise ValueError(f"block_gemm_mosaic: each consumer's part of the tile {tile} (split by "
                     f"{split}) is {part}; wgmma takes a multiple of 64 rows and of 8 "
                     "columns, at most 256.")
  if not (isinstance(stages, int) and stages >= 1):
    raise ValueError(f"block_gemm_mosaic: stages must be an int >= 1, got {stages!r}.")


def gemm(a: grouped.Quantized, b: grouped.Quantized, grouping_b: grouped.Grouping,
         out_dtype: Any, *, interpret: bool = False, tile: tuple[int, int] = TILE,
         stages: int = STAGES, split: str = SPLIT,
         group_columns: int = GROUP_COLUMNS) -> jax.Array:
  """``(B, P, C) x (B, Q, C) -> (B, P, Q)`` of two block-scaled fp8 operands.

  ``a`` is tiled ``1 x 128`` (activations, gradients), ``b`` ``1 x 128`` or
  ``128 x 128`` (weights); both padded along ``C`` to whole blocks, as
  :func:`~.grouped.quantize` leaves them. Rows are padded to whole tiles here (the
  product is sliced back).

  Args:
    a: the first operand (``grouped.Quantized``, ``Grouping(1, 128)``).
    b: the second operand.
    grouping_b: ``b``'s grouping, ``Grouping(1, 128)`` or ``Grouping(128, 128)``.
    out_dtype: the product's dtype (the float32 accumulator is rounded once to it).
    interpret: run the kernel in Mosaic GPU's interpreter (on any platform; for tests).
    tile: the output tile of one program (:data:`TILE`).
    stages: blocks in flight (:data:`STAGES`).
    split: how the two consumer warpgroups share the tile, :data:`ROWS` or
      :data:`COLUMNS`.
    group_columns: column tiles numbered together (:data:`GROUP_COLUMNS`).

  Returns:
    ``(B, P, Q)`` in ``out_dtype``, ``P`` and ``Q`` as ``a`` and ``b`` hold them.

  Raises:
    ValueError: for a tile the two warpgroups cannot share as ``wgmma`` needs, or a
      ``split`` or ``stages`` out of range.
    NotImplementedError: for ``interpret=True`` where this JAX has no Mosaic GPU
      interpreter.
  """
  _check_schedule(tile, split, stages)
  plgpu = jax_compat.mosaic_gpu()
  interpreter = jax_compat.mosaic_gpu_interpreter() if interpret else None
  if plgpu is None or (interpret and interpreter is None):
    missing = jax_compat.MOSAIC_GPU if plgpu is None else jax_compat.MOSAIC_GPU_INTERPRETER
    raise NotImplementedError(f"block_gemm_mosaic: {jax_compat.jax_version()} has no {missing}.")
  batch, p, c = a.data.shape
  q_ = b.data.shape[1]
  tile_p, tile_q = tile
  tiles_p, tiles_q, blocks = -(-p // tile_p), -(-q_ // tile_q), c // BLOCK
  rows_p, rows_q = tiles_p * tile_p, tiles_q * tile_q
  a_data = grouped.pad_rows(a.data, rows_p).reshape(batch * rows_p, c)
  b_data = grouped.pad_rows(b.data, rows_q).reshape(batch * rows_q, c)
  sa = _scales_by_block(grouped.pad_rows(a.scale, rows_p))        # (C/128, B * P')
  sb = _scales_by_block(grouped.row_scales(b, grouping_b, rows_q))  # (C/128, B * Q')
  part = (tile_p // CONSUMERS, tile_q) if split == ROWS else (tile_p, tile_q // CONSUMERS)
  kernel = functools.partial(
      _kernel, plgpu=plgpu, tiles=(batch, tiles_p, tiles_q, blocks), tile=tile, split=split,
      stages=stages, group_columns=group_columns, interpret=interpret)
  call = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((batch * rows_p, rows_q), out_dtype),
      grid=(batch * tiles_p * tiles_q,), grid_names=("program",),
      num_threads=CONSUMERS + 1, thread_name="wg",
      scratch_types={"out_smem": plgpu.SMEM((CONSUMERS, *part), out_dtype,
                                            transforms=_swizzled(plgpu, part[1], out_dtype))},
      interpret=interpreter() if interpreter is not None else None, kernel_name=KERNEL_NAME)
  out = call(a_data, b_data.T if interpret else b_data, sa, sb)
  return out.reshape(batch, rows_p, rows_q)[:, :p, :q_]


KERNEL_NAME = "jaxmp_block_fp8_gemm_mosaic"
"""The kernel's name (in a compiled program's HLO)."""

__all__ = ("BLOCK", "KERNEL_NAME", "STAGES", "TILE", "available", "gemm", "supports")
