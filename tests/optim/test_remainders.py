"""The 16-bit remainder scheme: bfloat16 param + int16 remainder == the float32 master."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxmp

SPECIALS = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 3.3895314e38, -3.3895314e38,
                     3.4028235e38, 1e-45, -1e-45, 1.1754944e-38, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8,
                     -(1.0 + 2.0**-8)], np.float32)


def _all_kinds_of_float32(n=1 << 20):
  bits = np.random.default_rng(0).integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
  return np.concatenate([bits.view(np.float32), SPECIALS])


def test_split_then_join_gives_every_float32_back_bit_for_bit():
  x = _all_kinds_of_float32()
  param, remainder = jax.jit(jaxmp.optim.split_remainder)(jnp.asarray(x))
  assert param.dtype == jnp.bfloat16 and remainder.dtype == jnp.int16
  back = np.asarray(jax.jit(jaxmp.optim.join_remainder)(param, remainder)).view(np.uint32)
  nan = np.isnan(x)
  np.testing.assert_array_equal(back[~nan], x.view(np.uint32)[~nan])
  np.testing.assert_array_equal(back[nan], np.uint32(0x7FC00000))  # the canonical NaN
  assert np.isnan(np.asarray(param, np.float32)[nan]).all()


def test_the_param_is_the_master_rounded_to_nearest_ties_away_from_zero():
  x = _all_kinds_of_float32()
  x = x[np.isfinite(x)]
  param = np.asarray(jaxmp.optim.split_remainder(jnp.asarray(x))[0], np.float32)
  low = x.view(np.uint32) & 0xFFFF
  tie = low == 0x8000
  nearest_even = np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float32)
  np.testing.assert_array_equal(param[~tie], nearest_even[~tie])
  # On a tie: the bfloat16 value of larger magnitude.
  up = (x.view(np.uint32)[tie] & 0xFFFF0000) + 0x10000
  np.testing.assert_array_equal(param[tie], up.astype(np.uint32).view(np.float32))
  assert tie.sum() > 0


def test_a_bfloat16_value_has_remainder_zero():
  x = jnp.asarray(np.random.default_rng(1).normal(size=1000), jnp.bfloat16)
  param, remainder = jaxmp.optim.split_remainder(x.astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(param), np.asarray(x))
  assert not np.asarray(remainder).any()
