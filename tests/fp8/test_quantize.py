"""Scale and history arithmetic: Flax/TE formulas, float32 always, never unsound."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import fp8_ops

from jaxmp._src.fp8 import grouped
from jaxmp._src.fp8 import quantize as q


def test_formats():
  assert q.fp8_max(q.E4M3) == 448.0 and q.fp8_max(q.E5M2) == 57344.0
  with pytest.raises(ValueError, match="Expected an fp8 dtype, got bfloat16"):
    q.fp8_max(jnp.bfloat16)


@pytest.mark.parametrize("amax, margin", [(1.0, 0), (10.0, 0), (0.40124354, 0), (3.0, 2),
                                          (1e-3, 0), (65504.0, 1)])
@pytest.mark.parametrize("fmt", [q.E4M3, q.E5M2])
def test_scale_is_bit_identical_to_flax(amax, margin, fmt):
  amax = jnp.float32(amax)
  ours = jax.jit(q.scale_from_amax, static_argnums=(2, 3))(amax, jnp.float32(1.0), fmt, margin)
  fmax = jnp.finfo(fmt).max.astype(jnp.float32)
  theirs = jax.jit(fp8_ops.compute_scale, static_argnums=3)(amax, jnp.ones(()), fmax, margin)
  assert np.asarray(ours).tobytes() == np.asarray(theirs, np.float32).tobytes()
  np.testing.assert_allclose(ours, float(amax) * 2**margin / float(fmax), rtol=1e-6)


@pytest.mark.parametrize("amax", [0.0, np.inf, np.nan, -1.0, 1e-44])
def test_scale_falls_back_to_the_previous_scale_where_amax_says_nothing(amax):
  # 1e-44 is a positive float32 whose 448 / amax overflows to inf: Flax then stores
  # scale 0 and its layer outputs zeros; jaxmp keeps the previous scale.
  prev = jnp.float32(0.25)
  assert float(q.scale_from_amax(jnp.float32(amax), prev, q.E4M3)) == 0.25


@pytest.mark.parametrize("prev", [0.0, -1.0, np.inf, np.nan])
def test_an_unusable_previous_scale_reads_as_one(prev):
  assert float(q.scale_from_amax(jnp.float32(0.0), jnp.float32(prev), q.E4M3)) == 1.0
  assert float(q.valid_scale(jnp.float32(prev))) == 1.0


def test_history_uses_flax_rotation_and_never_records_inf_or_nan():
  h = jnp.zeros(3)
  for amax, expected in [(2.0, [2, 0, 0]), (3.0, [3, 0, 2]), (np.inf, [0, 2, 3]),
                         (np.nan, [0, 3, 0]), (4.0, [4, 0, 0])]:
    h = q.record_amax(h, jnp.float32(amax))
    np.testing.assert_array_equal(h, expected)
  # An incoming history with inf/NaN/negative/-inf entries reads them as 0.
  bad = jnp.array([np.inf, np.nan, -1.0, -np.inf, 5.0])
  np.testing.assert_array_equal(q.valid_history(bad), [0, 0, 0, 0, 5])
  assert float(q.amax_from_history(bad, "max")) == 5.0


def test_amax_compute():
  h = jnp.array([3.0, 9.0, 1.0])
  assert float(q.amax_from_history(h, "max")) == 9.0
  assert float(q.amax_from_history(h, "most_recent")) == 3.0
  with pytest.raises(ValueError, match="Unknown amax_compute 'mean'"):
    q.amax_from_history(h, "mean")


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("margin", [0, 3])
def test_scales_of_several_tensors_at_once_equal_each_alone_bit_for_bit(margin, power_of_two):
  # A delayed-scaling op computes its three scales (E4M3, E4M3, E5M2) as one
  # computation over its stacked histories; each must be the scale computed alone.
  amaxes = [0.40124354, 10.0, 65504.0, 0.0, np.inf, np.nan, 1e-44, 3.0, 1e-3]
  previous = [0.25, 0.0, np.nan, 0.5, 2.0, -1.0, 0.125, np.inf, 4.0]
  fmts = (q.E4M3, q.E5M2, q.E4M3)
  for i in range(0, len(amaxes), 3):
    a, p = jnp.float32(amaxes[i:i + 3]), jnp.float32(previous[i:i + 3])
    together = jax.jit(q.scale_from_amax, static_argnums=(2, 3, 4))(
        a, p, fmts, margin, power_of_two)
    alone = [jax.jit(q.scale_from_amax, static_argnums=(2, 3, 4))(
        a[j], p[j], fmts[j], margin, power_of_two) for j in range(3)]
    assert np.asarray(together).tobytes() == np.asarray(alone, np.float32).tobytes(), (
        together, alone)


def test_amax_from_stacked_histories_is_each_history_s():
  h = jnp.array([[3.0, 9.0, 1.0], [np.inf, 2.0, 0.5], [-1.0, np.nan, 0.0]])
  np.testing.assert_array_equal(q.amax_from_history(h, "max"), [9.0, 2.0, 0.0])
  np.testing.assert_array_equal(q.amax_from_history(h, "most_recent"), [3.0, 0.0, 0.0])


def test_quantize_saturates_finite_values_and_keeps_overflow_visible():
  scale = jnp.float32(0.5)
  # 3e38 / 0.5 overflows float32: E4M3 makes that NaN, like an inf; E5M2 saturates it.
  x = jnp.array([1000.0, -1000.0, 3.0, 0.0, -0.0, 1e30, 3e38, np.inf, -np.inf, np.nan])
  e4m3 = q.quantize(x, q.E4M3, scale).astype(jnp.float32)
  np.testing.assert_array_equal(
      e4m3, [448, -448, 6, 0, 0, 448, np.nan, np.nan, np.nan, np.nan])
  e5m2 = q.quantize(x, q.E5M2, scale)
  assert e5m2.dtype == jnp.float8_e5m2
  np.testing.assert_array_equal(
      e5m2.astype(jnp.float32),
      [2048, -2048, 6, 0, 0, 57344, 57344, np.inf, -np.inf, np.nan])
  # Zeros keep their sign in both formats.
  np.testing.assert_array_equal(np.signbit(e4m3[3:5]), [False, True])
  np.testing.assert_array_equal(np.signbit(e5m2.astype(jnp.float32)[3:5]), [False, True])
  np.testing.assert_array_equal(
      q.dequantize(q.quantize(x[:4], q.E4M3, scale), scale), [224, -224, 3, 0])
  # Flax saturates inf to 448: an overflow upstream would vanish from the gradients.
  flax = fp8_ops.quantize(x, jnp.float8_e4m3fn, scale, jnp.float32).astype(jnp.float32)
  np.testing.assert_array_equal(flax[7:9], [448, -448])


def test_bfloat16_is_divided_in_float32_unlike_flax():
  """Flax rounds the scale and the quotient to bfloat16 before the fp8 cast."""
  x = (jax.random.normal(jax.random.key(1), (64, 128)) * 3).astype(jnp.bfloat16)
  scale = jnp.float32(7.3) / 448
  exact = np.clip(np.asarray(x, np.float64) / np.float64(scale), -448, 448)
  reference = np.asarray(jnp.asarray(exact, jnp.float32).astype(jnp.float8_e4m3fn), np.float32)
  ours = np.asarray(q.quantize(x, q.E4M3, scale), np.float32)
  flax = np.asarray(fp8_ops.quantize(x, jnp.float8_e4m3fn, scale, jnp.bfloat16), np.float32)
  assert np.array_equal(ours, reference)
  assert np.sum(flax != reference) > 100  # 296 of 8192 values land on another fp8 value.


def test_amax_of_every_dtype_is_float32():
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn):
    a = q.amax(jnp.array([-3.0, 2.0], dtype))
    assert a.dtype == jnp.float32 and float(a) == 3.0
  assert float(q.amax(jnp.zeros((0, 3)))) == 0.0


class TestSharedAmaxUnderVmap:
  """The amax follows the batching of the state it is recorded in."""

  xs = jnp.array([[1.0, -2.0], [5.0, 0.5], [-3.0, 1.0]])

  def test_unbatched_history_gets_one_amax_over_the_batch(self):
    h = jnp.zeros(2)
    out = jax.vmap(q.shared_amax, in_axes=(0, None), out_axes=None)(self.xs, h)
    assert float(out) == 5.0
    # And it is not batched: out_axes=None only works for unbatched results.

  def test_batched_history_gets_one_amax_per_member(self):
    hs = jnp.zeros((3, 2))
    np.testing.assert_array_equal(jax.vmap(q.shared_amax)(self.xs, hs), [2, 5, 3])
    np.testing.assert_array_equal(
        jax.vmap(q.shared_amax, in_axes=(None, 0))(self.xs[0], hs), [2, 2, 2])

  def test_nested_vmaps_each_follow_their_own_batching(self):
    xs = jnp.arange(12.0).reshape(2, 3, 2)  # members x examples x features
    hs = jnp.zeros((2, 4))
    # Outer: one history per member; inner: examples share it.
    inner = jax.vmap(q.shared_amax, in_axes=(0, None), out_axes=None)
    np.testing.assert_array_equal(jax.vmap(inner)(xs, hs), [5, 11])
    # Outer: examples share everything; inner: one history per member.
    inner = jax.vmap(q.shared_amax, in_axes=(0, 0))
    outer = jax.vmap(inner, in_axes=(1, None), out_axes=None)
    np.testing.assert_array_equal(outer(xs, hs), [5, 11])

  def test_under_jit(self):
    f = jax.jit(jax.vmap(q.shared_amax, in_axes=(0, None), out_axes=None))
    assert float(f(self.xs, jnp.zeros(2))) == 5.0


def test_an_overflowed_step_does_not_freeze_the_scale_as_in_flax():
  """Flax records inf in the history, and max(history) = inf keeps the old scale for
  amax_history_length steps; jaxmp records 0 and scales from the next real amax."""
  amaxes = [np.inf, 2.0, 3.0]
  flax_scale, flax_hist = jnp.ones(()), jnp.zeros(4)
  ours_scale, ours_hist = jnp.ones(()), jnp.zeros(4)
  flax_scales, ours_scales = [], []
  for a in amaxes:
    flax_scale, flax_hist = fp8_ops.update_fp8_meta(
        jnp.array([a]), jnp.float8_e4m3fn, flax_scale, flax_hist)
    ours_scale = q.scale_from_amax(q.amax_from_history(ours_hist), ours_scale, q.E4M3)
    ours_hist = q.record_amax(ours_hist, q.amax(jnp.array([a])))
    flax_scales.append(float(flax_scale))
    ours_scales.append(float(ours_scale))
  assert flax_scales == [1.0, 1.0, 1.0]  # frozen while the inf is in the history
  np.testing.assert_allclose(ours_scales, [1.0, 1.0, 2 / 448], rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("grouping", [grouped.TENSOR, grouped.ROW, grouped.Grouping(1, 4),
                                      grouped.Grouping(2, 4)])
def test_group_amax_is_numpy_s_with_nan_as_inf_and_reduces_bits_not_a_nan_mask(dtype, grouping):
  # Every scaled recipe's amax (grouped.amax): a NaN anywhere in a group gives inf, of
  # either sign and any payload, -inf gives inf, and groups padded past the edge count
  # only their values. It reduces the floats' bits: an isnan select made XLA write a
  # NaN mask of each operand reduced along both dimensions (compiled for an H100).
  x = np.array(jax.random.normal(jax.random.key(5), (1, 6, 10)) * 50, np.float32)
  x[0, 1, 2], x[0, 4, 9], x[0, 5, 0] = np.nan, -np.inf, -np.nan
  x = np.asarray(jnp.asarray(x, dtype))
  got = np.asarray(grouped.amax(jnp.asarray(x), grouping))
  r = x.shape[1] if grouping.rows is None else grouping.rows
  c = x.shape[2] if grouping.cols is None else grouping.cols
  magnitude = np.abs(x.astype(np.float32))
  padded = np.pad(magnitude, ((0, 0), (0, -x.shape[1] % r), (0, -x.shape[2] % c)))
  want = padded.reshape(1, padded.shape[1] // r, r, padded.shape[2] // c, c).max(axis=(2, 4))
  want = np.where(np.isnan(want), np.inf, want)
  assert got.dtype == np.float32 and got.shape == want.shape
  np.testing.assert_array_equal(got, want)
  assert np.isinf(got).any() and np.isfinite(got).any() or grouping == grouped.TENSOR
  primitives = {e.primitive.name for e in jax.make_jaxpr(
      lambda v: grouped.amax(v, grouping))(jnp.asarray(x)).jaxpr.eqns}
  assert not primitives & {"is_finite", "ne", "select_n"}, primitives
