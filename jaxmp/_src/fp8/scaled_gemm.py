"""One scaled fp8 GEMM: how a recipe's quantized operands are multiplied.

Per recipe (operands canonical, ``(B, P, C) x (B, Q, C) -> (B, P, Q)``, see
:mod:`~jaxmp._src.fp8.layout`):

- **per tensor, per row** (``CurrentScaling``, ``RowwiseScaling``, and
  ``OperandRecipes`` mixing them, one per operand): no scale varies
  along the contracted dimension, so the GEMM multiplies the fp8 operands themselves
  (float32 accumulation) and the product is multiplied by the outer product of the
  two operands' scales: ``acc * (scale_a[p] * scale_b[q])``. XLA lowers this to an fp8
  GEMM (cuBLASLt on Hopper and Blackwell) with the scaling in the epilogue or a fused
  elementwise kernel (:func:`rescaled_dot`).
- **blocks** (``BlockScaling``): scales vary along the contracted dimension and XLA
  has no block-scaled fp8 GEMM. On Hopper targets (``support.Target.block_fp8``), for
  the recipes it takes (:func:`.block_gemm.supports`), the product is jaxmp's kernel
  (:mod:`.block_gemm`: fp8 tensor-core products per 128-element block, scaled and
  summed in float32, as DeepGEMM), in a ``lax.platform_dependent`` branch for CUDA.
  Elsewhere the operands are dequantized (float32, or bfloat16 where power-of-two
  scales make it exact) and multiplied with float32 accumulation: the same sum of the
  same products, by a wider GEMM. Emulating the published kernel with XLA's GEMMs
  instead, as per-block partial products (a batched fp8 GEMM with ``K / 128`` float32
  partial outputs, then scaled and summed), compiles for an H100 to fp8 GEMMs but
  writes ``K / 128`` times the output to memory: about 6x slower than the dequantized
  GEMM at 4096^3 by the audit's estimate.
- **MX** (``MXScaling``): :func:`jaxmp._src.fp8.mx.gemm`.
- **int8** (``Int8Scaling``): the int8 operands multiply with an int32 accumulator
  (exact), and the product, converted to float32, is multiplied by the outer product
  of the row scales, then cast: :func:`int8_dot`.

Example:
  >>> from jaxmp._src.fp8 import scaled_gemm, quantize as q
  >>> a = q.quantize(jnp.ones((1, 2, 4)), q.E4M3, jnp.float32(0.5))
  >>> b = q.quantize(jnp.ones((1, 3, 4)), q.E4M3, jnp.float32(0.25))
  >>> scaled_gemm.rescaled_dot(a, b, scaled_gemm.CANONICAL, jnp.float32(0.125),
  ...                          jnp.bfloat16, exact_scale=True)
  Array([[[4, 4, 4],
          [4, 4, 4]]], dtype=bfloat16)
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import jax_compat
from jaxmp._src.fp8 import block_gemm
from jaxmp._src.fp8 import grouped
from jaxmp._src.fp8 import int8
from jaxmp._src.fp8 import mx
from jaxmp._src.fp8 import recipes as recipes_lib

F32 = np.dtype(np.float32)
BF16 = np.dtype(jnp.bfloat16)
CANONICAL = (((2,), (2,)), ((0,), (0,)))
"""Dimension numbers of a canonical product: contract the last axes, batch the first."""


def fuses_output(out_dtype: Any, exact_scale: bool) -> bool:
  """Whether the GEMM writes ``out_dtype`` itself rather than float32 then narrowed.

  Only for bfloat16 outputs with power-of-two scales: multiplying by a power of two
  commutes with rounding (barring overflow and subnormals), so ``round(acc) * s ==
  round(acc * s)``, and XLA folds the scale into the fp8 GEMM, which writes bfloat16.
  (float16 would round the unscaled accumulator, which can exceed its range.)
  """
  return exact_scale and np.dtype(out_dtype) == BF16


def fuses_output_on_gpus(out_dtype: Any, scale: jax.Array) -> bool:
  """Whether the CUDA lowering has the GEMM write ``out_dtype`` for any scale.

  For bfloat16 outputs and one scale for the whole product (per-tensor recipes).
  XLA folds a scalar multiplying a bfloat16-output fp8 GEMM into the cuBLASLt call,
  which applies it to the float32 accumulator before its one rounding; XLA's Triton
  GEMMs apply it in their epilogue. Either way no float32 product reaches memory.
  What the scale is multiplied in differs (compiled H100 HLO): the cuBLASLt call is
  given the float32 scale itself (XLA drops the conversion to bfloat16 written
  here), so it computes the float32 form's value; a Triton GEMM multiplies by the
  scale rounded to bfloat16, as Flax's fp8 GEMMs do: exact for power-of-two scales,
  otherwise a relative error of at most 2^-8 (bfloat16's unit roundoff; where it
  rounds the accumulator to bfloat16 before scaling, one more rounding). Row scales
  vary across the product and cannot be folded.
  """
  return np.dtype(out_dtype) == BF16 and np.size(scale) == 1


GPU_FP8_CONTRACTION_MULTIPLE = 16
"""On CUDA, fp8 GEMMs whose contraction is not a multiple of this run in bfloat16.

cuBLASLt's fp8 GEMMs need every dimension a multiple of 16. On an H100 (jax 0.11.2,
CUDA 13) XLA's fp8 GEMMs with a contraction of 2 to 10 elements returned NaN and -inf
for finite operands whose exact product is a few hundred thousand, in both of XLA's
GEMM back ends (cuBLASLt and Triton), and not on every run (measured; see
benchmarks/RESULTS.md, "On a real H100"). A bfloat16 GEMM of the same fp8 values is
the same computation: every fp8 value is a bfloat16 value and every product of two is
exact in float32, so only the speed of a GEMM this small is given up.
"""


def in_own_layout_on_gpus(k_major_fp8: bool, *operands: jax.Array, own_kernel: bool = False
                          ) -> tuple[jax.Array, ...]:
  """``operands``, each laid out row-major on CUDA GPUs (its own layout) if ``k_major_fp8``.

  ``k_major_fp8`` is the target's :attr:`~jaxmp._src.fp8.support.Target.k_major_fp8`
  (Hopper); without it, and off CUDA, the operands are returned as they are.

  For quantized GEMM operands, whose layout XLA otherwise chooses. cuBLASLt's fp8 GEMMs
  read both operands with the contracted dimension minor, and for that XLA had the
  kernel that quantizes a Dense kernel ``(in, out)`` write it transposed, at a cost
  seen in compiled H100 HLO (Llama-3-8B-shaped layer, benchmarks/RESULTS.md):

  - delayed scaling (:mod:`~jaxmp._src.fp8.dot_general`, operands in the layer's own
    shapes): a transposing kernel cannot also take the amax (XLA's reduction kernels
    write their extra outputs in their input's layout), so each float32 kernel was
    read twice, for its amax and for its quantization (224 MiB each for a
    ``(4096, 14336)`` kernel). Row-major, the quantization joins the amax's kernel and
    the GEMM's transposed copy is made from the fp8 values, a quarter of the bytes.
    Current scaling takes the amax first, but saves a pass the same way (3-4% of
    the non-GEMM bytes of a Dense step);
  - per-row scaling (:mod:`~jaxmp._src.fp8.per_gemm`, canonical ``(B, R, C)``
    operands, for which row-major *is* the contracted-minor layout the GEMM reads):
    the kernel's quantizations were written in another layout and its two amaxes read
    a transposed int16 copy of its magnitudes.

  With ``own_kernel``, each is also written out by the kernel that computes it (an
  optimization barrier), so that a transposed copy the other GEMM needs is made from
  the written fp8 values by a plain transpose, not fused into that kernel. For the
  output gradient under delayed scaling: XLA otherwise cast it and transposed it in
  one kernel with two outputs, and on an H200 such kernels moved 0.3-1.7 TB/s where
  most fusions moved 3-4.4 and fp8 transposes 2.3-2.9; written first, its
  quantization joins the kernel that computes the gradient. Measured on an H200
  (benchmarks/RESULTS.md, "Fifth run"): the Llama-3-8B layer's fp8 step 7.85 -> 7.64
  ms, the demo's 32.9 -> 31.1 ms. Not for current scaling, whose quantization follows
  an amax and cannot join the producer: the separate transpose only added bytes
  (compiled H100 HLO).

  The values are the same on every platform; only where they are laid out changes.
  Only for Hopper: on a B200, whose fp8 GEMMs read any layout, and an A100, XLA's own
  choice compiled as well or better.

  Example:
    >>> from jaxmp._src.fp8 import scaled_gemm
    >>> (x,) = scaled_gemm.in_own_layout_on_gpus(True, jnp.ones((2, 3)))
    >>> x.shape
    (2, 3)
  """
  if not k_major_fp8:
    return operands
  row_major = jax_compat.row_major  # without JAX's layout API: XLA's choice, and a warning
  on_cuda = (lambda x: jax.lax.optimization_barrier(row_major(x))) if own_kernel else row_major
  return tuple(jax.lax.platform_dependent(x, cuda=on_cuda, default=lambda x: x)
               for x in operands)


def _contraction(a: jax.Array, dimension_numbers: Any) -> int:
  (a_contracting, _), _ = dimension_numbers
  return int(np.prod([a.shape[d] for d in a_contracting], dtype=np.int64))


def _narrow_output_dot(a, b, scale, *, dimension_numbers, out_dtype, out_sharding, precision):
  out = jax.lax.dot_general(a, b, dimension_numbers, precision=precision,
                            preferred_element_type=out_dtype, out_sharding=out_sharding)
  if np.size(scale) == 1:  # XLA folds a scalar into the GEMM, not an array of one.
    scale = jnp.reshape(scale, ())
  return out * scale.astype(out_dtype)


def _wide_output_dot(a, b, scale, *, dimension_numbers, out_dtype, out_sharding, precision):
  out = jax.lax.dot_general(a, b, dimension_numbers, precision=precision,
                            preferred_element_type=F32, out_sharding=out_sharding)
  return (out * scale).astype(out_dtype)


def _on_bfloat16_operands(product):
  """``product`` of the fp8 operands widened to bfloat16 (exactly)."""

  def widened(a, b, scale):
    a, b = grouped.held(a, b)  # the widening must not let XLA skip the quantization
    return product(a.astype(BF16), b.astype(BF16), scale)

  return widened


def rescaled_dot(a: jax.Array, b: jax.Array, dimension_numbers: Any, scale: jax.Array,
                 out_dtype: Any, *, exact_scale: bool = False, out_sharding: Any = None,
                 accumulate_exactly_on_gpus: bool = False) -> jax.Array:
  """``dot_general(a, b) * scale`` in ``out_dtype``, for fp8 ``a`` and ``b``.

  The product is float32 (``preferred_element_type``), scaled in float32 and cast:
  ``dot -> multiply -> convert``, one rounding. With power-of-two scales and a
  bfloat16 output (:func:`fuses_output`) the GEMM writes bfloat16 and the scale is
  applied in bfloat16, which is exact: the same bits, and on GPUs no float32 output
  and no separate narrowing kernel. On CUDA GPUs (a ``lax.platform_dependent``
  branch):

  - a bfloat16 product with one scale takes that form for any scale
    (:func:`fuses_output_on_gpus`): XLA does not fold a float32 product's cast into
    the cuBLASLt call, so there the float32 form would write the product in float32
    and narrow it in a kernel of its own;
  - with ``accumulate_exactly_on_gpus`` the GEMM is asked for
    ``Precision.HIGHEST``, which XLA passes to cuBLASLt as "no fast accumulation":
    Hopper's fp8 tensor cores otherwise keep fewer bits in their running sums. Flax
    and TransformerEngine do this for the two gradient GEMMs and not for the forward
    one; on an H100 it cost 7% of an 8192^3 GEMM's speed and cut its largest error
    4x (measured, benchmarks/RESULTS.md);
  - a contraction that is not a multiple of :data:`GPU_FP8_CONTRACTION_MULTIPLE`
    multiplies the fp8 values as bfloat16 (exact, see there).

  Args:
    a: the first fp8 operand.
    b: the second fp8 operand.
    dimension_numbers: as for ``lax.dot_general``.
    scale: float32, broadcastable to the product (a scalar, or an outer product of
      row scales).
    out_dtype: the result's dtype.
    exact_scale: whether ``scale`` is a power of two.
    out_sharding: forwarded to ``lax.dot_general``.
    accumulate_exactly_on_gpus: turn off fast accumulation on CUDA (gradient GEMMs).

  Returns:
    The scaled product.
  """
  kwargs = dict(dimension_numbers=dimension_numbers, out_dtype=out_dtype,
                out_sharding=out_sharding)
  narrow = functools.partial(_narrow_output_dot, precision=None, **kwargs)
  wide = functools.partial(_wide_output_dot, precision=None, **kwargs)
  product = narrow if fuses_output(out_dtype, exact_scale) else wide
  cuda_form = (_narrow_output_dot if fuses_output(out_dtype, exact_scale)
               or fuses_output_on_gpus(out_dtype, scale) else _wide_output_dot)
  if _contraction(a, dimension_numbers) % GPU_FP8_CONTRACTION_MULTIPLE:
    # Fast accumulation is an fp8 GEMM's: a bfloat16 GEMM keeps the default precision.
    cuda_product = _on_bfloat16_operands(functools.partial(cuda_form, precision=None, **kwargs))
  elif accumulate_exactly_on_gpus:
    cuda_product = functools.partial(cuda_form, precision=jax.lax.Precision.HIGHEST, **kwargs)
  elif cuda_form is product.func:
    return product(a, b, scale)  # the same program on every platform
  else:
    cuda_product = functools.partial(cuda_form, precision=None, **kwargs)
  return jax.lax.platform_dependent(a, b, scale, cuda=cuda_product, default=product)


def _outer(scale_a: jax.Array, scale_b: jax.Array) -> jax.Array:
  """``(B, P, 1) x (B, Q, 1) -> (B, P, Q)``: the scale of every product element."""
  return scale_a * jnp.swapaxes(scale_b, 1, 2)


def int8_dot(a: grouped.Quantized, b: grouped.Quantized, out_dtype: Any) -> jax.Array:
  """``(B, P, C) x (B, Q, C) -> (B, P, Q)`` for int8 operands with row scales.

  ``float32(dot_general(a, b, preferred_element_type=int32)) * (scale_a * scale_b.T)``
  cast to ``out_dtype``: the accumulation is exact, then one float32 rounding (of the
  int32 sum, above ``2**24``), one of the scale product and one of the rescale.

  Example:
    >>> from jaxmp._src.fp8 import int8, scaled_gemm
    >>> a = int8.quantize(jnp.array([[[1.0, 127.0]]]))  # scale 1: exact
    >>> b = int8.quantize(jnp.array([[[2.0, 254.0], [0.0, 0.0]]]))  # scales 2, 1
    >>> scaled_gemm.int8_dot(a, b, jnp.float32)
    Array([[[32260.,     0.]]], dtype=float32)
  """
  acc = jax.lax.dot_general(a.data, b.data, CANONICAL, preferred_element_type=int8.INT32)
  return (acc.astype(F32) * _outer(a.scale, b.scale)).astype(out_dtype)


def _dequantized_dot(a: grouped.Quantized, b: grouped.Quantized, grouping_a: grouped.Grouping,
                     grouping_b: grouped.Grouping, out_dtype: Any, exact: bool) -> jax.Array:
  a, b = grouped.held(a, b)  # so that XLA does not skip the quantization on GPUs
  dtype = BF16 if exact else F32
  preferred = out_dtype if fuses_output(out_dtype, exact) else F32
  precision = None if exact else jax.lax.Precision.HIGHEST
  out = jax.lax.dot_general(grouped.dequantize(a, grouping_a, dtype),
                            grouped.dequantize(b, grouping_b, dtype), CANONICAL,
                            precision=precision, preferred_element_type=preferred)
  return out.astype(out_dtype)


def _block_dot(a: grouped.Quantized, b: grouped.Quantized, grouping_a: grouped.Grouping,
               grouping_b: grouped.Grouping, out_dtype: Any, recipe: Any,
               block_fp8: bool) -> jax.Array:
  """A ``BlockScaling`` product: the fp8 kernel when lowering for CUDA on Hopper."""
  dequantized = functools.partial(_dequantized_dot, grouping_a=grouping_a,
                                  grouping_b=grouping_b, out_dtype=out_dtype,
                                  exact=recipe.power_of_two)
  if not (block_fp8 and block_gemm.supports(recipe)):
    return dequantized(a, b)
  kernel = functools.partial(block_gemm.gemm, grouping_b=grouping_b, out_dtype=out_dtype)
  if grouping_a == grouping_b:
    # The weight-gradient GEMM (both operands tiled along the tokens) is written
    # transposed, (B, Q, P): the kernel's gradient is then already in the layout of a
    # Dense kernel, (in, out), which the caller's transpose back would otherwise
    # rewrite, and which a donated train step updates in place (compiled for an
    # H100, the Llama layer's step copied its three FFN kernels without this).
    kernel = _written_transposed(kernel)
  return jax.lax.platform_dependent(a, b, cuda=kernel, default=dequantized)


def _written_transposed(gemm: Any) -> Any:
  """``gemm(a, b)`` computed as the transpose of ``gemm(b, a)``: the same products."""
  return lambda a, b: jnp.swapaxes(gemm(b, a), 1, 2)


def gemm(a: grouped.Quantized, b: grouped.Quantized, recipe: Any, groupings: tuple,
         shape: tuple, out_dtype: Any, block_scaled_gemm: bool = False,
         accumulate_exactly_on_gpus: bool = False, block_fp8: bool = False) -> jax.Array:
  """The product of two quantized canonical operands under ``recipe``.

  Args:
    a: the first operand (``(B, P', C')`` data, padded to whole groups).
    b: the second operand (``(B, Q', C')``).
    recipe: the GEMM's recipe (``CurrentScaling``, ``RowwiseScaling``,
      ``BlockScaling`` or ``MXScaling``).
    groupings: the two operands' :class:`~.grouped.Grouping`.
    shape: ``(P, Q)``, the product's unpadded rows and columns.
    out_dtype: the product's dtype.
    block_scaled_gemm: for MX, use the block-scaled GEMM when lowering for CUDA.
    accumulate_exactly_on_gpus: as for :func:`rescaled_dot` (gradient GEMMs).
    block_fp8: for a ``BlockScaling`` the kernel takes (:func:`.block_gemm.supports`),
      use :func:`~.block_gemm.gemm` when lowering for CUDA (Hopper targets: the fp8
      support module decides).

  Returns:
    ``(B, P, Q)`` in ``out_dtype``.
  """
  p, q_ = shape
  if isinstance(recipe, recipes_lib.MXScaling):
    out = mx.gemm(a, b, out_dtype, block_scaled_gemm)
  elif isinstance(recipe, recipes_lib.Int8Scaling):
    out = int8_dot(a, b, out_dtype)
  elif isinstance(recipe, recipes_lib.BlockScaling):
    grouping_a, grouping_b = groupings
    out = _block_dot(a, b, grouping_a, grouping_b, out_dtype, recipe, block_fp8)
  else:
    out = rescaled_dot(a.data, b.data, CANONICAL, _outer(a.scale, b.scale), out_dtype,
                       exact_scale=recipe.power_of_two,
                       accumulate_exactly_on_gpus=accumulate_exactly_on_gpus)
  return out[:, :p, :q_]


__all__ = ("CANONICAL", "GPU_FP8_CONTRACTION_MULTIPLE", "fuses_output", "fuses_output_on_gpus",
           "gemm", "int8_dot", "rescaled_dot")
