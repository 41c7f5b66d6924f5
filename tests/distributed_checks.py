"""Eight-device checks of sharded mixed-precision training (run by test_distributed.py).

JAX fixes its device count when it starts, so these checks run in a fresh process
started with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/distributed_checks.py [NAME ...]

Each check prints one line, ``PASS <name>: <measurements>`` or ``FAIL <name>: <which
assertion failed>``; the exit status is 1 if any failed. One process runs them all so
that JAX starts once.

Every check trains the same small MLP (policy, dynamic loss scaling, fp8 by rule on
``nn.Dense``) on a global batch of 64 rows, 8 per device, and compares with the same
program run on one device:

* ``data_parallel_jit``: ``jax.jit`` with ``NamedSharding`` (batch sharded, state
  replicated). XLA's own collectives make the gradient sum, the finite check and the
  fp8 amax global.
* ``data_parallel_overflow_and_amax``: one shard's data poisoned makes every device
  skip; one shard's large value is the amax every device records.
* ``fsdp_jit``: params and Adam moments sharded over the same axis, in float32 and
  with bfloat16 compute (both with fp8).
* ``checkpoint_sharded``: the FSDP state saved with Orbax mid-run, restored into its
  shardings (and onto one device), resumes bit for bit without recompiling.
* ``shard_map_explicit``: a per-device step, gradients psum-ed, fp8 state cotangents
  max-reduced with ``jaxmp.fp8.state.all_reduce``, ``loss_scaling(axis_name=...)``.
* ``shard_map_invariant``: the same step with the replicated state used directly:
  JAX sums the params' gradients and fp8_dot_general max-reduces the fp8 state.
* ``shard_map_device_local_fault``: a fault on one device after the gradient
  reduction: with ``axis_name`` every device skips, without it the replicas diverge.
"""

from __future__ import annotations

import functools
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxmp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tests import eight_devices  # pylint: disable=g-import-not-at-top
from tests import tree_asserts  # pylint: disable=g-import-not-at-top

AXIS = "data"
DEVICES = eight_devices.DEVICES
BATCH, FEATURES, HIDDEN, OUT = 64, 16, 64, 8
STEPS = 5
LR = 1e-2
F32 = "float32"
BF16 = "params=float32,compute=bfloat16,output=float32"


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(HIDDEN, name="hidden")(x))
    return nn.Dense(OUT, name="out")(x)


@functools.lru_cache(maxsize=None)
def make_model(policy: str, fp8: bool):
  rules = [jaxmp.Rule(nn.Dense, fp8=jaxmp.fp8.DelayedScaling(amax_history_length=4))] if fp8 else []
  return jaxmp.linen.mixed_precision(MLP(), jaxmp.PolicyRules(policy, rules))


@functools.lru_cache(maxsize=None)
def data():
  x = jax.random.normal(jax.random.key(1), (BATCH, FEATURES))
  y = jnp.tanh(x @ jax.random.normal(jax.random.key(2), (FEATURES, OUT)))
  return np.asarray(x), np.asarray(y)


@functools.lru_cache(maxsize=None)
def make_tx(axis_name=None):
  # One object per configuration: the optimizer is static data of the TrainState, so
  # states built from the same object (a restore target, say) share the step's cache.
  return jaxmp.loss_scaling(optax.adam(LR), jaxmp.DynamicLossScale(2.0**12, growth_interval=3),
                            axis_name=axis_name)


def make_state(policy: str, fp8: bool, axis_name=None) -> jaxmp.linen.TrainState:
  model = make_model(policy, fp8)
  x, _ = data()
  return jaxmp.linen.TrainState.create(
      apply_fn=model.apply, variables=model.init(jax.random.key(0), x), tx=make_tx(axis_name))


def train_step(state, x, y):
  loss_fn = lambda variables: jnp.mean((state.apply_fn(variables, x) - y) ** 2)
  loss, grads = state.value_and_grad(loss_fn)()
  return state.apply_gradients(grads), loss


def run(step, state, x, y, steps=STEPS):
  losses, scales = [], []
  for _ in range(steps):
    state, loss = step(state, x, y)
    losses.append(float(loss))
    scales.append(float(state.loss_scale.loss_scale))
  return state, losses, scales


@functools.lru_cache(maxsize=None)
def single_device_run(policy: str, fp8: bool):
  """The reference: the same program, unsharded, on one device."""
  x, y = data()
  return run(jax.jit(train_step), make_state(policy, fp8), x, y)


# --------------------------------------------------------------------------------------
# Comparisons.


def max_abs_diff(a, b) -> float:
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b), "different numbers of leaves"
  return max((float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64))))
              for u, v in zip(leaves_a, leaves_b)), default=0.0)


def max_rel_diff(a, b) -> float:
  """The largest difference of two trees' leaves, relative to each leaf's largest value."""
  return max((float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64)))
                    / max(float(np.max(np.abs(np.asarray(v, np.float64)))), 1e-30))
              for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))), default=0.0)


def per_device(a: jax.Array) -> list[np.ndarray]:
  """What each device actually holds for ``a``, read from its own buffer."""
  return [np.asarray(shard.data) for shard in a.addressable_shards]


def assert_replicated_and_equal(tree, what: str) -> None:
  """Every leaf is fully replicated, and all 8 devices' buffers are bit-identical."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = what + jax.tree_util.keystr(path)
    assert leaf.sharding.is_fully_replicated, f"{name} is not replicated: {leaf.sharding}"
    buffers = per_device(leaf)
    assert len(buffers) == DEVICES, f"{name}: {len(buffers)} device buffers, expected {DEVICES}"
    for i, buf in enumerate(buffers[1:], 1):
      assert np.array_equal(buf, buffers[0], equal_nan=True), (
          f"{name}: device {i} holds {buf}, device 0 holds {buffers[0]}")


def compare_with_single_device(name, state, losses, scales, policy, fp8, *, params_atol,
                               fp8_rtol, loss_rtol) -> str:
  ref_state, ref_losses, ref_scales = single_device_run(policy, fp8)
  assert scales == ref_scales, f"{name}: loss-scale trajectory {scales} != single device {ref_scales}"
  assert int(state.opt_state.skipped_steps) == int(ref_state.opt_state.skipped_steps) == 0, (
      f"{name}: skipped steps differ or are not zero")
  d_params = max_abs_diff(state.params, ref_state.params)
  d_fp8 = max_rel_diff(state.fp8, ref_state.fp8)
  d_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
  assert d_params <= params_atol, f"{name}: params differ by {d_params:.3g} > {params_atol:.3g}"
  assert d_fp8 <= fp8_rtol, f"{name}: fp8 state differs by {d_fp8:.3g} (rel) > {fp8_rtol:.3g}"
  assert d_loss <= loss_rtol, f"{name}: losses differ by {d_loss:.3g} (rel) > {loss_rtol:.3g}"
  return f"params {d_params:.2g} (abs), fp8 state {d_fp8:.2g} (rel), losses {d_loss:.2g} (rel)"


def fp8_history(state, layer="hidden", tensor="input"):
  return state.fp8[layer]["Fp8DotGeneral_0"][f"{tensor}_amax_history"]


# Tolerances. In float32 the sharded program differs from the single-device one only in
# the order of float32 sums (the gradient reduction over the batch): a few ulps, here
# after STEPS Adam steps. With bfloat16 compute and fp8 matmuls that ulp-sized
# difference can flip the rounding of one bfloat16 value or one fp8 value (E4M3 keeps 3
# mantissa bits, E5M2 two: a flip moves a value by 6-25%), and Adam turns a gradient
# element that changed sign into an update of the opposite sign (each Adam step moves an
# element by at most about LR): params then agree within 2 * LR per step, the recorded
# amaxes (fp8 state) within one E5M2 step (25%) of the largest, losses within 1%.
TIGHT = dict(params_atol=1e-6, fp8_rtol=1e-6, loss_rtol=1e-6)
LOOSE = dict(params_atol=2 * LR * STEPS, fp8_rtol=0.25, loss_rtol=1e-2)


# --------------------------------------------------------------------------------------
# Sharded jit.


def check_data_parallel_jit() -> str:
  mesh = jax.make_mesh((DEVICES,), (AXIS,))  # Explicit axes: sharding in types
  replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
  x, y = data()
  xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
  report = []
  for policy, fp8, tol in [(F32, False, TIGHT), (F32, True, TIGHT), (BF16, True, LOOSE)]:
    name = f"{policy.split(',')[-2] if ',' in policy else policy}{'+fp8' if fp8 else ''}"
    state = make_state(policy, fp8)
    shardings = jax.tree.map(lambda _: replicated, state)
    step = jax.jit(train_step, in_shardings=(shardings, batch, batch),
                   out_shardings=(shardings, replicated))
    state, losses, scales = run(step, jax.device_put(state, replicated), xs, ys)
    report.append(f"[{name}] " + compare_with_single_device(name, state, losses, scales, policy,
                                                              fp8, **tol))
    # The whole state, loss scale and counter included, is one replicated array per
    # leaf, and each device's own buffer holds the same bits.
    assert_replicated_and_equal(state.opt_state.loss_scale, f"{name} loss scale")
    assert_replicated_and_equal(state.params, f"{name} params")
    assert_replicated_and_equal(state.fp8, f"{name} fp8")
    if fp8:
      hlo = step.lower(state, xs, ys).compile().as_text()
      assert "all-reduce" in hlo, f"{name}: no all-reduce in the compiled sharded step"
  return "; ".join(report)


def check_data_parallel_overflow_and_amax() -> str:
  mesh = jax.make_mesh((DEVICES,), (AXIS,))
  replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
  x, y = data()
  state = make_state(F32, True)
  shardings = jax.tree.map(lambda _: replicated, state)
  step = jax.jit(train_step, in_shardings=(shardings, batch, batch),
                 out_shardings=(shardings, replicated))
  state, _ = step(jax.device_put(state, replicated), jax.device_put(x, batch),
                  jax.device_put(y, batch))

  # One shard's data: rows 40-47 live on one device only.
  poisoned = x.copy()
  poisoned[5 * 8 + 3, 7] = np.inf
  xp = jax.device_put(poisoned, batch)
  holders = [s.device.id for s in xp.addressable_shards if not np.all(np.isfinite(s.data))]
  assert len(holders) == 1, f"the inf should live on one device, found on {holders}"
  before = state
  after, loss = step(before, xp, jax.device_put(y, batch))
  assert not np.isfinite(float(loss)), "the poisoned batch's loss should not be finite"
  finite_per_device = [bool(b) for b in per_device(after.opt_state.last_step_finite)]
  assert finite_per_device == [False] * DEVICES, (
      f"one shard's overflow: last_step_finite per device {finite_per_device}, expected all False")
  assert [int(s) for s in per_device(after.opt_state.skipped_steps)] == [1] * DEVICES
  scales = [float(s) for s in per_device(after.opt_state.loss_scale.loss_scale)]
  assert scales == [2.0**11] * DEVICES, f"loss scale per device {scales}, expected 2048 on all"
  tree_asserts.assert_trees_equal(after.params, before.params, what="params")
  tree_asserts.assert_trees_equal(after.opt_state.inner_state, before.opt_state.inner_state,
                                  what="inner opt state")
  tree_asserts.assert_trees_equal(after.fp8, before.fp8, what="fp8 state")

  # One shard's large value is the amax every device records, as on one device.
  big = x.copy()
  big[3 * 8 + 2, 4] = 40.0
  xb = jax.device_put(big, batch)
  holder = [s.device.id for s in xb.addressable_shards if np.max(np.abs(s.data)) == 40.0]
  after, _ = step(before, xb, jax.device_put(y, batch))
  recorded = [float(h[0]) for h in per_device(fp8_history(after))]
  assert recorded == [40.0] * DEVICES, f"input amax per device {recorded}, expected 40 (global max)"
  single, _ = jax.jit(train_step)(jax.device_get(before), big, y)
  assert float(fp8_history(single)[0]) == 40.0
  grad_amax = per_device(fp8_history(after, "out", "output_grad"))
  assert_replicated_and_equal(after.fp8, "fp8 after the large value")
  d = abs(float(grad_amax[0][0]) - float(fp8_history(single, "out", "output_grad")[0]))
  assert d <= 1e-6 * float(grad_amax[0][0]), f"output-grad amax differs from one device by {d}"
  return (f"inf on device {holders[0]} only: all {DEVICES} devices skipped, scale 4096->2048 "
          f"on each, params/opt/fp8 bit-identical; 40.0 on device {holder[0]} only: all "
          f"devices record input amax 40.0")


def _fsdp_setup(policy: str = F32, fp8: bool = True):
  # Auto axes: XLA all-gathers the sharded kernels where the matmul needs them. (With
  # Explicit axes an FSDP model must reshard its kernels itself; plain nn.Dense fails
  # there with or without jaxmp.)
  mesh = jax.make_mesh((DEVICES,), (AXIS,), axis_types=(AxisType.Auto,))
  replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))

  def sharding(path, leaf):
    # Params and Adam's moments split on their last dimension; fp8 state, counters and
    # the loss scale replicated.
    if ".fp8" in jax.tree_util.keystr(path) or leaf.ndim == 0 or leaf.shape[-1] % DEVICES:
      return replicated
    return NamedSharding(mesh, P(*([None] * (leaf.ndim - 1)), AXIS))

  state = make_state(policy, fp8)
  shardings = jax.tree_util.tree_map_with_path(sharding, state)
  step = jax.jit(train_step, in_shardings=(shardings, batch, batch),
                 out_shardings=(shardings, replicated))
  return mesh, batch, shardings, step, jax.device_put(state, shardings)


def check_fsdp_jit() -> str:
  x, y = data()
  report = []
  # With bfloat16 compute XLA may cast each shard of a kernel before gathering it or the
  # gathered kernel after (the same values: the cast is elementwise). What differs from
  # one device is, as in data parallel, only the order of float32 sums (over the batch,
  # and over the sharded dimension in the backward matmuls), so the tolerances are the
  # data-parallel case's.
  for policy, fp8, tol in [(F32, True, TIGHT), (BF16, True, LOOSE)]:
    name = f"fsdp {'bf16' if policy == BF16 else 'f32'}+fp8"
    mesh, batch, shardings, step, state = _fsdp_setup(policy, fp8)
    xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
    state, losses, scales = run(step, state, xs, ys)
    report.append(f"[{name}] " + compare_with_single_device(name, state, losses, scales, policy,
                                                              fp8, **tol))
    kernel = state.params["hidden"]["kernel"]
    assert kernel.dtype == jnp.float32, f"{name}: hidden kernel stored as {kernel.dtype}"
    assert kernel.sharding.spec == P(None, AXIS), f"{name}: kernel sharding {kernel.sharding}"
    shapes = {s.data.shape for s in kernel.addressable_shards}
    assert shapes == {(FEATURES, HIDDEN // DEVICES)}, f"{name}: per-device kernel shapes {shapes}"
    mu = state.opt_state.inner_state[0].mu["hidden"]["kernel"]
    assert mu.sharding.spec == P(None, AXIS), f"{name}: Adam mu sharding {mu.sharding}"
    assert_replicated_and_equal(state.opt_state.loss_scale, f"{name} loss scale")
    assert_replicated_and_equal(state.fp8, f"{name} fp8")

    poisoned = x.copy()
    poisoned[6 * 8, 0] = np.nan
    after, _ = step(state, jax.device_put(poisoned, batch), ys)
    finite = [bool(b) for b in per_device(after.opt_state.last_step_finite)]
    assert finite == [False] * DEVICES, f"{name}: last_step_finite per device {finite}"
    tree_asserts.assert_trees_equal(after.params, state.params, what=f"{name} params")
    tree_asserts.assert_trees_equal(after.opt_state.inner_state, state.opt_state.inner_state,
                                    what=f"{name} opt state")
    tree_asserts.assert_trees_equal(after.fp8, state.fp8, what=f"{name} fp8 state")
  return "; ".join(report) + (f"; kernels {FEATURES}x{HIDDEN // DEVICES} per device; "
                              "one NaN shard: all skip")


def check_checkpoint_sharded() -> str:
  import tempfile  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  mesh, batch, shardings, step, state = _fsdp_setup()
  x, y = data()
  xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
  poisoned = jax.device_put(np.where(np.arange(BATCH)[:, None] == 9, np.inf, x), batch)
  for xb in (xs, poisoned, xs):  # mid-run: one step skipped
    state, _ = step(state, xb, ys)
  saved = state
  reference, _, _ = run(step, state, xs, ys, steps=3)
  with tempfile.TemporaryDirectory() as directory:
    with ocp.CheckpointManager(directory) as mngr:
      mngr.save(3, args=ocp.args.StandardSave(saved))
      mngr.wait_until_finished()
    # Each leaf restored straight into its sharding: each device reads its own slice.
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          jax.eval_shape(lambda: make_state(F32, True)), shardings)
    with ocp.CheckpointManager(directory) as mngr:
      restored = mngr.restore(3, args=ocp.args.StandardRestore(target))
      # The same checkpoint read back onto one device (resharded by Orbax).
      one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      single = mngr.restore(3, args=ocp.args.StandardRestore(jax.tree.map(
          lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
          jax.eval_shape(lambda: make_state(F32, True)))))
  tree_asserts.assert_trees_equal(restored, saved, what="restored")
  tree_asserts.assert_trees_equal(single, saved, what="restored on one device")
  kernel = restored.params["hidden"]["kernel"]
  assert kernel.sharding.spec == P(None, AXIS), f"restored kernel sharding {kernel.sharding}"
  assert int(restored.opt_state.skipped_steps) == 1
  assert restored.opt_state.loss_scale.growth_interval == 3
  compilations = []
  listener = lambda name, *_, **__: compilations.append(name) if (
      name == "/jax/core/compile/backend_compile_duration") else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    resumed, _, _ = run(step, restored, xs, ys, steps=3)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  tree_asserts.assert_trees_equal(resumed, reference, what="resumed run")
  assert not compilations, "the restored state made the step compile again"
  return ("FSDP state saved mid-run (1 step skipped), restored sharded and on one device "
          "bit for bit; 3 more steps identical to the uninterrupted run, no new compilation")


# --------------------------------------------------------------------------------------
# shard_map.


def pvary(tree):
  """Marks a replicated tree as per-device, so its gradients stay per device."""
  if hasattr(jax.lax, "pcast"):
    return jax.tree.map(lambda a: jax.lax.pcast(a, (AXIS,), to="varying"), tree)
  return jax.tree.map(lambda a: jax.lax.pvary(a, (AXIS,)), tree)  # jax < 0.9


def local_loss(state, x, y):
  # This device's share of the global mean: the sum over devices is the global loss,
  # and each example's output gradient is what it is on one device.
  n = jax.lax.axis_size(AXIS)
  return lambda variables: jnp.mean((state.apply_fn(variables, x) - y) ** 2) / n


def shard_map_step(state, x, y):
  """Per-device gradients, then psum (params) and max (fp8 state) over the devices."""
  loss, grads = jaxmp.linen.value_and_grad(local_loss(state, x, y))(
      pvary(state.variables), loss_scale=state.loss_scale)
  grads = jaxmp.linen.Gradients(jax.lax.psum(grads.params, AXIS),
                                jaxmp.fp8.state.all_reduce(grads.fp8, AXIS))
  return state.apply_gradients(grads), jax.lax.psum(loss, AXIS)


def invariant_step(state, x, y):
  """The replicated state used as is: JAX sums its gradients over the devices."""
  loss, grads = state.value_and_grad(local_loss(state, x, y))()
  return state.apply_gradients(grads), jax.lax.psum(loss, AXIS)


def _shard_map_run(step_fn, name):
  mesh = jax.make_mesh((DEVICES,), (AXIS,))
  batch = NamedSharding(mesh, P(AXIS))
  x, y = data()
  xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
  step = jax.jit(jax.shard_map(step_fn, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)),
                               out_specs=(P(), P())))
  state = jax.device_put(make_state(F32, True, axis_name=AXIS), NamedSharding(mesh, P()))
  state, losses, scales = run(step, state, xs, ys)
  report = compare_with_single_device(name, state, losses, scales, F32, True, **TIGHT)
  assert_replicated_and_equal(state.opt_state.loss_scale, f"{name} loss scale")
  assert_replicated_and_equal(state.fp8, f"{name} fp8")
  assert_replicated_and_equal(state.params, f"{name} params")

  # The amax of one device's large value is what every device records.
  big = x.copy()
  big[3 * 8 + 2, 4] = 40.0
  after, _ = step(state, jax.device_put(big, batch), ys)
  recorded = [float(h[0]) for h in per_device(fp8_history(after))]
  assert recorded == [40.0] * DEVICES, f"{name}: input amax per device {recorded}, expected 40"

  # One device's activation overflow: every device skips.
  poisoned = x.copy()
  poisoned[5 * 8 + 1, 2] = np.inf
  skipped, _ = step(state, jax.device_put(poisoned, batch), ys)
  finite = [bool(b) for b in per_device(skipped.opt_state.last_step_finite)]
  assert finite == [False] * DEVICES, f"{name}: last_step_finite per device {finite}"
  scale = [float(s) for s in per_device(skipped.opt_state.loss_scale.loss_scale)]
  assert len(set(scale)) == 1 and scale[0] == float(state.loss_scale.loss_scale) / 2, (
      f"{name}: loss scale per device after the overflow {scale}")
  tree_asserts.assert_trees_equal(skipped.params, state.params, what=f"{name} params")
  tree_asserts.assert_trees_equal(skipped.fp8, state.fp8, what=f"{name} fp8 state")
  tree_asserts.assert_trees_equal(skipped.opt_state.inner_state, state.opt_state.inner_state,
                                  what=f"{name} opt state")
  return report + "; global amax 40.0 on every device; one device's inf: all skip"


def check_shard_map_explicit() -> str:
  return _shard_map_run(shard_map_step, "shard_map")


def check_shard_map_invariant() -> str:
  return _shard_map_run(invariant_step, "shard_map invariant")


def check_shard_map_device_local_fault() -> str:
  mesh = jax.make_mesh((DEVICES,), (AXIS,))
  batch = NamedSharding(mesh, P(AXIS))
  x, y = data()

  def faulty_step(state, x, y, fault):
    # A fault on one device after the gradients were reduced (a device-local
    # overflow while unscaling, a bad reduction): only that device sees it.
    loss, grads = jaxmp.linen.value_and_grad(local_loss(state, x, y))(
        pvary(state.variables), loss_scale=state.loss_scale)
    params = jax.tree.map(lambda g: g + fault[0], jax.lax.psum(grads.params, AXIS))
    grads = jaxmp.linen.Gradients(params, jaxmp.fp8.state.all_reduce(grads.fp8, AXIS))
    new = state.apply_gradients(grads)
    moved = jnp.any(jnp.stack([jnp.any(a != b) for a, b in zip(
        jax.tree.leaves(new.params), jax.tree.leaves(state.params))]))
    return (new.opt_state.last_step_finite[None], new.opt_state.loss_scale.loss_scale[None],
            moved[None])

  fault = np.zeros((DEVICES,), np.float32)
  fault[5] = np.inf
  outcome = {}
  for axis_name in (AXIS, None):
    state = jax.device_put(make_state(F32, True, axis_name=axis_name), NamedSharding(mesh, P()))
    step = jax.jit(jax.shard_map(faulty_step, mesh=mesh,
                                 in_specs=(P(), P(AXIS), P(AXIS), P(AXIS)),
                                 out_specs=P(AXIS)))
    finite, scale, moved = step(state, jax.device_put(x, batch), jax.device_put(y, batch),
                                jax.device_put(fault, batch))
    outcome[axis_name] = (np.asarray(finite).tolist(), np.asarray(scale).tolist(),
                          np.asarray(moved).tolist())
  finite, scale, moved = outcome[AXIS]
  assert finite == [False] * DEVICES, f"axis_name='data': last_step_finite per device {finite}"
  assert scale == [2.0**11] * DEVICES, f"axis_name='data': loss scale per device {scale}"
  assert moved == [False] * DEVICES, f"axis_name='data': params moved on devices {moved}"
  finite, scale, moved = outcome[None]
  expected = [i != 5 for i in range(DEVICES)]
  assert finite == expected, f"axis_name=None: last_step_finite per device {finite}"
  assert moved == expected, f"axis_name=None: params moved per device {moved}"
  return ("fault on device 5 only: with axis_name every device skipped (scale 2048 on all); "
          "without it only device 5 skipped and the replicas diverged")


CHECKS = {
    "data_parallel_jit": check_data_parallel_jit,
    "data_parallel_overflow_and_amax": check_data_parallel_overflow_and_amax,
    "fsdp_jit": check_fsdp_jit,
    "checkpoint_sharded": check_checkpoint_sharded,
    "shard_map_explicit": check_shard_map_explicit,
    "shard_map_invariant": check_shard_map_invariant,
    "shard_map_device_local_fault": check_shard_map_device_local_fault,
}


if __name__ == "__main__":
  sys.exit(eight_devices.main(CHECKS, sys.argv[1:]))
