"""MXFP8 (OCP Microscaling Formats v1.0): 32-element blocks sharing an E8M0 scale.

The OCP MX v1.0 conversion, block by block (32 consecutive elements along the
contracted dimension of a canonical ``(B, R, C)`` operand, ``C`` zero-padded to a
multiple of 32, see :mod:`~jaxmp._src.fp8.grouped`):

1. ``amax = max|x|`` over the block;
2. ``e = floor(log2(amax)) - emax`` with ``emax = floor(log2(fp8_max))``: 8 for E4M3,
   15 for E5M2 (OCP's rule; two others are below, *Scale rounding*); ``e`` is clamped
   to ``[-127, 127]``, the E8M0 range, and a block whose amax is 0 (or below 2**-126,
   where float32 stops being normal) gets the smallest scale ``2**-127`` (the reference
   implementation's rule: amax 0 reads as the smallest normal float32, whose ``e``
   clamps to -127);
3. the scale ``2**e`` is stored as E8M0, the unsigned biased exponent ``e + 127``
   (``0x00`` is ``2**-127``, ``0xFE`` is ``2**127``, ``0xFF`` is NaN). A block holding
   inf or NaN gets the NaN scale, so the whole block dequantizes to NaN;
4. the elements are ``x / 2**e`` rounded to the element format (round to nearest
   even) and clamped to its max: under OCP's rule the top of the block, up to
   ``2 * 2**floor(log2 amax)``, can exceed ``fp8_max * 2**e`` and saturates, as the
   spec says.

Dividing by ``2**e`` is exact in float32 (a power of two), computed as a product
with ``2**-e``, which is a normal float32 for every ``e`` this produces (``e <= 119``
for finite float32 inputs), so no backend that flushes subnormals to zero (XLA:CPU
does) changes a bit. Dequantizing a block with scale ``2**-127`` multiplies by a
subnormal float32, which such a backend reads as 0: only blocks whose amax is below
``2**-118`` are affected.

**Scale rounding.** Step 2 is the OCP rule, ``"floor"``. Three other rules are in use,
named as torchao's ``ScaleCalculationMode`` names them
(torchao/prototype/mx_formats/config.py):

- ``"floor"``: ``e = floor(log2(amax)) - emax`` (OCP MX v1.0 section 6.3; torchao
  FLOOR). The block's largest elements, up to ``2 * 2**floor(log2 amax)``, can exceed
  ``fp8_max * 2**e`` and saturate.
- ``"ceil"``: ``e = ceil(log2(amax)) - emax`` (torchao CEIL: "add one to scale if the
  mantissa is larger than 0"). Never saturates, but the block's largest element is
  at most ``2**emax`` (256 in E4M3) after scaling, leaving ``fp8_max / 2**emax`` (1.75x)
  of the format unused.
- ``"rceil"``: ``e = ceil(log2(amax / fp8_max))``, the smallest power of two that
  brings the block under the element format's max: JAX's own MX quantizer
  (jax/_src/cudnn/scaled_matmul_stablehlo.py: ``cast_to_e8m0_with_rounding_up(amax /
  MAX)``), TransformerEngine's MXFP8 casts (``ptx::float_to_e8m0(amax * max_norm_rcp)``,
  ``cvt.rp.satfinite.ue8m0x2.f32`` on Blackwell), torchao RCEIL (``max_abs * (1.0 /
  max_pos)`` then rounded up to E8M0) and cuBLAS's "Computing scaling and conversion
  factors for FP8 with UE8M0 scales". Never saturates and uses the whole format: the
  block's largest element lands in ``(fp8_max / 2, fp8_max]``. Those sources compute
  the quotient in float32 (JAX divides, the others multiply by the float32 reciprocal)
  and round its exponent up; here ``e`` is read exactly from the bits of ``amax``
  (``floor(log2(amax)) - emax``, plus one where ``amax``'s significand exceeds
  ``fp8_max``'s, 1.75 for both formats). Over every finite float32 amax the two agree
  except one: ``amax = 1.75 * 2**-119`` plus one ulp for E4M3 (``1.75 * 2**-112`` plus one
  ulp for E5M2), whose quotient is a float32 subnormal that rounds down to ``2**-127``
  (code 0) where the exact quotient, just above it, gets code 1 (all finite float32
  amaxes were compared once in NumPy; the tests compare every significand of several
  binades, that amax included). XLA:CPU would also flush the subnormal quotients below
  ``2**-126`` to zero; the exact form does not depend on the backend.
- ``"even"``: ``e = floor(log2(round(amax))) - emax``, where ``round`` rounds amax's
  significand half up to the element format's precision (3 bits for E4M3, 2 for E5M2):
  torchao EVEN, which adds ``1 << (23 - mbits - 1)`` to amax's float32 bits and clears
  the significand before floor's rule. The exponent goes up only where amax's
  significand is at least 1.9375 (E4M3) or 1.875 (E5M2), so a block whose maximum sits
  on a grid point keeps its scale while its values drift by an ulp either way; block
  maxima between ``fp8_max`` and ``1.9375 * 2**emax`` (E4M3) saturate, as with floor.

On Gaussian data the product of two MXFP8 operands has a relative error of 4.1% with
floor and 3.75% with ceil or rceil (tested): floor's saturated block maxima are the
difference. Ceil and rceil round the same values alike except near the bottom of the
element format: the fp8 formats' relative precision is the same in every normal binade,
and rceil's smaller scale only moves the block's smallest elements away from fp8's
subnormals and zero.

The three differ only in ``e``: the E8M0 encoding, the inf/NaN rule (a NaN scale, as
torchao; TransformerEngine saturates an inf amax to ``2**127``, and JAX's rounding
wraps a NaN amax's code past ``0xFF`` to 0) and the element conversion are the same.

The GEMM: on a Blackwell GPU (``sm_100``) the product of two MXFP8 operands is
``jax.nn.scaled_matmul``, which XLA lowers to cuDNN's block-scaled GEMM (cuDNN 9.10 or
newer); everywhere else, and on other GPUs, the operands are dequantized to bfloat16
(exact: an E4M3 or E5M2 value times a power of two) and multiplied in a bfloat16 GEMM
with float32 accumulation.

Example:
  >>> from jaxmp._src.fp8 import mx, quantize as q
  >>> x = jnp.array([[[0.0] * 31 + [3.0]]])
  >>> block = mx.quantize(x, q.E4M3)
  >>> int(block.scale.view(jnp.uint8)[0, 0, 0]) - 127   # floor(log2 3) - 8
  -7
  >>> float(mx.dequantize(block)[0, 0, 31])
  3.0
  >>> # floor, ceil, rceil: 3 -> 2**-7, 2**-6 (4 / 2**8), 2**-7 (3 / 448 <= 2**-7);
  >>> # 500 -> 2**0 (500 saturates to 448), 2**1 (512 / 2**8), 2**1 (500 / 448 <= 2).
  >>> [int(mx.shared_exponents(jnp.float32(a), q.E4M3, r)) - 127
  ...  for a in (3.0, 500.0) for r in ("floor", "ceil", "rceil")]
  [-7, -6, -7, 0, 1, 1]
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src.fp8 import chips
from jaxmp._src.fp8 import grouped
from jaxmp._src.fp8 import quantize as q

F32 = np.dtype(np.float32)
BF16 = np.dtype(jnp.bfloat16)
E8M0 = np.dtype(jnp.float8_e8m0fnu)
BLOCK = 32
"""Elements per MX block (OCP MX v1.0, all MX formats)."""
GROUPING = grouped.Grouping(1, BLOCK)
E8M0_BIAS = 127
E8M0_NAN = 0xFF


def emax(fp8_dtype: Any) -> int:
  """The element format's largest exponent: 8 for E4M3 (max 448), 15 for E5M2 (57344)."""
  return math.floor(math.log2(dtypes_lib.float_format(fp8_dtype).max))


def _pow2(exponent: jax.Array) -> jax.Array:
  """``2**exponent`` for int32 exponents in ``[-126, 127]``, exactly (built from bits)."""
  bits = (exponent + E8M0_BIAS).astype(np.uint32) << np.uint32(23)
  return jax.lax.bitcast_convert_type(bits, F32)


def _significand_threshold(fp8_dtype: Any, rounding: str) -> int:
  """The float32 significand bits above which an amax's exponent rounds up.

  ``floor`` never rounds up (no 23-bit significand exceeds ``0x7FFFFF``); ``ceil``
  rounds up unless ``amax`` is a power of two (significand 0); ``rceil`` where
  ``amax``'s significand exceeds ``fp8_max``'s: with ``amax = m * 2**E`` and
  ``fp8_max = M * 2**emax`` (``m``, ``M`` in ``[1, 2)``), ``amax / fp8_max = (m / M) *
  2**(E - emax)`` and ``m / M`` lies in ``(1/2, 2)``, so ``ceil(log2(amax / fp8_max))``
  is ``E - emax`` when ``m <= M`` and one more when ``m > M``; ``even`` where ``m``
  rounded half up to the element format's significand bits is 2.
  """
  if rounding == "rceil":
    max_bits = np.array(dtypes_lib.float_format(fp8_dtype).max, F32).view(np.uint32)
    return int(max_bits & np.uint32(0x7FFFFF))
  if rounding == "even":
    # torchao adds half of the element format's last significand bit to amax's bits
    # and clears the significand: the exponent goes up where the sum carries, i.e.
    # where the significand is at least 2**23 - 2**(22 - mbits).
    return 0x7FFFFF - (1 << (22 - dtypes_lib.float_format(fp8_dtype).mantissa_bits))
  return {"floor": 0x7FFFFF, "ceil": 0}[rounding]


def shared_exponents(amax: jax.Array, fp8_dtype: Any, rounding: str = "floor") -> jax.Array:
  """The E8M0 codes (``uint8``) of blocks with these amaxes (float32).

  ``clamp(e, -127, 127) + 127`` with ``e`` from ``rounding`` (see the module): read
  exactly from the float32 exponent and significand fields, ``floor(log2(amax)) -
  emax`` plus one where the significand exceeds the rounding's threshold; 0 for an
  amax below ``2**-126`` (every rounding's ``e`` clamps to -127 there); ``0xFF`` (NaN)
  for inf or NaN.
  """
  amax = jnp.asarray(amax, F32)
  bits = jax.lax.bitcast_convert_type(amax, np.uint32)
  # biased - 127 is floor(log2(amax)) for normal amaxes; 0 (zero, subnormal) clamps to -127.
  biased = (bits >> np.uint32(23)).astype(np.int32)
  round_up = (bits & np.uint32(0x7FFFFF)) > np.uint32(_significand_threshold(fp8_dtype, rounding))
  exponent = biased - E8M0_BIAS - emax(fp8_dtype) + round_up.astype(np.int32)
  codes = jnp.clip(exponent, -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
  return jnp.where(jnp.isfinite(amax), codes, E8M0_NAN).astype(np.uint8)


def to_e8m0(codes: jax.Array) -> jax.Array:
  """``uint8`` codes as ``float8_e8m0fnu`` (the same bits)."""
  return jax.lax.bitcast_convert_type(codes.astype(np.uint8), E8M0)


def decode(scale: jax.Array) -> jax.Array:
  """E8M0 scales as float32 ``2**(code - 127)``: NaN for ``0xFF``, ``2**-127`` for 0."""
  codes = jax.lax.bitcast_convert_type(scale, np.uint8).astype(np.int32)
  value = _pow2(jnp.maximum(codes - E8M0_BIAS, -126))
  value = jnp.where(codes == 0, np.float32(2.0**-127), value)
  return jnp.where(codes == E8M0_NAN, np.float32(np.nan), value)


def quantize(x: jax.Array, fp8_dtype: Any, rounding: str = "floor") -> grouped.Quantized:
  """``x`` (``(B, R, C)``) in MXFP8: elements in ``fp8_dtype``, one E8M0 scale per 32.

  Args:
    x: a canonical operand.
    fp8_dtype: the element format.
    rounding: the scale rounding, one of
      :data:`~jaxmp._src.fp8.recipes.SCALE_ROUNDINGS` (see the module).

  Returns:
    ``Quantized(data, scale)``: data ``(B, R, C')`` with ``C'`` the next multiple of
    32 (zero-padded), scale ``(B, R, C' / 32)`` in ``float8_e8m0fnu``.
  """
  codes = shared_exponents(grouped.amax(x, GROUPING), fp8_dtype, rounding)
  exponent = codes.astype(np.int32) - E8M0_BIAS
  # x * 2**-e (exact); a NaN-scale block keeps its elements (multiplier 1) and its
  # inf/NaN stay non-finite; the NaN scale makes the whole block NaN when dequantized.
  multiplier = jnp.where(codes == E8M0_NAN, np.float32(1.0), _pow2(-jnp.clip(exponent, -127, 126)))
  padded = grouped.pad(x, GROUPING).astype(F32)
  b, r, c = padded.shape
  blocks = jnp.reshape(padded, (b, r, c // BLOCK, BLOCK))
  data = q.saturate(blocks * multiplier[..., None], blocks, fp8_dtype)
  return grouped.Quantized(jnp.reshape(data, padded.shape), to_e8m0(codes))


def dequantize(x: grouped.Quantized, dtype: Any = F32) -> jax.Array:
  """``element * 2**e`` block by block, in ``dtype`` (still padded)."""
  b, r, c = x.data.shape
  blocks = jnp.reshape(x.data, (b, r, c // BLOCK, BLOCK)).astype(dtype)
  return jnp.reshape(blocks * decode(x.scale).astype(dtype)[..., None], x.data.shape)


def _dequantized_gemm(a: grouped.Quantized, b: grouped.Quantized, out_dtype: Any) -> jax.Array:
  a, b = grouped.held(a, b)  # so that XLA does not skip the quantization on GPUs
  dims = (((2,), (2,)), ((0,), (0,)))
  preferred = out_dtype if np.dtype(out_dtype) == BF16 else F32
  out = jax.lax.dot_general(dequantize(a, BF16), dequantize(b, BF16), dims,
                            preferred_element_type=preferred)
  return out.astype(out_dtype)


def _cudnn_gemm(a: grouped.Quantized, b: grouped.Quantized, out_dtype: Any) -> jax.Array:
  return jax.nn.scaled_matmul(a.data, b.data, a.scale, b.scale,
                              preferred_element_type=np.dtype(out_dtype))


def gemm(a: grouped.Quantized, b: grouped.Quantized, out_dtype: Any,
         block_scaled_gemm: bool = False) -> jax.Array:
  """``(B, P, C) x (B, Q, C) -> (B, P, Q)`` for two MXFP8 operands, float32 accumulation.

  Args:
    a: the first operand, from :func:`quantize`.
    b: the second operand.
    out_dtype: the product's dtype.
    block_scaled_gemm: use ``jax.nn.scaled_matmul`` (cuDNN's block-scaled GEMM) when
      lowering for CUDA; only Blackwell GPUs run it natively (the fp8 support module
      decides). Other platforms always take the dequantizing path.

  Returns:
    The product in ``out_dtype``.
  """
  if not block_scaled_gemm:
    return _dequantized_gemm(a, b, out_dtype)
  return jax.lax.platform_dependent(
      a, b, cuda=lambda a, b: _cudnn_gemm(a, b, out_dtype),
      default=lambda a, b: _dequantized_gemm(a, b, out_dtype))


def grouping(recipe: Any, role: str) -> grouped.Grouping:
  """:data:`GROUPING` for every operand: 32 elements along the contracted dimension."""
  del recipe, role
  return GROUPING


def fp8_format(recipe: Any, role: str) -> np.dtype:
  """E4M3 for the input and kernel, the recipe's ``gradient_format`` for the gradient."""
  return q.role_format(role, recipe.gradient_format)


def quantize_operand(x: jax.Array, recipe: Any, role: str) -> grouped.Quantized:
  """A canonical operand in ``role`` under an ``MXScaling`` recipe (:func:`quantize`)."""
  return quantize(x, fp8_format(recipe, role), recipe.scale_rounding)


def gemm_operands(a: grouped.Quantized, b: grouped.Quantized, recipe: Any, call: Any
                  ) -> jax.Array:
  """:func:`gemm` for a GEMM ``call``: cuDNN's block-scaled GEMM where the target runs MX."""
  del recipe
  return gemm(a, b, call.out_dtype, call.target.mx)


def lowering(recipe: Any, target: chips.Target) -> chips.Lowering:
  """cuDNN's MXFP8 GEMM on Blackwell (cuDNN >= 9.10); a bfloat16 GEMM elsewhere."""
  del recipe
  unknown = chips.unknown_fp8(target)
  if unknown is not None:
    return unknown
  if target.mx:
    return chips.Lowering("mx", "cuDNN's MXFP8 block-scaled GEMM")
  return chips.Lowering("fallback", "a bfloat16 GEMM on dequantized operands (MXFP8 GEMMs "
                        "need a Blackwell GPU with cuDNN >= 9.10)")


__all__ = (
    "BLOCK",
    "E8M0",
    "GROUPING",
    "decode",
    "dequantize",
    "emax",
    "fp8_format",
    "gemm",
    "gemm_operands",
    "grouping",
    "lowering",
    "quantize",
    "quantize_operand",
    "shared_exponents",
    "to_e8m0",
)
