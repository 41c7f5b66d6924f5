"""Master weights: bfloat16 params, an exact float32 master, the float32 trajectory."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
from jaxmp._src.optim import base
from tests import backends

STEPS = 40


def _params(dtype=jnp.bfloat16):
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"kernel": jax.random.normal(k1, (48, 33)).astype(dtype),
          "bias": (0.1 * jax.random.normal(k2, (33,))).astype(dtype)}


def _grads(step, like):
  key = jax.random.fold_in(jax.random.key(1), step)
  return jax.tree.map(lambda p: jax.random.normal(jax.random.fold_in(key, p.size), p.shape)
                      * 10.0 ** jax.random.uniform(key, (), minval=-3, maxval=1), like)


def _optimizer():
  # Clipping (a global reduction), AdamW's weight decay (reads the params) and a schedule.
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      optax.cosine_decay_schedule(3e-3, STEPS), weight_decay=0.1))


def _bits(tree):
  return [np.asarray(base.bits(x)) for x in jax.tree.leaves(tree)]


# Bit patterns, not chex.assert_trees_all_equal: chex's values equate -0.0 with 0.0 and any NaNs.
def _assert_bitwise(a, b, what):
  for x, y in zip(_bits(a), _bits(b), strict=True):
    np.testing.assert_array_equal(x, y, err_msg=what)


def _step(tx):
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def _assert_within_ulps(a, b, ulps, what):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    found = backends.max_ulps(x, y)
    assert found <= ulps, f"{what}: {found} float32 ulps apart"


@pytest.mark.parametrize("device", backends.DEVICES)
@pytest.mark.parametrize("remainders", [False, True])
def test_the_master_follows_the_float32_trajectory_bit_for_bit(remainders, device):
  # Bit for bit where both programs round alike (XLA:CPU without FMA). On a GPU, XLA
  # contracts multiply-adds per program and divides within an ulp, so the two runs may
  # part by an ulp a step. UNMEASURED bound: an ulp per step (tests/backends.py).
  exact = backends.exact(device)
  with backends.on(device):
    _follow_the_float32_trajectory(remainders, exact)


def _follow_the_float32_trajectory(remainders, exact):
  same = (lambda a, b, what: _assert_bitwise(a, b, what)) if exact else (
      lambda a, b, what: _assert_within_ulps(a, b, STEPS, what))
  params = _params()
  reference = jax.tree.map(lambda p: p.astype(jnp.float32), params)  # the same start
  ref_tx, tx = _optimizer(), jaxmp.optim.master_weights(_optimizer(), remainders=remainders)
  ref_state, state = ref_tx.init(reference), tx.init(params)
  ref_step, step = _step(ref_tx), _step(tx)
  moved = 0
  for i in range(STEPS):
    grads = _grads(i, reference)  # float32 gradients, the same for both
    before = params
    reference, ref_state = ref_step(reference, ref_state, grads)
    params, state = step(params, state, grads)
    masters = jaxmp.optim.master_params(state, params)
    same(masters, reference, f"master at step {i}")
    # optax.apply_updates landed every param exactly on its rounded master.
    rounded = (jax.tree.map(lambda m: jaxmp.optim.split_remainder(m)[0], masters) if remainders
               else jax.tree.map(lambda m: m.astype(jnp.bfloat16), masters))
    _assert_bitwise(params, rounded, f"params at step {i}")
    moved += sum(int(jnp.sum(a != b)) for a, b in zip(jax.tree.leaves(params),
                                                      jax.tree.leaves(before)))
  same(state.inner_state, ref_state, "Adam's state")
  assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
  assert moved > 0  # the bfloat16 params did move


def test_a_full_master_sets_a_param_that_missed_right_at_the_next_step():
  # A param shrinking by more than 2**15 in one step can miss its target (base.py): a
  # master just below 2.0 (param 2.0) drops to -8.7e-6. The full master stays exact
  # and the next update lands the param on it.
  tx = jaxmp.optim.master_weights(optax.sgd(1.0))
  params = {"w": jnp.array([1.0], jnp.bfloat16)}
  state = tx.init(params)
  step = _step(tx)
  masters = [np.float32(1.9972099), np.float32(-8.702278e-06)]
  for master in masters:
    previous = state.master["w"]
    params, state = step(params, state, {"w": previous - master})
    assert state.master["w"][0] == master
  assert float(params["w"][0]) != float(master.astype(jnp.bfloat16))  # missed, by less
  assert abs(float(params["w"][0]) - float(master)) <= 2.0**-22  # than a float32 ulp of 2.0
  params, state = step(params, state, {"w": jnp.zeros(1)})
  assert params["w"][0] == master.astype(jnp.bfloat16)


def test_the_state_has_the_params_shapes_and_float32_params_are_their_own_master():
  params = {"half": jnp.ones((4, 6), jnp.bfloat16), "wide": jnp.ones((3,), jnp.float32)}
  for remainders, dtype in [(False, jnp.float32), (True, jnp.int16)]:
    state = jaxmp.optim.master_weights(optax.adam(1e-2), remainders=remainders).init(params)
    assert state.master["half"].shape == (4, 6) and state.master["half"].dtype == dtype
    assert state.master["wide"] is None
    assert state.inner_state[0].mu["half"].dtype == jnp.float32
  # The float32 leaf is updated by Adam exactly as float32 params would be.
  tx, plain = jaxmp.optim.master_weights(optax.adam(1e-2)), optax.adam(1e-2)
  grads = {"half": jnp.ones((4, 6), jnp.bfloat16), "wide": jnp.arange(3.0)}
  params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  expected, _ = jax.jit(plain.update)(jax.tree.map(lambda g: g.astype(jnp.float32), grads),
                                      plain.init(params32), params32)
  np.testing.assert_array_equal(updates["wide"], expected["wide"])
  assert updates["half"].dtype == jnp.float32


def test_float16_params_get_a_full_float32_master():
  tx = jaxmp.optim.master_weights(optax.sgd(1e-4))
  params = {"w": jnp.ones(3, jnp.float16)}
  state = tx.init(params)
  for _ in range(100):
    updates, state = tx.update({"w": jnp.ones(3, jnp.float16)}, state, params)
    params = optax.apply_updates(params, updates)
  expected = np.float32(1.0)
  for _ in range(100):
    expected = np.float32(expected + np.float32(-1e-4))
  assert params["w"].dtype == jnp.float16
  np.testing.assert_array_equal(state.master["w"], expected)  # float32 arithmetic
  np.testing.assert_array_equal(params["w"], state.master["w"].astype(jnp.float16))


@pytest.mark.parametrize("placement", ["loss_scaling outside", "loss_scaling inside"])
@pytest.mark.parametrize("remainders", [False, True])
def test_a_non_finite_step_leaves_masters_params_and_adam_untouched(placement, remainders):
  scale = jaxmp.StaticLossScale(8.0)
  if placement == "loss_scaling outside":
    tx = jaxmp.loss_scaling(jaxmp.optim.master_weights(optax.adam(1e-2), remainders=remainders),
                            scale)
  else:
    tx = jaxmp.optim.master_weights(jaxmp.loss_scaling(optax.adam(1e-2), scale),
                                    remainders=remainders)
  params = _params()
  state = tx.init(params)
  step = _step(tx)
  for i in range(3):
    params, state = step(params, state, jax.tree.map(lambda g: 8.0 * g, _grads(i, params)))
  before_params, before_state = params, state
  masters = jaxmp.optim.master_params(state, params)
  poisoned = _grads(3, params)
  poisoned["kernel"] = poisoned["kernel"].at[2, 3].set(jnp.inf)
  params, state = step(params, state, poisoned)
  assert int(jaxmp.loss_scaling_metrics(state)["skipped_steps"]) == 1
  _assert_bitwise(params, before_params, "params")
  _assert_bitwise(jaxmp.optim.master_params(state, params), masters, "masters")
  adam = lambda s: jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
  adam_before = [x for x in adam(before_state) if isinstance(x, optax.ScaleByAdamState)]
  adam_after = [x for x in adam(state) if isinstance(x, optax.ScaleByAdamState)]
  _assert_bitwise(adam_after, adam_before, "Adam's state")
  assert int(adam_after[0].count) == 3


def test_a_linen_train_state_with_bfloat16_params_trains_its_master():
  model = jaxmp.linen.mixed_precision(nn.Dense(4), "params=bfloat16,compute=bfloat16,output=float32")
  x = jax.random.normal(jax.random.key(0), (16, 8))
  y = jnp.tanh(x[:, :4])
  tx = jaxmp.loss_scaling(jaxmp.optim.master_weights(optax.adam(1e-2), remainders=True),
                          jaxmp.NoOpLossScale())
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                        variables=model.init(jax.random.key(1), x), tx=tx)

  @jax.jit
  def train_step(state):
    loss, grads = state.value_and_grad(lambda v: jnp.mean((state.apply_fn(v, x) - y) ** 2))()
    return state.apply_gradients(grads), loss

  losses = []
  for _ in range(30):
    state, loss = train_step(state)
    losses.append(float(loss))
  assert state.params["kernel"].dtype == jnp.bfloat16
  masters = jaxmp.optim.master_params(state.opt_state, state.params)
  assert masters["kernel"].dtype == jnp.float32
  np.testing.assert_array_equal(
      state.params["kernel"], jaxmp.optim.split_remainder(masters["kernel"])[0])
  assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("remainders", [False, True])
def test_an_nnx_optimizer_with_bfloat16_params_trains_its_master(remainders):
  rules = jaxmp.PolicyRules("params=bfloat16,compute=bfloat16,output=float32",
                            [jaxmp.Rule("layers/1", "float32")])  # the norm's own master
  model = jaxmp.nnx.mixed_precision(nnx.Sequential(
      nnx.Linear(8, 4, rngs=nnx.Rngs(1)), nnx.LayerNorm(4, rngs=nnx.Rngs(2))), rules)
  tx = jaxmp.loss_scaling(jaxmp.optim.master_weights(optax.adam(1e-2), remainders=remainders),
                          jaxmp.NoOpLossScale())
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(0), (16, 8))
  y = jnp.tanh(x[:, :4])

  @nnx.jit
  def train_step(model, optimizer):
    loss, grads = jaxmp.nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(
        model, loss_scale=jaxmp.get_loss_scale(optimizer.opt_state))
    jaxmp.nnx.apply_gradients(optimizer, model, grads)
    return loss

  losses = [float(train_step(model, optimizer)) for _ in range(30)]
  assert losses[-1] < 0.5 * losses[0]
  params = nnx.state(model, nnx.Param)
  masters = jaxmp.optim.master_params(optimizer.opt_state, params)
  assert jax.tree.structure(masters) == jax.tree.structure(params)  # an nnx.State of Params
  kernel = masters["model"]["layers"][0]["kernel"][...]
  assert kernel.dtype == jnp.float32
  rounded = (jaxmp.optim.split_remainder(kernel)[0] if remainders
             else kernel.astype(jnp.bfloat16))
  np.testing.assert_array_equal(model.model.layers[0].kernel[...], rounded)
  assert not np.array_equal(np.asarray(kernel), np.asarray(rounded, np.float32))  # more bits
  scale = model.model.layers[1].scale[...]
  assert scale.dtype == jnp.float32  # its own master, handed back as it is
  _assert_bitwise(masters["model"]["layers"][1]["scale"][...], scale, "norm scale")
  # Inside jit too, and the same.
  _assert_bitwise(jax.jit(jaxmp.optim.master_params)(optimizer.opt_state, params), masters,
                  "masters under jit")


def test_master_params_names_a_param_tree_that_does_not_match():
  model = jaxmp.nnx.mixed_precision(nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
                                    "params=bfloat16,compute=bfloat16,output=float32")
  optimizer = nnx.Optimizer(model, jaxmp.optim.master_weights(optax.sgd(0.1)), wrt=nnx.Param)
  # The wrapped model's own params: their paths lack the wrapper's "model".
  with pytest.raises(ValueError, match=r"master_params: .*\['bias'\].*\['model'\]\['bias'\]"):
    jaxmp.optim.master_params(optimizer.opt_state, nnx.state(model.model, nnx.Param))


def test_master_params_needs_exactly_one_master_weights_state():
  with pytest.raises(ValueError, match="found 0"):
    jaxmp.optim.master_params(optax.adam(1e-3).init({"w": jnp.ones(1)}), {"w": jnp.ones(1)})
