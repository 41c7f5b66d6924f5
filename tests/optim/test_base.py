"""The landing of a 16-bit param on a target through ``optax.apply_updates``.

Every jaxmp.optim transform returns ``float32(t) - float32(p)`` so that the user's
``optax.apply_updates`` gives the target ``t``. The claim (jaxmp/_src/optim/base.py):
exact whenever ``t`` or ``p`` is zero, ``t`` is larger than ``p`` in magnitude, or
``|t| >= |p| / 2**15`` (``2**13`` for float16); only a param shrinking more than that
in one step can miss, or values below ``2**-118`` (XLA flushes subnormal float32
results to zero), or a jump across more than float32's range.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmp._src.optim import base


def _random_finite(rng, n, dtype):
  """Random finite values of ``dtype`` over its whole range, from random bit patterns."""
  bits = rng.integers(0, 2**16, size=4 * n, dtype=np.uint32).astype(np.uint16)
  values = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(bits), dtype), np.float32)
  return values[np.isfinite(values)][:n]


@pytest.mark.parametrize("dtype, factor", [(jnp.bfloat16, 2.0**15), (jnp.float16, 2.0**13)])
def test_landing_is_exact_unless_the_param_shrinks_more_than_the_stated_factor(dtype, factor):
  rng = np.random.default_rng(0)
  p = _random_finite(rng, 200_000, dtype)
  # Targets near p (as training makes them), anywhere (random bits), and zeros.
  near = np.clip(p * rng.uniform(-3.0, 3.0, size=p.shape), -float(jnp.finfo(dtype).max),
                 float(jnp.finfo(dtype).max)).astype(np.float32)
  far = _random_finite(rng, p.size, dtype)
  for t in (near, far, np.zeros_like(p)):
    p16, t16 = jnp.asarray(p, dtype), jnp.asarray(t, dtype)
    exact = np.asarray(base.landing_is_exact(p16, t16))
    landed = optax.apply_updates(p16, base.update_to(p16, t16))
    zeros = np.asarray((landed == 0) & (t16 == 0))
    np.testing.assert_array_equal(exact, np.asarray(base.bits(landed) == base.bits(t16)) | zeros)
    p32, t32 = np.abs(np.asarray(p16, np.float32)), np.abs(np.asarray(t16, np.float32))
    tiny = 2.0**-118
    jump = np.abs(np.asarray(t16, np.float64) - np.asarray(p16, np.float64))
    covered = (((p32 == 0) | (t32 == 0) | (t32 >= p32 / factor))
               & ((p32 == 0) | (p32 >= tiny)) & ((t32 == 0) | (t32 >= tiny))
               & (jump <= float(jnp.finfo(jnp.float32).max)))
    assert covered.sum() > 0.9 * covered.size or t is far
    assert exact[covered].all(), (p[covered & ~exact][:5], t[covered & ~exact][:5])


def test_a_param_shrinking_by_more_than_two_to_the_15_can_miss():
  # 1e-7 is not a multiple of 2**-24, float32's spacing just below 1.0.
  p, t = jnp.bfloat16(1.0), jnp.bfloat16(1e-7)
  assert not bool(base.landing_is_exact(p, t))
  landed = optax.apply_updates(p, base.update_to(p, t))
  assert float(landed) != float(t)
  assert abs(float(landed) - float(t)) <= 2.0**-24  # within a float32 ulp of the old value


def test_an_unchanged_param_keeps_every_bit_negative_zero_included():
  p = jnp.array([-0.0, 0.0, 1.0, -2.0, jnp.inf], jnp.bfloat16)
  landed = optax.apply_updates(p, base.update_to(p, p))
  np.testing.assert_array_equal(np.asarray(base.bits(landed)), np.asarray(base.bits(p)))


def test_select_leaves_refuses_trees_with_nothing_to_do_and_refused_dtypes():
  with pytest.raises(ValueError, match="float32"):
    base.select_leaves({"w": jnp.ones(2)}, base.HALF_DTYPES, "t", "acts on", "hint")
  with pytest.raises(ValueError, match="param a has dtype float16"):
    base.select_leaves({"a": jnp.ones(2, jnp.float16), "b": jnp.ones(2, jnp.bfloat16)},
                       (np.dtype(jnp.bfloat16),), "t", "acts on", "hint",
                       refused=(np.dtype(jnp.float16),))
  mask = base.select_leaves({"a": jnp.ones(2), "b": jnp.ones(2, jnp.bfloat16)},
                            base.HALF_DTYPES, "t", "acts on", "hint")
  assert mask == {"a": False, "b": True}
