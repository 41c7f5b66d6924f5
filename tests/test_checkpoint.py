"""Checkpointing a mixed-precision run with Orbax, mid-run, and resuming exactly.

What must survive a save and restore: the params, the optimizer state (inner Adam
moments and count, the loss scale with its growth counter, skipped steps, the last
step's finiteness), the fp8 delayed-scaling state, and the loss scale's
hyperparameters, which are static pytree aux data: they are not in the checkpoint but
come from the restore target, built by the same code as the original state. A linen
``TrainState`` first; then an NNX model and ``nnx.Optimizer`` (with float32 masters,
batch statistics and an RNG stream too), saved and restored by the sharding guide's
own code (docs/guides/sharding.md, :mod:`tests.nnx_checkpoint_run`), in this process
and in a fresh one.
"""

import contextlib
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxmp
from jaxmp import fp8
from tests import nnx_checkpoint_run as nnx_run
from tests import tree_asserts

LOSS_SCALE = dict(scale=2.0**10, growth_interval=3, growth_factor=2.0, backoff_factor=0.5,
                  min_scale=0.5, max_scale=2.0**14)


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="out")(nn.gelu(nn.Dense(32, name="hidden")(x)))


MODEL = jaxmp.linen.mixed_precision(MLP(), jaxmp.PolicyRules(
    "params=float32,compute=bfloat16,output=float32",
    [jaxmp.Rule(nn.Dense, fp8=fp8.DelayedScaling(amax_history_length=4))]))
X = jax.random.normal(jax.random.key(1), (16, 8))
Y = jnp.tanh(X[:, :4] * 2.0)


def make_tx():
  return jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(**LOSS_SCALE))


# The optimizer (like the model) is part of the program, not of the checkpoint: the
# TrainState holds it as static data, so a restore target built with this same object
# restores into states the jitted step has already compiled for.
TX = make_tx()


def create_state(tx=TX):
  return jaxmp.linen.TrainState.create(apply_fn=MODEL.apply,
                                       variables=MODEL.init(jax.random.key(0), X), tx=tx)


def make_step():
  traces = []

  @jax.jit
  def step(state, x, y, grad_fault):
    traces.append(1)  # runs once per trace, not per call
    loss_fn = lambda variables: jnp.mean((state.apply_fn(variables, x) - y) ** 2)
    loss, grads = state.value_and_grad(loss_fn)()
    grads = grads._replace(params=jax.tree.map(lambda g: g + grad_fault, grads.params))
    return state.apply_gradients(grads), loss

  return step, traces


@contextlib.contextmanager
def count_compilations():
  """Counts XLA backend compilations inside the block."""
  events = []

  def listener(name, *args, **kwargs):
    del args, kwargs
    if name == "/jax/core/compile/backend_compile_duration":
      events.append(name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def abstract_target(tx, placed_like):
  """The restore target: shapes and dtypes from the model's own init (nothing is
  computed), each leaf placed where the leaf of ``placed_like`` is."""
  abstract = jax.eval_shape(lambda: create_state(tx))
  leaves, treedef = jax.tree.flatten(abstract)
  return jax.tree.unflatten(treedef, [
      jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s.sharding)
      for a, s in zip(leaves, jax.tree.leaves(placed_like), strict=True)])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """Trains 7 steps (one skipped), saves, trains 4 more: the uninterrupted reference."""
  directory = tmp_path_factory.mktemp("ckpt")
  step, traces = make_step()
  device = jax.devices()[0]
  clean, fault = jax.device_put(jnp.float32(0.0), device), jax.device_put(jnp.float32(jnp.inf), device)
  x, y = jax.device_put((X, Y), device)
  state = jax.device_put(create_state(), device)
  for i in range(7):
    state, _ = step(state, x, y, fault if i == 2 else clean)
  saved = state
  with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=2)) as mngr:
    mngr.save(7, args=ocp.args.StandardSave(saved))
    mngr.wait_until_finished()
  reference = []
  for _ in range(4):
    state, loss = step(state, x, y, clean)
    reference.append((state, loss))
  return dict(directory=directory, saved=saved, reference=reference, step=step, traces=traces,
              inputs=(x, y, clean))


def restore(directory, placed_like, tx=TX):
  with ocp.CheckpointManager(directory) as mngr:
    assert mngr.latest_step() == 7
    return mngr.restore(7, args=ocp.args.StandardRestore(abstract_target(tx, placed_like)))


def test_the_saved_state_is_mid_run_and_non_trivial(run):
  metrics = jaxmp.loss_scaling_metrics(run["saved"].opt_state)
  assert int(metrics["skipped_steps"]) == 1 and bool(metrics["last_step_finite"])
  ls = run["saved"].opt_state.loss_scale
  # 2 finite steps, an overflow (1024 -> 512), 3 finite steps (grow to 1024), 1 counted.
  assert float(ls.loss_scale) == 1024.0 and int(ls.counter) == 1
  assert int(run["saved"].opt_state.inner_state[0].count) == 6  # the skipped step did not count
  assert int(run["saved"].step) == 7
  history = run["saved"].fp8["hidden"]["Fp8DotGeneral_0"]["input_amax_history"]
  assert np.count_nonzero(np.asarray(history)) == 4


def test_restore_gives_back_every_leaf_bit_for_bit_and_the_hyperparameters(run):
  restored = restore(run["directory"], run["saved"])
  assert isinstance(restored, jaxmp.linen.TrainState)
  tree_asserts.assert_trees_equal(restored, run["saved"])
  ls = restored.opt_state.loss_scale
  assert isinstance(restored.opt_state, jaxmp.LossScalingState)
  assert isinstance(ls, jaxmp.DynamicLossScale)
  assert (ls.growth_interval, ls.growth_factor, ls.backoff_factor, ls.min_scale,
          ls.max_scale) == (3, 2.0, 0.5, 0.5, 2.0**14)
  assert restored.apply_fn == run["saved"].apply_fn and restored.tx is run["saved"].tx
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(run["saved"])):
    assert a.sharding == b.sharding and a.weak_type == b.weak_type


def test_resuming_reproduces_the_uninterrupted_run_without_recompiling(run):
  step, traces = run["step"], run["traces"]
  x, y, clean = run["inputs"]
  restored = restore(run["directory"], run["saved"])
  trace_count = len(traces)
  state = restored
  with count_compilations() as compilations:
    for ref_state, ref_loss in run["reference"]:
      state, loss = step(state, x, y, clean)
      tree_asserts.assert_trees_equal(state, ref_state)
      assert np.asarray(loss).tobytes() == np.asarray(ref_loss).tobytes()
  assert compilations == [], "the restored state made the step compile again"
  assert len(traces) == trace_count == 1, "the step was traced again"


def test_a_restored_overflow_then_backs_off_from_the_restored_scale(run):
  # The restored loss scale is a live DynamicLossScale: its rule continues (and the
  # min_scale from the target, 0.5, still bounds it).
  step = run["step"]
  x, y, _ = run["inputs"]
  state = restore(run["directory"], run["saved"])
  scales = []
  for _ in range(12):
    state, _ = step(state, x, y, jax.device_put(jnp.float32(jnp.nan), jax.devices()[0]))
    scales.append(float(state.loss_scale.loss_scale))
  assert scales == [512.0, 256.0, 128.0, 64.0, 32.0, 16.0, 8.0, 4.0, 2.0, 1.0, 0.5, 0.5]
  tree_asserts.assert_trees_equal(state.params, run["saved"].params, what="params")
  tree_asserts.assert_trees_equal(state.fp8, run["saved"].fp8, what="fp8")
  assert int(jaxmp.loss_scaling_metrics(state.opt_state)["skipped_steps"]) == 13


def test_a_scale_restored_below_the_targets_min_scale_is_never_raised_by_an_overflow(run):
  # The target's optimizer floors the scale at 2048, above the saved 1024: the
  # hyperparameters are the target's, the scale the checkpoint's. Overflows keep it
  # (backing off never raises a scale); the first finite step lifts it to the floor.
  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(
      **{**LOSS_SCALE, "scale": 4096.0, "min_scale": 2048.0}))
  state = restore(run["directory"], run["saved"], tx=tx)
  assert float(state.loss_scale.loss_scale) == 1024.0 and state.loss_scale.min_scale == 2048.0
  step, _ = make_step()
  x, y, clean = run["inputs"]
  fault = jax.device_put(jnp.float32(jnp.nan), jax.devices()[0])
  scales = []
  for grad_fault in (fault, fault, clean, fault):
    state, _ = step(state, x, y, grad_fault)
    scales.append(float(state.loss_scale.loss_scale))
  assert scales == [1024.0, 1024.0, 2048.0, 2048.0]


def test_a_new_program_with_an_equal_optimizer_resumes_identically(run):
  # What a restarted job does: build the model and optimizer again (equal, not the
  # same objects), restore into their abstract state, jit the step afresh.
  tx = make_tx()
  restored = restore(run["directory"], run["saved"], tx=tx)
  assert restored.tx is tx
  ls = restored.opt_state.loss_scale
  assert (ls.growth_interval, ls.min_scale, ls.max_scale) == (3, 0.5, 2.0**14)
  step, traces = make_step()
  x, y, clean = run["inputs"]
  state = restored
  for ref_state, ref_loss in run["reference"]:
    state, loss = step(state, x, y, clean)
    tree_asserts.assert_trees_equal(jax.tree.leaves(state), jax.tree.leaves(ref_state))
    assert np.asarray(loss).tobytes() == np.asarray(ref_loss).tobytes()
  assert len(traces) == 1


def test_the_readme_recipe_on_one_device_restores_without_compiling_again(run, tmp_path):
  # docs/guides/sharding.md, "Checkpoints (Orbax)": create the state committed to its
  # device, save, and restore into the plain abstract state (no shardings needed on one
  # device). Orbax returns committed arrays; a state created uncommitted (create_state()
  # as is) would make the step compile once more for them.
  step, traces = run["step"], run["traces"]
  x, y, clean = run["inputs"]
  state, _ = step(jax.device_put(create_state(), jax.devices()[0]), x, y, clean)
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(1, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
  with ocp.CheckpointManager(tmp_path) as mngr:
    restored = mngr.restore(mngr.latest_step(),
                            args=ocp.args.StandardRestore(jax.eval_shape(create_state)))
  tree_asserts.assert_trees_equal(restored, state)
  with count_compilations() as compilations:
    step(restored, x, y, clean)
  assert compilations == [] and len(traces) == 1


# ---- NNX: the sharding guide's recipe, killed and resumed ------------------------------

SAVED_AT, RESUMED = 4, 3  # steps before the save (the second one skipped), and after


def _nnx_snapshot(model, optimizer):
  """The run's whole state as host arrays (PRNG keys as their key data)."""
  as_host = lambda a: np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(
      a.dtype, jax.dtypes.prng_key) else a)
  return jax.tree.map(as_host, nnx.state((model, optimizer)))


@pytest.fixture(scope="module")
def nnx_checkpointed(tmp_path_factory):
  """Trains SAVED_AT steps, saves with the guide's code, trains RESUMED more."""
  directory = tmp_path_factory.mktemp("nnx_ckpt")
  recipe = nnx_run.recipe()
  model, optimizer = recipe["create"]()
  nnx_run.train(model, optimizer, SAVED_AT, skip_at=1)
  recipe["save"](directory, model, optimizer)
  saved = _nnx_snapshot(model, optimizer)
  losses = [np.asarray(loss) for loss in nnx_run.train(model, optimizer, RESUMED)]
  return dict(directory=directory, saved=saved, losses=losses,
              final=_nnx_snapshot(model, optimizer))


def test_nnx_restore_gives_back_the_mid_run_state_bit_for_bit(nnx_checkpointed):
  model, optimizer = nnx_run.recipe()["restore"](nnx_checkpointed["directory"])
  tree_asserts.assert_trees_equal(_nnx_snapshot(model, optimizer), nnx_checkpointed["saved"])
  # What was saved is mid-run and non-trivial in every part.
  metrics = jaxmp.loss_scaling_metrics(optimizer.opt_state)
  assert int(metrics["skipped_steps"]) == 1 and int(optimizer.step[...]) == SAVED_AT
  ls = optimizer.opt_state.loss_scale  # 1024 -> 512 (skip) -> 1024 (grown after 2 steps)
  assert float(ls.loss_scale[...]) == 1024.0 and int(ls.counter[...]) == 0
  assert (ls.growth_interval, optimizer.tx) == (2, nnx_run.TX)  # static: from the target
  history = nnx.state(model, jaxmp.nnx.Fp8State)
  assert any(np.count_nonzero(np.asarray(x)) for x in jax.tree.leaves(history))
  params = nnx.state(model, nnx.Param)
  kernel = jaxmp.optim.master_params(optimizer.opt_state, params)["model"]["layers"][
      "linear"]["kernel"][...]
  assert kernel.dtype == jnp.float32 and model.model.layers.linear.kernel[...].dtype == jnp.bfloat16
  assert not np.array_equal(np.asarray(kernel),
                            np.asarray(kernel.astype(jnp.bfloat16), np.float32))
  fresh, _ = nnx_run.recipe()["create"]()
  for kind in (nnx.BatchStat, nnx.RngCount):
    assert any(not np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(nnx.state(model, kind)), jax.tree.leaves(nnx.state(fresh, kind))))


def test_nnx_resuming_in_fresh_objects_reproduces_the_run_without_recompiling(nnx_checkpointed):
  model, optimizer = nnx_run.recipe()["restore"](nnx_checkpointed["directory"])
  traces = len(nnx_run.TRACES)
  with count_compilations() as compilations:
    losses = nnx_run.train(model, optimizer, RESUMED)
  for loss, reference in zip(losses, nnx_checkpointed["losses"], strict=True):
    assert np.asarray(loss).tobytes() == reference.tobytes()
  tree_asserts.assert_trees_equal(_nnx_snapshot(model, optimizer), nnx_checkpointed["final"])
  assert compilations == [], "the restored state made the step compile again"
  assert len(nnx_run.TRACES) == traces == 1, "the step was traced again"


@pytest.mark.slow
def test_nnx_resuming_in_a_fresh_process_reproduces_the_run(nnx_checkpointed, tmp_path):
  # What a killed job does on restart: a new process restores and trains on.
  root = pathlib.Path(__file__).parents[1]
  result = subprocess.run(
      [sys.executable, "-m", "tests.nnx_checkpoint_run", str(nnx_checkpointed["directory"]),
       str(tmp_path), str(RESUMED)], cwd=root, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  losses = [float.fromhex(line.split()[1]) for line in result.stdout.splitlines()
            if line.startswith("loss ")]
  assert losses == [float(loss) for loss in nnx_checkpointed["losses"]]
  model, optimizer = nnx_run.recipe()["restore"](tmp_path)
  assert int(optimizer.step[...]) == SAVED_AT + RESUMED
  tree_asserts.assert_trees_equal(_nnx_snapshot(model, optimizer), nnx_checkpointed["final"])
