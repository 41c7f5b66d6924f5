"""Training the demo transformer with less memory per parameter: jaxmp.optim.

The model, data, schedule and seed of ``examples/train_lm.py``, trained with the
params and AdamW's state stored in different ways:

  float32                   reference: float32 params, compute and Adam (16 bytes/param
                            with gradients; 12 without)
  (a) mixed                 today's jaxmp: float32 params and Adam, bfloat16 compute
  (b) master + bf16 Adam    bfloat16 params, exact float32 master, bfloat16 moments
  (b) remainders            the same master as a bfloat16 param + 16-bit remainder
  (c) pure bf16, nearest    bfloat16 params and moments, round-to-nearest writes
  (d) pure bf16, stochastic bfloat16 params and moments, stochastic rounding
  (e) pure bf16, Kahan      bfloat16 params and moments, Kahan-compensated writes
  (a) / (b) with 8-bit Adam the moments stored as 8-bit codes plus a float32 scale per
                            256 values (jaxmp.optim.quantized_moments): float32 params
                            (no master), or the master as a full copy or remainder

and prints validation loss against float32, bytes per parameter of params, master,
optimizer state and gradients (``jaxmp.tools.memory_report``), the compiled step's
peak memory, and for the pure-bfloat16 runs the share of the last step's updates
that round-to-nearest would have lost (``bf16(p + u) == p`` although ``u != 0``).

Every run wraps its optimizer in ``jaxmp.loss_scaling(..., NoOpLossScale())``
(outermost, except stochastic rounding, which wraps the loss scaling), so a non-finite
step would be skipped, masters and all.

Run: ``python examples/train_memory.py`` (the demo's 600 steps at learning rate
2e-3), ``--lr 2e-4`` for updates that round-to-nearest loses, ``--runs`` to pick,
``--preset smoke`` for the demo's tiny test model.
``benchmarks/bench_memory.py`` runs both learning rates side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jaxmp  # pylint: disable=g-import-not-at-top
import train_lm  # pylint: disable=g-import-not-at-top

MIXED = "params=float32,compute=bfloat16,output=float32"
BF16 = "params=bfloat16,compute=bfloat16,output=float32"
SEED = 0
NEAREST = "(c) pure bf16, nearest"


def bf16_adamw(schedule) -> optax.GradientTransformation:
  """The demo's clipped AdamW with its moments stored in bfloat16 (math in float32)."""
  return jaxmp.optim.state_dtypes(train_lm.adamw(schedule), "bfloat16")


def master(schedule) -> optax.GradientTransformation:
  return jaxmp.optim.master_weights(bf16_adamw(schedule))


def master_remainders(schedule) -> optax.GradientTransformation:
  return jaxmp.optim.master_weights(bf16_adamw(schedule), remainders=True)


def adamw_8bit(schedule) -> optax.GradientTransformation:
  """The demo's clipped AdamW with its moments stored in 8 bits (math in float32)."""
  return jaxmp.optim.quantized_moments(train_lm.adamw(schedule))


def master_8bit(schedule) -> optax.GradientTransformation:
  return jaxmp.optim.master_weights(adamw_8bit(schedule))


def master_remainders_8bit(schedule) -> optax.GradientTransformation:
  return jaxmp.optim.master_weights(adamw_8bit(schedule), remainders=True)


def stochastic(schedule) -> optax.GradientTransformation:
  # Outside loss scaling, unlike the others: inside it, the random bits make XLA keep the
  # skip as a conditional with float32 update buffers (docs/guides/memory.md,
  # "Loss scaling outermost"). A skipped step's zero updates round to the params exactly.
  return jaxmp.optim.stochastic_rounding(
      jaxmp.loss_scaling(bf16_adamw(schedule), jaxmp.NoOpLossScale()), jax.random.key(SEED))


def kahan(schedule) -> optax.GradientTransformation:
  return jaxmp.optim.kahan_summation(bf16_adamw(schedule))


def _run(name: str, policy: str, optimizer=train_lm.adamw, loss_scale=jaxmp.NoOpLossScale):
  return train_lm.Run(name, policy, loss_scale, optimizer=optimizer)


RUNS = (
    _run("float32", "float32", loss_scale=None),
    _run("(a) mixed", MIXED),
    _run("(b) master + bf16 Adam", BF16, master),
    _run("(b) remainders", BF16, master_remainders),
    _run(NEAREST, BF16, bf16_adamw),
    _run("(d) pure bf16, stochastic", BF16, stochastic, loss_scale=None),
    _run("(e) pure bf16, Kahan", BF16, kahan),
    _run("(a) mixed, 8-bit Adam", MIXED, adamw_8bit),
    _run("(b) master + 8-bit Adam", BF16, master_8bit),
    _run("(b) remainders, 8-bit Adam", BF16, master_remainders_8bit),
)


def lost_share(result: dict[str, Any], tokens: jax.Array) -> float:
  """The share of one more step's nonzero updates that round-to-nearest drops.

  At the run's final state: the gradients on ``tokens``, the run's own optimizer's
  updates ``u``, and how many of the nonzero ones leave their bfloat16 param ``p``
  where it was (``bf16(p + u) == p``). For the round-to-nearest run these are the
  updates it loses.
  """
  state = result["state"]

  @jax.jit
  def counts(state, tokens):
    _, grads = state.value_and_grad(lambda v: train_lm.loss_fn(state.apply_fn, v, tokens))()
    updates, _ = state.tx.update(grads.params, state.opt_state, state.params)
    new = optax.apply_updates(state.params, updates)
    nonzero = [u != 0 for u in jax.tree_util.tree_leaves(updates)]
    same = [a == b for a, b in zip(jax.tree_util.tree_leaves(new),
                                   jax.tree_util.tree_leaves(state.params))]
    return (sum(jnp.sum(n & s) for n, s in zip(nonzero, same)),
            sum(jnp.sum(n) for n in nonzero))

  lost, nonzero = counts(state, tokens)
  return float(lost) / max(float(nonzero), 1.0)


@dataclasses.dataclass
class Row:
  name: str
  val: float
  bytes_per_param: dict[str, float]
  peak_bytes: float


def report(result: dict[str, Any]) -> Row:
  state = result["state"]
  memory = jaxmp.tools.memory_report(state.params, state.opt_state)
  return Row(result["name"], result["val"], memory.bytes_per_param(), result["peak_bytes"])


def print_table(rows: list[Row], baseline: Row) -> None:
  against = "vs f32" if baseline.name == "float32" else "vs row 1"
  header = (f"{'run':<28} {'val':>7} {against:>8} {'params':>7} {'master':>7} {'opt':>6} "
            f"{'grads':>6} {'p+m+opt':>8} {'peak MiB':>9}")
  print("\n" + header + "\n" + "-" * len(header))
  for r in rows:
    b = r.bytes_per_param
    delta = (r.val - baseline.val) / baseline.val * 100
    print(f"{r.name:<28} {r.val:>7.4f} {delta:>+7.2f}% {b['params']:>7.2f} {b['master']:>7.2f} "
          f"{b['optimizer state']:>6.2f} {b['gradients']:>6.2f} "
          f"{b['params'] + b['master'] + b['optimizer state']:>8.2f} "
          f"{r.peak_bytes / 2**20:>9.2f}")
  print("(bytes per parameter; 'opt' is the optimizer state besides the master: Adam's "
        "moments, Kahan's compensation, counters)")


def load_data(batch: int, preset: str = "cpu"):
  """The demo's training bytes and validation batches (``examples/train_lm.py``)."""
  settings = train_lm.PRESETS[preset]
  corpus = train_lm.load_corpus()
  split = int(len(corpus) * 0.95)
  val_stream = train_lm.batches(corpus[split:], batch, settings["config"].context, seed=12345)
  return corpus[:split], [next(val_stream) for _ in range(settings["eval_batches"])]


def train_runs(runs, *, steps: int, batch: int, lr: float, seed: int, data,
               preset: str = "cpu") -> list[dict]:
  """Trains each run with ``train_lm.train`` (same model, weights, data order, seed)."""
  args = argparse.Namespace(steps=steps, batch=batch, lr=lr, seed=seed)
  train_data, val_batches = data
  return [train_lm.train(run, args, train_lm.PRESETS[preset]["config"], train_data, val_batches)
          for run in runs]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", choices=sorted(train_lm.PRESETS), default="cpu",
                      help="the demo's model; the defaults of the next three")
  parser.add_argument("--steps", type=int)
  parser.add_argument("--batch", type=int)
  parser.add_argument("--lr", type=float)
  parser.add_argument("--seed", type=int, default=SEED)
  parser.add_argument("--runs", nargs="*", help="names of the runs to do (default: all)")
  args = parser.parse_args(argv)
  preset = train_lm.PRESETS[args.preset]
  args.steps = args.steps or preset["steps"]
  args.batch = args.batch or preset["batch"]
  args.lr = args.lr or preset["lr"]
  data = load_data(args.batch, args.preset)
  runs = [r for r in RUNS if not args.runs or r.name in args.runs]
  results = train_runs(runs, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                       data=data, preset=args.preset)
  rows = [report(r) for r in results]
  print(f"\n{args.steps} steps, peak learning rate {args.lr:g}")
  print_table(rows, rows[0])
  for result in results:
    if result["name"] == NEAREST:
      share = lost_share(result, data[1][0])
      print(f"{NEAREST}: round-to-nearest drops {100 * share:.1f}% of the nonzero updates of "
            "one more step at the end (bf16(p + u) == p)")
  return rows


if __name__ == "__main__":
  main()
