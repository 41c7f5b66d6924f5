"""The train-step core: a skipped step keeps every collection the step would update.

A float16 forward that overflows writes inf/NaN into BatchNorm's running statistics.
Loss scaling skips the step (its gradients are not finite); the statistics must then be
exactly what they were, or evaluation, which reads them, is NaN from then on.
"""

import copy
import dataclasses
import pickle

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
from jaxmp._src import step as step_lib

F16 = "params=float32,compute=float16,output=float32"


def _data():
  x = jax.random.normal(jax.random.key(1), (16, 4))
  return x, jnp.tanh(x[:, :2])


def _overflowing(x):
  return x.at[0, 0].set(1e6)  # inf once cast to float16


# Bytes, not chex.assert_trees_all_equal: chex's values equate -0.0 with 0.0 and any NaNs.
def _assert_bit_equal(a, b):
  leaves_a, def_a = jax.tree.flatten(a)
  leaves_b, def_b = jax.tree.flatten(b)
  assert def_a == def_b
  for u, v in zip(leaves_a, leaves_b):
    assert np.asarray(u).dtype == np.asarray(v).dtype
    assert np.asarray(u).tobytes() == np.asarray(v).tobytes()


# --------------------------------------------------------------------------------------
# linen: TrainState.apply_gradients(grads, collections=...)


class LinenNet(nn.Module):

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    return nn.Dense(2)(nn.relu(x))


def _linen_state():
  model = jaxmp.linen.mixed_precision(LinenNet(), F16)
  x, _ = _data()
  return jaxmp.linen.TrainState.create(
      apply_fn=model.apply, variables=model.init(jax.random.key(0), x),
      tx=jaxmp.loss_scaling(optax.adam(1e-2)))


@jax.jit
def _linen_step(state, x, y):
  def loss_fn(variables):
    out, updates = state.apply_fn(variables, x, mutable=["batch_stats"])
    return jnp.mean((out - y) ** 2), updates

  (loss, updates), grads = state.value_and_grad(loss_fn, has_aux=True)()
  return state.apply_gradients(grads, collections=updates), loss


def test_linen_skipped_step_keeps_batch_stats_bit_for_bit():
  x, y = _data()
  state, _ = _linen_step(_linen_state(), x, y)
  skipped, loss = _linen_step(state, _overflowing(x), y)
  assert not np.isfinite(float(loss))
  assert not bool(jaxmp.loss_scaling_metrics(skipped.opt_state)["last_step_finite"])
  _assert_bit_equal(skipped.collections, state.collections)
  _assert_bit_equal(skipped.params, state.params)
  out = skipped.apply_fn(skipped.variables, x, train=False)
  assert bool(jnp.all(jnp.isfinite(out)))
  # A finite step still writes the new statistics.
  after, _ = _linen_step(skipped, x, y)
  assert not np.array_equal(after.collections["batch_stats"]["BatchNorm_0"]["mean"],
                            state.collections["batch_stats"]["BatchNorm_0"]["mean"])


def test_linen_collections_of_another_structure_are_refused():
  state = jaxmp.linen.TrainState.create(
      apply_fn=lambda v, x: x, tx=optax.sgd(1.0),
      variables={"params": {"w": jnp.ones(2)}, "batch_stats": {"norm": {"mean": jnp.zeros(2)}}})
  grads = jaxmp.linen.Gradients({"w": jnp.zeros(2)}, {})
  with pytest.raises(ValueError, match=r"collections= .*missing \['batch_stats'\]\['norm'\]"):
    state.apply_gradients(grads, collections={"batch_stats": {}})
  # All collections, as the message says, are accepted.
  new = state.apply_gradients(grads, collections={**state.collections})
  _assert_bit_equal(new.collections, state.collections)


# --------------------------------------------------------------------------------------
# NNX: value_and_grad writes BatchNorm's statistics in place; apply_gradients undoes
# that on a skipped step.


class NnxNet(nnx.Module):

  def __init__(self, rngs):
    self.dense = nnx.Linear(4, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.head = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(self.drop(nnx.relu(self.norm(self.dense(x)))))


def _nnx_setup():
  model = jaxmp.nnx.mixed_precision(NnxNet(nnx.Rngs(0)), F16)
  optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(optax.adam(1e-2)), wrt=nnx.Param)
  return model, optimizer


@nnx.jit
def _nnx_step(model, optimizer, x, y):
  loss_scale = jaxmp.get_loss_scale(optimizer.opt_state)
  loss, grads = jaxmp.nnx.value_and_grad(lambda m, x, y: jnp.mean((m(x) - y) ** 2))(
      model, x, y, loss_scale=loss_scale)
  jaxmp.nnx.apply_gradients(optimizer, model, grads)
  return loss


def _pure(model, kind):
  return nnx.as_pure(nnx.clone(nnx.state(model, kind)))


def test_nnx_skipped_step_restores_batch_stats_bit_for_bit():
  x, y = _data()
  model, optimizer = _nnx_setup()
  model.train()
  _nnx_step(model, optimizer, x, y)
  stats, params = _pure(model, nnx.BatchStat), _pure(model, nnx.Param)
  rng_count = _pure(model, nnx.RngCount)
  loss = _nnx_step(model, optimizer, _overflowing(x), y)
  assert not np.isfinite(float(loss))
  assert not bool(jaxmp.loss_scaling_metrics(optimizer.opt_state)["last_step_finite"])
  _assert_bit_equal(_pure(model, nnx.BatchStat), stats)
  _assert_bit_equal(_pure(model, nnx.Param), params)
  # RNG streams advance on a skipped step too (the next step draws new dropout masks).
  (before,), (after,) = jax.tree.leaves(rng_count), jax.tree.leaves(_pure(model, nnx.RngCount))
  assert int(after) == int(before) + 1
  model.eval()
  assert bool(jnp.all(jnp.isfinite(model(x))))
  model.train()
  _nnx_step(model, optimizer, x, y)
  assert not np.array_equal(jax.tree.leaves(_pure(model, nnx.BatchStat))[0],
                            jax.tree.leaves(stats)[0])


def test_nnx_accumulated_micro_batches_restore_the_state_before_the_first():
  x, y = _data()
  model, optimizer = _nnx_setup()
  stats = _pure(model, nnx.BatchStat)
  grad_fn = nnx.jit(jaxmp.nnx.value_and_grad(lambda m, x, y: jnp.mean((m(x) - y) ** 2)))
  scale = jaxmp.get_loss_scale(optimizer.opt_state)
  _, first = grad_fn(model, x[:8], y[:8], loss_scale=scale)
  _, second = grad_fn(model, _overflowing(x[8:]), y[8:], loss_scale=scale)
  nnx.jit(jaxmp.nnx.apply_gradients)(optimizer, model,
                                     jaxmp.nnx.accumulate_gradients(first, second))
  _assert_bit_equal(_pure(model, nnx.BatchStat), stats)


# --------------------------------------------------------------------------------------
# The shared decision.


def test_keep_on_skip_selects_by_finiteness_and_checks_structure():
  old, new = {"a": jnp.zeros(2), "b": {"c": jnp.ones(())}}, {"a": jnp.ones(2),
                                                              "b": {"c": jnp.zeros(())}}
  _assert_bit_equal(step_lib.keep_on_skip(old, new, jnp.array(False)), old)
  _assert_bit_equal(jax.jit(step_lib.keep_on_skip)(old, new, jnp.array(True)), new)
  assert step_lib.keep_on_skip({}, {}, jnp.array(False)) == {}
  with pytest.raises(ValueError, match=r"\['b'\]\['d'\]"):
    step_lib.keep_on_skip(old, {"a": jnp.ones(2), "b": {"d": jnp.ones(())}}, jnp.array(True))


# --------------------------------------------------------------------------------------
# Every state pytree copies and pickles (item 4 of the issue, for the step's states).


def test_gradients_and_train_state_copy_and_pickle():
  state = _linen_state()
  grads = jaxmp.linen.Gradients(state.params, state.fp8, state.collections)
  for tree in (grads, state, state.opt_state):
    for clone in (copy.copy(tree), copy.deepcopy(tree)):
      _assert_bit_equal(clone, tree)
  for tree in (grads, state.opt_state):
    _assert_bit_equal(pickle.loads(pickle.dumps(tree)), tree)


# --------------------------------------------------------------------------------------
# One skip behaviour for every train-step entry point: on a skipped (non-finite) step
# every collection stays as it was (params, fp8 state, the inner optimizer state, batch
# statistics and any other collection the forward pass writes), on published models
# with BatchNorm. What advances on a skipped step is what counts steps: the loss
# scaling's own bookkeeping (the scale backs off, skipped_steps counts), the step
# counters (TrainState.step, nnx.Optimizer.step) and NNX RNG streams (none here: the
# published CNN takes its dropout rngs as an argument).

_FP8_F16 = jaxmp.PolicyRules(F16, [jaxmp.Rule((nn.Dense, nnx.Linear),
                                              fp8=jaxmp.fp8.DelayedScaling(amax_history_length=4))])


def _published(name):
  from tests.published import models as published  # pylint: disable=g-import-not-at-top
  entry = next(e for e in published.MODELS if e.name == name)
  return entry, entry.batch(jax.random.key(1))


def _non_finite(images):
  return images.at[0, 0, 0, 0].set(jnp.inf)


def _kept(opt_state):
  # The loss scaling's inner state: what the skipped step must not touch.
  return opt_state.inner_state


def _linen_everything(entry_point):
  """(state after a finite step, after a further non-finite one) of ``entry_point``."""
  from tests.published.flax_imagenet import models  # pylint: disable=g-import-not-at-top
  entry, batch = _published("imagenet_resnet18")
  # The same published file's one-block ResNet (its own test model, `_ResNet1`): every
  # collection ResNet18 has (params, fp8 state of the Dense head, BatchNorm statistics)
  # in an eighth of the blocks, and so of the compile time.
  entry = dataclasses.replace(
      entry, module=lambda mode: models._ResNet1(num_classes=10, num_filters=8))  # pylint: disable=protected-access
  model = jaxmp.linen.mixed_precision(entry.module("train"), _FP8_F16)
  tx = jaxmp.loss_scaling(optax.adam(1e-3))
  variables = entry.init(model, jax.random.key(0), batch)

  def loss_fn(variables, images):
    batch_of = dataclasses.replace(batch, inputs=(images,))
    logits, updates = entry.forward(model, variables, batch_of, "train", None)
    return entry.loss(logits, batch.targets), updates

  if entry_point == "TrainState.apply_gradients":
    @jax.jit
    def step(state, images):
      (_, updates), grads = state.value_and_grad(loss_fn, has_aux=True)(images)
      return state.apply_gradients(grads, collections={**state.collections, **updates})

    state = jaxmp.linen.TrainState.create(apply_fn=model.apply, variables=variables, tx=tx)
    view = lambda s: {"params": s.params, "fp8": s.fp8, "collections": s.collections,
                      "opt_state": _kept(s.opt_state)}
  else:
    @jax.jit
    def step(state, images):
      params, fp8, opt_state, collections = state
      (_, updates), grads = jaxmp.linen.value_and_grad(loss_fn, has_aux=True)(
          jaxmp.linen.join_variables(params, fp8, collections), images,
          loss_scale=jaxmp.get_loss_scale(opt_state))
      return jaxmp.linen.apply_gradients(tx, params, fp8, opt_state, grads,
                                         collections={**collections, **updates})

    params, fp8, collections = jaxmp.linen.split_variables(variables)
    state = (params, fp8, tx.init(params), collections)
    view = lambda s: {"params": s[0], "fp8": s[1], "collections": s[3],
                      "opt_state": _kept(s[2])}
  (images,) = batch.inputs
  applied = step(state, images)
  skipped = step(applied, _non_finite(images))
  opt_state = skipped.opt_state if entry_point == "TrainState.apply_gradients" else skipped[2]
  return view(applied), view(skipped), opt_state


@pytest.mark.parametrize("entry_point", ["TrainState.apply_gradients", "apply_gradients"])
def test_linen_entry_points_keep_every_collection_on_a_skipped_step(entry_point):
  before, after, opt_state = _linen_everything(entry_point)
  assert not bool(jaxmp.loss_scaling_metrics(opt_state)["last_step_finite"])
  assert jax.tree.leaves(before["fp8"]) and jax.tree.leaves(before["collections"])
  _assert_bit_equal(after, before)


def test_nnx_apply_gradients_keeps_every_collection_on_a_skipped_step():
  entry, batch = _published("mnist_cnn")
  model = jaxmp.nnx.mixed_precision(entry.module(nnx.Rngs(0)), _FP8_F16)
  optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(optax.adam(1e-3)), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, images):
    batch_of = dataclasses.replace(batch, inputs=(images,))
    loss_fn = lambda model: entry.loss(entry.forward(model, batch_of, "train",
                                                     jax.random.key(2)), batch.targets)
    _, grads = jaxmp.nnx.value_and_grad(loss_fn)(
        model, loss_scale=jaxmp.get_loss_scale(optimizer.opt_state))
    jaxmp.nnx.apply_gradients(optimizer, model, grads)

  def everything():
    return {"model": nnx.as_pure(nnx.clone(nnx.state(model))),
            "opt_state": nnx.as_pure(nnx.clone(_kept(optimizer.opt_state)))}

  (images,) = batch.inputs
  step(model, optimizer, images)
  before = everything()
  assert len(nnx.state(model, jaxmp.nnx.Fp8State)) and len(nnx.state(model, nnx.BatchStat))
  step(model, optimizer, _non_finite(images))
  assert not bool(jaxmp.loss_scaling_metrics(optimizer.opt_state)["last_step_finite"])
  _assert_bit_equal(everything(), before)
