"""Scaled fp8 GEMMs: how quantized operands with per-tensor or per-row scales are multiplied.

Operands canonical, ``(B, P, C) x (B, Q, C) -> (B, P, Q)`` (see
:mod:`~jaxmp._src.fp8.layout`). Where no scale varies along the contracted dimension
(per tensor, per row: ``CurrentScaling``, ``RowwiseScaling``, and ``OperandRecipes``
mixing them, one per operand), the GEMM multiplies the fp8 operands themselves
(float32 accumulation) and the product is multiplied by the outer product of the two
operands' scales: ``acc * (scale_a[p] * scale_b[q])`` (:func:`outer_scaled_gemm`). XLA
lowers this to an fp8 GEMM (cuBLASLt on Hopper and Blackwell) with the scaling in the
epilogue or a fused elementwise kernel (:func:`rescaled_dot`, which the per-tensor op
of :mod:`~jaxmp._src.fp8.dot_general` also uses). The GEMMs of the other recipes live
with them: block scales in :mod:`~jaxmp._src.fp8.block`, MX in
:mod:`~jaxmp._src.fp8.mx`, int8 in :mod:`~jaxmp._src.fp8.int8`; the table of
:mod:`~jaxmp._src.fp8.ops` says which is whose.

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
from jaxmp._src.fp8 import grouped
from jaxmp._src.fp8 import quantize as q

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

  ``k_major_fp8`` is the target's :attr:`~jaxmp._src.fp8.chips.Target.k_major_fp8`
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


def outer(scale_a: jax.Array, scale_b: jax.Array) -> jax.Array:
  """``(B, P, 1) x (B, Q, 1) -> (B, P, Q)``: the scale of every product element."""
  return scale_a * jnp.swapaxes(scale_b, 1, 2)


def outer_scaled_gemm(a: grouped.Quantized, b: grouped.Quantized, recipe: Any, call: Any
                      ) -> jax.Array:
  """The product of two operands with per-tensor or per-row scales, rescaled by their outer
  product (:func:`rescaled_dot`); ``recipe.power_of_two`` says whether the scales are exact.

  ``call`` is the GEMM (:class:`~jaxmp._src.fp8.ops.GemmCall`): its output dtype, and
  whether it accumulates without fast accumulation on GPUs (the gradient GEMMs).
  """
  return rescaled_dot(a.data, b.data, CANONICAL, outer(a.scale, b.scale), call.out_dtype,
                      exact_scale=recipe.power_of_two,
                      accumulate_exactly_on_gpus=call.accumulate_exactly_on_gpus)


def forward_operands(lhs: jax.Array, rhs: jax.Array, x_scale: jax.Array, k_scale: jax.Array,
                     k_major_fp8: bool) -> tuple[jax.Array, ...]:
  """A per-tensor forward GEMM's operands in E4M3, in their own layout on Hopper if asked.

  ``k_major_fp8`` is the target's :attr:`~jaxmp._src.fp8.chips.Target.k_major_fp8` (see
  :func:`in_own_layout_on_gpus`); ``False`` leaves the layouts to XLA.
  """
  return in_own_layout_on_gpus(
      k_major_fp8, q.quantize(lhs, q.E4M3, x_scale), q.quantize(rhs, q.E4M3, k_scale))


__all__ = ("CANONICAL", "GPU_FP8_CONTRACTION_MULTIPLE", "forward_operands", "fuses_output",
           "fuses_output_on_gpus", "in_own_layout_on_gpus", "outer", "outer_scaled_gemm",
           "rescaled_dot")
