"""Plain NumPy implementations of the published fp8 formulas, for jaxmp to be checked against.

Nothing here uses JAX or ml_dtypes: fp8 values are encoded bit by bit from the format
definitions (OCP 8-bit floating point, OFP8: E4M3 with bias 7, no infinities, max 448;
E5M2 with bias 15, infinities, max 57344; round to nearest, ties to even), E8M0 scales
from OCP MX v1.0 (unsigned biased exponent, bias 127, 0xFF NaN), the current-scaling
scale from TransformerEngine/Flax (``1 / ((fp8_max / amax) / 2**margin)`` in float32,
torchao's power-of-two rounding of the multiplier), the groupings of torchao's rowwise
recipe and DeepSeek-V3's 1x128 / 128x128 blocks, and the MX conversion of OCP MX v1.0
section 6.3 (shared exponent ``floor(log2(amax)) - emax``, elements clamped) with
torchao's CEIL and the RCEIL of torchao, TransformerEngine and JAX (``amax / fp8_max``
in float32 rounded up to E8M0), and
AQT's symmetric int8 (scale ``amax / 127`` in float32, round to nearest even, clip to
``[-127, 127]``, integer accumulation, float32 rescale by the two row scales).
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
FORMATS = {
    # name: (exponent bias, mantissa bits, max finite, has inf)
    "e4m3": (7, 3, 448.0, False),
    "e5m2": (15, 2, 57344.0, True),
}
EMAX = {"e4m3": 8, "e5m2": 15}


def encode(values, fmt: str) -> np.ndarray:
  """fp8 bit patterns (uint8) of ``values`` (exact float64 inputs), round to nearest even.

  Values beyond the max must have been clipped by the caller (as quantization does);
  inf is inf in E5M2 and NaN in E4M3; NaN is the all-ones pattern ``0x7F``.
  """
  bias, mbits, max_finite, has_inf = FORMATS[fmt]
  v = np.asarray(values, np.float64)
  a = np.abs(v)
  finite = np.isfinite(a)
  assert np.all(a[finite] <= max_finite), f"values beyond the {fmt} range: clip first"
  safe = np.where(finite & (a > 0), a, 1.0)
  e = np.maximum(np.floor(np.log2(safe)), 1 - bias)         # the binade (subnormals: emin)
  q = safe / 2.0**e * 2**mbits                               # in [2**mbits, 2**(mbits+1))
  n = np.floor(q)
  frac = q - n
  n = n + ((frac > 0.5) | ((frac == 0.5) & (n % 2 == 1)))   # ties to even
  e = np.where(n == 2 ** (mbits + 1), e + 1, e)              # rounding carried a binade
  n = np.where(n == 2 ** (mbits + 1), 2**mbits, n)
  subnormal = n < 2**mbits
  bits = np.where(subnormal, n, (e + bias) * 2**mbits + (n - 2**mbits))
  bits = np.where(a == 0, 0, bits)
  inf_bits = (2 ** (7 - mbits) - 1) * 2**mbits if has_inf else 0x7F
  bits = np.where(np.isinf(a), inf_bits, bits)
  bits = np.where(np.isnan(a), 0x7F, bits)
  sign = np.where(np.signbit(v) & ~np.isnan(v), 0x80, 0)
  return (bits.astype(np.int64) | sign).astype(np.uint8)


def decode(codes, fmt: str) -> np.ndarray:
  """The float64 values of fp8 bit patterns."""
  bias, mbits, _, has_inf = FORMATS[fmt]
  c = np.asarray(codes, np.uint8).astype(np.int64)
  sign = np.where(c & 0x80, -1.0, 1.0)
  e, m = (c >> mbits) & (2 ** (7 - mbits) - 1), c & (2**mbits - 1)
  top = 2 ** (7 - mbits) - 1
  value = np.where(e == 0, m / 2**mbits * 2.0 ** (1 - bias),
                   (1 + m / 2**mbits) * 2.0 ** (e - bias))
  if has_inf:
    value = np.where(e == top, np.where(m == 0, np.inf, np.nan), value)
  else:
    value = np.where((e == top) & (m == 2**mbits - 1), np.nan, value)
  return sign * value


def current_scale(amax, fmt: str, margin: int = 0, power_of_two: bool = False) -> np.ndarray:
  """``1 / ((fp8_max / amax) / 2**margin)`` in float32; 1 where that is not finite > 0.

  With ``power_of_two`` the multiplier ``(fp8_max / amax) / 2**margin`` is rounded
  down to a power of two first (torchao's ``round_scales_to_power_of_2``).
  """
  amax = np.asarray(amax, F32)
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    inverse = (F32(FORMATS[fmt][2]) / amax) / F32(2.0**margin)
    if power_of_two:
      mantissa, exponent = np.frexp(inverse.astype(np.float64))
      inverse = np.where(np.isfinite(inverse) & (inverse > 0),
                         np.ldexp(1.0, exponent - 1), inverse).astype(F32)
    scale = F32(1) / inverse
  ok = np.isfinite(amax) & (amax > 0) & np.isfinite(scale) & (scale > 0)
  return np.where(ok, scale, F32(1)).astype(F32)


def pad(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
  """``(B, R, C)`` zero-padded at the end to multiples of ``rows`` and ``cols``."""
  return np.pad(x, ((0, 0), (0, -x.shape[1] % rows), (0, -x.shape[2] % cols)))


def group_amax(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
  """``max|x|`` per ``rows x cols`` group of a ``(B, R, C)`` array (partial groups: own elements)."""
  b, r, c = x.shape
  out = np.zeros((b, -(-r // rows), -(-c // cols)), F32)
  for i in range(out.shape[1]):
    for j in range(out.shape[2]):
      block = x[:, i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
      out[:, i, j] = np.max(np.abs(block.reshape(b, -1)), axis=1)  # NaN propagates
  return out


def quantize_groups(x: np.ndarray, rows: int, cols: int, fmt: str, margin: int = 0,
                    power_of_two: bool = False):
  """Current scaling per group: (padded fp8 codes, float32 scales), ``x / scale`` in float32."""
  x = np.asarray(x, F32)
  scale = current_scale(group_amax(x, rows, cols), fmt, margin, power_of_two)
  full = np.repeat(np.repeat(scale, rows, axis=1), cols, axis=2)
  padded = pad(x, rows, cols)
  with np.errstate(invalid="ignore"):
    quotient = padded / full[:, :padded.shape[1], :padded.shape[2]]
  bound = FORMATS[fmt][2]
  clipped = np.where(np.isinf(quotient), quotient, np.clip(quotient, -bound, bound))
  return encode(clipped, fmt), scale


def dequantize_groups(codes: np.ndarray, scale: np.ndarray, rows: int, cols: int,
                      fmt: str) -> np.ndarray:
  full = np.repeat(np.repeat(scale.astype(np.float64), rows, axis=1), cols, axis=2)
  return decode(codes, fmt) * full[:, :codes.shape[1], :codes.shape[2]]


def block_scaled_operands(x: np.ndarray, w: np.ndarray, block: int = 128, fmt: str = "e4m3"):
  """DeepSeek-V3's block-scaled GEMM operands and their exact product.

  ``x`` ``(B, P, C)`` in ``1 x block`` tiles, ``w`` ``(B, Q, C)`` in ``block x block``
  blocks: ``(codes, scales)`` of each, and the product of their dequantized values in
  float64, ``(B, P', Q')`` over the padded rows.
  """
  (xc, xs), (wc, ws) = (quantize_groups(v, r, block, fmt) for v, r in ((x, 1), (w, block)))
  exact = np.einsum("bpc,bqc->bpq", dequantize_groups(xc, xs, 1, block, fmt),
                    dequantize_groups(wc, ws, block, block, fmt))
  return (xc, xs), (wc, ws), exact


def e8m0_floor(amax, fmt: str) -> np.ndarray:
  """OCP MX v1.0 section 6.3: ``floor(log2(amax)) - emax``, clamped, biased; 0xFF for inf/NaN.

  Amax 0 reads as the smallest normal float32 (whose exponent then clamps).
  """
  a = np.asarray(amax, np.float64)
  finite = np.isfinite(a)
  safe = np.where(finite, np.maximum(a, 2.0**-126), 1.0)
  shared = np.clip(np.floor(np.log2(safe)) - EMAX[fmt], -127, 127)
  return np.where(finite, shared + 127, 0xFF).astype(np.uint8)


def e8m0_ceil(amax, fmt: str) -> np.ndarray:
  """torchao CEIL (torchao/prototype/mx_formats/mx_tensor.py, ``to_mx``): the float32
  exponent of amax, "add one to scale if the mantissa is larger than 0", minus emax,
  clamped to ``[-127, 128]`` and biased; 0xFF where amax is not finite.

  Read here with ``frexp`` (``amax = m * 2**E``, ``m`` in ``[0.5, 1)``): ``ceil(log2
  amax)`` is ``E - 1`` for ``m == 0.5`` and ``E`` otherwise; a float32 subnormal has
  exponent field 0, i.e. ``2**-127`` (torchao reads it so) and clamps to code 0.
  """
  a = np.asarray(amax, np.float64)
  finite = np.isfinite(a)
  m, e = np.frexp(np.where(finite & (a >= 2.0**-126), a, 2.0**-127))
  shared = np.clip(np.where(m == 0.5, e - 1, e) - EMAX[fmt], -127, 128)
  return np.where(finite, shared + 127, 0xFF).astype(np.uint8)


def _f32_to_e8m0_round_up(value) -> np.ndarray:
  """torchao's ``_f32_to_e8m0_rceil`` / TransformerEngine's ``float_to_e8m0`` (non-Blackwell
  path) / JAX's ``cast_to_e8m0_with_rounding_up``: the float32 exponent field, plus one
  where any significand bit is set; for a float32 subnormal (exponent field 0) only
  above ``2**-127`` (significand above ``0x400000``); 0xFF for inf/NaN (torchao)."""
  value = np.asarray(value, F32)
  bits = value.view(np.uint32)
  exponent = (bits >> 23).astype(np.int64) & 0xFF
  mantissa = bits & 0x7FFFFF
  up = np.where(exponent == 0, mantissa > 0x400000, mantissa != 0)
  return np.where(np.isfinite(value), exponent + up, 0xFF).astype(np.uint8)


def e8m0_rceil(amax, fmt: str, quotient: str = "reciprocal") -> np.ndarray:
  """RCEIL: ``amax / fp8_max`` in float32, rounded up to E8M0.

  ``quotient="reciprocal"`` multiplies by the float32 reciprocal, as torchao
  (``max_abs * (1.0 / max_pos)``) and TransformerEngine (``amax * max_norm_rcp``);
  ``"divide"`` divides, as JAX (``jnp.max(jnp.abs(values)) / MAX``).
  """
  a = np.asarray(amax, F32)
  bound = F32(FORMATS[fmt][2])
  with np.errstate(over="ignore", invalid="ignore"):
    q = a * (F32(1) / bound) if quotient == "reciprocal" else a / bound
  return _f32_to_e8m0_round_up(q)


def e8m0_even(amax, fmt: str) -> np.ndarray:
  """torchao EVEN (torchao/prototype/mx_formats/mx_tensor.py, ``to_mx``): to amax's
  float32 bits add ``1 << (23 - mbits - 1)`` (``mbits``: the element format's
  significand bits), clear the significand (``& (((1 << (8 + 1)) - 1) << 23)``), then
  the floor rule on the result's exponent field, clamped and biased; 0xFF where amax is
  not finite. An exponent field of 0 (amax zero or subnormal, not carried) reads as
  ``2**-126``, as torchao's ``+ eps`` (the smallest normal) makes it, and clamps.
  """
  a = np.asarray(amax, F32)
  bits = a.view(np.uint32).astype(np.int64)
  rounded = (bits + (1 << (23 - FORMATS[fmt][1] - 1))) & (((1 << (8 + 1)) - 1) << 23)
  field = (rounded >> 23) & 0xFF
  shared = np.clip(np.maximum(field, 1) - 127 - EMAX[fmt], -127, 127)
  return np.where(np.isfinite(a), shared + 127, 0xFF).astype(np.uint8)


E8M0_RULES = {"floor": e8m0_floor, "ceil": e8m0_ceil, "rceil": e8m0_rceil, "even": e8m0_even}


def mx_quantize(x: np.ndarray, fmt: str, rounding: str = "floor"):
  """MX per 32-element block: (padded element codes, E8M0 codes as uint8).

  The scale from :data:`E8M0_RULES` (OCP MX v1.0's floor by default), elements ``x /
  2**e`` clipped to the format's max and rounded; a NaN-scale block keeps its elements.
  """
  x = pad(np.asarray(x, F32), 1, 32)
  b, r, c = x.shape
  blocks = x.reshape(b, r, c // 32, 32).astype(np.float64)
  amax = np.max(np.abs(blocks), axis=-1)
  codes = E8M0_RULES[rounding](amax, fmt)
  shared = np.where(codes == 0xFF, 0, codes.astype(np.int64) - 127)
  bound = FORMATS[fmt][2]
  with np.errstate(invalid="ignore"):
    quotient = blocks / 2.0**shared[..., None]
  elements = np.where(np.isinf(quotient), quotient, np.clip(quotient, -bound, bound))
  return encode(elements.reshape(b, r, c), fmt), codes


def mx_dequantize(codes: np.ndarray, scale_codes: np.ndarray, fmt: str) -> np.ndarray:
  scale = np.where(scale_codes == 0xFF, np.nan, np.ldexp(1.0, scale_codes.astype(int) - 127))
  return decode(codes, fmt) * np.repeat(scale, 32, axis=-1)


def int8_quantize_rows(x: np.ndarray):
  """Symmetric int8 per row of a 2-D array: (codes as int8, float32 scales ``(rows,)``).

  ``scale = float32(amax) / 127`` (1 for an all-zero row); ``round(x / scale)`` in
  float32, ties to even (``np.round``), clipped to ``[-127, 127]``.
  """
  x = np.asarray(x, F32)
  scale = np.max(np.abs(x), axis=1) / F32(127)
  scale = np.where(scale > 0, scale, F32(1)).astype(F32)
  codes = np.clip(np.round(x / scale[:, None]), -127, 127)
  return codes.astype(np.int8), scale


def int8_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """``a @ b.T`` of two 2-D arrays (rows along the contraction), each quantized per row.

  The integer products are summed exactly (int64), the sum converted to float32 and
  multiplied by ``scale_a[i] * scale_b[j]`` (float32).
  """
  qa, sa = int8_quantize_rows(a)
  qb, sb = int8_quantize_rows(b)
  acc = qa.astype(np.int64) @ qb.astype(np.int64).T
  return acc.astype(F32) * (sa[:, None] * sb[None, :])
