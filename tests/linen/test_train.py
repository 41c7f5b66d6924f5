"""jaxmp.linen: params, loss scaling and fp8 state updated together, soundly."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp import fp8

OWG = "_overwrite_with_gradient"
RECIPE = fp8.DelayedScaling(amax_history_length=4)


class TwoDense(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name="out")(nn.relu(nn.Dense(8, name="hidden")(x)))


def _fp8_model(module=None, default="float32"):
  rules = jaxmp.PolicyRules(default, [jaxmp.Rule(nn.Dense, fp8=RECIPE)])
  return jaxmp.linen.mixed_precision(module or TwoDense(), rules)


def _mse(apply_fn, x, y):
  return lambda variables: jnp.mean((apply_fn(variables, x) - y) ** 2)


def _data(n=16):
  x = jax.random.normal(jax.random.key(1), (n, 5))
  return x, jnp.tanh(x @ jax.random.normal(jax.random.key(2), (5, 3)))


def _step(state, x, y):
  loss, grads = state.value_and_grad(_mse(state.apply_fn, x, y))()
  return state.apply_gradients(grads), loss


def test_trains_fp8_model_and_updates_its_state():
  x, y = _data()
  model = _fp8_model(default="params=float32,compute=bfloat16,output=float32")
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                        variables=model.init(jax.random.key(0), x),
                                        tx=jaxmp.loss_scaling(optax.adam(3e-2)))
  step = jax.jit(_step)
  losses = []
  for _ in range(40):
    state, loss = step(state, x, y)
    losses.append(float(loss))
  assert losses[-1] < 0.3 * losses[0]
  hidden = state.fp8["hidden"]["Fp8DotGeneral_0"]
  # Delayed scaling: the scale is amax/448 of the recorded history.
  np.testing.assert_allclose(hidden["input_scale"][0],
                             np.max(hidden["input_amax_history"]) / 448, rtol=0.02)
  assert float(hidden["output_grad_scale"][0]) != 1.0
  assert int(state.step) == 40


def test_skipped_step_leaves_params_fp8_and_optimizer_untouched():
  x, y = _data()
  model = _fp8_model()
  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10))
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                        variables=model.init(jax.random.key(0), x), tx=tx)
  state, _ = _step(state, x, y)
  poisoned, _ = _step(state, x.at[0, 0].set(jnp.inf), y)
  chex.assert_trees_all_equal(poisoned.params, state.params)
  chex.assert_trees_all_equal(poisoned.fp8, state.fp8)
  chex.assert_trees_all_equal(poisoned.opt_state.inner_state, state.opt_state.inner_state)
  metrics = jaxmp.loss_scaling_metrics(poisoned.opt_state)
  assert int(metrics["skipped_steps"]) == 1
  assert float(metrics["loss_scale"]) == 2.0**9
  # The next clean step trains again from the kept state.
  after, _ = _step(poisoned, x, y)
  assert not np.array_equal(after.fp8["hidden"]["Fp8DotGeneral_0"]["input_amax_history"],
                            state.fp8["hidden"]["Fp8DotGeneral_0"]["input_amax_history"])


def test_unused_output_does_not_zero_the_layer():

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      side = nn.Dense(4, name="side")(x)
      return nn.Dense(3, name="main")(x) + jax.lax.stop_gradient(side).sum() * 0.0

  x, y = _data()
  model = _fp8_model(Net())
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                        variables=model.init(jax.random.key(0), x),
                                        tx=optax.sgd(1e-2))
  before = state.fp8["side"]["Fp8DotGeneral_0"]
  for _ in range(2):
    state, _ = _step(state, x, y)
  after = state.fp8["side"]["Fp8DotGeneral_0"]
  # The stop_gradient-ed layer got no cotangent: its state is kept, not zeroed.
  chex.assert_trees_all_equal(after, before)
  assert np.all(np.isfinite(model.apply(state.variables, x)))
  assert float(state.fp8["main"]["Fp8DotGeneral_0"]["kernel_scale"][0]) != 1.0


def test_layer_used_twice_records_the_max_not_the_sum():

  class Twice(nn.Module):

    @nn.compact
    def __call__(self, x):
      dense = nn.Dense(5, name="shared")
      return dense(x) + dense(3.0 * x)

  x = jnp.full((2, 5), 2.0)
  model = _fp8_model(Twice())
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                        variables=model.init(jax.random.key(0), x),
                                        tx=optax.sgd(0.0))
  _, grads = state.value_and_grad(lambda v: jnp.sum(state.apply_fn(v, x)))()
  history = grads.fp8["shared"]["Fp8DotGeneral_0"]["input_amax_history"]
  np.testing.assert_array_equal(history, [6.0, 0.0, 0.0, 0.0])  # max(2, 6), not 8


def test_accumulated_micro_batches_take_the_max():
  x, y = _data()
  model = _fp8_model()
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                        variables=model.init(jax.random.key(0), x),
                                        tx=optax.sgd(1e-2))
  grad = lambda xs, ys: state.value_and_grad(_mse(state.apply_fn, xs, ys))()[1]
  small, large = grad(0.5 * x[:8], y[:8]), grad(4.0 * x[8:], y[8:])
  total = jaxmp.linen.accumulate_gradients(small, large)
  history = lambda g: g.fp8["hidden"]["Fp8DotGeneral_0"]["input_amax_history"][0]
  assert float(history(total)) == max(float(history(small)), float(history(large)))
  assert float(history(total)) == pytest.approx(float(jnp.max(jnp.abs(4.0 * x[8:]))))
  chex.assert_trees_all_close(total.params, jax.tree.map(jnp.add, small.params, large.params),
                              rtol=1e-6)


def test_accumulating_gradients_of_different_models_is_refused():
  with_fp8 = jaxmp.linen.Gradients({"w": jnp.ones(2)}, fp8.init_state(RECIPE))
  without = jaxmp.linen.Gradients({"w": jnp.ones(2)}, {})
  for a, b in ((with_fp8, without), (without, with_fp8)):
    with pytest.raises(ValueError, match="fp8 states differ"):
      jaxmp.linen.accumulate_gradients(a, b)


def test_train_state_forwards_extra_args_to_the_optimizer():
  x, y = _data()
  model = jaxmp.linen.mixed_precision(TwoDense(), "float32")
  # reduce_on_plateau reads the loss as the extra argument ``value``.
  tx = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=0, factor=0.5))
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                        variables=model.init(jax.random.key(0), x), tx=tx)
  _, grads = state.value_and_grad(_mse(state.apply_fn, x, y))()
  state = state.apply_gradients(grads, extra_args={"value": jnp.asarray(1.0)})
  state = state.apply_gradients(grads, extra_args={"value": jnp.asarray(2.0)})  # no progress
  assert float(state.opt_state[1].scale) == 0.5
  with pytest.raises(TypeError):
    state.apply_gradients(grads)  # reduce_on_plateau needs its value


def test_loss_scale_multiplies_params_gradients_only():
  x, y = _data()
  model = _fp8_model()
  variables = model.init(jax.random.key(0), x)
  grad_fn = jaxmp.linen.value_and_grad(_mse(model.apply, x, y))
  loss1, g1 = grad_fn(variables)
  loss8, g8 = grad_fn(variables, loss_scale=jaxmp.StaticLossScale(8.0))
  assert float(loss1) == float(loss8)
  chex.assert_trees_all_close(jax.tree.map(lambda g: 8 * g, g1.params), g8.params, rtol=1e-6)
  np.testing.assert_array_equal(g1.fp8["hidden"]["Fp8DotGeneral_0"]["input_scale"],
                                g8.fp8["hidden"]["Fp8DotGeneral_0"]["input_scale"])


def test_non_finite_step_without_loss_scaling_keeps_fp8_state():
  x, y = _data()
  model = _fp8_model()
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                        variables=model.init(jax.random.key(0), x),
                                        tx=optax.sgd(1e-2))
  state, _ = _step(state, x, y)
  poisoned, _ = _step(state, x.at[0, 0].set(jnp.nan), y)
  chex.assert_trees_all_equal(poisoned.fp8, state.fp8)


def test_batch_stats_collections():

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(nn.BatchNorm(use_running_average=False)(x))

  x, y = _data()
  model = jaxmp.linen.mixed_precision(Net(), "params=float32,compute=bfloat16,output=float32")
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                        variables=model.init(jax.random.key(0), x),
                                        tx=optax.adam(1e-2))
  assert state.fp8 == {} and set(state.collections) == {"batch_stats"}

  def loss_fn(variables):
    out, updates = state.apply_fn(variables, x, mutable=["batch_stats"])
    return jnp.mean((out - y) ** 2), updates

  (_, updates), grads = state.value_and_grad(loss_fn, has_aux=True)()
  new = state.apply_gradients(grads, collections=updates)
  assert not np.allclose(new.collections["batch_stats"]["BatchNorm_0"]["mean"],
                         state.collections["batch_stats"]["BatchNorm_0"]["mean"])
  assert set(new.variables) == {"params", "batch_stats"}


def test_loss_scale_property():
  x, _ = _data()
  model = _fp8_model()
  variables = model.init(jax.random.key(0), x)
  plain = jaxmp.linen.TrainState.create(apply_fn=model.apply, variables=variables,
                                        tx=optax.sgd(1.0))
  assert isinstance(plain.loss_scale, jaxmp.NoOpLossScale)
  scaled = jaxmp.linen.TrainState.create(
      apply_fn=model.apply, variables=variables,
      tx=jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.StaticLossScale(4.0)))
  assert float(scaled.loss_scale.loss_scale) == 4.0


def test_bad_input():
  x, _ = _data()
  model = _fp8_model()
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(TypeError, match="optax.GradientTransformation"):
    jaxmp.linen.TrainState.create(apply_fn=model.apply, variables=variables, tx="adam")
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply, variables=variables,
                                        tx=optax.sgd(1.0))
  with pytest.raises(TypeError, match="jaxmp.linen.Gradients"):
    state.apply_gradients({"params": variables["params"]})


def test_create_refuses_flax_params_spelling_and_variables_without_params():
  x, _ = _data()
  model = _fp8_model()
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(TypeError, match=r"takes variables=.*not Flax's params=.*"
                                      r"variables=\{'params': params\}"):
    jaxmp.linen.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                  tx=optax.sgd(1.0))
  # A params dict passed as the variables: refused here, not at the first apply.
  with pytest.raises(ValueError, match=r"'params' collection.*\['hidden', 'out'\]"):
    jaxmp.linen.TrainState.create(apply_fn=model.apply, variables=variables["params"],
                                  tx=optax.sgd(1.0))


def test_value_and_grad_passes_keyword_arguments_on():
  x, y = _data()
  model = _fp8_model()
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                        variables=model.init(jax.random.key(0), x),
                                        tx=optax.sgd(1.0))

  def loss_fn(variables, x, *, y, weight=1.0):
    return weight * jnp.mean((state.apply_fn(variables, x) - y) ** 2)

  loss, grads = state.value_and_grad(loss_fn)(x, y=y, weight=2.0)
  reference, ref_grads = state.value_and_grad(lambda v: loss_fn(v, x, y=y, weight=2.0))()
  assert float(loss) == float(reference)
  chex.assert_trees_all_equal(grads, ref_grads)
  loss, _ = jaxmp.linen.value_and_grad(loss_fn)(state.variables, x, y=y,
                                                loss_scale=jaxmp.StaticLossScale(4.0))
  assert float(loss) == float(reference) / 2


def test_with_rules_keeps_every_leaf_and_swaps_the_apply_function():
  rules = jaxmp.PolicyRules("params=float32,compute=float16,output=float32",
                            [jaxmp.Rule(nn.Dense, fp8=jaxmp.fp8.DelayedScaling(4))],
                            trace_nonfinite=True)
  model = jaxmp.linen.mixed_precision(nn.Dense(2), rules)
  x = jnp.ones((4, 3))
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                        variables=model.init(jax.random.key(0), x),
                                        tx=jaxmp.loss_scaling(optax.adam(1e-3)))
  new_rules = jaxmp.PolicyRules("float32", trace_nonfinite=True)
  new = state.with_rules(new_rules)
  assert new.apply_fn.__self__.rules == new_rules
  assert new.apply_fn.__self__.model is model.model
  # Params, fp8 state, the probe, the optimizer and its loss scale: the same arrays.
  old_leaves, new_leaves = jax.tree.leaves(state), jax.tree.leaves(new)
  assert len(old_leaves) == len(new_leaves) and all(
      a is b for a, b in zip(old_leaves, new_leaves))
  assert new.tx is state.tx
  with pytest.raises(TypeError, match="apply_fn must be the apply of a jaxmp.linen wrapper"):
    state.replace(apply_fn=model.model.apply).with_rules(new_rules)


def test_with_rules_that_stop_tracing_drop_the_probe_and_the_step_runs():
  tracing = jaxmp.PolicyRules("params=float32,compute=float16,output=float32",
                              trace_nonfinite=True)
  model = jaxmp.linen.mixed_precision(TwoDense(), tracing)
  x, y = _data()
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                        variables=model.init(jax.random.key(0), x),
                                        tx=jaxmp.loss_scaling(optax.adam(1e-3)))
  assert jaxmp.linen.NONFINITE_COLLECTION in state.collections
  plain = state.with_rules(jaxmp.PolicyRules("params=float32,compute=float16,output=float32"))
  # A wrapper that does not trace refuses the probe; the state no longer holds it.
  assert plain.collections == {}
  assert all(a is b for a, b in zip(jax.tree.leaves((state.params, state.opt_state)),
                                    jax.tree.leaves((plain.params, plain.opt_state))))
  stepped, loss = _step(plain, x, y)
  _, grads = plain.value_and_grad(_mse(plain.apply_fn, x, y))()
  assert grads.nonfinite is None
  # The same step as a model that never traced: tracing changes no value.
  never = jaxmp.linen.TrainState.create(
      apply_fn=jaxmp.linen.mixed_precision(TwoDense(), plain.apply_fn.__self__.rules).apply,
      variables={"params": state.params}, tx=state.tx)
  expected, expected_loss = _step(never, x, y)
  assert float(loss) == float(expected_loss)
  chex.assert_trees_all_equal(stepped.params, expected.params)
