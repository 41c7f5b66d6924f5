"""Block-wise 8-bit dynamic quantization: bit for bit torchao's, as ported to NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp._src.optim import dynamic_map
from tests.optim import quantized_reference as ref

F32 = np.float32
BLOCK = 256


def _bits(x):
  return np.asarray(x, F32).view(np.uint32)


@pytest.mark.parametrize("signed", [True, False])
def test_the_maps_are_torchaos_create_dynamic_map(signed):
  np.testing.assert_array_equal(_bits(dynamic_map.table(signed)),
                                _bits(ref.create_dynamic_map(signed)))


def test_the_maps_span_what_the_papers_say():
  signed, unsigned = dynamic_map.SIGNED_MAP, dynamic_map.UNSIGNED_MAP
  assert signed.dtype == unsigned.dtype == F32 and signed.shape == unsigned.shape == (256,)
  assert signed[-1] == unsigned[-1] == 1.0 and unsigned[0] == 0.0
  assert signed[0] == F32(-0.99296874)  # the negative side stops short of -1
  assert np.sum(signed > 0) == 128 and np.sum(signed < 0) == 127 and np.sum(unsigned > 0) == 255
  # Seven decades from 1e-7 to 1, each with twice the points of the one below.
  positive = unsigned[1:]
  per_decade = [np.sum((positive > 10.0**(e - 1)) & (positive <= 10.0**e)) for e in range(-6, 1)]
  assert per_decade == [2, 4, 8, 16, 32, 64, 129]


def _random_inputs(rng):
  yield "normal", rng.standard_normal((64, BLOCK)).astype(F32)
  wide = rng.standard_normal((64, BLOCK)) * 10.0 ** rng.integers(-30, 30, (64, BLOCK))
  yield "30 decades", wide.astype(F32)
  yield "squares", (rng.standard_normal((64, BLOCK)) ** 2 * 1e-6).astype(F32)


def _edge_inputs(rng):
  q = ref.QMAP[True]
  midpoints = (q[:-1] + q[1:]) / F32(2)
  rows = {
      "zeros": np.zeros(BLOCK),
      "negative zeros": np.full(BLOCK, -0.0),
      "subnormals": np.r_[[1e-40, -1e-45, 1e-38, 3e-39, -1e-39], np.zeros(BLOCK - 5)],
      "a subnormal block maximum": np.full(BLOCK, 1.2e-38),
      "below the scale floor": rng.standard_normal(BLOCK) * 1e-12,
      "a negative block maximum": np.r_[-10.0, rng.uniform(-1, 1, BLOCK - 1)],
      "the float32 maximum": np.where(np.arange(BLOCK) % 2, F32(3.4e38), F32(-3.4e38)),
      "map values": np.r_[1.0, q[rng.integers(0, 256, BLOCK - 1)]],
      "midpoints": np.r_[1.0, midpoints[:BLOCK - 1]],
      "above midpoints": np.r_[1.0, np.nextafter(midpoints[:BLOCK - 1], F32(np.inf))],
      "below midpoints": np.r_[1.0, np.nextafter(midpoints[:BLOCK - 1], F32(-np.inf))],
      "tiny beside one": np.r_[1.0, np.full(BLOCK - 1, 1e-30)],
      "inf": np.r_[rng.standard_normal(5), np.inf, rng.standard_normal(BLOCK - 6)],
      "-inf": np.r_[rng.standard_normal(7), -np.inf, rng.standard_normal(BLOCK - 8)],
      "nan": np.r_[rng.standard_normal(9), np.nan, rng.standard_normal(BLOCK - 10)],
  }
  for name, row in rows.items():
    yield name, np.asarray(row, F32).reshape(1, BLOCK)


def _all_inputs():
  rng = np.random.default_rng(0)
  return [*_random_inputs(rng), *_edge_inputs(rng)]


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_and_dequantize_equal_torchaos_bit_for_bit(signed):
  quantize = jax.jit(dynamic_map.quantize, static_argnames=("signed", "block_size"))
  dequantize = jax.jit(dynamic_map.dequantize, static_argnames=("signed",))
  for name, x in _all_inputs():
    codes, scale = quantize(x, signed=signed, block_size=BLOCK)
    ref_codes, ref_scale = ref.quantize(x, signed, BLOCK)
    assert codes.dtype == np.uint8 and scale.dtype == F32, name
    np.testing.assert_array_equal(np.asarray(codes), ref_codes, err_msg=name)
    np.testing.assert_array_equal(_bits(scale).reshape(-1), _bits(ref_scale), err_msg=name)
    back = dequantize(codes, scale, signed=signed)
    np.testing.assert_array_equal(_bits(back), _bits(ref.dequantize(ref_codes, ref_scale, signed)),
                                  err_msg=name)


def test_what_the_edges_come_back_as():
  def round_trip(row, signed=True):
    codes, scale = dynamic_map.quantize(jnp.asarray(row, F32), signed=signed, block_size=4)
    return np.asarray(dynamic_map.dequantize(codes, scale, signed=signed)), np.asarray(scale)

  back, scale = round_trip([0.0, -0.0, 1e-40, 0.0])
  assert scale == F32(1e-12) and _bits(back).tolist() == [0, 0, 0, 0]  # +0.0, all
  back, _ = round_trip([3.0, -3.0, 1e-7, -1e-7])
  assert back[0] == 3.0 and back[1] == F32(-0.99296874) * F32(3.0) and back[2] == back[3] == 0
  back, _ = round_trip([3.0, -3.0, 0.5, 0.25], signed=False)
  assert back[1] == 0.0 and back[0] == 3.0
  back, scale = round_trip([1.0, np.nan, 2.0, 0.0])
  assert np.isnan(scale).all() and np.isnan(back).all()
  back, scale = round_trip([1.0, np.inf, 2.0, 0.0])
  assert scale == np.inf and back[1] == -np.inf and np.isnan(back[[0, 2, 3]]).all()


def test_scales_keep_the_leading_axes():
  shape = dynamic_map.scale_shape
  assert shape((64, 512), 256) == (64, 2)
  assert shape((64, 128), 256) == (32,)
  assert shape((4, 8, 32), 256) == (4, 1)
  assert shape((4, 2, 32), 256) == (1,)
  assert shape((2, 4, 8, 64), 256) == (2, 4, 2)
  assert shape((4096,), 256) == (16,)
  assert shape((100,), 256) is None and shape((300, 3), 256) is None and shape((), 1) is None
  assert shape((0, 256), 256) is None
  x = np.arange(2 * 4 * 8 * 64, dtype=F32).reshape(2, 4, 8, 64) - 1000
  codes, scale = dynamic_map.quantize(jnp.asarray(x), signed=True, block_size=256)
  ref_codes, ref_scale = ref.quantize(x, True, 256)  # torchao's blocks: the flattened array
  np.testing.assert_array_equal(np.asarray(codes), ref_codes)
  np.testing.assert_array_equal(np.asarray(scale).reshape(-1), ref_scale)


def test_an_array_without_whole_blocks_is_refused():
  with pytest.raises(ValueError, match=r"shape \(100,\) \(size 100\) has no blocks of 256"):
    dynamic_map.quantize(jnp.zeros(100), signed=True, block_size=256)


@pytest.mark.parametrize("signed", [True, False])
def test_the_code_steps_up_exactly_at_each_threshold(signed):
  # Where torchao's code steps up (the smallest float32 of each code, found with the
  # port) jaxmp's code does too: checked at each threshold and at the float32 just
  # below it, in blocks whose scale is 1 (so the values are not moved).
  thresholds = ref.thresholds(signed)
  below = np.nextafter(thresholds, F32(-np.inf))
  x = np.stack([np.r_[1.0, thresholds], np.r_[1.0, below]]).astype(F32)  # each block's max: 1
  ref_codes, ref_scale = ref.quantize(x, signed, BLOCK)
  assert np.all(ref_scale == 1.0)
  k = np.arange(1, 256)
  np.testing.assert_array_equal(ref_codes[0, 1:], k)      # at the threshold: code k
  np.testing.assert_array_equal(ref_codes[1, 1:], k - 1)  # just below: k - 1
  jax_codes, _ = dynamic_map.quantize(jnp.asarray(x), signed=signed, block_size=BLOCK)
  np.testing.assert_array_equal(np.asarray(jax_codes), ref_codes)


def _in_blocks_of_scale_one(values):
  """``values`` in rows of ``BLOCK``, each row led by 1.0 (so that its scale is 1)."""
  rows = -(-values.size // (BLOCK - 1))
  padded = np.zeros(rows * (BLOCK - 1), F32)
  padded[:values.size] = values
  return np.concatenate([np.ones((rows, 1), F32), padded.reshape(rows, BLOCK - 1)], axis=1)


@pytest.mark.parametrize("signed", [True, False])
def test_the_codes_across_every_interval_of_the_map(signed):
  # jaxmp estimates a value's index within its decade and settles it by comparisons:
  # checked against the port at 65 float32 spread evenly (by their bits) over each
  # interval between neighbouring map values, and at their negations.
  positive = np.union1d(ref.QMAP[True], ref.QMAP[False])
  positive = positive[positive >= 0].astype(F32).view(np.uint32).astype(np.int64)
  bits = np.linspace(positive[:-1], positive[1:], 65).astype(np.uint32).reshape(-1)
  values = np.unique(bits).view(F32)
  x = _in_blocks_of_scale_one(np.concatenate([values, -values]))
  ref_codes, ref_scale = ref.quantize(x, signed, BLOCK)
  assert np.all(ref_scale == 1.0)
  codes, _ = dynamic_map.quantize(jnp.asarray(x), signed=signed, block_size=BLOCK)
  np.testing.assert_array_equal(np.asarray(codes), ref_codes)


@pytest.mark.parametrize("index_dtype", [jnp.int32, jnp.int16])
@pytest.mark.parametrize("signed", [True, False])
def test_the_computed_map_values_are_the_table(signed, index_dtype):
  codes = jnp.arange(256, dtype=jnp.uint8)
  values = jax.jit(dynamic_map.map_values, static_argnames=("signed", "index_dtype"))(
      codes, signed=signed, index_dtype=index_dtype)
  np.testing.assert_array_equal(_bits(values), _bits(ref.QMAP[signed]))
