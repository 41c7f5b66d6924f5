"""Orbax round trips of every jaxmp.optim state, mid-run: the resumed run is identical."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxmp


def _adamw():
  return jaxmp.optim.state_dtypes(optax.adamw(3e-3, weight_decay=0.1), "bfloat16")


# Each optimizer is built once: a restore target must come from the same program.
OPTIMIZERS = {
    "master": jaxmp.optim.master_weights(_adamw()),
    "master remainders": jaxmp.optim.master_weights(_adamw(), remainders=True),
    "stochastic rounding": jaxmp.optim.stochastic_rounding(_adamw(), jax.random.key(3)),
    "kahan": jaxmp.optim.kahan_summation(_adamw()),
    # 8-bit moments (blocks of 64, no size threshold: the small test params' too).
    "master 8-bit moments": jaxmp.optim.master_weights(jaxmp.optim.quantized_moments(
        optax.adamw(3e-3, weight_decay=0.1), block_size=64, min_size=0)),
}


def _make(name):
  tx = jaxmp.loss_scaling(OPTIMIZERS[name], jaxmp.DynamicLossScale(2.0**8, growth_interval=2))
  # A float32 leaf among the bfloat16 ones: its state entries are None.
  params = {"w": jax.random.normal(jax.random.key(0), (16, 24)).astype(jnp.bfloat16),
            "b": jnp.zeros(24, jnp.bfloat16), "norm": jnp.ones(24, jnp.float32)}
  return tx, params, tx.init(params)


def _step_fn(tx):
  @jax.jit
  def step(params, opt_state, i, poison):
    key = jax.random.fold_in(jax.random.key(9), i)
    grads = jax.tree.map(lambda p: jax.random.normal(key, p.shape).astype(p.dtype) * 256.0,
                         params)
    grads["w"] = grads["w"].at[0, 0].add(poison)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def _run(step, params, opt_state, steps):
  for i in steps:
    params, opt_state = step(params, opt_state, i, jnp.inf if i == 1 else 0.0)  # 1 skipped
  return params, opt_state


# Bytes, not chex.assert_trees_all_equal: chex's values equate -0.0 with 0.0 and any NaNs.
def _assert_identical(a, b):
  leaves_a, def_a = jax.tree.flatten(a)
  leaves_b, def_b = jax.tree.flatten(b)
  assert def_a == def_b
  for x, y in zip(leaves_a, leaves_b):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8),
                                  np.atleast_1d(np.asarray(y)).view(np.uint8))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_save_restore_and_continue_identically(tmp_path, name):
  tx, params, opt_state = _make(name)
  step = _step_fn(tx)
  params, opt_state = _run(step, params, opt_state, range(3))
  assert int(jaxmp.loss_scaling_metrics(opt_state)["skipped_steps"]) == 1
  saved = (params, opt_state)
  straight = _run(step, *saved, range(3, 6))
  with ocp.CheckpointManager(tmp_path) as manager:
    manager.save(3, args=ocp.args.StandardSave(saved))
    manager.wait_until_finished()
  target = jax.eval_shape(lambda: _run(step, *_make(name)[1:], range(0)))
  with ocp.CheckpointManager(tmp_path) as manager:
    restored = manager.restore(3, args=ocp.args.StandardRestore(target))
  _assert_identical(restored, saved)
  resumed = _run(step, *restored, range(3, 6))
  _assert_identical(resumed, straight)
