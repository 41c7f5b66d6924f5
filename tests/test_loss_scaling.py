"""loss_scaling with gradient accumulation, its wrong nesting, and the consecutive-skip cap.

The skip semantics, composition with optax and state lookup are in test_transforms.py.
"""

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
from tests.test_loss_scale import torch_grad_scaler


def _params():
  return {"w": jnp.array([0.5, -1.0]), "b": jnp.array(0.25)}


def _grads(seed):
  keys = jax.random.split(jax.random.key(seed), 2)
  return {"w": jax.random.normal(keys[0], (2,)), "b": jax.random.normal(keys[1], ())}


def _poison(grads):
  return {"w": grads["w"].at[0].set(jnp.nan), "b": grads["b"]}


def _run(tx, grads_seq, poison_at=()):
  """Feeds each gradient, scaled by the state's current scale (as a training loop does).

  Returns the scale each gradient was scaled with, the scale after each update, and the
  final state and params.
  """
  params = _params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  used, after = [], []
  for i, grads in enumerate(grads_seq):
    loss_scale = jaxmp.get_loss_scale(state)
    used.append(float(loss_scale.loss_scale))
    grads = loss_scale.scale(grads)
    if i in poison_at:
      grads = _poison(grads)
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
  used, after, state, _ = _run(tx, [_grads(i) for i in range(4)])
  assert used == torch_used == [128.0, 128.0, 256.0, 256.0]
  assert after[-1] == torch_after_updates[-1] == 512.0
  assert after == [128.0, 256.0, 256.0, 512.0]
  assert int(state.inner_state.gradient_step) == 2


def test_growth_interval_counts_optimizer_steps():
  tx = jaxmp.loss_scaling(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2),
                          _torch_like(16.0, growth_interval=2))
  params, state = _params(), tx.init(_params())
  counters, scales = [], []
  for i in range(8):
    grads = jaxmp.get_loss_scale(state).scale(_grads(i))
    _, state = tx.update(grads, state, params)
    counters.append(int(state.loss_scale.counter))
    scales.append(float(state.loss_scale.loss_scale))
  # The 2nd and 4th optimizer steps (micro-batches 4 and 8) complete a growth interval.
  assert counters == [0, 1, 1, 0, 0, 1, 1, 0]
  assert scales == [16.0, 16.0, 16.0, 32.0, 32.0, 32.0, 32.0, 64.0]


def test_a_non_finite_micro_batch_backs_off_at_once_and_is_dropped():
  tx = jaxmp.loss_scaling(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2),
                          _torch_like(128.0, growth_interval=1))
  g = [_grads(i) for i in range(5)]
  used, after, state, params = _run(tx, g, poison_at=(1,))
  # Micro-batch 1 overflows: the scale halves before micro-batch 2 (which needs it), the
  # micro-batch is dropped, and micro-batch 2 completes the first optimizer step.
  assert used == [128.0, 128.0, 64.0, 128.0, 128.0]
  assert after == [128.0, 64.0, 128.0, 128.0, 256.0]
  assert int(state.skipped_steps) == 1 and int(state.inner_state.gradient_step) == 2
  # The accumulated gradients were unscaled with their own scales (128 and 64): the
  # params are those of plain MultiSteps over the finite micro-batches.
  ref_tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
  ref_params, ref_state = _params(), ref_tx.init(_params())
  for grads in (g[0], g[2], g[3], g[4]):
    updates, ref_state = ref_tx.update(grads, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)


# --------------------------------------------------------------------------------------
# MultiSteps outside loss_scaling: refused where the state is read.


WRONG = re.escape("jaxmp.loss_scaling(optax.MultiSteps(")


def _wrong_nesting():
  return optax.MultiSteps(jaxmp.loss_scaling(optax.sgd(1.0)), every_k_schedule=2)


def test_multisteps_outside_loss_scaling_is_refused_with_the_right_order():
  tx = _wrong_nesting()
  for state in (tx.init(_params()), tx.gradient_transformation().init(_params()),
                optax.chain(optax.clip(1.0), tx.gradient_transformation()).init(_params())):
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
# max_consecutive_skips: a scale that keeps skipping is an error, not a silent stall.


def _capped(n):
  return jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**4), max_consecutive_skips=n)


def test_consecutive_skips_are_counted_and_reset_by_a_finite_step():
  tx = _capped(None)
  params, state = _params(), tx.init(_params())
  update = jax.jit(tx.update)
  counts = []
  for bad in (True, True, False, True):
    grads = _poison(_grads(0)) if bad else _grads(0)
    _, state = update(grads, state, params)
    counts.append(int(jaxmp.loss_scaling_metrics(state)["consecutive_skips"]))
  assert counts == [1, 2, 0, 1]
  assert int(state.skipped_steps) == 3


@pytest.mark.parametrize("jit", [True, False])
def test_the_nth_consecutive_skip_raises(jit):
  tx = _capped(3)
  params, state = _params(), tx.init(_params())
  update = jax.jit(tx.update) if jit else tx.update
  for bad in (True, True, False, True, True):  # never 3 in a row
    grads = _poison(_grads(0)) if bad else _grads(0)
    _, state = update(grads, state, params)
  jax.block_until_ready(state)
  assert int(state.consecutive_skips) == 2
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"3 consecutive steps skipped .*max_consecutive_skips=3"):
    jax.block_until_ready(update(_poison(_grads(0)), state, params))


def test_without_a_cap_the_step_has_no_callback_and_with_one_it_is_behind_a_cond():
  params = _params()
  grads = _grads(0)
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
