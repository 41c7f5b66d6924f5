"""Stochastic rounding float32 -> bfloat16: the formula, unbiasedness, determinism, the transform."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp


def numpy_stochastic_round(x: np.ndarray, r: np.ndarray) -> np.ndarray:
  """REFERENCE.md's formula: add a random 16-bit integer, clear the low 16 bits."""
  bits = x.astype(np.float32).view(np.uint32)
  rounded = ((bits.astype(np.uint64) + r.astype(np.uint64)) & 0xFFFF0000).astype(np.uint32)
  return np.where(np.isfinite(x), rounded.view(np.float32), x)


def _values(n=100_000):
  rng = np.random.default_rng(0)
  pieces = [rng.normal(size=n), rng.normal(size=n) * 1e-30, rng.normal(size=n) * 1e30,
            [0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, -3.4028235e38, 1e-45, -1e-45]]
  random_bits = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
  return np.concatenate([np.asarray(p, np.float32) for p in pieces]
                        + [random_bits.view(np.float32)])


def test_equals_the_numpy_formula_bit_for_bit():
  x = _values()
  key = jax.random.key(42)
  ours = np.asarray(jax.jit(jaxmp.optim.stochastic_round)(jnp.asarray(x), key), np.float32)
  r = np.asarray(jax.random.bits(key, x.shape, jnp.uint16))  # the bits it draws
  expected = numpy_stochastic_round(x, r)
  finite = np.isfinite(x)
  np.testing.assert_array_equal(ours[finite].view(np.uint32), expected[finite].view(np.uint32))
  np.testing.assert_array_equal(ours[~finite], x[~finite])  # inf stays inf, NaN NaN


def test_unbiased_the_mean_of_many_roundings_is_the_value():
  rng = np.random.default_rng(1)
  x = (rng.normal(size=64) * 10.0 ** rng.uniform(-5, 5, size=64)).astype(np.float32)
  n = 20_000
  keys = jax.random.split(jax.random.key(7), n)
  rounded = jax.jit(jax.vmap(lambda k: jaxmp.optim.stochastic_round(jnp.asarray(x), k)))(keys)
  mean = np.asarray(rounded, np.float64).mean(axis=0)
  nearest = np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float64)
  # The two bfloat16 neighbours: truncation, and truncation plus an ulp.
  below = np.asarray(numpy_stochastic_round(x, np.zeros(x.shape, np.uint16)), np.float64)
  above = np.asarray(numpy_stochastic_round(x, np.full(x.shape, 0xFFFF, np.uint16)), np.float64)
  ulp = np.abs(above - below)
  frac = np.where(ulp > 0, np.abs(x - below) / np.where(ulp > 0, ulp, 1), 0)
  sigma = ulp * np.sqrt(frac * (1 - frac) / n)  # the standard error of the mean
  # Within 5 standard errors of the value, where round-to-nearest is off by up to half an ulp.
  assert np.all(np.abs(mean - x) <= 5 * sigma + 1e-12 * np.abs(x)), np.max(
      np.abs(mean - x) / np.maximum(sigma, 1e-300))
  assert np.mean(np.abs(nearest - x) > 5 * sigma) > 0.9  # nearest rounding would fail this


def test_deterministic_per_key_and_different_across_keys():
  x = jnp.asarray(_values(1000))
  a = jaxmp.optim.stochastic_round(x, jax.random.key(3))
  b = jaxmp.optim.stochastic_round(x, jax.random.key(3))
  c = jaxmp.optim.stochastic_round(x, jax.random.key(4))
  np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
  assert np.any(np.asarray(a).view(np.uint16) != np.asarray(c).view(np.uint16))
  raw = jaxmp.optim.stochastic_round(x, jax.random.PRNGKey(3))  # a raw key: the same bits
  np.testing.assert_array_equal(np.asarray(raw).view(np.uint16), np.asarray(a).view(np.uint16))


def test_bfloat16_values_are_left_exactly_as_they_are():
  x = jnp.asarray(np.random.default_rng(2).normal(size=1000), jnp.bfloat16)
  out = jaxmp.optim.stochastic_round(x.astype(jnp.float32), jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x))


def _train(tx, params, steps, state=None, start=0):
  state = tx.init(params) if state is None else state

  @jax.jit
  def step(params, state, i):
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * (1.0 + 0.1 * i), params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for i in range(start, start + steps):
    params, state = step(params, state, i)
  return params, state


def test_small_updates_survive_on_average_where_nearest_rounding_loses_them():
  params = {"w": jnp.ones(4096, jnp.bfloat16)}
  lr = 2e-4  # 1/20 of a bfloat16 ulp below 1.0: nearest rounding never moves
  nearest, _ = _train(optax.sgd(lr), params, 50)
  sr, _ = _train(jaxmp.optim.stochastic_rounding(optax.sgd(lr), jax.random.key(0)), params, 50)
  exact = 1.0 - lr * sum(1.0 + 0.1 * i for i in range(50))
  assert np.all(np.asarray(nearest["w"], np.float32) == 1.0)
  assert abs(float(jnp.mean(sr["w"].astype(jnp.float32))) - exact) < 2e-4


def test_a_restored_state_continues_with_the_same_bits():
  tx = jaxmp.optim.stochastic_rounding(optax.adam(1e-3), jax.random.key(5))
  params = {"w": jax.random.normal(jax.random.key(1), (300,)).astype(jnp.bfloat16),
            "f32": jnp.ones(3)}
  straight, _ = _train(tx, params, 6)
  half, state = _train(tx, params, 3)
  restored = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), state)  # through the host
  resumed, _ = _train(tx, half, 3, state=restored, start=3)
  chex.assert_trees_all_equal(resumed, straight)
  assert int(state.count) == 3 and state.key.dtype == jnp.uint32
  assert int(state.inner_state[0].count) == 3  # Adam's


def test_each_step_and_each_leaf_draws_its_own_bits():
  tx = jaxmp.optim.stochastic_rounding(optax.identity(), jax.random.key(0))
  params = {"a": jnp.ones(1000, jnp.bfloat16), "b": jnp.ones(1000, jnp.bfloat16)}
  small = jax.tree.map(lambda p: jnp.full(p.shape, 2.0**-9, jnp.float32), params)  # 1/4 ulp
  state = tx.init(params)
  first, state = tx.update(small, state, params)
  second, _ = tx.update(small, state, params)
  moved = lambda u: np.asarray(u != -0.0)
  assert np.any(moved(first["a"]) != moved(first["b"]))
  assert np.any(moved(first["a"]) != moved(second["a"]))
  assert 0.15 < moved(first["a"]).mean() < 0.35  # rounds up a quarter of the time


def test_each_step_rounds_param_plus_the_inner_update_with_the_formula_bit_for_bit():
  key = jax.random.key(11)
  rng = np.random.default_rng(4)
  params = {"a": jnp.asarray(rng.normal(size=300), jnp.bfloat16),
            "b": jnp.asarray(rng.normal(size=(4, 5)), jnp.bfloat16), "f32": jnp.ones(3)}
  # Momentum in float32 (bfloat16 arithmetic inside jit may keep excess precision).
  inner = jaxmp.optim.state_dtypes(optax.sgd(1e-3, momentum=0.9), "bfloat16")
  tx = jaxmp.optim.stochastic_rounding(inner, key)
  state, inner_ref = tx.init(params), inner.init(params)
  for step in range(3):
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    u, inner_ref = jax.jit(inner.update)(grads, inner_ref, params)
    expected = {}
    for i, name in enumerate(sorted(params)):  # leaf i draws from fold_in(key_step, i)
      if name == "f32":
        expected[name] = np.asarray(params[name] + u[name])
        continue
      x = np.asarray(params[name], np.float32) + np.asarray(u[name], np.float32)
      r = np.asarray(jax.random.bits(jax.random.fold_in(jax.random.fold_in(key, step), i),
                                     x.shape, jnp.uint16))
      expected[name] = numpy_stochastic_round(x, r)
    params = optax.apply_updates(params, updates)
    for name in params:
      np.testing.assert_array_equal(np.asarray(params[name], np.float32),
                                    np.asarray(expected[name], np.float32),
                                    err_msg=f"step {step}, {name}")


def test_the_chain_form_that_a_later_transform_silently_undid_is_refused():
  # optax.chain(stochastic_rounding(key), optax.sgd(lr)) trained exactly like nearest
  # rounding: SGD rescaled the updates that were meant to land on the rounded values.
  with pytest.raises(TypeError, match=r"stochastic_rounding\(inner, key\)"):
    optax.chain(jaxmp.optim.stochastic_rounding(jax.random.key(0)), optax.sgd(1e-3))


def test_outside_loss_scaling_a_skipped_step_keeps_every_param_bit_for_bit():
  # The order docs/guides/memory.md recommends: stochastic_rounding(loss_scaling(...)). Loss
  # scaling's zero updates (-0.0) round to the params themselves: p's low 16 bits are
  # zero, so no random 16-bit addend carries into the kept bits.
  params = {"w": jnp.array([1.0, -0.0, 0.0, -3.5, 1e-30, jnp.inf], jnp.bfloat16),
            "b": jnp.array([2.0**-126, -7.0], jnp.bfloat16)}
  tx = jaxmp.optim.stochastic_rounding(
      jaxmp.loss_scaling(jaxmp.optim.state_dtypes(optax.adam(1e-2), "bfloat16"),
                         jaxmp.DynamicLossScale(2.0**15)), jax.random.key(3))
  state = tx.init(params)
  finite = jax.tree.map(lambda p: jnp.ones(p.shape, jnp.float32), params)
  updates, state = tx.update(finite, state, params)
  params = optax.apply_updates(params, updates)
  adam_before = state.inner_state.inner_state  # under stochastic rounding and loss scaling
  bad = jax.tree.map(lambda p: jnp.full(p.shape, jnp.nan, jnp.float32), params)
  updates, skipped = tx.update(bad, state, params)
  chex.assert_trees_all_equal(optax.apply_updates(params, updates), params)
  chex.assert_trees_all_equal(skipped.inner_state.inner_state, adam_before)
  assert float(jaxmp.get_loss_scale(skipped).loss_scale) == 2.0**14
