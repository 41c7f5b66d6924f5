"""Every recipe against a plain NumPy implementation of its published formula (tests/fp8/reference.py).

Bit-exact where the formula is exact: fp8 encodings and rounding, E8M0 scales, the
current-scaling scale (float32 arithmetic, power-of-two rounding), the row, tile,
block and MX groupings with their partial-group rule, and the edge cases (zeros,
all-zero groups, inf, NaN, tiny and huge amaxes, saturation). The GEMMs accumulate in
float32 in some order, so they are compared with the float64 product of the
reference's quantized operands at float32 accumulation accuracy.
"""

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp import fp8
from jaxmp._src.fp8 import mx
from jaxmp._src.fp8 import per_gemm
from jaxmp._src.fp8 import quantize as q
from jaxmp._src.fp8 import recipes as recipes_lib
from jaxmp._src.fp8 import scaled_gemm
from tests import backends
from tests.fp8 import reference as ref

DENSE = (((1,), (0,)), ((), ()))
"""A Dense layer's dimension numbers: contract the input's last axis with the kernel's first."""

FMT = {"e4m3": q.E4M3, "e5m2": q.E5M2}


def _bits(x):
  return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8))


def _assert_same_codes(actual_fp8, expected_codes, fmt, exact=True):
  """fp8 arrays equal bit for bit (any NaN pattern matches any NaN); not ``exact`` (a
  GPU, whose scales are an ulp off the reference's: tests/backends.py), a few codes
  may be one step away."""
  actual_nan = np.isnan(ref.decode(_bits(actual_fp8), fmt))
  expected_nan = np.isnan(ref.decode(expected_codes, fmt))
  np.testing.assert_array_equal(actual_nan, expected_nan)
  actual, expected = np.where(actual_nan, 0, _bits(actual_fp8)), np.where(expected_nan, 0,
                                                                          expected_codes)
  if exact:
    np.testing.assert_array_equal(actual, expected)
    return
  # Sign and magnitude onto one line, where neighbouring codes are one apart.
  line = lambda b: np.where(b & 0x80, -(b.astype(np.int32) & 0x7F), b.astype(np.int32) & 0x7F)
  steps = np.abs(line(actual) - line(expected))
  assert steps.max(initial=0) <= 1, f"codes {steps.max()} steps from the reference"
  assert np.mean(steps > 0) <= backends.CODES_OFF_BY_ONE_STEP, (
      f"{np.mean(steps > 0):.3g} of the codes one step from the reference")


# ---------------------------------------------------------------- encodings and rounding


@pytest.mark.parametrize("fmt, cases", [
    ("e4m3", {448.0: 0x7E, 1.0: 0x38, -1.0: 0xB8, 2.0**-6: 0x08, 2.0**-9: 0x01,
              7 / 8 * 2.0**-6: 0x07, 1.0625: 0x38, 1.1875: 0x3A, 0.0: 0x00, 240.0: 0x77}),
    ("e5m2", {57344.0: 0x7B, 1.0: 0x3C, 2.0**-14: 0x04, 2.0**-16: 0x01, np.inf: 0x7C,
              -np.inf: 0xFC, 1.125: 0x3C, 1.375: 0x3E, -0.0: 0x80}),
])
def test_reference_encoder_follows_the_format_definitions(fmt, cases):
  # Ties: 1.0625 lies halfway between 1 and 1.125 in E4M3 and goes to the even 1.0;
  # 1.1875 between 1.125 and 1.25 goes to 1.25; E5M2 likewise 1.125 -> 1, 1.375 -> 1.5.
  values = np.array(list(cases), np.float64)
  np.testing.assert_array_equal(ref.encode(values, fmt), np.array(list(cases.values())))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_fp8_code_round_trips_through_jaxmp_quantize(fmt):
  codes = np.arange(256, dtype=np.uint8)
  values = ref.decode(codes, fmt)
  finite = np.isfinite(values) | (np.isinf(values) & (fmt == "e5m2"))
  quantized = q.quantize(jnp.asarray(values[finite], jnp.float32), FMT[fmt], jnp.float32(1))
  np.testing.assert_array_equal(_bits(quantized), codes[finite])
  np.testing.assert_array_equal(ref.encode(values[finite], fmt), codes[finite])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rounding_to_fp8_is_round_to_nearest_even_as_the_reference(fmt):
  values = ref.decode(np.arange(256, dtype=np.uint8), fmt)
  grid = np.unique(values[np.isfinite(values)])
  midpoints = (grid[:-1] + grid[1:]) / 2       # exact ties
  rng = np.random.default_rng(0)
  between = grid[:-1] + (grid[1:] - grid[:-1]) * rng.uniform(size=grid.size - 1)
  x = np.concatenate([midpoints, between]).astype(np.float32)
  _assert_same_codes(q.quantize(jnp.asarray(x), FMT[fmt], jnp.float32(1)),
                     ref.encode(x.astype(np.float64), fmt), fmt)


def test_e8m0_scales_are_biased_exponents_with_a_nan_code():
  codes = np.array([0, 1, 100, 126, 127, 128, 200, 254, 255], np.uint8)
  decoded = np.asarray(mx.decode(mx.to_e8m0(jnp.asarray(codes))))
  expected = np.where(codes == 255, np.nan, np.ldexp(1.0, codes.astype(int) - 127))
  np.testing.assert_array_equal(decoded, expected.astype(np.float32))
  # Codes read from amaxes: floor(log2(amax)) - emax + 127; 0xFF for inf/NaN; 0 below 2**-126.
  amax = np.array([1.0, 3.0, 448.0, 0.0, 1e-40, 2.0**-126, 3e38, np.inf, np.nan], np.float32)
  expected = [127 - 8, 128 - 8, 135 - 8, 0, 0, 0, 127 + 127 - 8, 255, 255]
  np.testing.assert_array_equal(np.asarray(mx.shared_exponents(amax, q.E4M3)), expected)
  np.testing.assert_array_equal(np.asarray(mx.shared_exponents(amax[:3], q.E5M2)),
                                [127 - 15, 128 - 15, 135 - 15])


# ---------------------------------------------------------------- scales


@pytest.mark.parametrize("device", backends.DEVICES)
def test_power_of_two_scales_round_the_multiplier_down_as_torchao(device):
  # On a GPU the float32 scales' two divisions are each within an ulp of IEEE
  # (tests/backends.py); the power-of-two ones must still be torchao's exactly.
  amax = np.array([0.0, 1e-30, 0.003, 1.0, 3.0, 447.0, 448.0, 449.0, 1e5, 3e38, np.inf, np.nan],
                  np.float32)
  for fmt in ("e4m3", "e5m2"):
    for margin in (0, 3):
      with backends.on(device):
        actual = q.scale_from_amax(amax, jnp.float32(1), FMT[fmt], margin, power_of_two=True)
        plain = q.scale_from_amax(amax, jnp.float32(1), FMT[fmt], margin)
      expected = ref.current_scale(amax, fmt, margin, power_of_two=True)
      np.testing.assert_array_equal(np.asarray(actual), expected)
      if backends.exact(device):
        np.testing.assert_array_equal(np.asarray(plain), ref.current_scale(amax, fmt, margin))
      else:
        assert backends.max_ulps(plain, ref.current_scale(amax, fmt, margin)) <= (
            backends.SCALE_ULPS)
  scales = ref.current_scale(amax[1:-3], "e4m3", power_of_two=True)
  assert np.all(np.frexp(scales)[0] == 0.5)                     # powers of two
  assert np.all(scales.astype(np.float64) * 448 >= amax[1:-3])  # the amax still fits


# ---------------------------------------------------------------- groupings


def _edge_case_operand(shape, seed=0):
  """Random values with an all-zero row and block, an inf, a NaN and a huge outlier."""
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  x[0, 1, :] = 0.0                        # an all-zero row (and every group in it)
  x[0, 2, 5] = np.inf
  x[-1, -1, 3] = np.nan
  x[0, 0, 7] = 3e4
  return x


@pytest.mark.parametrize("recipe, role, rows, cols", [
    (fp8.RowwiseScaling(power_of_two=False), "input", 1, None),
    (fp8.RowwiseScaling(), "kernel", 1, None),
    (fp8.RowwiseScaling(margin=2, gradient_format="e5m2"), "output_grad", 1, None),
    (fp8.BlockScaling(), "input", 1, 128),
    (fp8.BlockScaling(), "kernel", 128, 128),
    (fp8.BlockScaling(power_of_two=True), "output_grad", 1, 128),
    (fp8.BlockScaling(block_size=16, margin=1), "kernel", 16, 16),
    (fp8.CurrentScaling(), "output_grad", None, None),
])
@pytest.mark.parametrize("device", backends.DEVICES)
def test_current_scaling_groups_match_the_reference(recipe, role, rows, cols, device):
  # 150 x 300: neither a multiple of 128 nor of 16: the last groups are partial.
  x = _edge_case_operand((2, 150, 300))
  fmt = "e5m2" if per_gemm.fp8_format(recipe, role) == q.E5M2 else "e4m3"
  with backends.on(device):
    got = per_gemm.quantize(jnp.asarray(x), recipe, role)
  if rows is None:  # per tensor: one group, batch included
    codes, scale = ref.quantize_groups(x.reshape(1, 1, -1), 1, x.size, fmt, recipe.margin,
                                       recipe.power_of_two)
    codes = codes.reshape(x.shape)
  else:
    codes, scale = ref.quantize_groups(x, rows, cols or x.shape[2], fmt, recipe.margin,
                                       recipe.power_of_two)
  if backends.exact(device):
    np.testing.assert_array_equal(np.asarray(got.scale).reshape(scale.shape), scale)
  else:  # two divisions, each within an ulp of IEEE (tests/backends.py)
    assert backends.max_ulps(np.asarray(got.scale).reshape(scale.shape), scale) <= (
        backends.SCALE_ULPS)
  _assert_same_codes(got.data, codes, fmt, exact=backends.exact(device))


def test_all_zero_and_non_finite_groups_get_scale_one_and_stay_non_finite():
  x = _edge_case_operand((2, 150, 300))
  got = per_gemm.quantize(jnp.asarray(x), fp8.BlockScaling(), "kernel")
  scale = np.asarray(got.scale)
  assert scale[0, 0, 0] == 1.0          # holds the inf: non-finite amax
  assert scale[1, 1, 0] == 1.0          # the block of batch 1 holding the NaN
  data = ref.decode(_bits(got.data), "e4m3")
  assert np.isnan(data[0, 2, 5]) and np.isnan(data[1, 149, 3])
  rows = per_gemm.quantize(jnp.asarray(x), fp8.RowwiseScaling(), "input")
  assert np.asarray(rows.scale)[0, 1, 0] == 1.0 and not _bits(rows.data)[0, 1].any()


ROUNDINGS = ("floor", "ceil", "rceil", "even")


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mx_blocks_match_the_ocp_conversion(fmt, rounding):
  x = _edge_case_operand((2, 3, 70))    # 70 = 2 blocks + a partial block of 6
  x[1, 0, :32] = 0.0                    # an all-zero block
  x[1, 1, :32] = np.linspace(1, 2, 32) * 2.0**-120  # amax below 2**-118: smallest scale
  x[1, 2, :32] = np.linspace(-1.9, 1.9, 32) * 2.0**10  # top of the binade saturates (floor)
  x[0, 0, 40:64] *= 2.0**100            # a huge block
  x[1, 0, 40] = np.nan                  # a NaN in the block after the all-zero one
  got = mx.quantize(jnp.asarray(x), FMT[fmt], rounding)
  codes, scale_codes = ref.mx_quantize(x, fmt, rounding)
  np.testing.assert_array_equal(_bits(got.scale), scale_codes)
  _assert_same_codes(got.data, codes, fmt)
  assert got.data.shape == (2, 3, 96) and got.scale.shape == (2, 3, 3)
  top = ref.decode(_bits(got.data), fmt)[1, 2, 0]
  # even rounds 1.9 to the element format's significand bits: 1.875 for E4M3 (its scale
  # stays floor's), 2 for E5M2 (one binade up, as ceil's).
  if rounding == "floor" or (rounding == "even" and fmt == "e4m3"):
    # Saturation: amax 1.9 * 2**10 -> e = 10 - emax, elements up to 1.9 * 2**emax, clamped.
    assert _bits(got.scale)[1, 2, 0] == 127 + 10 - ref.EMAX[fmt]
    assert top == -ref.FORMATS[fmt][2]
    assert _bits(got.scale)[1, 1, 0] == 0                          # 2**-127
    assert ref.decode(_bits(got.data), fmt)[1, 1, 31] == 2.0**8     # 2**-119 * 2**127
  else:
    # ceil(log2(1.9 * 2**10)) - emax = 11 - emax; ceil(log2(1.9 * 2**10 / (1.75 * 2**emax)))
    # is the same (1.9 > 1.75): no clamp, -1.9 * 2**(emax - 1) rounded to the format.
    assert _bits(got.scale)[1, 2, 0] == 127 + 11 - ref.EMAX[fmt]
    assert top == ref.decode(ref.encode(-1.9 * 2.0**(ref.EMAX[fmt] - 1), fmt), fmt)
  # Dequantized bit for bit; NaN for the blocks holding inf or NaN. (The 2**-127 scale is
  # a subnormal float32, which XLA:CPU flushes to zero: those blocks are left out.)
  expected = ref.mx_dequantize(codes, scale_codes, fmt)
  actual = np.asarray(mx.dequantize(got))
  normal = np.isfinite(expected) & (np.repeat(scale_codes, 32, axis=-1) > 0)
  np.testing.assert_array_equal(actual[normal], expected[normal].astype(np.float32))
  assert np.isnan(actual[0, 2, :32]).all() and np.isnan(actual[1, 0, 32:64]).all()
  assert _bits(got.scale)[0, 2, 0] == _bits(got.scale)[1, 0, 1] == 0xFF


def test_rounding_mx_scales_up_cuts_the_product_error_on_gaussian_data():
  # The numbers (#29): 4.14% with floor (its saturated block maxima), 3.75% with
  # the rounded-up scales; ceil and rceil round the normal fp8 values alike.
  k = jax.random.split(jax.random.key(0), 2)
  x, w = jax.random.normal(k[0], (256, 1024)), jax.random.normal(k[1], (1024, 256))
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  error = {}
  for rounding in ROUNDINGS:
    y = fp8.fp8_dot_general(x, w, DENSE, recipe=fp8.MXScaling(scale_rounding=rounding))
    error[rounding] = np.linalg.norm(np.asarray(y, np.float64) - exact) / np.linalg.norm(exact)
  assert 0.040 < error["floor"] < 0.042, error
  assert 0.037 < error["rceil"] < 0.038 and abs(error["ceil"] - error["rceil"]) < 1e-6, error
  # E4M3 blocks saturate where amax's significand is in [1.75, 2) under floor, in
  # [1.75, 1.9375) under even: 3.90%, between the two.
  assert 0.0385 < error["even"] < 0.0395, error


def _binade(exponent):
  """Every float32 of ``[2**exponent, 2**(exponent + 1))`` (every 23-bit significand)."""
  bits = np.uint32(exponent + 127) << np.uint32(23) | np.arange(1 << 23, dtype=np.uint32)
  return bits.view(np.float32)


def _edge_amaxes(fmt):
  """Amaxes at the rules' edges: 0, subnormals, powers of two, the format max times powers
  of two and their neighbours, float32's max, inf and NaN."""
  bound = np.float32(ref.FORMATS[fmt][2])
  around = [bound * np.float32(2.0**k) for k in (-126, -119, -40, -1, 0, 1, 60, 100)]
  around += [np.nextafter(a, np.float32(0)) for a in around] + [
      np.nextafter(a, np.float32(np.inf)) for a in around]
  return np.array([0.0, 1e-45, 2.0**-149 * 3, 2.0**-127, 2.0**-126 * 0.75, 2.0**-126,
                   2.0**-120, 0.5, 1.0, 2.0**8, 2.0**15, 2.0**127, 1.75, 1.7500001,
                   np.finfo(np.float32).max, np.inf, -np.inf, np.nan, *around], np.float32)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mx_scale_roundings_match_the_published_formulas(fmt, rounding):
  # Every significand of one binade (the rules look at the significand only, the binade
  # shifts the code) and the edge cases, bit for bit.
  amax = np.concatenate([_binade(0), _edge_amaxes(fmt)])
  got = np.asarray(mx.shared_exponents(jnp.asarray(amax), FMT[fmt], rounding))
  np.testing.assert_array_equal(got, ref.E8M0_RULES[rounding](amax, fmt))
  if rounding == "rceil":  # JAX divides where torchao and TransformerEngine multiply
    np.testing.assert_array_equal(got, ref.e8m0_rceil(amax, fmt, quotient="divide"))
  # What the names promise: floor saturates only above fp8_max * 2**e, ceil and rceil
  # never; rceil's scale is the smallest that fits; ceil's block max lands in
  # (2**(emax-1), 2**emax].
  finite = np.isfinite(amax) & (amax >= 2.0**-100)
  scaled = amax[finite].astype(np.float64) / np.ldexp(1.0, got[finite].astype(int) - 127)
  bound = ref.FORMATS[fmt][2]
  if rounding == "floor":
    assert ((scaled >= 2.0**ref.EMAX[fmt]) & (scaled < 2.0**(ref.EMAX[fmt] + 1))).all()
  elif rounding == "ceil":
    assert ((scaled > 2.0**(ref.EMAX[fmt] - 1)) & (scaled <= 2.0**ref.EMAX[fmt])).all()
  elif rounding == "even":
    # floor's rule, one binade up where amax rounded to the element format's precision
    # is the next power of two: the scaled block max lies in [1 - 2**-(mbits + 2),
    # 2 - 2**-(mbits + 1)) * 2**emax (0.96875 to 1.9375 for E4M3).
    mbits = ref.FORMATS[fmt][1]
    low, high = 1 - 2.0**-(mbits + 2), 2 - 2.0**-(mbits + 1)
    assert ((scaled >= low * 2.0**ref.EMAX[fmt]) & (scaled < high * 2.0**ref.EMAX[fmt])).all()
  else:
    assert ((scaled > bound / 2) & (scaled <= bound)).all()


@pytest.mark.parametrize("fmt, exponent", [("e4m3", -119), ("e5m2", -112)])
def test_rceil_differs_from_the_float32_quotient_only_where_it_is_a_rounded_subnormal(
    fmt, exponent):
  # amax / fp8_max is a float32 subnormal below 2**-126: the published forms round it
  # (to 2**-149); the exact quotient of 1.75 * 2**exponent + 1 ulp is just above
  # 2**-127 and gets code 1, where the rounded one is 2**-127 exactly (code 0).
  amax = np.concatenate([_binade(exponent - 1), _binade(exponent)])  # quotients subnormal
  got = np.asarray(mx.shared_exponents(jnp.asarray(amax), FMT[fmt], "rceil"))
  edge = np.nextafter(np.float32(1.75 * 2.0**exponent), np.float32(np.inf))
  for quotient in ("reciprocal", "divide"):
    expected = ref.e8m0_rceil(amax, fmt, quotient)
    assert list(amax[got != expected]) == [edge]
  assert np.asarray(mx.shared_exponents(jnp.float32(edge), FMT[fmt], "rceil")) == 1


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rceil_blocks_equal_jax_s_own_mx_quantizer_bit_for_bit(fmt):
  # JAX's quantizer behind jax.nn.scaled_dot_general (private: skipped if it moves).
  try:
    from jax._src.cudnn import scaled_matmul_stablehlo as jax_mx  # noqa: PLC0415
    config = jax_mx.BlockScaleConfig(mode="mxfp8", block_size=32, data_type=FMT[fmt],
                                     scale_type=jnp.float8_e8m0fnu, global_scale=None,
                                     infer_only=False)
  except (ImportError, AttributeError, TypeError) as error:
    pytest.skip(f"JAX's MX quantizer is not where it was: {error}")
  rng = np.random.default_rng(4)
  # Blocks from 2**-60 to 2**60 in magnitude, a few at fp8_max times a power of two.
  x = rng.standard_normal((2, 64, 256)) * 2.0 ** rng.integers(-60, 60, (2, 64, 1))
  x[0, 0, :32] = ref.FORMATS[fmt][2] * 2.0**-3
  x[0, 1, 32:64] = -ref.FORMATS[fmt][2] * 2.0**5
  x = jnp.asarray(x, jnp.float32)
  data, scale = jax_mx.quantize(x, config)
  got = mx.quantize(x, FMT[fmt], "rceil")
  np.testing.assert_array_equal(_bits(got.scale), _bits(scale))
  np.testing.assert_array_equal(_bits(got.data), _bits(data))


# ---------------------------------------------------------------- GEMMs


def _reference_operand(x3, recipe, role):
  """The reference's dequantized canonical operand (float64) under ``recipe``."""
  if isinstance(recipe, fp8.OperandRecipes):
    recipe = getattr(recipe, role)  # the recipe of this operand's role
  if recipe is None:
    return x3.astype(np.float64)
  fmt = "e5m2" if per_gemm.fp8_format(recipe, role) == q.E5M2 else "e4m3"
  if isinstance(recipe, fp8.MXScaling):
    codes, scales = ref.mx_quantize(x3, fmt, recipe.scale_rounding)
    return ref.mx_dequantize(codes, scales, fmt)[..., :x3.shape[2]]
  grouping = per_gemm.grouping(recipe, role)
  rows = grouping.rows or x3.shape[1]
  cols = grouping.cols or x3.shape[2]
  if grouping.rows is None:
    flat = x3.reshape(1, 1, -1)
    codes, scale = ref.quantize_groups(flat, 1, flat.shape[2], fmt, recipe.margin,
                                       recipe.power_of_two)
    return ref.dequantize_groups(codes, scale, 1, flat.shape[2], fmt).reshape(x3.shape)
  codes, scale = ref.quantize_groups(x3, rows, cols, fmt, recipe.margin, recipe.power_of_two)
  return ref.dequantize_groups(codes, scale, rows, cols, fmt)[:, :x3.shape[1], :x3.shape[2]]


def _reference_gemms(x3, w3, g3, recipes):
  """y, dx, dw in canonical form: forward (M,K)x(N,K), dgrad (M,N)x(K,N), wgrad (N,M)x(K,M)."""
  forward, input_grad, weight_grad = recipes.gemms
  t = lambda a: np.swapaxes(a, 1, 2)
  y = np.einsum("bmk,bnk->bmn", _reference_operand(x3, forward, "input"),
                _reference_operand(w3, forward, "kernel"))
  dx = np.einsum("bmn,bkn->bmk", _reference_operand(g3, input_grad, "output_grad"),
                 _reference_operand(t(w3), input_grad, "kernel"))
  dw = np.einsum("bnm,bkm->bnk", _reference_operand(t(g3), weight_grad, "output_grad"),
                 _reference_operand(t(x3), weight_grad, "input"))
  return y, dx, dw


RECIPES = {
    "current": fp8.GemmRecipes(fp8.CurrentScaling(), fp8.CurrentScaling(margin=1), None),
    "rowwise": fp8.RowwiseScaling(),
    "rowwise float32 scales": fp8.RowwiseScaling(power_of_two=False, gradient_format="e5m2"),
    "block": fp8.BlockScaling(block_size=16),
    "block power of two": fp8.BlockScaling(block_size=16, power_of_two=True),
    "mx": fp8.MXScaling(),
    "mx e5m2 gradients": fp8.MXScaling(gradient_format="e5m2"),
    "mx ceil": fp8.MXScaling(scale_rounding="ceil"),
    "mx rceil e5m2 gradients": fp8.MXScaling(gradient_format="e5m2", scale_rounding="rceil"),
    "torchao rowwise_with_gw_hp": fp8.GemmRecipes.rowwise_with_gw_hp(),
    "per operand, float32 scales": fp8.GemmRecipes(
        fp8.OperandRecipes(input=fp8.CurrentScaling(margin=1),
                           kernel=fp8.RowwiseScaling(power_of_two=False)),
        fp8.OperandRecipes(output_grad=fp8.CurrentScaling(), kernel=fp8.RowwiseScaling()),
        fp8.OperandRecipes(output_grad=fp8.RowwiseScaling(gradient_format="e5m2"),
                           input=fp8.CurrentScaling(power_of_two=True))),
    "mixed": fp8.GemmRecipes(fp8.MXScaling(), fp8.BlockScaling(block_size=8),
                             fp8.RowwiseScaling()),
}


def _forward_backward(recipe, dims, lhs, rhs, g):
  """The product and both operand gradients, in one jitted computation."""
  @jax.jit
  def run(lhs, rhs, g):
    y, vjp = jax.vjp(lambda a, b: fp8.fp8_dot_general(a, b, dims, recipe=recipe), lhs, rhs)
    return (y, *vjp(g))
  return run(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(g))


def _close(actual, expected, rtol=2e-5):
  # float32 accumulation of at most a few hundred products: 1e-5 of the largest term.
  scale = np.max(np.abs(expected)) + 1e-30
  np.testing.assert_array_less(np.abs(np.asarray(actual, np.float64) - expected) / scale, rtol)


def _rtol(gemm_recipe, device):
  """A GEMM's tolerance against the reference: a float32 GEMM (no recipe) on a GPU
  multiplies TF32 operands (tests/backends.py). fp8 GEMMs of these shapes are exact
  there too: contractions that are not multiples of 16 multiply the fp8 values as
  bfloat16 on CUDA, without fast accumulation."""
  return 2e-5 if gemm_recipe is not None or backends.exact(device) else backends.TF32_GEMM_RTOL


@pytest.mark.parametrize("device", backends.DEVICES)
@pytest.mark.parametrize("name", list(RECIPES))
def test_dense_gemms_match_the_reference(name, device):
  recipes = recipes_lib.per_gemm(RECIPES[name])
  k = jax.random.split(jax.random.key(1), 3)
  x = np.asarray(jax.random.normal(k[0], (24, 40)))
  w = np.asarray(jax.random.normal(k[1], (40, 36)))
  g = np.asarray(jax.random.normal(k[2], (24, 36)))
  with backends.on(device):
    y, dx, dw = _forward_backward(RECIPES[name], DENSE, x, w, g)
  ry, rdx, rdw = _reference_gemms(x[None], w.T[None], g[None], recipes)
  forward, input_grad, weight_grad = recipes.gemms
  _close(y, ry[0], _rtol(forward, device))
  _close(dx, rdx[0], _rtol(input_grad, device))
  _close(dw, rdw[0].T, _rtol(weight_grad, device))


@pytest.mark.parametrize("device", backends.DEVICES)
def test_torchao_rowwise_with_gw_hp_scales_the_kernel_per_tensor_in_the_input_gradient(device):
  # torchao: grad_input = grad_output_fp8_axiswise_dim0 @ weight_fp8_tensorwise, and the
  # weight gradient in high precision. Rows of w and g of very different magnitudes, so
  # that per-row and per-tensor scales differ (Gaussian rows share one power of two).
  recipe = fp8.GemmRecipes.rowwise_with_gw_hp()
  k = jax.random.split(jax.random.key(5), 3)
  x = np.asarray(jax.random.normal(k[0], (24, 64)))
  w = np.asarray(jax.random.normal(k[1], (64, 48))) * 3.0 ** np.arange(-8, 8, 0.25)[:, None]
  g = np.asarray(jax.random.normal(k[2], (24, 48))) * 5.0 ** np.arange(-6, 6, 0.5)[:, None]
  with backends.on(device):
    y, dx, dw = _forward_backward(recipe, DENSE, x, w, g)
  ry, rdx, _ = _reference_gemms(x[None], w.T[None], g[None], recipe)
  # Each column of dx (an input channel) and y against its own largest term.
  columns_close = lambda actual, expected: [_close(a, e) for a, e in zip(
      np.asarray(actual).T, expected.T)]
  columns_close(y, ry[0])
  columns_close(dx, rdx[0])
  # The weight gradient in high precision: float32 here (TF32 operands on a GPU).
  close = 1e-5 if backends.exact(device) else backends.TF32_GEMM_RTOL
  np.testing.assert_allclose(dw, x.T.astype(np.float64) @ g, rtol=close, atol=close * abs(
      x.T @ g).max())
  # The kernel per row instead (what GemmRecipes(rows, rows, None) runs) is another GEMM.
  _, rows_dx, _ = _reference_gemms(x[None], w.T[None], g[None], fp8.GemmRecipes(
      fp8.RowwiseScaling(), fp8.RowwiseScaling(), None))
  with pytest.raises(AssertionError):
    columns_close(dx, rows_dx[0])


def test_general_dimension_numbers_contract_the_flattened_dimensions():
  # lhs [batch 2, m 3, k1 4, k2 10], rhs [k2 10, batch 2, k1 4, n 5]: K = 40, blocks of 8
  # run along the flattened (k1, k2) in dimension-number order.
  recipe = fp8.GemmRecipes(fp8.BlockScaling(block_size=8), fp8.MXScaling(),
                           fp8.RowwiseScaling(power_of_two=False))
  dims = (((2, 3), (2, 0)), ((0,), (1,)))
  k = jax.random.split(jax.random.key(2), 3)
  lhs = np.asarray(jax.random.normal(k[0], (2, 3, 4, 10)))
  rhs = np.asarray(jax.random.normal(k[1], (10, 2, 4, 5)))
  g = np.asarray(jax.random.normal(k[2], (2, 3, 5)))
  y, dlhs, drhs = _forward_backward(recipe, dims, lhs, rhs, g)
  x3 = lhs.reshape(2, 3, 40)
  w3 = np.transpose(rhs, (1, 3, 2, 0)).reshape(2, 5, 40)
  ry, rdx, rdw = _reference_gemms(x3, w3, g, recipe)
  _close(y, ry)
  _close(dlhs, rdx.reshape(2, 3, 4, 10))
  _close(drhs, np.transpose(rdw.reshape(2, 5, 4, 10), (3, 0, 2, 1)))


# ---------------------------------------------------------------- power-of-two outputs


def test_bfloat16_output_with_power_of_two_scales_is_bit_exact_with_float32_scaling():
  k = jax.random.split(jax.random.key(3), 3)
  a = q.quantize(jax.random.normal(k[0], (64, 96)) * 30, q.E4M3, jnp.float32(0.125))
  b = q.quantize(jax.random.normal(k[1], (96, 80)), q.E5M2, jnp.float32(2.0**-7))
  dims = DENSE
  for scale in (2.0**-20, 2.0**-3, 1.0, 2.0**9):
    scale = jnp.float32(scale)
    fused = scaled_gemm.rescaled_dot(a, b, dims, scale, jnp.bfloat16, exact_scale=True)
    wide = scaled_gemm.rescaled_dot(a, b, dims, scale, jnp.bfloat16, exact_scale=False)
    np.testing.assert_array_equal(np.asarray(fused.view(jnp.uint16)),
                                  np.asarray(wide.view(jnp.uint16)))


@pytest.mark.parametrize("recipe", [fp8.CurrentScaling(power_of_two=True),
                                    fp8.DelayedScaling(4, power_of_two=True),
                                    fp8.RowwiseScaling()])
def test_power_of_two_recipes_write_bfloat16_from_the_gemm(recipe):
  step, (x, w, g) = _dense_forward_backward(recipe)
  for platform in ("cpu", "tpu", "cuda"):
    assert _lowered_gemm_outputs(step, (x, w, g), platform) == ["bf16"] * 3
  recipe_f32 = dataclasses.replace(recipe, power_of_two=False)
  forward = lambda x, w: fp8.fp8_dot_general(x, w, DENSE, recipe=recipe_f32,
                                             state=fp8.init_state(recipe_f32))
  # Other scales: float32 products, except on CUDA GPUs for per-tensor scales.
  per_tensor = not isinstance(recipe, fp8.RowwiseScaling)
  assert _lowered_gemm_outputs(forward, (x, w), "cpu") == ["f32"]
  assert _lowered_gemm_outputs(forward, (x, w), "tpu") == ["f32"]
  assert _lowered_gemm_outputs(forward, (x, w), "cuda") == ["bf16" if per_tensor else "f32"]


def _dense_forward_backward(recipe):
  """A bfloat16 fp8 Dense forward and backward under ``recipe``, and its arguments."""
  args = tuple(jax.ShapeDtypeStruct(shape, jnp.bfloat16)
               for shape in ((32, 48), (48, 16), (32, 16)))
  state = fp8.init_state(recipe)

  def step(x, w, g):
    f = lambda x, w: fp8.fp8_dot_general(x, w, DENSE, state=state, recipe=recipe)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(g)[:2])

  return step, args


def _lowered_gemm_outputs(fn, args, platform):
  """The output element type of every dot_general in ``fn`` lowered for ``platform``."""
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  return re.findall(r"stablehlo\.dot_general .*-> tensor<[0-9x]*x(\w+)>", text)


def _lowered_gemms(fn, args, platform):
  """(operand types, precision) of every dot_general in ``fn`` lowered for ``platform``."""
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  return re.findall(r"stablehlo\.dot_general .*precision = \[(\w+), \w+\] : "
                    r"\(tensor<[0-9x]*x(\w+)>, tensor<[0-9x]*x(\w+)>\)", text)


@pytest.mark.parametrize("recipe", [fp8.CurrentScaling(), fp8.DelayedScaling(4),
                                    fp8.RowwiseScaling()])
def test_cuda_gradient_gemms_turn_off_fast_accumulation_as_flax_does(recipe):
  # Flax's fp8 ops and TransformerEngine keep cuBLASLt's fast accumulation for the
  # forward GEMM only; HIGHEST is how XLA is told (on an H100 it cut the largest error
  # of a 2048^3 fp8 GEMM from 8.4% to 1.9%).
  step, args = _dense_forward_backward(recipe)
  cuda = _lowered_gemms(step, args, "cuda")
  assert [precision for precision, *_ in cuda] == ["DEFAULT", "HIGHEST", "HIGHEST"]
  assert all(a.startswith("f8") and b.startswith("f8") for _, a, b in cuda)
  for platform in ("cpu", "tpu"):  # nothing changes where there is no fast accumulation
    assert [p for p, *_ in _lowered_gemms(step, args, platform)] == ["DEFAULT"] * 3


def _lowered_layout_constraints(fn, args, platform):
  """The element type and result layout of every layout constraint in ``fn`` for ``platform``."""
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  return re.findall(r"@LayoutConstraint\(.*result_layouts = \[dense<\[([\d, ]+)\]>.*"
                    r"-> tensor<[0-9x]*x(\w+)>", text)


@pytest.mark.parametrize("recipe, layouts", [
    # x and w in their own shapes; with delayed scaling the output gradient g too
    (fp8.DelayedScaling(4), [("1, 0", "f8E4M3FN")] * 2 + [("1, 0", "f8E5M2")]),
    (fp8.CurrentScaling(), [("1, 0", "f8E4M3FN")] * 2),
    (fp8.RowwiseScaling(), [("2, 1, 0", "f8E4M3FN")] * 4),  # x, w, w.T, x.T canonical
    (fp8.Int8Scaling(), [("2, 1, 0", "i8")] * 4),
])
def test_hopper_quantizations_are_written_row_major(recipe, layouts):
  # cuBLASLt wants both fp8 operands K-major on Hopper; left to choose, XLA had the
  # quantization of a Dense kernel write it transposed, which a kernel that also takes
  # the amax cannot do (delayed scaling: the float32 kernel read twice), and rowwise's
  # amaxes read a transposed int16 copy of the kernel (compiled H100 HLO; the plugin
  # tests count the readers). Pinned row-major (minor-to-major listed) in the CUDA
  # lowering for Hopper only: a B200's and an A100's compiles were as good or better
  # without; the values are the same. Delayed scaling's output gradient is pinned too
  # (next test).
  step, args = _dense_forward_backward(recipe)
  for target, platform, expected in (("h100", "cuda", layouts), ("h100", "cpu", []),
                                     ("h100", "tpu", []), ("b200", "cuda", []),
                                     ("a100", "cuda", []), ("v5e", "tpu", [])):
    with fp8.compile_target(target), warnings.catch_warnings():
      warnings.simplefilter("ignore", fp8.Fp8FallbackWarning)  # int8 off TPUs says so
      found = _lowered_layout_constraints(step, args, platform)
    assert found == expected, (target, platform)


def _lowered_barrier_types(fn, args, platform):
  """The operand types of every optimization barrier in ``fn`` lowered for ``platform``."""
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  return [line.split(" : ")[-1] for line in re.findall(r"stablehlo\.optimization_barrier .*",
                                                       text)]


@pytest.mark.parametrize("recipe, gradient_held", [
    (fp8.DelayedScaling(4), True), (fp8.CurrentScaling(), False)])
def test_hopper_writes_the_delayed_output_gradient_before_transposing_it(recipe, gradient_held):
  # Left to itself XLA cast the output gradient to fp8 and transposed it (for the
  # weight gradient's GEMM) in one kernel with two outputs; on an H200 such kernels
  # moved 0.3-1.7 TB/s where most others moved 3-4.4. Behind a barrier of its own, the
  # codes are written by the kernel that computes g and a plain fp8 transpose follows
  # (the Llama layer's fp8 step 7.85 -> 7.64 ms measured on an H200). Hopper's CUDA
  # lowering only, and not for current scaling, whose compile only got more bytes.
  step, args = _dense_forward_backward(recipe)
  gradient = "tensor<32x16xf8E5M2>"
  for target, platform, expected in (("h100", "cuda", gradient_held), ("h100", "cpu", False),
                                     ("b200", "cuda", False), ("v5e", "tpu", False)):
    with fp8.compile_target(target):
      held = gradient in _lowered_barrier_types(step, args, platform)
    assert held == expected, (target, platform)


def test_delayed_scaling_without_a_gradient_quantizes_straight_into_the_gemm_s_layout():
  # Nothing records an amax when nothing differentiates the op (an eval step), so its
  # primal leaves out _forward's amaxes, barrier and layout pins: a Dense 4096^3
  # forward compiled for an H100 then moves 96 MiB of other traffic, Flax's figure,
  # where it moved 128. Same product, bit for bit, as the differentiated forward's.
  recipe = fp8.DelayedScaling(4)
  state = fp8.init_state(recipe)._replace(input_scale=jnp.array([0.5], jnp.float32),
                                          kernel_scale=jnp.array([0.25], jnp.float32))
  apply = lambda x, w: fp8.fp8_dot_general(x, w, DENSE, state=state, recipe=recipe)
  args = tuple(jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((32, 48), (48, 16)))
  with fp8.compile_target("h100"):
    assert _lowered_layout_constraints(apply, args, "cuda") == []
    assert not any("f8E4M3FN" in types for types in _lowered_barrier_types(apply, args, "cuda"))
  x, w = (jax.random.normal(jax.random.key(i), a.shape).astype(jnp.bfloat16)
          for i, a in enumerate(args))
  differentiated, _ = jax.vjp(apply, x, w)
  np.testing.assert_array_equal(jax.jit(apply)(x, w), differentiated)


def test_cuda_gemms_with_a_short_contraction_multiply_the_fp8_values_in_bfloat16():
  # On an H100, XLA's fp8 GEMMs with 2 to 10 contracted elements returned NaN and -inf
  # for finite operands; there jaxmp multiplies the same fp8 values as bfloat16.
  recipe = fp8.CurrentScaling()
  shapes = ((2, 4), (4, 3), (2, 3))  # contractions 4 (forward), 3 and 2 (gradients)
  args = tuple(jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes)

  def step(x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp8.fp8_dot_general(x, w, DENSE, recipe=recipe), x, w)
    return y, vjp(g)

  # (Fast accumulation is an fp8 GEMM's: the bfloat16 ones keep the default precision.)
  assert _lowered_gemms(step, args, "cuda") == [("DEFAULT", "bf16", "bf16")] * 3
  assert all(a.startswith("f8") for _, a, _ in _lowered_gemms(step, args, "cpu"))
  # The same numbers: the bfloat16 products of fp8 values are exact, as fp8 ones are.
  x, w = (jax.random.normal(jax.random.key(i), shape).astype(jnp.bfloat16)
          for i, shape in enumerate(shapes[:2]))
  qx, qw = q.quantize(x, q.E4M3, jnp.float32(0.01)), q.quantize(w, q.E4M3, jnp.float32(0.01))
  fp8_values = scaled_gemm.rescaled_dot(qx, qw, DENSE, jnp.float32(1e-4), jnp.float32)
  widened = jax.lax.dot_general(qx.astype(jnp.bfloat16), qw.astype(jnp.bfloat16), DENSE,
                                preferred_element_type=jnp.float32) * jnp.float32(1e-4)
  np.testing.assert_array_equal(fp8_values, widened)


@pytest.mark.parametrize("recipe", [fp8.CurrentScaling(), fp8.DelayedScaling(4)])
def test_cuda_lowering_writes_bfloat16_from_every_gemm_with_any_per_tensor_scales(recipe):
  step, args = _dense_forward_backward(recipe)
  assert _lowered_gemm_outputs(step, args, "cuda") == ["bf16"] * 3
  assert _lowered_gemm_outputs(step, args, "cpu") == ["f32"] * 3
  # A float32 product keeps the float32 form on CUDA too.
  state = fp8.init_state(recipe)
  x32 = jax.ShapeDtypeStruct((32, 48), jnp.float32)
  f32 = lambda x, w: fp8.fp8_dot_general(x, w, DENSE, state=state, recipe=recipe)
  assert _lowered_gemm_outputs(f32, (x32, jax.ShapeDtypeStruct((48, 16), jnp.float32)),
                               "cuda") == ["f32"]


def test_cuda_form_of_a_bfloat16_product_is_within_the_bfloat16_scale_rounding():
  # What XLA's folded Triton GEMM computes from the CUDA form: the float32
  # accumulator times the bfloat16-rounded scale, rounded once (its cuBLASLt GEMM is
  # given the float32 scale: the float32 form's value; test_support's
  # test_h100_bfloat16_gemm_scale_reaches_cublaslt_in_float32). Against jaxmp's
  # float32 form (the CPU's), each element differs by that scale's rounding and the
  # two outputs' roundings, each at most bfloat16's unit roundoff 2^-8 (relative).
  k = jax.random.split(jax.random.key(5), 2)
  a = q.quantize(jax.random.normal(k[0], (64, 96)) * 30, q.E4M3, jnp.float32(0.125))
  b = q.quantize(jax.random.normal(k[1], (96, 80)), q.E5M2, jnp.float32(2.0**-7))
  dims = DENSE
  scale = jnp.float32(0.3711)  # not a power of two, not a bfloat16
  assert float(scale.astype(jnp.bfloat16)) != float(scale)
  acc = jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
  cuda = (acc * scale.astype(jnp.bfloat16).astype(jnp.float32)).astype(jnp.bfloat16)
  wide = scaled_gemm.rescaled_dot(a, b, dims, scale, jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(cuda, np.float32), np.asarray(wide, np.float32),
                             rtol=3 * 2.0**-8, atol=0)
  # The CUDA branch itself, as the HLO says (rounding the accumulator first, as a
  # Triton GEMM may): one rounding more.
  narrow = scaled_gemm._narrow_output_dot(a, b, scale, dimension_numbers=dims,
                                          out_dtype=jnp.bfloat16, out_sharding=None,
                                          precision=None)
  np.testing.assert_allclose(np.asarray(narrow, np.float32), np.asarray(wide, np.float32),
                             rtol=4 * 2.0**-8, atol=0)


def test_power_of_two_outputs_equal_the_float32_output_path_bit_for_bit(monkeypatch):
  recipe = fp8.CurrentScaling(power_of_two=True)
  k = jax.random.split(jax.random.key(4), 3)
  x, w, g = (jax.random.normal(key, shape).astype(jnp.bfloat16)
             for key, shape in zip(k, ((64, 256), (256, 48), (64, 48))))
  dims = DENSE

  @jax.jit
  def step(x, w, g):
    f = lambda x, w: fp8.fp8_dot_general(x, w, dims, recipe=recipe)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(g))

  gemm_outputs = lambda: _lowered_gemm_outputs(step, (x, w, g), "cpu")

  assert gemm_outputs() == ["bf16"] * 3
  fused = step(x, w, g)
  # The float32-output path (as for scales that are not powers of two): the same bits.
  monkeypatch.setattr(scaled_gemm, "fuses_output", lambda out_dtype, exact_scale: False)
  jax.clear_caches()
  assert gemm_outputs() == ["f32"] * 3
  for a, b in zip(fused, step(x, w, g)):
    np.testing.assert_array_equal(np.asarray(a.view(jnp.uint16)), np.asarray(b.view(jnp.uint16)))
  jax.clear_caches()


def _all_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in (value if isinstance(value, (tuple, list)) else (value,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _all_eqns(inner)


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", [
    ((4, 8), (8, 3), DENSE),
    ((8, 4), (3, 8), (((0,), (1,)), ((), ()))),            # both operands "transposed"
    ((3, 4, 8), (3, 8, 5), (((2,), (1,)), ((0,), (0,)))),  # batched
])
def test_gradient_gemms_write_their_operands_layout(lhs_shape, rhs_shape, dims):
  """Each backward GEMM takes its operands in the order whose product is laid out as
  the gradient's primal: no permutation follows it (on GPUs XLA leaves one after a
  cuBLAS GEMM whose gradient is a function output as a kernel of its own)."""
  recipe = fp8.DelayedScaling(4)
  state = fp8.init_state(recipe)
  x, w = jnp.ones(lhs_shape, jnp.bfloat16), jnp.ones(rhs_shape, jnp.bfloat16)
  forward = lambda x, w: fp8.fp8_dot_general(x, w, dims, state=state, recipe=recipe)
  g = jnp.ones(jax.eval_shape(forward, x, w).shape, jnp.bfloat16)
  backward = lambda x, w: jax.vjp(forward, x, w)[1](g)
  eqns = list(_all_eqns(jax.make_jaxpr(backward)(x, w).jaxpr))
  gemm_shapes = [tuple(e.outvars[0].aval.shape) for e in eqns if e.primitive.name == "dot_general"]
  # (Each product appears once per lowering branch: lax.platform_dependent.)
  assert set(gemm_shapes) == {g.shape, lhs_shape, rhs_shape}
  assert not [e for e in eqns if e.primitive.name == "transpose"]
