"""Block scaling: DeepSeek-V3's 1 x 128 tiles and 128 x 128 blocks.

:class:`~jaxmp.fp8.BlockScaling`'s operands and GEMM. A canonical operand ``(B, R, C)``
is cut into ``1 x block_size`` tiles along its contracted dimension (activations,
gradients) or ``block_size x block_size`` blocks (the kernel, so that the same blocks
serve the forward GEMM and, transposed, the input-gradient GEMM), each scaled by its
own amax in E4M3 (:func:`~jaxmp._src.fp8.grouped.scales`).

XLA has no block-scaled fp8 GEMM: the scales vary along the contracted dimension, so no
epilogue can apply them. On Hopper targets the recipes jaxmp's kernels support multiply
in one of them (fp8 tensor-core products per 128-element block, scaled and summed in
float32, as DeepGEMM), in a ``lax.platform_dependent`` branch for CUDA: the first of
the target's :attr:`~jaxmp._src.fp8.chips.Target.block_fp8_kernels` (the chip table's
one entry) whose ``supports`` takes the recipe, among :data:`KERNELS`
(:mod:`~jaxmp._src.fp8.block_gemm` in Pallas Triton,
:mod:`~jaxmp._src.fp8.block_gemm_mosaic` in Pallas Mosaic GPU). Elsewhere the
operands are dequantized (float32, or bfloat16 where power-of-two scales make it
exact) and multiplied with float32 accumulation: the same sum of the same products, by a
wider GEMM. Emulating the published kernel with XLA's
GEMMs instead, as per-block partial products (a batched fp8 GEMM with ``K / 128``
float32 partial outputs, then scaled and summed), compiles for an H100 to fp8 GEMMs
but writes ``K / 128`` times the output to memory: about 6x slower than the
dequantized GEMM at 4096^3 by the audit's estimate.

Example:
  >>> from jaxmp._src.fp8 import block
  >>> recipe = jaxmp.fp8.BlockScaling(block_size=16)
  >>> block.grouping(recipe, "kernel"), block.grouping(recipe, "input")
  (Grouping(rows=16, cols=16), Grouping(rows=1, cols=16))
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.fp8 import block_gemm
from jaxmp._src.fp8 import block_gemm_mosaic
from jaxmp._src.fp8 import chips
from jaxmp._src.fp8 import grouped
from jaxmp._src.fp8 import quantize as q
from jaxmp._src.fp8 import recipes as recipes_lib
from jaxmp._src.fp8 import scaled_gemm

F32, BF16 = scaled_gemm.F32, scaled_gemm.BF16
KERNEL = "kernel"

KERNELS: dict[str, Any] = {"triton": block_gemm, "mosaic": block_gemm_mosaic}
"""jaxmp's block-scaled fp8 kernels by the names the chip table gives them: each
module has ``supports(recipe)``, ``available()``, ``BLOCK`` and ``gemm``."""

DESCRIPTIONS = {"triton": "a Pallas Triton kernel, wgmma",
                "mosaic": "a Pallas Mosaic GPU kernel: TMA, wgmma, warp-specialised"}
"""What each kernel is, for :func:`lowering`'s answer."""

NEEDS = {"triton": "Pallas Triton internals", "mosaic": "Pallas Mosaic GPU"}
"""What each kernel needs of this JAX (its ``available``), for the fallback message."""


def kernel_for(recipe: recipes_lib.BlockScaling, target: chips.Target) -> str | None:
  """The name of the kernel ``recipe``'s GEMMs run as on ``target``, or ``None``.

  The first of ``target.block_fp8_kernels`` whose module supports the recipe (block
  size, scales, and this JAX).

  Example:
    >>> from jaxmp._src.fp8 import block, chips
    >>> block.kernel_for(jaxmp.fp8.BlockScaling(), chips.TARGETS["h100"])
    'triton'
    >>> block.kernel_for(jaxmp.fp8.BlockScaling(), chips.TARGETS["b200"]) is None
    True
  """
  for name in target.block_fp8_kernels:
    if KERNELS[name].supports(recipe):
      return name
  return None


def grouping(recipe: recipes_lib.BlockScaling, role: str) -> grouped.Grouping:
  """``block_size x block_size`` blocks of the kernel, ``1 x block_size`` tiles otherwise."""
  size = recipe.block_size
  return grouped.Grouping(size if role == KERNEL else 1, size)


def fp8_format(recipe: recipes_lib.BlockScaling, role: str) -> np.dtype:
  """E4M3 for every operand, as DeepSeek-V3."""
  del recipe, role
  return q.E4M3


def dequantized_dot(a: grouped.Quantized, b: grouped.Quantized, grouping_a: grouped.Grouping,
                    grouping_b: grouped.Grouping, out_dtype: Any, exact: bool) -> jax.Array:
  """The product of the dequantized operands, float32 accumulation.

  bfloat16 operands where ``exact`` (power-of-two scales make the dequantization exact
  in bfloat16), float32 ones at ``HIGHEST`` precision otherwise.
  """
  a, b = grouped.held(a, b)  # so that XLA does not skip the quantization on GPUs
  dtype = BF16 if exact else F32
  preferred = out_dtype if scaled_gemm.fuses_output(out_dtype, exact) else F32
  precision = None if exact else jax.lax.Precision.HIGHEST
  out = jax.lax.dot_general(grouped.dequantize(a, grouping_a, dtype),
                            grouped.dequantize(b, grouping_b, dtype), scaled_gemm.CANONICAL,
                            precision=precision, preferred_element_type=preferred)
  return out.astype(out_dtype)


def _written_transposed(gemm: Any) -> Any:
  """``gemm(a, b)`` computed as the transpose of ``gemm(b, a)``: the same products."""
  return lambda a, b: jnp.swapaxes(gemm(b, a), 1, 2)


def gemm(a: grouped.Quantized, b: grouped.Quantized, recipe: recipes_lib.BlockScaling,
         call: Any) -> jax.Array:
  """A ``BlockScaling`` product: jaxmp's fp8 kernel when lowering for CUDA on Hopper."""
  grouping_a, grouping_b = call.groupings
  dequantized = functools.partial(dequantized_dot, grouping_a=grouping_a,
                                  grouping_b=grouping_b, out_dtype=call.out_dtype,
                                  exact=recipe.power_of_two)
  name = kernel_for(recipe, call.target)
  if name is None:
    return dequantized(a, b)
  kernel = functools.partial(KERNELS[name].gemm, grouping_b=grouping_b, out_dtype=call.out_dtype)
  if grouping_a == grouping_b:
    # The weight-gradient GEMM (both operands tiled along the tokens) is written
    # transposed, (B, Q, P): the kernel's gradient is then already in the layout of a
    # Dense kernel, (in, out), which the caller's transpose back would otherwise
    # rewrite, and which a donated train step updates in place (compiled for an
    # H100, the Llama layer's step copied its three FFN kernels without this).
    kernel = _written_transposed(kernel)
  return jax.lax.platform_dependent(a, b, cuda=kernel, default=dequantized)


def lowering(recipe: recipes_lib.BlockScaling, target: chips.Target) -> chips.Lowering:
  """jaxmp's kernel on Hopper for the recipes it takes; dequantized GEMMs elsewhere."""
  unknown = chips.unknown_fp8(target)
  if unknown is not None:
    return unknown
  name = kernel_for(recipe, target)
  if name is not None:
    return chips.Lowering("fp8", f"jaxmp's block-scaled fp8 GEMM ({DESCRIPTIONS[name]})")
  if recipe.power_of_two:
    why = ("exact with power-of-two scales, and faster than jaxmp's block-scaled fp8 "
           "GEMM, which runs the other scales" if target.block_fp8 else
           f"jaxmp's block-scaled fp8 GEMM runs on Hopper GPUs, sm_90, with block_size "
           f"{block_gemm.BLOCK} and scales that are not powers of two")
    return chips.Lowering("fallback", f"a bfloat16 GEMM on dequantized operands ({why})")
  needs = " or ".join(NEEDS[name] for name in target.block_fp8_kernels)
  why = (f"needs {needs}, which this JAX lacks"
         if target.block_fp8 and recipe.block_size == block_gemm.BLOCK else
         f"runs on Hopper GPUs, sm_90, with block_size {block_gemm.BLOCK}")
  return chips.Lowering("fallback", f"a float32 GEMM on dequantized operands (jaxmp's "
                        f"block-scaled fp8 GEMM {why})")


__all__ = ("KERNELS", "dequantized_dot", "fp8_format", "gemm", "grouping", "kernel_for", "lowering")
