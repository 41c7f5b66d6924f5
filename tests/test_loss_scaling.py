"""loss_scaling: skip semantics, composition with optax, gradient accumulation and its
wrong nesting, the consecutive-skip cap, state lookup, metrics, bad input."""

import math
import re
import subprocess
import sys
import textwrap

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
from tests import tree_asserts
from tests import xla_flags
from tests.test_loss_scale import torch_grad_scaler

SCALE = 2.0**10  # a power of two: scaling and unscaling are exact
# Comparisons with a reference optimizer compiled on its own: XLA may fuse (and contract
# into FMAs) the same arithmetic differently inside the wrapper's cond, so results can
# differ in the last bit. What the wrapper promises exactly (a skipped step leaves the
# state untouched, zero updates) is checked with tree_asserts.assert_trees_equal.
REFERENCE_RTOL = 1e-6


def _params():
  return {"w": jnp.array([[0.5, -1.0], [2.0, 0.25]], jnp.float32), "b": jnp.array([0.1, -0.2])}


def _grads(seed):
  keys = jax.random.split(jax.random.key(seed), 2)
  return {"w": jax.random.normal(keys[0], (2, 2)), "b": jax.random.normal(keys[1], (2,))}


def _poison(grads):
  return {"w": grads["w"].at[0, 1].set(jnp.nan), "b": grads["b"]}


def _scaled(grads, scale=SCALE):
  return jax.tree_util.tree_map(lambda g: g * scale, grads)


def _run(tx, grads_seq, params=None, *, poison_at=(), scale_with_state=False):
  """Runs tx over a sequence of gradients; returns the updates, final state and params.

  With scale_with_state, each gradient is first multiplied by the loss scale in the
  current state (as a training loop does); indices in poison_at then get a NaN.
  """
  params = _params() if params is None else params
  state = tx.init(params)
  update = jax.jit(tx.update)
  all_updates = []
  for i, grads in enumerate(grads_seq):
    if scale_with_state:
      grads = jaxmp.get_loss_scale(state).scale(grads)
    if i in poison_at:
      grads = _poison(grads)
    updates, state = update(grads, state, params)
    all_updates.append(updates)
    params = optax.apply_updates(params, updates)
  return all_updates, state, params


# --------------------------------------------------------------------------------------
# Core semantics.


@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adam(1e-2), optax.adamw(1e-2)])
def test_finite_steps_match_the_inner_optimizer_on_unscaled_grads(inner):
  grads = [_grads(i) for i in range(3)]
  ours, _, params = _run(jaxmp.loss_scaling(inner, jaxmp.DynamicLossScale(SCALE)),
                         [_scaled(g) for g in grads])
  ref, _, ref_params = _run(inner, grads)
  tree_asserts.assert_trees_close(ours, ref, rtol=REFERENCE_RTOL)
  tree_asserts.assert_trees_close(params, ref_params, rtol=REFERENCE_RTOL)


def test_a_non_finite_step_is_skipped_bit_for_bit():
  inner = optax.adam(1e-2)
  tx = jaxmp.loss_scaling(inner, jaxmp.DynamicLossScale(SCALE, growth_interval=100))
  params = _params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  _, state = update(_scaled(_grads(0)), state, params)
  before = state
  for bad in (_poison(_scaled(_grads(1))), jax.tree_util.tree_map(lambda g: g * jnp.inf,
                                                                  _grads(2))):
    updates, state = update(bad, state, params)
    tree_asserts.assert_trees_equal(updates, jax.tree_util.tree_map(jnp.zeros_like, params))
    tree_asserts.assert_trees_equal(state.inner_state, before.inner_state)
    assert int(state.inner_state[0].count) == 1  # Adam's step count did not advance
    assert not bool(state.last_step_finite)
  assert int(state.skipped_steps) == 2
  assert float(state.loss_scale.loss_scale) == SCALE / 4
  assert int(state.loss_scale.counter) == 0

  # The next finite step continues exactly as if the bad steps had never happened.
  updates, state = update(_scaled(_grads(3), SCALE / 4), state, params)
  ref_state = inner.init(params)
  _, ref_state = jax.jit(inner.update)(_grads(0), ref_state, params)
  ref_updates, ref_state = jax.jit(inner.update)(_grads(3), ref_state, params)
  tree_asserts.assert_trees_close(updates, ref_updates, rtol=REFERENCE_RTOL)
  tree_asserts.assert_trees_close(state.inner_state, ref_state, rtol=REFERENCE_RTOL)
  assert bool(state.last_step_finite) and int(state.skipped_steps) == 2


def test_default_loss_scale_is_dynamic_and_initial_state():
  state = jaxmp.loss_scaling(optax.sgd(1.0)).init(_params())
  assert isinstance(state, jaxmp.LossScalingState)
  assert isinstance(state.loss_scale, jaxmp.DynamicLossScale)
  assert float(state.loss_scale.loss_scale) == 2.0**15
  assert state.skipped_steps.dtype == jnp.int32 and int(state.skipped_steps) == 0
  assert state.last_step_finite.dtype == jnp.bool_ and bool(state.last_step_finite)
  assert state.consecutive_skips.dtype == jnp.int32 and int(state.consecutive_skips) == 0
  assert state._fields == ("loss_scale", "inner_state", "skipped_steps", "last_step_finite",
                           "consecutive_skips")


def test_scale_trajectory_through_the_transform_matches_the_reference():
  overflows = (1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0)
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**15, growth_interval=3))
  params = _params()
  state = tx.init(params)
  scales = []
  for i, overflow in enumerate(overflows):
    grads = jaxmp.get_loss_scale(state).scale(_grads(i))
    grads = _poison(grads) if overflow else grads
    _, state = jax.jit(tx.update)(grads, state, params)
    scales.append(float(jaxmp.loss_scaling_metrics(state)["loss_scale"]))
  assert scales == [16384, 8192, 8192, 8192, 16384, 16384, 16384, 32768, 16384, 16384, 16384,
                    32768, 32768]
  assert int(state.skipped_steps) == 3


def test_skip_zeros_have_the_inner_updates_dtypes():
  # Pure float16 parameters and gradients: updates and skip zeros are float16.
  params = {"w": jnp.ones(3, jnp.float16), "b": jnp.ones(2, jnp.bfloat16)}
  tx = jaxmp.loss_scaling(optax.sgd(0.5), jaxmp.DynamicLossScale(2.0**8))
  state = tx.init(params)
  grads = {"w": jnp.full(3, 2.0**8, jnp.float16), "b": jnp.full(2, 2.0**8, jnp.bfloat16)}
  updates, state = jax.jit(tx.update)(grads, state, params)
  assert updates["w"].dtype == jnp.float16 and updates["b"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(updates["w"], np.full(3, -0.5, np.float16))
  grads["w"] = grads["w"].at[1].set(jnp.inf)
  updates, state = jax.jit(tx.update)(grads, state, params)
  assert updates["w"].dtype == jnp.float16 and updates["b"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(updates["w"], np.zeros(3, np.float16))
  assert int(state.skipped_steps) == 1


def test_finite_check_is_exact_on_both_sides_of_the_fast_path():
  params = {"w": jnp.zeros(2)}
  big = {"w": jnp.array([3e38, 3e38], jnp.float32)}  # finite, but their sum overflows
  tx = jaxmp.loss_scaling(optax.sgd(1e-30), jaxmp.NoOpLossScale())
  updates, state = jax.jit(tx.update)(big, tx.init(params), params)
  assert bool(state.last_step_finite) and int(state.skipped_steps) == 0
  np.testing.assert_allclose(updates["w"], [-3e8, -3e8], rtol=1e-6)
  # A scale below 1: the scaled gradients are finite, the unscaled ones overflow.
  tx = jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.StaticLossScale(0.5))
  updates, state = jax.jit(tx.update)({"w": jnp.array([3e38, 1.0])}, tx.init(params), params)
  assert not bool(state.last_step_finite) and int(state.skipped_steps) == 1
  np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
  # Non-float leaves in the gradients are ignored by the check.
  tx = jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.StaticLossScale(2.0))
  p = {"w": jnp.ones(2)}
  _, state = tx.update({"w": jnp.ones(2)}, tx.init(p), p)
  assert bool(state.last_step_finite)


def test_no_op_loss_scale_only_skips():
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.NoOpLossScale())
  ours, state, _ = _run(tx, [_grads(0), _poison(_grads(1)), _grads(2)])
  ref, _, _ = _run(optax.sgd(0.1), [_grads(0), _grads(2)])
  tree_asserts.assert_trees_close([ours[0], ours[2]], ref, rtol=REFERENCE_RTOL)
  assert int(state.skipped_steps) == 1 and isinstance(state.loss_scale, jaxmp.NoOpLossScale)


def test_runs_in_a_scan_and_donated_state_does_not_break_a_second_init():
  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(SCALE, growth_interval=2))
  params = _params()
  grads = jax.tree_util.tree_map(lambda *g: jnp.stack(g),
                                 *[_scaled(_grads(i)) for i in range(5)])
  grads["w"] = grads["w"].at[2, 0, 0].set(jnp.inf)

  def body(carry, g):
    params, state = carry
    updates, state = tx.update(g, state, params)
    return (optax.apply_updates(params, updates), state), jaxmp.loss_scaling_metrics(state)

  run = jax.jit(lambda p, s, g: jax.lax.scan(body, (p, s), g), donate_argnums=(1,))
  (_, state), metrics = run(params, tx.init(params), grads)
  np.testing.assert_array_equal(metrics["last_step_finite"], [True, True, False, True, True])
  np.testing.assert_array_equal(metrics["skipped_steps"], [0, 0, 1, 1, 1])
  np.testing.assert_array_equal(metrics["loss_scale"],
                                [SCALE, 2 * SCALE, SCALE, SCALE, 2 * SCALE])
  assert int(state.inner_state[0].count) == 4
  # init hands out fresh arrays: the donated state's arrays are not reused.
  (_, state2), _ = run(params, tx.init(params), grads)
  assert int(state2.skipped_steps) == 1


def test_state_survives_a_checkpoint_round_trip_and_training_continues_identically():
  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(SCALE, growth_interval=3,
                                                                   min_scale=0.5))
  params = _params()
  update = jax.jit(tx.update)
  state = tx.init(params)
  for i in range(4):
    grads = _scaled(_grads(i))
    _, state = update(_poison(grads) if i == 1 else grads, state, params)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  restored = jax.tree_util.tree_unflatten(treedef, [np.array(np.asarray(x)) for x in leaves])
  assert restored.loss_scale.min_scale == 0.5 and restored.loss_scale.growth_interval == 3
  tree_asserts.assert_trees_equal(restored, state)
  grads = _scaled(_grads(9), SCALE / 2)
  tree_asserts.assert_trees_equal(update(grads, restored, params), update(grads, state, params))


# --------------------------------------------------------------------------------------
# Composition.


def test_gradient_clipping_inside_sees_unscaled_gradients():
  inner = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1.0))
  grads = [_grads(i) for i in range(3)]
  ours, _, _ = _run(jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(SCALE)),
                    [_scaled(g) for g in grads])
  ref, _, _ = _run(inner, grads)
  tree_asserts.assert_trees_close(ours, ref, rtol=REFERENCE_RTOL)
  # Clipping the scaled gradients (the classic mistake) gives something else.
  wrong, wrong_state, _ = _run(
      optax.chain(optax.clip_by_global_norm(0.5),
                  jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.StaticLossScale(SCALE))),
      [_scaled(g) for g in grads])
  assert not np.allclose(wrong[0]["w"], ref[0]["w"])
  # ... which is why jaxmp refuses that state wherever it reads it (below).
  with pytest.raises(ValueError, match="chained before"):
    jaxmp.get_loss_scale(wrong_state)


def test_multi_steps_inside_drops_a_non_finite_micro_batch_without_breaking_the_window():
  def make():
    return jaxmp.loss_scaling(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3),
                              jaxmp.DynamicLossScale(SCALE, growth_interval=1000))

  g = [_grads(i) for i in range(6)]
  # A NaN micro-batch (which also halves the scale) arrives between g0 and g1.
  ours, state, params = _run(make(), g[:1] + [g[1]] + g[1:], poison_at=(1,),
                             scale_with_state=True)
  ref, ref_state, ref_params = _run(make(), g, scale_with_state=True)
  # The window (g0, g1, g2) closes one call later; then (g3, g4, g5) as usual.
  zeros = jax.tree_util.tree_map(jnp.zeros_like, _params())
  for u in ours[:3]:
    tree_asserts.assert_trees_equal(u, zeros)
  tree_asserts.assert_trees_equal(ours[3], ref[2])
  tree_asserts.assert_trees_equal(ours[6], ref[5])
  tree_asserts.assert_trees_equal(params, ref_params)
  tree_asserts.assert_trees_equal(state.inner_state.acc_grads, ref_state.inner_state.acc_grads)
  tree_asserts.assert_trees_equal(state.inner_state.inner_opt_state,
                                  ref_state.inner_state.inner_opt_state)
  assert int(state.inner_state.gradient_step) == 2
  assert int(state.skipped_steps) == 1
  assert float(state.loss_scale.loss_scale) == SCALE / 2
  # The accumulated gradients are the unscaled ones.
  plain, _, _ = _run(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3), g)
  tree_asserts.assert_trees_close(ref, plain, rtol=REFERENCE_RTOL)


def test_inject_hyperparams_inside_schedule_does_not_advance_on_skipped_steps():
  schedule = lambda count: 0.1 * (count + 1.0)
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
  tx = jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(SCALE))
  g = [_grads(i) for i in range(3)]
  ours, state, _ = _run(tx, [_scaled(g[0]), _poison(_scaled(g[1])), _scaled(g[2])])
  ref, ref_state, _ = _run(inner, [g[0], g[2]])
  tree_asserts.assert_trees_close([ours[0], ours[2]], ref, rtol=REFERENCE_RTOL)
  tree_asserts.assert_trees_close(state.inner_state, ref_state, rtol=REFERENCE_RTOL)
  assert int(state.inner_state.count) == 2
  np.testing.assert_allclose(state.inner_state.hyperparams["learning_rate"], 0.2)


def test_chain_inside_with_weight_decay_and_adam():
  inner = optax.chain(optax.add_decayed_weights(1e-2), optax.scale_by_adam(),
                      optax.scale(-1e-2))
  grads = [_grads(i) for i in range(3)]
  ours, _, _ = _run(jaxmp.loss_scaling(inner, jaxmp.DynamicLossScale(SCALE)),
                    [_scaled(x) for x in grads])
  ref, _, _ = _run(inner, grads)
  tree_asserts.assert_trees_close(ours, ref, rtol=REFERENCE_RTOL)


def test_a_chain_wrapped_whole_equals_the_plain_chain_on_finite_steps():
  # What the refused chain(loss_scaling(a), b) becomes: loss_scaling(chain(a, b)).
  tx = jaxmp.loss_scaling(optax.chain(optax.scale_by_adam(), optax.scale(-1e-2)),
                          jaxmp.DynamicLossScale(SCALE))
  ref_tx = optax.chain(optax.scale_by_adam(), optax.scale(-1e-2))
  g = [_grads(i) for i in range(3)]
  ours, state, _ = _run(tx, [_scaled(g[0]), _poison(_scaled(g[1])), _scaled(g[2], SCALE / 2)])
  ref, _, _ = _run(ref_tx, [g[0], g[2]])
  tree_asserts.assert_trees_close([ours[0], ours[2]], ref, rtol=REFERENCE_RTOL)
  tree_asserts.assert_trees_equal(ours[1], jax.tree_util.tree_map(jnp.zeros_like, _params()))
  assert float(jaxmp.get_loss_scale(state).loss_scale) == SCALE / 2
  assert int(jaxmp.loss_scaling_metrics(state)["skipped_steps"]) == 1


def test_extra_args_are_forwarded_to_an_inner_that_takes_them():
  def scale_by_value():
    def update(updates, state, params=None, *, value, **extra):
      del params, extra
      return jax.tree_util.tree_map(lambda g: g * value, updates), state
    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)

  tx = jaxmp.loss_scaling(scale_by_value(), jaxmp.StaticLossScale(4.0))
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  params = {"w": jnp.ones(2)}
  updates, _ = jax.jit(tx.update)({"w": jnp.array([4.0, 8.0])}, tx.init(params), params,
                                  value=jnp.float32(3.0))
  np.testing.assert_array_equal(updates["w"], [3.0, 6.0])
  # An inner without extra-args support ignores them; an outer chain forwards them.
  outer = optax.chain(jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.StaticLossScale(4.0)))
  updates, _ = outer.update({"w": jnp.array([4.0, 8.0])}, outer.init(params), params,
                            value=jnp.float32(3.0))
  np.testing.assert_array_equal(updates["w"], [-1.0, -2.0])


def test_reduce_on_plateau_inside_gets_the_loss_value():
  inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=0, factor=0.5,
                                                                      cooldown=0))
  tx = jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(2.0))
  params = {"w": jnp.ones(1)}
  state = tx.init(params)
  for loss in (1.0, 2.0, 3.0):
    updates, state = tx.update({"w": jnp.array([2.0])}, state, params, value=jnp.float32(loss))
  assert float(updates["w"][0]) < 1.0 and float(updates["w"][0]) != -1.0


def test_multi_steps_object_is_accepted_directly():
  tx = jaxmp.loss_scaling(optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2))
  state = tx.init(_params())
  assert isinstance(state.inner_state, optax.MultiStepsState)


# --------------------------------------------------------------------------------------
# get_loss_scale and metrics.


def test_get_loss_scale_finds_the_state_in_nested_containers():
  ls = jaxmp.StaticLossScale(8.0)
  state = jaxmp.loss_scaling(optax.sgd(1.0), ls).init(_params())
  for nested in (state, [1, (state,)], {"opt": {"x": state}, "step": 3}):
    assert float(jaxmp.get_loss_scale(nested).loss_scale) == 8.0
  # Inside a MultiSteps it is the wrong nesting (issue 13), refused rather than found.
  with pytest.raises(ValueError, match=r"jaxmp\.loss_scaling\(optax\.MultiSteps\("):
    jaxmp.get_loss_scale(optax.MultiStepsState(jnp.zeros(()), jnp.zeros(()), state, None, None))


def test_get_loss_scale_through_multisteps_chain_and_inject_hyperparams():
  # MultiSteps goes inside loss_scaling; outside it is refused (test_loss_scaling.py).
  inner_multi = jaxmp.loss_scaling(optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2),
                                   jaxmp.StaticLossScale(8.0))
  injected = optax.inject_hyperparams(
      lambda learning_rate: jaxmp.loss_scaling(optax.sgd(learning_rate),
                                               jaxmp.StaticLossScale(8.0)))(learning_rate=0.1)
  chained = optax.chain(jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.StaticLossScale(8.0)))
  for tx in (inner_multi, injected, chained):
    state = tx.init(_params())
    assert float(jaxmp.get_loss_scale(state).loss_scale) == 8.0
    assert float(jax.jit(jaxmp.get_loss_scale)(state).loss_scale) == 8.0


def test_get_loss_scale_inside_an_nnx_optimizer():
  from flax import nnx

  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(SCALE, growth_interval=1))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  ls = jaxmp.get_loss_scale(optimizer.opt_state)
  assert isinstance(ls, jaxmp.DynamicLossScale)
  assert isinstance(ls.loss_scale, jax.Array) and float(ls.loss_scale) == SCALE
  assert ls.growth_interval == 1

  def loss_fn(model, x):
    return jnp.sum(model(x) ** 2)

  @nnx.jit
  def train_step(model, optimizer, x):
    ls = jaxmp.get_loss_scale(optimizer.opt_state)
    loss, grads = ls.value_and_grad(loss_fn)(model, x)
    optimizer.update(model, grads)
    return loss, jaxmp.loss_scaling_metrics(optimizer.opt_state)

  _, metrics = train_step(model, optimizer, jnp.ones((1, 2)))
  assert float(metrics["loss_scale"]) == 2 * SCALE and bool(metrics["last_step_finite"])
  _, metrics = train_step(model, optimizer, jnp.full((1, 2), jnp.nan))
  assert float(metrics["loss_scale"]) == SCALE and int(metrics["skipped_steps"]) == 1
  assert int(jaxmp.loss_scaling_metrics(optimizer.opt_state)["skipped_steps"]) == 1


def test_get_loss_scale_needs_exactly_one_state():
  with pytest.raises(ValueError, match="no LossScalingState.*jaxmp.loss_scaling"):
    jaxmp.get_loss_scale(optax.adam(1e-3).init(_params()))
  state = jaxmp.loss_scaling(optax.sgd(1.0)).init(_params())
  with pytest.raises(ValueError, match="2 LossScalingStates"):
    jaxmp.get_loss_scale((state, state))
  nested = jaxmp.loss_scaling(jaxmp.loss_scaling(optax.sgd(1.0))).init(_params())
  with pytest.raises(ValueError, match="2 LossScalingStates"):
    jaxmp.loss_scaling_metrics(nested)


def test_metrics_inside_jit():
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(SCALE))
  params = _params()

  @jax.jit
  def step(state, grads):
    _, state = tx.update(grads, state, params)
    return state, jaxmp.loss_scaling_metrics(state)

  state, metrics = step(tx.init(params), _poison(_scaled(_grads(0))))
  assert set(metrics) == {"loss_scale", "skipped_steps", "last_step_finite",
                          "consecutive_skips"}
  assert metrics["consecutive_skips"].dtype == jnp.int32 and int(metrics["consecutive_skips"]) == 1
  assert metrics["loss_scale"].dtype == jnp.float32 and float(metrics["loss_scale"]) == SCALE / 2
  assert metrics["skipped_steps"].dtype == jnp.int32 and int(metrics["skipped_steps"]) == 1
  assert metrics["last_step_finite"].dtype == jnp.bool_ and not bool(metrics["last_step_finite"])


# --------------------------------------------------------------------------------------
# Mapped axes.


def _vmapped_step(axis_name):
  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(SCALE), axis_name=axis_name)
  params = _params()
  state = tx.init(params)
  members = [_scaled(_grads(i)) for i in range(4)]
  members[2] = _poison(members[2])
  grads = jax.tree_util.tree_map(lambda *g: jnp.stack(g), *members)
  step = lambda g: tx.update(g, state, params)
  return jax.jit(jax.vmap(step, axis_name="i"))(grads), state


def test_vmap_with_axis_name_one_poisoned_member_makes_all_skip():
  (updates, new_state), state = _vmapped_step("i")
  np.testing.assert_array_equal(new_state.last_step_finite, [False] * 4)
  np.testing.assert_array_equal(new_state.skipped_steps, [1] * 4)
  np.testing.assert_array_equal(new_state.loss_scale.loss_scale, [SCALE / 2] * 4)
  np.testing.assert_array_equal(updates["w"], np.zeros((4, 2, 2)))
  np.testing.assert_array_equal(new_state.inner_state[0].count, [0] * 4)


def test_vmap_without_axis_name_only_the_poisoned_member_skips():
  (updates, new_state), _ = _vmapped_step(None)
  np.testing.assert_array_equal(new_state.last_step_finite, [True, True, False, True])
  np.testing.assert_array_equal(new_state.inner_state[0].count, [1, 1, 0, 1])
  assert np.all(updates["w"][2] == 0) and np.all(updates["w"][0] != 0)


@pytest.mark.slow
def test_shard_map_over_eight_devices_agrees_on_the_skip():
  code = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np, optax, jaxmp
      from jax.sharding import NamedSharding, PartitionSpec as P
      assert jax.device_count() == 8
      mesh = jax.make_mesh((8,), ("data",))
      tx = jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.DynamicLossScale(4.0), axis_name="data")
      params = {"w": jnp.ones(3)}
      state = tx.init(params)

      def step(grads):  # each device holds one row of gradients
        updates, new = tx.update({"w": grads[0]}, state, params)
        return updates["w"][None], new.last_step_finite[None], new.loss_scale.loss_scale[None]

      f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
      good = np.full((8, 3), 4.0, np.float32)
      bad = good.copy()
      bad[5, 1] = np.inf
      u, finite, scale = f(jax.device_put(good, NamedSharding(mesh, P("data"))))
      assert bool(finite.all()) and np.all(u == -1.0) and np.all(scale == 4.0), (u, finite)
      u, finite, scale = f(jax.device_put(bad, NamedSharding(mesh, P("data"))))
      assert not bool(finite.any()) and np.all(u == 0.0) and np.all(scale == 2.0), (u, finite)

      # Adam with a replicated state and per-device gradients: the new state varies.
      adam = jaxmp.loss_scaling(optax.adam(0.1), jaxmp.StaticLossScale(4.0), axis_name="data")
      adam_state = adam.init(params)

      def adam_step(grads):
        updates, new = adam.update({"w": grads[0]}, adam_state, params)
        return updates["w"][None], new.inner_state[0].count[None]

      g = jax.jit(jax.shard_map(adam_step, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
      u, count = g(jax.device_put(good, NamedSharding(mesh, P("data"))))
      assert np.all(count == 1) and np.allclose(u, -0.1), (u, count)
      u, count = g(jax.device_put(bad, NamedSharding(mesh, P("data"))))
      assert np.all(count == 0) and np.all(u == 0.0), (u, count)
      print("ok")
  """)
  env = xla_flags.environ("--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().endswith("ok")


# --------------------------------------------------------------------------------------
# Bad input.


def test_inner_must_be_a_gradient_transformation():
  with pytest.raises(TypeError, match=r"inner must be an optax.GradientTransformation.*did "
                                      r"you mean to call adam"):
    jaxmp.loss_scaling(optax.adam)
  with pytest.raises(TypeError, match="got 3 of type int"):
    jaxmp.loss_scaling(3)
  with pytest.raises(TypeError, match="inner must be"):
    jaxmp.loss_scaling((lambda p: None, lambda u, s, p: (u, s)))


def test_a_loss_scale_built_under_jit_from_an_invalid_value_skips_every_step():
  @jax.jit
  def first_step(scale, params):
    tx = jaxmp.loss_scaling(optax.sgd(0.5), jaxmp.DynamicLossScale(scale))
    state = tx.init(params)
    grads = jaxmp.get_loss_scale(state).scale({"w": jnp.ones(2)})
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params, state = first_step(8.0, {"w": jnp.ones(2)})
  assert params["w"].tolist() == [0.5, 0.5] and int(state.skipped_steps) == 0
  # -8 used to be accepted: the sign cancelled out and the step was applied.
  for bad in (-8.0, 0.0, math.nan):
    params, state = first_step(bad, {"w": jnp.ones(2)})
    assert params["w"].tolist() == [1.0, 1.0], bad
    assert int(state.skipped_steps) == 1 and not bool(state.last_step_finite)
    assert math.isnan(float(state.loss_scale.loss_scale))


def test_loss_scale_must_be_a_jaxmp_loss_scale():
  with pytest.raises(TypeError, match=r"jaxmp.StaticLossScale\(1024.0\)"):
    jaxmp.loss_scaling(optax.sgd(1.0), 1024.0)
  with pytest.raises(TypeError, match="loss_scale must be a jaxmp"):
    jaxmp.loss_scaling(optax.sgd(1.0), jmp_loss_scale())


def jmp_loss_scale():
  import jmp
  return jmp.DynamicLossScale(jnp.float32(2**15))


def test_axis_name_must_be_hashable_and_state_must_be_ours():
  with pytest.raises(TypeError, match="axis_name must be None, an axis name"):
    jaxmp.loss_scaling(optax.sgd(1.0), axis_name=["i"])
  tx = jaxmp.loss_scaling(optax.sgd(1.0))
  with pytest.raises(TypeError, match="state must be the LossScalingState"):
    tx.update(_grads(0), optax.sgd(1.0).init(_params()), _params())


# ---- gradient accumulation, wrong nesting, the consecutive-skip cap -------------------------


def _acc_params():
  return {"w": jnp.array([0.5, -1.0]), "b": jnp.array(0.25)}


def _acc_grads(seed):
  keys = jax.random.split(jax.random.key(seed), 2)
  return {"w": jax.random.normal(keys[0], (2,)), "b": jax.random.normal(keys[1], ())}


def _acc_poison(grads):
  return {"w": grads["w"].at[0].set(jnp.nan), "b": grads["b"]}


def _acc_run(tx, grads_seq, poison_at=()):
  """Feeds each gradient, scaled by the state's current scale (as a training loop does).

  Returns the scale each gradient was scaled with, the scale after each update, and the
  final state and params.
  """
  params = _acc_params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  used, after = [], []
  for i, grads in enumerate(grads_seq):
    loss_scale = jaxmp.get_loss_scale(state)
    used.append(float(loss_scale.loss_scale))
    grads = loss_scale.scale(grads)
    if i in poison_at:
      grads = _acc_poison(grads)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    after.append(float(jaxmp.get_loss_scale(state).loss_scale))
  return used, after, state, params


def _torch_like(scale, growth_interval):
  return jaxmp.DynamicLossScale(scale, growth_interval=growth_interval, growth_factor=2.0,
                                backoff_factor=0.5, min_scale=0.0, max_scale=math.inf)


# --------------------------------------------------------------------------------------
# MultiSteps inside loss_scaling: the scale follows optimizer steps.


def test_scale_follows_optimizer_steps_as_torch_grad_scaler_does():
  # torch's accumulation recipe (torch.amp docs, "Gradient accumulation"):
  #   scaler = GradScaler(init_scale=128, growth_factor=2, growth_interval=1)
  #   2 optimizer steps x 2 micro-batches; scaler.scale(loss).backward() per micro-batch,
  #   scaler.step(opt); scaler.update() once per optimizer step.
  # GradScaler's rule (REFERENCE.md) runs once per update, so every micro-batch of an
  # optimizer step is scaled by the scale the previous update left: 128, 128 | 256, 256,
  # and the run ends at 512 (torch 2.13.0 on CPU printed the same trajectory:
  # scaler.get_scale() before each backward 128, 128, 256, 256, after the last update 512).
  torch_after_updates = torch_grad_scaler(128.0, (0, 0), growth_interval=1, growth_factor=2.0,
                                          backoff_factor=0.5)
  assert torch_after_updates == [256.0, 512.0]
  torch_used = [128.0, 128.0, *[torch_after_updates[0]] * 2]

  tx = jaxmp.loss_scaling(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2),
                          _torch_like(128.0, growth_interval=1))
  used, after, state, _ = _acc_run(tx, [_acc_grads(i) for i in range(4)])
  assert used == torch_used == [128.0, 128.0, 256.0, 256.0]
  assert after[-1] == torch_after_updates[-1] == 512.0
  assert after == [128.0, 256.0, 256.0, 512.0]
  assert int(state.inner_state.gradient_step) == 2


def test_growth_interval_counts_optimizer_steps():
  tx = jaxmp.loss_scaling(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2),
                          _torch_like(16.0, growth_interval=2))
  params, state = _acc_params(), tx.init(_acc_params())
  counters, scales = [], []
  for i in range(8):
    grads = jaxmp.get_loss_scale(state).scale(_acc_grads(i))
    _, state = tx.update(grads, state, params)
    counters.append(int(state.loss_scale.counter))
    scales.append(float(state.loss_scale.loss_scale))
  # The 2nd and 4th optimizer steps (micro-batches 4 and 8) complete a growth interval.
  assert counters == [0, 1, 1, 0, 0, 1, 1, 0]
  assert scales == [16.0, 16.0, 16.0, 32.0, 32.0, 32.0, 32.0, 64.0]


def test_a_non_finite_micro_batch_backs_off_at_once_and_is_dropped():
  tx = jaxmp.loss_scaling(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2),
                          _torch_like(128.0, growth_interval=1))
  g = [_acc_grads(i) for i in range(5)]
  used, after, state, params = _acc_run(tx, g, poison_at=(1,))
  # Micro-batch 1 overflows: the scale halves before micro-batch 2 (which needs it), the
  # micro-batch is dropped, and micro-batch 2 completes the first optimizer step.
  assert used == [128.0, 128.0, 64.0, 128.0, 128.0]
  assert after == [128.0, 64.0, 128.0, 128.0, 256.0]
  assert int(state.skipped_steps) == 1 and int(state.inner_state.gradient_step) == 2
  # The accumulated gradients were unscaled with their own scales (128 and 64): the
  # params are those of plain MultiSteps over the finite micro-batches.
  ref_tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
  ref_params, ref_state = _acc_params(), ref_tx.init(_acc_params())
  for grads in (g[0], g[2], g[3], g[4]):
    updates, ref_state = ref_tx.update(grads, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
  chex.assert_trees_all_close(params, ref_params, rtol=1e-6)


def test_each_dropped_micro_batch_moves_every_later_window_end_by_one():
  # k = 3; micro-batches 1 and 5 overflow. A window ends on its 3rd *finite*
  # micro-batch: (0, 2, 3), (4, 6, 7), (8, 9, 10), where without the overflows they
  # would be (0, 1, 2), (3, 4, 5), (6, 7, 8). Each averages exactly 3 micro-batches.
  tx = jaxmp.loss_scaling(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=3),
                          _torch_like(128.0, growth_interval=1000))
  g = [_acc_grads(i) for i in range(11)]
  params, state = _acc_params(), tx.init(_acc_params())
  update = jax.jit(tx.update)
  emitted = []
  for i, grads in enumerate(g):
    grads = jaxmp.get_loss_scale(state).scale(grads)
    if i in (1, 5):
      grads = _acc_poison(grads)
    before = int(state.inner_state.gradient_step)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    if int(state.inner_state.gradient_step) > before:
      emitted.append(i)
  assert emitted == [3, 7, 10]
  assert int(state.skipped_steps) == 2 and int(state.inner_state.mini_step) == 0
  ref_tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=3)
  ref_params, ref_state = _acc_params(), ref_tx.init(_acc_params())
  for i in (0, 2, 3, 4, 6, 7, 8, 9, 10):
    updates, ref_state = ref_tx.update(g[i], ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
  chex.assert_trees_all_close(params, ref_params, rtol=1e-6)


def test_accumulating_in_the_step_counts_windows_by_micro_batches_and_skips_a_whole_window():
  # The other semantics (torch's recipe): sum a window's micro-batches with
  # accumulate_gradients and update once per window; an overflow anywhere in the window
  # skips it whole, and the next window starts on time.
  tx = jaxmp.loss_scaling(optax.sgd(0.1), _torch_like(128.0, growth_interval=1000))
  params, state = _acc_params(), tx.init(_acc_params())
  windows = [[_acc_grads(0), _acc_grads(1)], [_acc_grads(2), _acc_grads(3)]]
  applied = []
  for w, window in enumerate(windows):
    loss_scale = jaxmp.get_loss_scale(state)
    parts = [jaxmp.linen.Gradients(loss_scale.scale(grads), {}) for grads in window]
    if w == 0:
      parts[1] = parts[1]._replace(params=_acc_poison(parts[1].params))
    total = jaxmp.linen.accumulate_gradients(*parts)
    mean = jax.tree_util.tree_map(lambda x: x / len(window), total.params)
    before = params
    updates, state = tx.update(mean, state, params)
    params = optax.apply_updates(params, updates)
    applied.append(not all(bool(jnp.array_equal(a, b)) for a, b in
                           zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(params))))
  assert applied == [False, True]
  assert float(jaxmp.get_loss_scale(state).loss_scale) == 64.0 and int(state.skipped_steps) == 1


# --------------------------------------------------------------------------------------
# MultiSteps outside loss_scaling: refused where the state is read.


WRONG = re.escape("jaxmp.loss_scaling(optax.MultiSteps(")


def _wrong_nesting():
  return optax.MultiSteps(jaxmp.loss_scaling(optax.sgd(1.0)), every_k_schedule=2)


def test_multisteps_outside_loss_scaling_is_refused_with_the_right_order():
  tx = _wrong_nesting()
  for state in (tx.init(_acc_params()), tx.gradient_transformation().init(_acc_params()),
                optax.chain(optax.clip(1.0), tx.gradient_transformation()).init(_acc_params())):
    for read in (jaxmp.get_loss_scale, jaxmp.loss_scaling_metrics, jax.jit(jaxmp.get_loss_scale)):
      with pytest.raises(ValueError, match=WRONG) as error:
        read(state)
      assert "optax.MultiSteps" in str(error.value) and "outside" in str(error.value)


def test_wrong_nesting_is_refused_by_the_train_steps():
  model = nn.Dense(2)
  x = jnp.ones((4, 3))
  state = jaxmp.linen.TrainState.create(
      apply_fn=model.apply, variables=model.init(jax.random.key(0), x),
      tx=_wrong_nesting().gradient_transformation())
  with pytest.raises(ValueError, match=WRONG):
    state.value_and_grad(lambda v: jnp.sum(state.apply_fn(v, x)))()
  linear = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(linear, _wrong_nesting(), wrt=nnx.Param)
  with pytest.raises(ValueError, match=WRONG):
    jaxmp.get_loss_scale(optimizer.opt_state)


# --------------------------------------------------------------------------------------
# loss_scaling wraps the whole optimizer: anything chained with it or wrapped around it
# (but inject_hyperparams) is refused where the state is read.


def _clip():
  return optax.clip_by_global_norm(1.0)


def _ls(inner=None):
  return jaxmp.loss_scaling(optax.sgd(0.1) if inner is None else inner,
                            jaxmp.StaticLossScale(SCALE))


NOT_OUTERMOST = [
    ("chained before", lambda: optax.chain(_clip(), _ls()),
     "jaxmp.loss_scaling(optax.chain(..., opt))"),
    ("chained before", lambda: optax.chain(optax.add_decayed_weights(1e-2), _ls(optax.adam(0.1))),
     "jaxmp.loss_scaling(optax.chain(..., opt))"),
    ("chained before", lambda: optax.named_chain(("clip", _clip()), ("opt", _ls())),
     "jaxmp.loss_scaling(optax.named_chain(..., opt))"),
    ("chained after", lambda: optax.chain(_ls(optax.identity()), optax.adam(0.1)),
     "jaxmp.loss_scaling(optax.chain(opt, ...))"),
    ("chained after", lambda: optax.chain(_ls(optax.scale_by_adam()), optax.scale(-0.1)),
     "jaxmp.loss_scaling(optax.chain(opt, ...))"),
    ("chained after", lambda: optax.named_chain(("opt", _ls()), ("decay", optax.add_decayed_weights(1e-2))),
     "jaxmp.loss_scaling(optax.named_chain(opt, ...))"),
    ("optax.masked wraps", lambda: optax.masked(_ls(), {"w": True, "b": False}),
     "jaxmp.loss_scaling(optax.masked(opt, mask))"),
    ("optax.multi_transform wraps", lambda: optax.multi_transform(
        {"a": _ls(), "b": optax.sgd(0.1)}, {"w": "a", "b": "b"}),
     "jaxmp.loss_scaling(optax.multi_transform("),
    ("optax.apply_if_finite wraps", lambda: optax.apply_if_finite(_ls(), 3),
     "jaxmp.loss_scaling(opt)"),
    ("ConditionallyTransformState", lambda: optax.conditionally_transform(_ls(), lambda step: step > 2),
     "loss_scaling outside"),
    ("optax.MultiSteps wraps", lambda: optax.MultiSteps(_ls(), 2).gradient_transformation(),
     "jaxmp.loss_scaling(optax.MultiSteps(opt, k))"),
]


@pytest.mark.parametrize("what, make, fix", NOT_OUTERMOST,
                         ids=[f"{i}-{w}" for i, (w, _, _) in enumerate(NOT_OUTERMOST)])
def test_loss_scaling_that_is_not_outermost_is_refused_with_the_fix(what, make, fix):
  state = make().init(_params())
  for read in (jaxmp.get_loss_scale, jaxmp.loss_scaling_metrics, jax.jit(jaxmp.get_loss_scale),
               lambda s: jaxmp.get_loss_scale(s, default=jaxmp.NoOpLossScale())):
    with pytest.raises(ValueError, match=re.escape(what)) as error:
      read(state)
    assert fix in str(error.value)


def test_a_transform_chained_after_loss_scaling_would_move_the_params_on_a_skipped_step():
  # Why chained-after is refused too: Adam after it gets the skip's zero updates and
  # steps on its momentum anyway; inside, the skip skips it.
  after = optax.chain(_ls(optax.identity()), optax.adam(0.1))
  inside = _ls(optax.adam(0.1))
  poisoned = [_scaled(_grads(0)), _poison(_scaled(_grads(1)))]
  moved, _, _ = _run(after, poisoned)
  kept, _, _ = _run(inside, poisoned)
  assert np.all(np.asarray(moved[1]["w"]) != 0)
  tree_asserts.assert_trees_equal(kept[1], jax.tree_util.tree_map(jnp.zeros_like, _params()))


def test_containers_and_pass_through_wrappers_around_loss_scaling_are_accepted():
  bf16 = {"w": jnp.ones((2, 2), jnp.bfloat16), "b": jnp.zeros(2, jnp.bfloat16)}
  accepted = [
      (_ls(), _params()),
      (optax.chain(_ls()), _params()),  # a chain of one
      (optax.inject_hyperparams(lambda learning_rate: _ls(optax.sgd(learning_rate)))(
          learning_rate=0.1), _params()),
      (jaxmp.optim.master_weights(_ls()), bf16),
      (jaxmp.optim.stochastic_rounding(_ls(), jax.random.key(0)), bf16),
      (jaxmp.optim.kahan_summation(_ls()), bf16),
  ]
  for tx, params in accepted:
    state = tx.init(params)
    assert float(jaxmp.get_loss_scale(state).loss_scale) == SCALE
    _, state = tx.update(jax.tree_util.tree_map(jnp.ones_like, params), state, params)
    assert int(jaxmp.loss_scaling_metrics(state)["skipped_steps"]) == 0
  # A state inside a dict or list of one's own, beside other things, is found.
  state = _ls().init(_params())
  assert float(jaxmp.get_loss_scale({"opt": state, "step": 3}).loss_scale) == SCALE
  assert float(jaxmp.get_loss_scale([state, _params()]).loss_scale) == SCALE


def test_a_chained_loss_scaling_is_refused_by_every_train_step():
  tx = optax.chain(_clip(), _ls())
  model, x = nn.Dense(2), jnp.ones((4, 3))
  variables = model.init(jax.random.key(0), x)
  loss_fn = lambda v: jnp.sum(model.apply(v, x))
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply, variables=variables, tx=tx)
  with pytest.raises(ValueError, match="chained before"):
    state.value_and_grad(loss_fn)()
  _, grads = jaxmp.linen.value_and_grad(loss_fn)(variables, loss_scale=jaxmp.StaticLossScale(SCALE))
  with pytest.raises(ValueError, match="chained before"):
    state.apply_gradients(grads)
  params, fp8, _ = jaxmp.linen.split_variables(variables)
  with pytest.raises(ValueError, match="chained before"):
    jaxmp.linen.apply_gradients(tx, params, fp8, tx.init(params), grads)
  linear = jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "float32")
  optimizer = nnx.Optimizer(linear, tx, wrt=nnx.Param)
  with pytest.raises(ValueError, match="chained before"):
    jaxmp.get_loss_scale(optimizer.opt_state)
  _, nnx_grads = jaxmp.nnx.value_and_grad(lambda m: jnp.sum(m(x)))(
      linear, loss_scale=jaxmp.StaticLossScale(SCALE))
  before = jax.tree_util.tree_leaves(nnx.state((linear, optimizer)))
  with pytest.raises(ValueError, match="chained before"):
    jaxmp.nnx.apply_gradients(optimizer, linear, nnx_grads)
  # Refused before the optimizer changed anything.
  tree_asserts.assert_trees_equal(jax.tree_util.tree_leaves(nnx.state((linear, optimizer))), before)


# --------------------------------------------------------------------------------------
# max_consecutive_skips: a scale that keeps skipping is an error, not a silent stall.


def _capped(n):
  return jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**4), max_consecutive_skips=n)


def test_consecutive_skips_are_counted_and_reset_by_a_finite_step():
  tx = _capped(None)
  params, state = _acc_params(), tx.init(_acc_params())
  update = jax.jit(tx.update)
  counts = []
  for bad in (True, True, False, True):
    grads = _acc_poison(_acc_grads(0)) if bad else _acc_grads(0)
    _, state = update(grads, state, params)
    counts.append(int(jaxmp.loss_scaling_metrics(state)["consecutive_skips"]))
  assert counts == [1, 2, 0, 1]
  assert int(state.skipped_steps) == 3


@pytest.mark.parametrize("jit", [True, False])
def test_the_nth_consecutive_skip_raises(jit):
  tx = _capped(3)
  params, state = _acc_params(), tx.init(_acc_params())
  update = jax.jit(tx.update) if jit else tx.update
  for bad in (True, True, False, True, True):  # never 3 in a row
    grads = _acc_poison(_acc_grads(0)) if bad else _acc_grads(0)
    _, state = update(grads, state, params)
  jax.block_until_ready(state)
  assert int(state.consecutive_skips) == 2
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"3 consecutive steps skipped .*max_consecutive_skips=3"):
    jax.block_until_ready(update(_acc_poison(_acc_grads(0)), state, params))


def test_the_cap_check_produces_the_count_the_state_returns():
  # Outside jit each primitive is its own computation. On a GPU, where dispatch is
  # asynchronous, the callback's error fails the computation it runs in, and a
  # computation with no output reported it nowhere but at jax.effects_barrier (an H100
  # run: the error did not reach the caller outside jit). The count the state returns
  # comes out of the cond that runs the check, so reading the state raises the error.
  tx = _capped(3)
  params = _acc_params()
  state = tx.init(params)
  closed = jax.make_jaxpr(tx.update)(_acc_grads(0), state, params)
  _, new_state = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(jax.eval_shape(tx.update, _acc_grads(0), state, params)),
      closed.jaxpr.outvars)
  producer = next(e for e in closed.jaxpr.eqns if new_state.consecutive_skips in e.outvars)
  assert producer.primitive.name == "cond"
  assert "callback" in str(producer)


def test_without_a_cap_the_step_has_no_callback_and_with_one_it_is_behind_a_cond():
  params = _acc_params()
  grads = _acc_grads(0)
  plain = jax.make_jaxpr(_capped(None).update)(grads, _capped(None).init(params), params)
  capped = jax.make_jaxpr(_capped(3).update)(grads, _capped(3).init(params), params)
  assert "callback" not in str(plain)
  top_level = [eqn.primitive.name for eqn in capped.jaxpr.eqns]
  assert not any("callback" in name for name in top_level)
  assert "callback" in str(capped)


def test_a_skipped_step_leaves_every_param_bit_for_bit():
  # The zero updates are -0.0: p + (-0.0) == p bit for bit, -0.0 included (+0.0 would
  # turn a -0.0 param into +0.0).
  params = {"w": jnp.array([-0.0, 0.0, 1.5, -2.0])}
  tx = jaxmp.loss_scaling(optax.sgd(1.0))
  updates, _ = tx.update({"w": jnp.full(4, jnp.nan)}, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(np.signbit(new["w"]), np.signbit(params["w"]))
  np.testing.assert_array_equal(new["w"], params["w"])
