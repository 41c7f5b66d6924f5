"""Optimizer-state storage dtypes: stored narrow, computed in float32, rounded on storage."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from tests import tree_asserts

PARAMS = {"kernel": jax.random.normal(jax.random.key(0), (32, 17)),
          "bias": jnp.zeros(17), "scalar": jnp.ones(())}


def _grads(step):
  key = jax.random.fold_in(jax.random.key(1), step)
  return jax.tree.map(lambda p: jax.random.normal(jax.random.fold_in(key, p.size), p.shape),
                      PARAMS)


def test_adam_moments_are_stored_in_bfloat16_counts_and_scalars_keep_their_dtype():
  tx = jaxmp.optim.state_dtypes(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
                                "bfloat16")
  state = tx.init(PARAMS)
  adam = state.inner_state[0]
  assert {x.dtype for x in jax.tree.leaves((adam.mu["kernel"], adam.nu["bias"]))} == {
      jnp.dtype(jnp.bfloat16)}
  assert adam.mu["scalar"].dtype == jnp.float32  # a scalar leaf: not an array state
  assert adam.count.dtype == jnp.int32
  assert state.hyperparams["learning_rate"].dtype == jnp.float32
  updates, state = jax.jit(tx.update)(_grads(0), state, PARAMS)
  assert state.inner_state[0].mu["kernel"].dtype == jnp.bfloat16
  assert updates["kernel"].dtype == jnp.float32


def test_each_step_computes_in_float32_from_the_stored_state_and_rounds_only_the_storage():
  inner = optax.adamw(1e-2, weight_decay=0.1)
  tx = jaxmp.optim.state_dtypes(inner, "bfloat16")
  state, natural = tx.init(PARAMS), inner.init(PARAMS)
  step, ref_step = jax.jit(tx.update), jax.jit(inner.update)
  for i in range(10):
    # By hand: widen the stored state, run AdamW in float32, round the new state.
    widened = jax.tree.map(lambda s, n: s.astype(n.dtype), state, natural)
    expected_updates, new = ref_step(_grads(i), widened, PARAMS)
    expected_state = jax.tree.map(lambda n, s: n.astype(s.dtype), new, state)
    updates, state = step(_grads(i), state, PARAMS)
    tree_asserts.assert_trees_equal(updates, expected_updates)
    tree_asserts.assert_trees_equal(state, expected_state)
  assert state[0].mu["kernel"].dtype == jnp.bfloat16


def test_a_choice_per_leaf_stores_only_nu_narrow():
  nu_only = lambda path, leaf: "bfloat16" if "/nu/" in f"/{path}/" else None
  tx = jaxmp.optim.state_dtypes(optax.adam(1e-2), nu_only)
  state = tx.init(PARAMS)
  _, state = jax.jit(tx.update)(_grads(0), state, PARAMS)
  assert state[0].nu["kernel"].dtype == jnp.bfloat16
  assert state[0].mu["kernel"].dtype == jnp.float32
  # mu went through float32 arithmetic only: exactly float32 Adam's.
  _, reference = optax.adam(1e-2).update(_grads(0), optax.adam(1e-2).init(PARAMS), PARAMS)
  np.testing.assert_array_equal(state[0].mu["kernel"], reference[0].mu["kernel"])


def test_the_choice_function_sees_paths_and_leaves():
  seen = {}

  def choose(path, leaf):
    seen[path] = (leaf.shape, leaf.dtype)
    return None

  jaxmp.optim.state_dtypes(optax.chain(optax.clip(1.0), optax.adam(1e-3)), choose).init(PARAMS)
  assert seen["1/0/nu/kernel"] == ((32, 17), jnp.float32)
  assert "1/0/count" not in seen  # integer leaves are never offered


def test_bfloat16_gradients_and_params_are_widened_before_the_inner_update():
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
  grads = jax.tree.map(lambda g: g.astype(jnp.bfloat16), _grads(0))
  tx = jaxmp.optim.state_dtypes(optax.adamw(1e-2, weight_decay=0.1), "bfloat16")
  updates, _ = tx.update(grads, tx.init(params), params)
  expected, _ = optax.adamw(1e-2, weight_decay=0.1).update(
      jax.tree.map(lambda g: g.astype(jnp.float32), grads),
      optax.adamw(1e-2).init(PARAMS), jax.tree.map(lambda p: p.astype(jnp.float32), params))
  tree_asserts.assert_trees_equal(updates, expected)


def test_a_skipped_step_leaves_the_stored_state_bit_for_bit():
  tx = jaxmp.loss_scaling(jaxmp.optim.state_dtypes(optax.adam(1e-2), "bfloat16"),
                          jaxmp.NoOpLossScale())
  state = tx.init(PARAMS)
  _, state = tx.update(_grads(0), state, PARAMS)
  bad = _grads(1)
  bad["bias"] = bad["bias"].at[3].set(jnp.nan)
  _, after = tx.update(bad, state, PARAMS)
  tree_asserts.assert_trees_equal(after.inner_state, state.inner_state)


@pytest.mark.parametrize("dtype", ["float16", jnp.float32])
def test_other_floating_storage_dtypes(dtype):
  state = jaxmp.optim.state_dtypes(optax.sgd(1e-3, momentum=0.9), dtype).init(PARAMS)
  assert state[0].trace["kernel"].dtype == jnp.dtype(dtype)
  state = jaxmp.optim.state_dtypes(optax.adam(1e-3), jnp.float32).init(PARAMS)
  assert state[0].nu["kernel"].dtype == jnp.float32


def test_float16_underflows_what_adam_keeps_in_nu():
  # Why float16 is refused there: a gradient of 1e-4 gives nu = (1 - b2) * g**2 = 1e-11,
  # below float16's smallest subnormal (2**-24, 6e-8), so it is stored as zero and the
  # next step divides mu by eps alone.
  nu = (1 - 0.999) * np.float32(1e-4) ** 2
  assert nu > 0 and float(jnp.float16(nu)) == 0.0 and float(jnp.bfloat16(nu)) > 0


@pytest.mark.parametrize("inner, leaf", [
    (optax.adam(1e-3), "'0/nu/bias' (ScaleByAdamState.nu)"),
    (optax.chain(optax.clip(1.0), optax.adamw(1e-3)), "'1/0/nu/bias' (ScaleByAdamState.nu)"),
    (optax.rmsprop(1e-3), "'0/nu/bias' (ScaleByRmsState.nu)"),
    (optax.adagrad(1e-3), "'0/sum_of_squares/bias' (ScaleByRssState.sum_of_squares)"),
    (optax.adafactor(1e-3), "'0/v_row/bias' (FactoredState.v_row)"),
    (optax.sm3(1e-3), "'0/mu/bias/0' (ScaleBySM3State.mu)"),
    (optax.adadelta(1e-3), "'1/e_g/bias' (ScaleByAdaDeltaState.e_g)"),
    (optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
     "'inner_state/0/nu/bias' (ScaleByAdamState.nu)"),
])
def test_float16_is_refused_for_state_that_holds_squared_gradients(inner, leaf):
  for dtype in ("float16", lambda path, leaf: "float16"):
    with pytest.raises(ValueError, match=re.escape(leaf) + r".*float16"):
      jaxmp.optim.state_dtypes(inner, dtype).init(PARAMS)


def test_float16_first_moments_with_bfloat16_second_moments_compute_as_by_hand():
  halves = lambda path, leaf: "bfloat16" if "/nu/" in f"/{path}/" else "float16"
  inner = optax.adam(1e-2)
  tx = jaxmp.optim.state_dtypes(inner, halves)
  state, natural = tx.init(PARAMS), inner.init(PARAMS)
  assert (state[0].mu["kernel"].dtype, state[0].nu["kernel"].dtype) == (
      jnp.float16, jnp.bfloat16)
  for i in range(3):
    widened = jax.tree.map(lambda s, n: s.astype(n.dtype), state, natural)
    expected_updates, new = jax.jit(inner.update)(_grads(i), widened, PARAMS)
    expected_state = jax.tree.map(lambda n, s: n.astype(s.dtype), new, state)
    updates, state = jax.jit(tx.update)(_grads(i), state, PARAMS)
    tree_asserts.assert_trees_equal(updates, expected_updates)
    tree_asserts.assert_trees_equal(state, expected_state)
