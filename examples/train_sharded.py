"""Sharded mixed-precision training: the demo transformer on a ("data", "fsdp") mesh.

The transformer language model of ``examples/transformer.py`` (plain linen, unchanged)
trains with a jaxmp policy (float32 params, bfloat16 compute, fp8 matmuls by rule as in
``train_lm.py``; ``--no-fp8`` for bfloat16 alone), dynamic loss scaling
(``jaxmp.loss_scaling``) and ``jaxmp.linen.TrainState``, sharded with nothing but JAX's
own sharding:

* a 2-D device mesh with axes ``("data", "fsdp")`` (``--mesh 4x2``: 4 x 2 devices);
* the batch split over both axes, so that every device reads different rows (FSDP is
  data parallel too);
* every large param, and Adam's two moments with it, split along its largest axis that
  the fsdp size divides, over ``"fsdp"`` (replicated over ``"data"``); the small
  leaves (biases, LayerNorm scales, the loss scale, counters) and the fp8 state
  replicated;
* one ``jax.jit`` with those ``in_shardings``/``out_shardings`` around the ordinary
  single-device step. The arrays are global, so every reduction in the step is over
  the global batch: XLA inserts the all-gathers of the sharded kernels, the reductions
  of their gradients, and the all-reduces that make the loss, the gradient norm, the
  loss scaling's finite check and the fp8 amaxes global. Every device takes the same
  skip-or-update decision and records the same amaxes; no ``axis_name`` is needed
  (that is for ``shard_map``, where code sees per-device arrays).

The script prints the mesh and how a few params are sharded, trains, shows that the
loss-scaling state (scale, growth counter, skipped steps) is identical on every device,
and replays the first ``--compare-steps`` steps on one device to show that sharding
changes the losses only by rounding.

Devices on a CPU:
  JAX gives a CPU a single device unless ``XLA_FLAGS`` holds
  ``--xla_force_host_platform_device_count=N``, which JAX reads once, when its CPU
  backend starts. So this script, *before importing jax*, sets
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` when ``XLA_FLAGS`` is unset
  and JAX would run on the CPU (``JAX_PLATFORMS`` unset or starting with ``cpu``, and
  no GPU/TPU plugin installed). An ``XLA_FLAGS`` you set is left as it is: set the
  flag in it yourself to choose another count. The forced devices share the CPU's
  cores, so they show the sharding, not a speed-up.

Run:
  python examples/train_sharded.py                      # 8 CPU devices: mesh 4x2, bf16 + fp8
  python examples/train_sharded.py --mesh 8x1 --no-fp8  # pure data parallel, bf16
  python examples/train_sharded.py --mesh 1x8 --steps 60

Multi-host (one process per host, each driving its own devices), what changes:
  1. Every process calls ``jax.distributed.initialize()`` first, before any other JAX
     call (on Cloud TPU, SLURM and similar clusters it finds its arguments itself;
     elsewhere pass ``coordinator_address``, ``num_processes``, ``process_id``: here
     ``--coordinator``, ``--num-processes`` and ``--process-id``).
  2. ``jax.devices()`` then lists every host's devices (``jax.local_devices()`` this
     host's), and the mesh is built over all of them: ``jax.make_mesh`` does that
     unchanged. Its axes go in increasing order of traffic, so ``"fsdp"`` (gathered in
     every layer) comes last.
  3. Each host draws only its share of the global batch (``--batch`` /
     ``jax.process_count()`` rows; here each from its own random stream) and makes the
     global array with ``jax.make_array_from_process_local_data(batch_sharding,
     local_rows)``. This script already does so, also with one process.
  4. Nothing else changes. The state is created by a jitted init straight into its
     shardings (``out_shardings``; not built whole and then split), and the step is the
     same jitted program on every host. The loss
     scale and the fp8 state stay in sync across hosts because the finite check
     (``jaxmp.all_finite`` over the gradients inside ``loss_scaling``) and the fp8
     amaxes are reductions over global arrays inside that program: XLA compiles them
     into cross-host collectives, and every host gets the same replicated result.
  5. Host-side reads see only local devices: a replicated scalar (the loss, the loss
     scale) can be read on every host; print from ``jax.process_index() == 0``.
  6. Checkpoint with Orbax, calling ``save`` and ``restore`` on every host with one
     directory they all see (a bucket, a shared file system): each host writes the
     shards its devices hold, and restores into a target of ``jax.ShapeDtypeStruct``s
     carrying the shardings (docs/guides/sharding.md;
     ``tests/distributed_checks.py``, check ``checkpoint_sharded``).
  The one-device comparison here needs the whole batch in one process, so it runs
  only when there is one process.

  Two processes on one machine, 4 CPU devices each, show it (run both commands):
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/train_sharded.py \\
        --coordinator localhost:12355 --num-processes 2 --process-id 0
    (the same with --process-id 1)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

CPU_DEVICES = 8


def _jax_would_run_on_cpu() -> bool:
  """Whether JAX would pick the CPU, decided without importing (and so starting) it."""
  requested = os.environ.get("JAX_PLATFORMS", "").strip()
  if requested:
    return requested.split(",")[0].strip().lower() == "cpu"
  # Without a request JAX prefers a GPU or TPU whose plugin is installed: a module in
  # the jax_plugins namespace or a "jax_plugins" entry point (CUDA, ROCm), or libtpu.
  return (importlib.util.find_spec("jax_plugins") is None
          and importlib.util.find_spec("libtpu") is None
          and not importlib.metadata.entry_points(group="jax_plugins"))


# JAX fixes its CPU device count when its CPU backend starts, so this must come before
# `import jax` (here and in the modules imported below). A user's own XLA_FLAGS wins.
if "XLA_FLAGS" not in os.environ and _jax_would_run_on_cpu():
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={CPU_DEVICES}"

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jaxmp
import train_lm
import transformer

CONFIG = transformer.Config(context=32, width=128, depth=2, heads=4)
BF16 = "params=float32,compute=bfloat16,output=float32"
MIN_SHARDED_SIZE = 2**12  # leaves smaller than this are replicated: not worth a gather


# ---- sharding ----------------------------------------------------------------------------


def parse_mesh(spec: str | None, devices: int) -> tuple[int, int]:
  """``"4x2"`` -> (4, 2); None -> (devices / 2, 2), or (devices, 1) for an odd count."""
  if spec is None:
    return (devices // 2, 2) if devices % 2 == 0 else (devices, 1)
  try:
    data, fsdp = (int(n) for n in spec.lower().split("x"))
  except ValueError:
    raise ValueError(f"--mesh must look like 4x2 (data x fsdp), got {spec!r}") from None
  if data < 1 or fsdp < 1 or data * fsdp > devices:
    raise ValueError(f"--mesh {spec} needs {data * fsdp} devices; JAX has {devices} "
                     f"(on a CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N)")
  return data, fsdp


def fsdp_spec(shape: tuple[int, ...], fsdp: int) -> P:
  """Splits a large array along its largest axis that ``fsdp`` divides; else replicates."""
  if fsdp == 1 or int(np.prod(shape, dtype=np.int64)) < MIN_SHARDED_SIZE:
    return P()
  for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
    if shape[axis] % fsdp == 0:
      return P(*[("fsdp" if a == axis else None) for a in range(len(shape))])
  return P()


def state_shardings(abstract_state: jaxmp.linen.TrainState,
                    mesh: jax.sharding.Mesh) -> jaxmp.linen.TrainState:
  """The sharding of every leaf of the train state (a TrainState of NamedShardings).

  The rule looks only at shapes, so Adam's moments land where their params do. The fp8
  state is replicated whatever its size: every matmul reads its scales and histories
  whole.
  """
  replicated = NamedSharding(mesh, P())
  shardings = jax.tree.map(
      lambda leaf: NamedSharding(mesh, fsdp_spec(leaf.shape, mesh.shape["fsdp"])),
      abstract_state)
  return shardings.replace(fp8=jax.tree.map(lambda _: replicated, abstract_state.fp8))


SHOWN = ("embed/embedding", "positions", "block_0/attn/query/kernel", "block_0/attn/out/kernel",
         "block_0/mlp/up/kernel", "head/kernel", "block_0/mlp/up/bias")


def describe_shardings(params) -> list[str]:
  """A few lines: some params' shapes, PartitionSpecs and what each device holds."""
  leaves = {"/".join(str(k.key) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  lines = [f"  {name:<26} {str(leaves[name].shape):<13} {str(leaves[name].sharding.spec):<22} "
           f"per device {leaves[name].addressable_shards[0].data.shape}"
           for name in SHOWN if name in leaves]
  sharded = sum(not leaf.sharding.is_fully_replicated for leaf in leaves.values())
  lines.append(f"  ... {sharded} of {len(leaves)} param arrays split over 'fsdp', the others "
               "replicated")
  return lines


def bytes_on_first_device(tree) -> int:
  first = jax.local_devices()[0]
  return sum(s.data.nbytes for leaf in jax.tree.leaves(tree)
             for s in leaf.addressable_shards if s.device == first)


# ---- the model, the step -----------------------------------------------------------------


def make_model(fp8: bool):
  rules = train_lm.fp8_rules() if fp8 else jaxmp.PolicyRules(BF16)
  return jaxmp.linen.mixed_precision(transformer.TransformerLM(CONFIG), rules)


def make_tx(steps: int, lr: float) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 10, 1), steps, lr / 10)
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
  # bfloat16 has float32's range and does not need a loss scale; a dynamic one is used
  # here anyway to show that its state (and its growth every 10 steps) stays replicated.
  return jaxmp.loss_scaling(inner, jaxmp.DynamicLossScale(2.0**12, growth_interval=10))


def train_step(state: jaxmp.linen.TrainState, tokens: jax.Array):
  """The ordinary one-device step; sharding comes from the jit around it."""
  loss_fn = lambda variables: train_lm.loss_fn(state.apply_fn, variables, tokens)
  loss, grads = state.value_and_grad(loss_fn)()
  return state.apply_gradients(grads), loss


def batches(corpus: np.ndarray, rows: int, seed: int):
  """Random windows of ``context + 1`` token ids, ``rows`` at a time (host numpy)."""
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(corpus) - CONFIG.context - 1, size=rows)
    yield corpus[starts[:, None] + np.arange(CONFIG.context + 1)].astype(np.int32)


# ---- checks ------------------------------------------------------------------------------


def replicated_values(leaf: jax.Array) -> list:
  """What each of this host's devices holds for a replicated scalar, read from its buffer."""
  assert leaf.sharding.is_fully_replicated, f"not replicated: {leaf.sharding}"
  return [np.asarray(shard.data).item() for shard in leaf.addressable_shards]


def single_device_losses(state, tokens: list[np.ndarray]) -> list[float]:
  """The same steps from the same state, unsharded, on one device."""
  step = jax.jit(train_step)
  state = jax.device_put(state, jax.devices()[0])
  losses = []
  for batch in tokens:
    state, loss = step(state, batch)
    losses.append(float(loss))
  return losses


# ---- main --------------------------------------------------------------------------------


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--batch", type=int, default=16, help="global batch (rows)")
  parser.add_argument("--mesh", help="DATAxFSDP, e.g. 4x2 (default: (devices/2)x2)")
  parser.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True,
                      help="fp8 matmuls by rule (default) or bfloat16 only")
  parser.add_argument("--compare-steps", type=int, default=4,
                      help="steps replayed on one device (0: none)")
  parser.add_argument("--lr", type=float, default=2e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--coordinator", help="multi-process: host:port of process 0")
  parser.add_argument("--num-processes", type=int)
  parser.add_argument("--process-id", type=int)
  args = parser.parse_args(argv)

  if args.coordinator:
    # First, before anything else touches JAX: afterwards jax.devices() spans all
    # processes.
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  lead = jax.process_index() == 0
  say = print if lead else (lambda *a, **k: None)

  data, fsdp = parse_mesh(args.mesh, jax.device_count())
  mesh = jax.make_mesh((data, fsdp), ("data", "fsdp"),
                       axis_types=(AxisType.Auto, AxisType.Auto))
  # Auto axes: XLA gathers the sharded kernels where a matmul needs them whole (with
  # Explicit axes the model itself would have to reshard them).
  if args.batch % (data * fsdp):
    raise ValueError(f"--batch {args.batch} must be a multiple of the {data * fsdp} devices")
  batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
  replicated = NamedSharding(mesh, P())
  say(f"{jax.process_count()} process(es), {jax.device_count()} {jax.devices()[0].platform} "
      f"devices; mesh {dict(mesh.shape)}:\n{mesh.devices}")

  model = make_model(args.fp8)
  tx = make_tx(args.steps, args.lr)
  sample = jnp.zeros((args.batch, CONFIG.context), jnp.int32)

  def create_state():
    variables = model.init(jax.random.key(args.seed), sample)
    return jaxmp.linen.TrainState.create(apply_fn=model.apply, variables=variables, tx=tx)

  # Shapes first (nothing computed), then the init itself jitted straight into the
  # shardings, rather than built whole on one device and split: with several hosts, or
  # a model too large for one device, that is the only way.
  shardings = state_shardings(jax.eval_shape(create_state), mesh)
  state = jax.jit(create_state, out_shardings=shardings)()
  say(f"policy: {'bfloat16 + fp8 by rule' if args.fp8 else 'bfloat16'}; params:")
  for line in describe_shardings(state.params):
    say(line)
  total = sum(leaf.nbytes for leaf in jax.tree.leaves((state.params, state.opt_state)))
  say(f"  params + optimizer state: {total / 2**20:.2f} MiB in all, "
      f"{bytes_on_first_device((state.params, state.opt_state)) / 2**20:.2f} MiB on device 0")

  step = jax.jit(train_step, in_shardings=(shardings, batch_sharding),
                 out_shardings=(shardings, replicated), donate_argnums=0)
  comparing = args.compare_steps > 0 and jax.process_count() == 1
  initial = jax.device_get(state) if comparing else None  # before it is donated

  corpus = train_lm.load_corpus(max_bytes=2_000_000)
  local_rows = args.batch // jax.process_count()
  stream = batches(corpus, local_rows, seed=args.seed + 1000 * jax.process_index())
  losses, replayed = [], []
  start = time.perf_counter()
  for i in range(args.steps):
    rows = next(stream)
    if i < args.compare_steps:
      replayed.append(rows)
    tokens = jax.make_array_from_process_local_data(batch_sharding, rows)
    state, loss = step(state, tokens)
    losses.append(float(loss))
    if i % 10 == 0 or i == args.steps - 1:
      metrics = jaxmp.loss_scaling_metrics(state.opt_state)
      say(f"step {i:>4}  loss {losses[-1]:.4f}  loss scale {float(metrics['loss_scale']):g}  "
          f"skipped {int(metrics['skipped_steps'])}")
  seconds = time.perf_counter() - start

  say(f"{args.steps} steps in {seconds:.1f} s; loss {np.mean(losses[:5]):.4f} (mean of the "
      f"first 5) -> {np.mean(losses[-5:]):.4f} (last 5)")
  # Read from each device's own buffer: copies that had drifted apart would not show
  # through float(...), which reads one of them. With several processes each checks
  # its own devices (and prints, so that every host's line shows).
  where = f"[process {jax.process_index()}] " if jax.process_count() > 1 else ""
  ls_state = state.opt_state  # the LossScalingState
  on_devices = {
      "loss scale": replicated_values(ls_state.loss_scale.loss_scale),
      "growth counter": replicated_values(ls_state.loss_scale.counter),
      "skipped steps": replicated_values(ls_state.skipped_steps),
  }
  identical = all(len(set(values)) == 1 for values in on_devices.values())
  for name, values in on_devices.items():
    print(f"{where}{name} on each of the {len(values)} devices: {values}")
  print(f"{where}loss-scaling state identical on every device: {identical}")
  fp8_identical = all(
      leaf.sharding.is_fully_replicated
      and len({np.asarray(s.data).tobytes() for s in leaf.addressable_shards}) == 1
      for leaf in jax.tree.leaves(state.fp8))
  if args.fp8:
    print(f"{where}fp8 state replicated and identical on every device: {fp8_identical}")

  result = dict(losses=losses, loss_scale=on_devices["loss scale"][0],
                skipped=on_devices["skipped steps"][0], scale_identical=identical,
                fp8_identical=fp8_identical, mesh=(data, fsdp), seconds=seconds)
  if comparing:
    reference = single_device_losses(initial, replayed)
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    show = lambda values: " ".join(f"{x:.6f}" for x in values)
    say(f"first {len(reference)} losses, sharded:    {show(losses[:len(reference)])}")
    say(f"first {len(reference)} losses, one device: {show(reference)}")
    say(f"max |sharded - one device| loss difference: {diff:.2e} "
        f"({diff / reference[-1]:.1e} relative)")
    result["single_device_diff"] = diff
  return result


if __name__ == "__main__":
  main()
