"""Kahan-compensated updates of bfloat16 params."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp


def numpy_kahan_add(p, u, c):
  """REFERENCE.md's formula in float32 NumPy, c and p stored in bfloat16."""
  bf16 = jnp.bfloat16
  p32, c32 = np.asarray(p, np.float32), np.asarray(c, np.float32)
  y = np.float32(u) - c32
  t = np.asarray((p32 + y).astype(bf16), np.float32)
  c_new = ((t - p32) - y).astype(bf16)
  return t.astype(bf16), c_new


def test_1000_updates_of_1e_minus_4_reach_1_1_where_nearest_rounding_stays_at_1():
  nearest = kahan = jnp.ones((), jnp.bfloat16)
  c = jnp.zeros((), jnp.bfloat16)
  for _ in range(1000):
    nearest = (nearest + jnp.float32(1e-4)).astype(jnp.bfloat16)
    kahan, c = jaxmp.optim.kahan_add(kahan, jnp.float32(1e-4), c)
  assert float(nearest) == 1.0
  # The bfloat16 value nearest to 1.1 (1.1015625: bfloat16 steps by 2**-7 there).
  assert float(kahan) == float(jnp.bfloat16(1.1))


def test_equals_the_numpy_formula_bit_for_bit():
  rng = np.random.default_rng(0)
  p = jnp.asarray(rng.normal(size=10_000), jnp.bfloat16)
  c = jnp.asarray(rng.normal(size=10_000) * 1e-3, jnp.bfloat16)
  u = rng.normal(size=10_000).astype(np.float32) * 10.0 ** rng.uniform(-6, 0, 10_000)
  u = u.astype(np.float32)
  t, c_new = jax.jit(jaxmp.optim.kahan_add)(p, jnp.asarray(u), c)
  t_ref, c_ref = numpy_kahan_add(p, u, c)
  np.testing.assert_array_equal(np.asarray(t).view(np.uint16), np.asarray(t_ref).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(c_new).view(np.uint16),
                                np.asarray(c_ref).view(np.uint16))


def test_the_transform_recovers_what_nearest_rounding_loses():
  params = {"w": jnp.ones(8, jnp.bfloat16), "f32": jnp.ones(2)}
  grads = jax.tree.map(lambda p: -jnp.ones(p.shape, p.dtype), params)
  for tx, expected in [(optax.sgd(1e-4), 1.0),
                       (jaxmp.optim.kahan_summation(optax.sgd(1e-4)), 1.1015625)]:
    state, p = tx.init(params), params
    step = jax.jit(lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(
        *tx.update(grads, s, p)))
    for _ in range(1000):
      p, state = step(p, state)
    assert float(p["w"][0]) == expected  # 1.1015625: the bfloat16 nearest 1.1
    assert p["w"].dtype == jnp.bfloat16
    np.testing.assert_allclose(p["f32"], 1.1, rtol=1e-4)  # float32 leaves: plain SGD


def test_each_step_is_kahan_add_of_the_inner_optimizers_update_bit_for_bit():
  rng = np.random.default_rng(3)
  params = {"w": jnp.asarray(rng.normal(size=500), jnp.bfloat16)}
  # Adam in float32 (bfloat16 arithmetic inside jit may keep excess precision).
  inner = jaxmp.optim.state_dtypes(optax.adam(1e-3), "bfloat16")
  tx = jaxmp.optim.kahan_summation(inner)
  state = tx.init(params)
  p_ref, c_ref, inner_ref = params["w"], jnp.zeros(500, jnp.bfloat16), inner.init(params)
  for i in range(5):
    grads = {"w": jnp.asarray(rng.normal(size=500), jnp.bfloat16)}
    updates, state = jax.jit(tx.update)(grads, state, params)
    params = optax.apply_updates(params, updates)
    u, inner_ref = jax.jit(inner.update)(grads, inner_ref, {"w": p_ref})
    p_ref, c_ref = numpy_kahan_add(p_ref, np.asarray(u["w"], np.float32), c_ref)
    np.testing.assert_array_equal(np.asarray(params["w"]).view(np.uint16),
                                  np.asarray(p_ref).view(np.uint16), err_msg=f"step {i}")
    np.testing.assert_array_equal(np.asarray(state.compensation["w"]).view(np.uint16),
                                  np.asarray(c_ref).view(np.uint16), err_msg=f"step {i}")
  assert int(state.inner_state[0].count) == 5


def test_the_chain_form_that_a_later_transform_silently_undid_is_refused():
  # optax.chain(kahan_summation(), optax.sgd(lr)) trained exactly like nearest rounding:
  # SGD rescaled the updates that were meant to land on the compensated values.
  with pytest.raises(TypeError, match=r"kahan_summation wraps the optimizer, "
                                      r"kahan_summation\(inner\)"):
    optax.chain(jaxmp.optim.kahan_summation(), optax.sgd(1e-4))


def test_the_compensation_has_the_params_shape_and_dtype():
  state = jaxmp.optim.kahan_summation(optax.sgd(1.0)).init(
      {"w": jnp.ones((3, 5), jnp.bfloat16), "h": jnp.ones(2, jnp.float16), "f": jnp.ones(2)})
  assert state.compensation["w"].shape == (3, 5)
  assert state.compensation["w"].dtype == jnp.bfloat16
  assert state.compensation["h"].dtype == jnp.float16
  assert state.compensation["f"] is None
