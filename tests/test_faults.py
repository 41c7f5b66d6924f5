"""Fault injection: a long run with random inf/NaN in activations and gradients.

A seeded schedule poisons about one step in five, some in runs of several in a row,
either in an input activation (the fault travels through the fp8 matmuls and the
backward pass) or directly in the gradients (through a traced flag: one compiled step
serves every kind of step). Checked on every step against the schedule: exactly the
poisoned steps are skipped, with params, inner optimizer state and fp8 state bit for
bit as they were; no clean step is skipped; the loss scale follows a plain-Python
transcription of the rule; the step is traced once; and the model still learns.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp import fp8

STEPS = 200
HPARAMS = dict(growth_interval=4, growth_factor=2.0, backoff_factor=0.5, min_scale=1.0,
               max_scale=2.0**13)
INITIAL_SCALE = 2.0**10
FAULTS = ("activation_inf", "activation_nan", "grad_inf", "grad_nan", "grad_neg_inf")


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="out")(nn.gelu(nn.Dense(32, name="hidden")(x)))


def schedule(seed=0):
  """Which fault (or None) hits each step: ~20% random, plus runs of 3 and 5 in a row."""
  rng = np.random.default_rng(seed)
  faults = [FAULTS[rng.integers(len(FAULTS))] if rng.random() < 0.2 else None
            for _ in range(STEPS)]
  for start, length in ((60, 3), (130, 5)):
    for i in range(start, start + length):
      faults[i] = FAULTS[(i - start) % len(FAULTS)]
  for i in range(8):  # a clean start
    faults[i] = None
  return faults


def reference_scales(overflows):
  """The dynamic loss-scale rule in plain Python (docs/guides/loss_scaling.md), one value per step."""
  scale, counter, out = INITIAL_SCALE, 0, []
  for overflow in overflows:
    if overflow:
      scale, counter = max(scale * HPARAMS["backoff_factor"], HPARAMS["min_scale"]), 0
    else:
      counter += 1
      if counter == HPARAMS["growth_interval"]:
        scale, counter = min(scale * HPARAMS["growth_factor"], HPARAMS["max_scale"]), 0
    out.append(scale)
  return out


def injections(fault):
  """(added to one input activation, added to one gradient element) for a fault."""
  values = {"inf": np.inf, "nan": np.nan, "neg_inf": -np.inf}
  if fault is None:
    return np.float32(0.0), np.float32(0.0)
  where, kind = fault.split("_", 1)
  value = np.float32(values[kind])
  return (value, np.float32(0.0)) if where == "activation" else (np.float32(0.0), value)


@pytest.mark.slow
def test_every_poisoned_step_and_only_those_is_skipped_over_a_long_run():
  rules = jaxmp.PolicyRules("params=float32,compute=bfloat16,output=float32",
                            [jaxmp.Rule(nn.Dense, fp8=fp8.DelayedScaling(amax_history_length=8))])
  model = jaxmp.linen.mixed_precision(MLP(), rules)
  x = jax.random.normal(jax.random.key(1), (32, 8))
  y = jnp.tanh(x[:, :4] * 1.5)
  tx = jaxmp.loss_scaling(optax.adam(3e-3),
                          jaxmp.DynamicLossScale(INITIAL_SCALE, **HPARAMS))
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                        variables=model.init(jax.random.key(0), x), tx=tx)
  traces = []

  @jax.jit
  def step(state, x, y, activation_fault, grad_fault):
    traces.append(1)
    x = x.at[3, 5].add(activation_fault)  # + 0.0 on a clean step: exact
    loss_fn = lambda variables: jnp.mean((state.apply_fn(variables, x) - y) ** 2)
    loss, grads = state.value_and_grad(loss_fn)()
    params = jax.tree.map(lambda g: g, grads.params)
    params["out"]["kernel"] = params["out"]["kernel"].at[1, 2].add(grad_fault)
    new = state.apply_gradients(grads._replace(params=params))
    return new, loss, jaxmp.loss_scaling_metrics(new.opt_state)

  faults = schedule()
  losses, scales, finite, skipped = [], [], [], []
  for i, fault in enumerate(faults):
    before = state
    state, loss, metrics = step(state, x, y, *injections(fault))
    metrics = jax.device_get(metrics)
    scales.append(float(metrics["loss_scale"]))
    finite.append(bool(metrics["last_step_finite"]))
    skipped.append(int(metrics["skipped_steps"]))
    assert finite[-1] == (fault is None), (
        f"step {i}: fault {fault!r} but last_step_finite={finite[-1]}")
    if fault is None:
      losses.append(float(loss))
      assert np.isfinite(losses[-1])
    else:
      skipped_step = f"step {i}: changed on a skipped step"
      chex.assert_trees_all_equal(state.params, before.params, custom_message=skipped_step)
      chex.assert_trees_all_equal(state.opt_state.inner_state, before.opt_state.inner_state,
                                  custom_message=skipped_step)
      chex.assert_trees_all_equal(state.fp8, before.fp8, custom_message=skipped_step)

  poisoned = [fault is not None for fault in faults]
  assert sum(poisoned) >= 40 and any(map(all, zip(poisoned, poisoned[1:], poisoned[2:])))
  assert {f for f in faults if f} == set(FAULTS)
  assert skipped == list(np.cumsum(poisoned))
  assert scales == reference_scales(poisoned)
  assert max(scales) == HPARAMS["max_scale"] and min(scales) == HPARAMS["min_scale"]  # both bounds
  assert int(state.step) == STEPS
  assert int(state.opt_state.inner_state[0].count) == STEPS - sum(poisoned)
  assert len(traces) == 1, f"the step was traced {len(traces)} times"
  assert np.mean(losses[-10:]) < 0.2 * np.mean(losses[:5]), (losses[:5], losses[-10:])
  # fp8 state is finite and in use after all the faults.
  for leaf in jax.tree.leaves(state.fp8):
    assert np.all(np.isfinite(leaf))
  assert float(state.fp8["hidden"]["Fp8DotGeneral_0"]["input_scale"][0]) != 1.0


def test_schedule_and_reference_rule_are_what_the_run_test_assumes():
  faults = schedule()
  assert len(faults) == STEPS and faults[:8] == [None] * 8
  assert faults[60:63] == list(FAULTS[:3]) and faults[130:135] == list(FAULTS)
  # growth on the 4th consecutive finite step, clamped at max; backoff clamped at min.
  assert reference_scales([False] * 4) == [1024, 1024, 1024, 2048]
  assert reference_scales([True] * 12)[-3:] == [1.0, 1.0, 1.0]
  assert reference_scales([False] * 40)[-1] == 2.0**13
  # The same rule, run by the library, gives the same trajectory.
  ls = jaxmp.DynamicLossScale(INITIAL_SCALE, **HPARAMS)
  flags = [f is not None for f in faults]
  ours = []
  for overflow in flags[:60]:
    ls = ls.adjust(not overflow)
    ours.append(float(ls.loss_scale))
  assert ours == reference_scales(flags[:60])
