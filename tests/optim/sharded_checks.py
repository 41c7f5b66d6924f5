"""Eight-device checks of jaxmp.optim under FSDP (run by test_sharded.py).

JAX fixes its device count when it starts, so these run in a fresh process:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/optim/sharded_checks.py

Each check prints ``PASS <name>: ...`` or ``FAIL <name>: ...``; the exit status is 1
if any failed.

* ``optimizer_parity``: params sharded on their last dimension over 8 devices, every
  state leaf with a param's shape sharded like it; master weights (full and
  remainders), stochastic rounding, Kahan and bfloat16 moments under AdamW (an
  elementwise update) give bit for bit what one device gives, and the state keeps
  the params' shardings.
* ``clipped_parity``: with ``optax.clip_by_global_norm`` inside (not elementwise: a
  float32 sum over every gradient), master weights (full and remainders) follow
  float32 Optax bit for bit on one device and on 8, masters and AdamW state. One
  device and 8 do not agree bit for bit here, for float32 Optax itself: XLA sums each
  device's shard and then the partial sums, a different order from one device's
  sum, and the float32 norms differ by a few ulps (the line reports how many). Plain
  Optax over bfloat16 params agrees only because it rounds that float32 sum to
  bfloat16, which hides a few float32 ulps (except where the sum lies near a bfloat16
  rounding boundary).
* ``quantized_parity``: 8-bit moments (``quantized_moments``) alone and under master
  weights (full and remainders), params sharded on their last dimension: codes sharded
  like their param, scales (a block per 32 values of a row) along the same axis, and
  every value bit for bit what one device gives.
* ``fsdp_train_step``: a bfloat16-param MLP trained with master weights under
  ``jaxmp.loss_scaling``, FSDP-sharded, matches one device; a NaN in one device's
  data makes every device skip with masters and params untouched.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import flax.linen as nn  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import optax  # pylint: disable=g-import-not-at-top
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

import jaxmp  # pylint: disable=g-import-not-at-top
from tests import distributed_checks as dc  # pylint: disable=g-import-not-at-top
from tests import eight_devices  # pylint: disable=g-import-not-at-top
from tests import tree_asserts  # pylint: disable=g-import-not-at-top

DEVICES, AXIS = dc.DEVICES, dc.AXIS
STEPS = 5
BF16_PARAMS = "params=bfloat16,compute=bfloat16,output=float32"


def _adamw():
  return optax.adamw(1e-2, weight_decay=0.1)


OPTIMIZERS = {
    "master": lambda: jaxmp.optim.master_weights(_adamw()),
    "master remainders": lambda: jaxmp.optim.master_weights(_adamw(), remainders=True),
    "bf16 moments": lambda: jaxmp.optim.state_dtypes(_adamw(), "bfloat16"),
    "stochastic rounding": lambda: jaxmp.optim.stochastic_rounding(
        jaxmp.optim.state_dtypes(_adamw(), "bfloat16"), jax.random.key(1)),
    "kahan": lambda: jaxmp.optim.kahan_summation(jaxmp.optim.state_dtypes(_adamw(), "bfloat16")),
}


def _mesh():
  return jax.make_mesh((DEVICES,), (AXIS,), axis_types=(AxisType.Auto,))


def _fsdp_shardings(tree, mesh):
  """Leaves split on their last dimension where it divides; the rest replicated."""
  def one(leaf):
    if leaf.ndim == 0 or leaf.shape[-1] % DEVICES:
      return NamedSharding(mesh, P())
    return NamedSharding(mesh, P(*([None] * (leaf.ndim - 1)), AXIS))
  return jax.tree.map(one, tree)


def _grads(params, i):
  """Step ``i``'s gradients, bfloat16 values whatever the param dtype: the same for
  bfloat16 params and their float32 copies."""
  key = jax.random.fold_in(jax.random.key(2), i)
  return jax.tree.map(
      lambda p: jax.random.normal(key, p.shape).astype(jnp.bfloat16).astype(p.dtype), params)


def _optimizer_run(tx, params, mesh=None):
  def step(params, opt_state, i):
    grads = _grads(params, i)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  state = (params, tx.init(params))
  if mesh is None:
    jitted = jax.jit(step)
  else:
    shardings = _fsdp_shardings(state, mesh)
    state = jax.device_put(state, shardings)
    jitted = jax.jit(step, in_shardings=(*shardings, None), out_shardings=shardings)
  for i in range(STEPS):
    state = jitted(*state, i)
  return state


def _sharded_runs(optimizers, params, mesh):
  """Each optimizer's run on 8 devices, after checking it equals one device's bit for bit."""
  for name, make in optimizers.items():
    tx = make()
    single = _optimizer_run(tx, params)
    sharded = _optimizer_run(tx, params, mesh)
    tree_asserts.assert_trees_equal(jax.device_get(sharded), jax.device_get(single), what=name)
    yield name, sharded


def check_optimizer_parity() -> str:
  mesh = _mesh()
  params = {"w": jax.random.normal(jax.random.key(0), (16, 64)).astype(jnp.bfloat16),
            "b": jnp.zeros(64, jnp.bfloat16), "norm": jnp.ones(64, jnp.float32)}
  checked = []
  for name, sharded in _sharded_runs(OPTIMIZERS, params, mesh):
    n_sharded = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(sharded[1])[0]:
      if leaf.shape in ((16, 64), (64,)):
        expected = P(None, AXIS) if leaf.ndim == 2 else P(AXIS)
        assert leaf.sharding.spec == expected, (
            f"{name}: state leaf {jax.tree_util.keystr(path)} has sharding {leaf.sharding.spec}")
        assert {s.data.shape[-1] for s in leaf.addressable_shards} == {64 // DEVICES}
        n_sharded += 1
    assert n_sharded >= 6, f"{name}: only {n_sharded} param-shaped state leaves"
    checked.append(f"{name} ({n_sharded} sharded state leaves)")
  return "bit for bit as on one device: " + ", ".join(checked)


def _quantized_adamw():
  return jaxmp.optim.quantized_moments(_adamw(), block_size=32, min_size=0)


QUANTIZED = {
    "8-bit moments": _quantized_adamw,
    "master, 8-bit moments": lambda: jaxmp.optim.master_weights(_quantized_adamw()),
    "remainders, 8-bit moments": lambda: jaxmp.optim.master_weights(
        _quantized_adamw(), remainders=True),
}


def check_quantized_parity() -> str:
  mesh = _mesh()
  params = {"w": jax.random.normal(jax.random.key(0), (16, 512)).astype(jnp.bfloat16),
            "b": jnp.zeros(512, jnp.bfloat16)}
  is_quantized = lambda x: isinstance(x, jaxmp.optim.QuantizedMoment)
  checked = []
  for name, sharded in _sharded_runs(QUANTIZED, params, mesh):
    moments = [x for x in jax.tree.leaves(sharded[1], is_leaf=is_quantized) if is_quantized(x)]
    assert len(moments) == 4, f"{name}: {len(moments)} quantized moments"
    for moment in moments:
      codes, scale = moment
      assert codes.dtype == jnp.uint8 and scale.shape[-1] == 16, (name, scale.shape)
      for leaf, per_device in ((codes, 512 // DEVICES), (scale, 16 // DEVICES)):
        assert leaf.sharding.spec[-1] == AXIS, f"{name}: {leaf.shape} {leaf.sharding.spec}"
        assert {s.data.shape[-1] for s in leaf.addressable_shards} == {per_device}
    checked.append(name)
  return ("codes and scales sharded like their param, bit for bit as on one device: "
          + ", ".join(checked))


def _clipped_adamw():
  return optax.chain(optax.clip_by_global_norm(1.0), _adamw())


def _norm_ulps(params, mesh) -> int:
  """How many float32 ulps the global norm of step 0's gradients moves when sharded."""
  grads = jax.tree.map(lambda g: g.astype(jnp.float32), _grads(params, 0))
  single = jax.jit(optax.tree.norm)(grads)
  sharded = jax.jit(optax.tree.norm)(jax.device_put(grads, _fsdp_shardings(grads, mesh)))
  as_int = lambda x: int(np.asarray(x, np.float32).view(np.int32))
  return abs(as_int(single) - as_int(sharded))


def check_clipped_parity() -> str:
  mesh = _mesh()
  params = {"w": jax.random.normal(jax.random.key(0), (16, 64)).astype(jnp.bfloat16),
            "b": jnp.zeros(64, jnp.bfloat16), "norm": jnp.ones(64, jnp.float32)}
  params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  runs = {}
  for layout, on in (("1 device", None), ("8 devices", mesh)):
    runs[layout] = reference = jax.device_get(_optimizer_run(_clipped_adamw(), params32, on))
    for remainders in (False, True):
      name = f"master{' remainders' if remainders else ''} on {layout}"
      tx = jaxmp.optim.master_weights(_clipped_adamw(), remainders=remainders)
      new_params, state = jax.device_get(_optimizer_run(tx, params, on))
      masters = jaxmp.optim.master_params(state, new_params)
      tree_asserts.assert_trees_equal(masters, reference[0],
                                      what=f"{name}: masters vs float32 optax")
      tree_asserts.assert_trees_equal(state.inner_state, reference[1],
                                      what=f"{name}: AdamW state vs float32 optax")
  differ = sum(int(np.sum(np.asarray(a) != np.asarray(b))) for a, b in zip(
      jax.tree.leaves(runs["1 device"]), jax.tree.leaves(runs["8 devices"])))
  return (f"masters and AdamW state equal float32 optax bit for bit on 1 and on 8 devices; "
          f"float32 optax itself differs between them in {differ} values, its global norm "
          f"by {_norm_ulps(params, mesh)} float32 ulps")


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(dc.OUT, name="out")(nn.gelu(nn.Dense(dc.HIDDEN, name="hidden")(x)))


def _train_state(tx):
  model = jaxmp.linen.mixed_precision(MLP(), BF16_PARAMS)
  x, _ = dc.data()
  return jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                       variables=model.init(jax.random.key(0), x), tx=tx)


def check_fsdp_train_step() -> str:
  mesh = _mesh()
  batch = NamedSharding(mesh, P(AXIS))
  tx = jaxmp.loss_scaling(jaxmp.optim.master_weights(
      jaxmp.optim.state_dtypes(optax.adam(dc.LR), "bfloat16"), remainders=True),
                          jaxmp.NoOpLossScale())
  state = _train_state(tx)
  shardings = _fsdp_shardings(state, mesh)
  step = jax.jit(dc.train_step, in_shardings=(shardings, batch, batch),
                 out_shardings=(shardings, NamedSharding(mesh, P())))
  x, y = dc.data()
  single, _, _ = dc.run(jax.jit(dc.train_step), _train_state(tx), x, y)
  sharded, _, _ = dc.run(step, jax.device_put(state, shardings), jax.device_put(x, batch),
                         jax.device_put(y, batch))
  masters = jaxmp.optim.master_params(sharded.opt_state, sharded.params)
  reference = jaxmp.optim.master_params(single.opt_state, single.params)
  # As in distributed_checks' bfloat16 runs: only the order of the gradient sums
  # differs, and Adam moves each element by at most LR per step.
  d = dc.max_abs_diff(masters, reference)
  assert d <= 2 * dc.LR * STEPS, f"masters differ from one device by {d:.3g}"
  kernel_rest = sharded.opt_state.inner_state.master["hidden"]["kernel"]
  assert kernel_rest.dtype == jnp.int16 and kernel_rest.sharding.spec == P(None, AXIS)

  poisoned = x.copy()
  poisoned[6 * 8, 0] = np.nan
  after, _ = step(sharded, jax.device_put(poisoned, batch), jax.device_put(y, batch))
  finite = [bool(b) for b in dc.per_device(after.opt_state.last_step_finite)]
  assert finite == [False] * DEVICES, f"last_step_finite per device {finite}"
  tree_asserts.assert_trees_equal(after.params, sharded.params, what="params")
  tree_asserts.assert_trees_equal(after.opt_state.inner_state, sharded.opt_state.inner_state,
                                  what="masters and Adam")
  return (f"masters within {d:.2g} of one device; remainders sharded like the kernel; "
          "one NaN shard: every device skipped, state bit for bit")


CHECKS = {
    "optimizer_parity": check_optimizer_parity,
    "clipped_parity": check_clipped_parity,
    "quantized_parity": check_quantized_parity,
    "fsdp_train_step": check_fsdp_train_step,
}

if __name__ == "__main__":
  sys.exit(eight_devices.main(CHECKS, sys.argv[1:]))
