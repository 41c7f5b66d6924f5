"""Sharded training: data parallel and FSDP under jit, shard_map; fp8 under shard_map.

The eight-device checks live in ``distributed_checks.py`` and run in one subprocess
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (JAX fixes its device count
when it starts); each check below reads its own PASS/FAIL line, which names the failed
assertion. The one-device-mesh tests run in this process.
"""

import pathlib

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxmp
from jaxmp import fp8
from tests import eight_devices

SCRIPT = pathlib.Path(__file__).with_name("distributed_checks.py")
CHECKS = (
    "data_parallel_jit",
    "data_parallel_overflow_and_amax",
    "fsdp_jit",
    "checkpoint_sharded",
    "shard_map_explicit",
    "shard_map_invariant",
    "shard_map_device_local_fault",
)


eight_device_results, test_eight_devices, test_the_check_names_match_the_script = (
    eight_devices.make_tests(SCRIPT, CHECKS, cwd=SCRIPT.parents[1]))


# --------------------------------------------------------------------------------------
# shard_map typing, on a one-device mesh (the varying/invariant types are the same with
# one device as with eight).


def _pvary(tree):
  return jax.tree.map(lambda a: jax.lax.pcast(a, ("data",), to="varying"), tree)


@pytest.mark.parametrize("recipe", [fp8.DelayedScaling(amax_history_length=4),
                                    fp8.CurrentScaling()])
def test_fp8_dot_general_with_replicated_kernel_and_state_under_shard_map(recipe):
  # A replicated kernel and fp8 state meet per-device inputs: the custom VJP must hand
  # back gradients of the replicated type (JAX rejected the per-device ones before).
  mesh = jax.make_mesh((1,), ("data",))
  dims = (((1,), (0,)), ((), ()))
  x = jax.random.normal(jax.random.key(0), (4, 3))
  w = jax.random.normal(jax.random.key(1), (3, 2))
  state = fp8.init_state(recipe)

  def grads(x, w, state):
    def loss(w, state):
      s = None if state is None else fp8.state.for_grad(state)
      return jnp.sum(fp8.fp8_dot_general(x, w, dims, state=s, recipe=recipe) ** 2)
    return jax.grad(loss, argnums=(0, 1))(w, state)

  sharded = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(P("data"), P(), P()),
                                  out_specs=P()))
  g_w, g_state = sharded(jax.device_put(x, NamedSharding(mesh, P("data"))), w, state)
  ref_w, ref_state = jax.jit(grads)(x, w, state)
  np.testing.assert_array_equal(g_w, ref_w)
  if state is not None:
    np.testing.assert_array_equal(g_state.input_amax_history, ref_state.input_amax_history)
    assert float(g_state.input_amax_history[0]) == float(jnp.max(jnp.abs(x)))


def test_shard_map_train_step_with_per_device_gradients_matches_plain_jit():
  # The per-device pattern: variables marked varying, gradients psum-ed, fp8 state
  # cotangents max-reduced, the finite check all-reduced by loss_scaling(axis_name=).
  mesh = jax.make_mesh((1,), ("data",))
  rules = jaxmp.PolicyRules("float32", [jaxmp.Rule(nn.Dense, fp8=fp8.DelayedScaling(4))])
  model = jaxmp.linen.mixed_precision(nn.Dense(3), rules)
  x = jax.random.normal(jax.random.key(0), (8, 5))
  y = jnp.ones((8, 3))

  def make(axis_name):
    tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.StaticLossScale(8.0), axis_name=axis_name)
    return jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                         variables=model.init(jax.random.key(1), x), tx=tx)

  def plain(state, x, y):
    loss, grads = state.value_and_grad(lambda v: jnp.mean((model.apply(v, x) - y) ** 2))()
    return state.apply_gradients(grads), loss

  def per_device(state, x, y):
    loss_fn = lambda v: jnp.mean((model.apply(v, x) - y) ** 2)
    loss, grads = jaxmp.linen.value_and_grad(loss_fn)(_pvary(state.variables),
                                                      loss_scale=state.loss_scale)
    grads = jaxmp.linen.Gradients(jax.lax.pmean(grads.params, "data"),
                                  fp8.state.all_reduce(grads.fp8, "data"))
    return state.apply_gradients(grads), jax.lax.pmean(loss, "data")

  step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                               out_specs=(P(), P())))
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  ys = jax.device_put(y, NamedSharding(mesh, P("data")))
  ours, ref = make("data"), make(None)
  for _ in range(3):
    ours, loss = step(ours, xs, ys)
    ref, ref_loss = jax.jit(plain)(ref, x, y)
  assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
  chex.assert_trees_all_close((ours.params, ours.fp8), (ref.params, ref.fp8), rtol=1e-6, atol=1e-7)
