"""jaxmp's main demo: one transformer language model trained five ways, side by side.

The model (``examples/transformer.py``) is a small decoder-only transformer written
with no precision code at all. It is trained on Python's own standard-library source
(bytes as tokens, nothing downloaded) with the same initial weights, data order and
seed in each configuration:

  float32                 the baseline
  bfloat16                jaxmp policy params=float32,compute=bfloat16,output=float32
  float16 + loss scaling  compute float16, jaxmp.loss_scaling with DynamicLossScale
  bfloat16 + fp8          bfloat16 policy, fp8 matmuls (delayed scaling) by rule
  float16, no scaling     compute float16 without loss scaling: what scaling prevents

then prints one table (train and validation loss, tokens/s, memory, skipped steps,
final loss scale) and saves a plot of the loss curves and the fp16 loss scale.

Run: ``make demo``, or ``python examples/train_lm.py --steps 300``;
``--preset gpu`` trains a larger model on an accelerator, ``--preset smoke`` a tiny one
for a few steps (what the tests run; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import sysconfig
import time
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jaxmp  # pylint: disable=g-import-not-at-top
import transformer  # pylint: disable=g-import-not-at-top

PRESETS = {
    "cpu": dict(config=transformer.Config(context=64, width=128, depth=2, heads=4),
                batch=16, steps=600, lr=2e-3, eval_batches=8),
    # On GPUs the 16-bit runs' attention layers run cuDNN's fused flash attention:
    # the [batch, heads, T, T] scores never reach memory (see make_model).
    "gpu": dict(config=transformer.Config(context=512, width=768, depth=8, heads=12),
                batch=64, steps=2000, lr=6e-4, eval_batches=16, fused_attention=True),
    # What the tests run: every code path of the demo and of the benchmarks built on
    # it, at a size that says nothing about quality or speed.
    "smoke": dict(config=transformer.Config(context=8, width=16, depth=1, heads=2),
                  batch=2, steps=3, lr=2e-3, eval_batches=1),
}


# ---- data ------------------------------------------------------------------------------


def load_corpus(max_bytes: int = 8_000_000) -> np.ndarray:
  """The standard library's Python source as bytes (a uint8 array), sorted by path."""
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  chunks, total = [], 0
  for path in sorted(stdlib.rglob("*.py")):
    if "site-packages" in path.parts or "test" in path.parts:
      continue
    data = path.read_bytes()
    chunks.append(data)
    total += len(data)
    if total >= max_bytes:
      break
  return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def batches(data: np.ndarray, batch: int, length: int, seed: int):
  """Random windows of ``length + 1`` tokens, the same sequence for every run."""
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - length - 1, size=batch)
    yield jnp.asarray(data[starts[:, None] + np.arange(length + 1)].astype(np.int32))


# ---- the five configurations -------------------------------------------------------------


def adamw(schedule) -> optax.GradientTransformation:
  """The demo's optimizer: AdamW with global-norm clipping (inside loss scaling)."""
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


@dataclasses.dataclass(frozen=True)
class Run:
  name: str
  policy: Any  # a policy (string) or a jaxmp.PolicyRules: what mixed_precision gets
  loss_scale: Optional[Callable[[], jaxmp.LossScale]]  # None: no loss_scaling wrapper
  note: str = ""
  optimizer: Callable[[Any], optax.GradientTransformation] = adamw  # of the LR schedule


def fp8_rules(recipe: Any = None) -> jaxmp.PolicyRules:
  """bfloat16 compute with every Dense layer but the head under ``recipe`` (default:
  per-tensor delayed scaling)."""
  return jaxmp.PolicyRules("params=float32,compute=bfloat16,output=float32", [
      jaxmp.Rule("head"),  # first match wins: keep the output projection out of fp8
      jaxmp.Rule((nn.Dense, nn.DenseGeneral),
                 fp8=jaxmp.fp8.DelayedScaling() if recipe is None else recipe),
  ])


RUNS = (
    Run("float32", "float32", None),
    Run("bfloat16", "params=float32,compute=bfloat16,output=float32", jaxmp.NoOpLossScale),
    # growth_interval=50 rather than the default 2000, so the scale's growth and
    # back-off show within a short demo run.
    Run("float16 + loss scaling", "params=float32,compute=float16,output=float32",
        lambda: jaxmp.DynamicLossScale(growth_interval=50)),
    Run("bfloat16 + fp8", fp8_rules(), jaxmp.NoOpLossScale),
    Run("float16, no loss scaling", "params=float32,compute=float16,output=float32",
        jaxmp.NoOpLossScale, note="what loss scaling is for"),
)


# ---- training ------------------------------------------------------------------------------


def tree_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


CAUSAL_ATTENTION = jaxmp.Rule(nn.MultiHeadDotProductAttention, causal_attention=True)
"""The blocks' self-attention is causal over unpadded text: cuDNN's CAUSAL mode, no mask."""


def make_model(run: Run, config: transformer.Config, fused_attention: bool = False):
  """The run's model: the transformer wrapped in its policy, with
  ``PolicyRules(fused_attention=True)`` and the attention declared causal
  (:data:`CAUSAL_ATTENTION`) in the 16-bit runs if ``fused_attention`` (cuDNN's
  fused kernel takes 16-bit inputs only; the float32 run keeps Flax's attention,
  which moves fewer bytes than XLA's fused-attention fallback there)."""
  rules = (run.policy if isinstance(run.policy, jaxmp.PolicyRules)
           else jaxmp.PolicyRules(run.policy))
  if fused_attention and rules.default.compute_dtype != jnp.float32:
    rules = dataclasses.replace(rules, fused_attention=True,
                                rules=rules.rules + (CAUSAL_ATTENTION,))
  return jaxmp.linen.mixed_precision(transformer.TransformerLM(config), rules)


def loss_fn(apply_fn, variables, tokens):
  logits = apply_fn(variables, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), tokens[:, 1:]).mean()


def make_optimizer(run: Run, lr: float, steps: int) -> optax.GradientTransformation:
  """The run's optimizer over warm-up + cosine decay; loss scaling if the run has it."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, steps // 10, steps, lr / 10)
  tx = run.optimizer(schedule)
  if run.loss_scale is not None:
    tx = jaxmp.loss_scaling(tx, run.loss_scale())
  return tx


def step(state, tokens):
  """One training step of a jaxmp.linen.TrainState: loss, gradients, update."""
  loss, grads = state.value_and_grad(lambda v: loss_fn(state.apply_fn, v, tokens))()
  return state.apply_gradients(grads), loss


def logged_step(state, tokens):
  """:func:`step`, returning the loss scale beside the loss.

  The loop donates the state (the next state is written into its buffers), so a value
  read after later steps have run has to be an output of its own.
  """
  state, loss = step(state, tokens)
  return state, (loss, state.loss_scale.loss_scale)


def train(run: Run, args, config, corpus, val_batches, fused_attention: bool = False):
  model = make_model(run, config, fused_attention)
  first = next(batches(corpus, args.batch, config.context, args.seed))
  variables = model.init(jax.random.key(args.seed), first[:, :-1])
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply, variables=variables,
                                        tx=make_optimizer(run, args.lr, args.steps))

  compiled = jax.jit(logged_step, donate_argnums=0).lower(state, first).compile()
  memory = compiled.memory_analysis()
  evaluate = jax.jit(lambda variables, tokens: loss_fn(model.apply, variables, tokens))

  # Steps are dispatched back to back and their losses read at the end (and every 20
  # steps for the progress bar), as a training loop that does not wait for each step:
  # the host builds the next batch and launches the next step while this one runs.
  # Waiting for every step instead adds the host's launch time to each (measured on
  # an H200 with the fp8 step: 38.4 ms waited for, 33.1 ms back to back).
  losses, scales = [], []
  data = batches(corpus, args.batch, config.context, args.seed)
  bar = tqdm(range(args.steps), desc=f"{run.name:<24}", ncols=100, mininterval=1.0)
  for i in bar:
    state, (loss, scale) = compiled(state, next(data))
    losses.append(loss)
    scales.append(scale)
    if i == 0:  # the first call warms caches up: the clock starts when it is done
      jax.block_until_ready(loss)
      start = time.perf_counter()
    if i % 20 == 0:
      bar.set_postfix(loss=f"{float(loss):.3f}", scale=f"{float(scales[-1]):g}")
  jax.block_until_ready(state)
  seconds = time.perf_counter() - start
  losses, scales = [float(x) for x in losses], [float(x) for x in scales]

  val = float(np.mean([evaluate(state.variables, t) for t in val_batches]))
  metrics = (jaxmp.loss_scaling_metrics(state.opt_state) if run.loss_scale is not None
             else None)
  return dict(
      name=run.name, note=run.note, losses=losses, scales=scales, state=state,
      train=float(np.mean(losses[-20:])), val=val,
      tokens_per_s=(args.steps - 1) * args.batch * config.context / seconds,
      param_bytes=tree_bytes(state.params), opt_bytes=tree_bytes(state.opt_state),
      fp8_bytes=tree_bytes(state.fp8),
      peak_bytes=(memory.temp_size_in_bytes + memory.argument_size_in_bytes
                  + memory.output_size_in_bytes - memory.alias_size_in_bytes)
      if memory is not None else float("nan"),
      skipped=int(metrics["skipped_steps"]) if metrics else 0,
      final_scale=float(metrics["loss_scale"]) if metrics else 1.0,
  )


# ---- report --------------------------------------------------------------------------------


def mib(n: float) -> str:
  return f"{n / 2**20:.2f}"


def print_table(results, baseline):
  header = (f"{'run':<26} {'train':>7} {'val':>7} {'val vs f32':>10} {'tokens/s':>9} "
            f"{'speed':>6} {'params MiB':>10} {'opt MiB':>8} {'peak MiB':>9} {'skipped':>7} "
            f"{'scale':>8}")
  print("\n" + header + "\n" + "-" * len(header))
  for r in results:
    delta = (r["val"] - baseline["val"]) / baseline["val"] * 100
    print(f"{r['name']:<26} {r['train']:>7.4f} {r['val']:>7.4f} {delta:>+9.2f}% "
          f"{r['tokens_per_s']:>9.0f} {r['tokens_per_s'] / baseline['tokens_per_s']:>5.2f}x "
          f"{mib(r['param_bytes']):>10} {mib(r['opt_bytes']):>8} {mib(r['peak_bytes']):>9} "
          f"{r['skipped']:>7} {r['final_scale']:>8g}")
  for r in results:
    if r["note"]:
      print(f"  {r['name']} ({r['note']}): " + unscaled_fp16_verdict(r, baseline))


def unscaled_fp16_verdict(result, baseline) -> str:
  """An honest reading of the float16 run without loss scaling."""
  gap = (result["val"] - baseline["val"]) / baseline["val"] * 100
  if not np.isfinite(result["val"]) or gap > 2.0:
    return (f"without a loss scale its validation loss is {gap:+.1f}% off float32 "
            "(small gradients flushed to zero in float16)")
  return (f"in this run it stayed within {gap:+.2f}% of float32, although float16 "
          "flushes or denormalizes most of the logits gradient (below): the values it "
          "loses are the smallest, and this short run did not feel their loss")


def gradients_in_float16(results, tokens) -> None:
  """What float16 would do to the float32 run's gradients, with and without a scale.

  The gradients of the trained float32 model on a validation batch: the cotangent of
  the logits (the error signal every backward pass starts from: the softmax error
  divided by the batch's token count) and the params gradients, classified as float16
  would store them (``jaxmp.tools.underflow_report``) at scale 1 and at the final scale of
  the float16 run's dynamic loss scaling.
  """
  baseline = results[0]
  scaled = next((r for r in results if r["name"] == "float16 + loss scaling"), None)
  if baseline["name"] != "float32" or scaled is None:
    return
  state = baseline["state"]
  logits = state.apply_fn(state.variables, tokens[:, :-1])
  cross_entropy = lambda logits: optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]).mean()
  trees = {"logits gradient": jax.grad(cross_entropy)(logits),
           "params gradients": jax.grad(
               lambda params: loss_fn(state.apply_fn, {**state.variables, "params": params},
                                      tokens))(state.params)}
  print("\nWhy float16 needs a loss scale: the float32 run's gradients (one validation batch)"
        "\nas float16 would hold them, without a scale and at the float16 run's final scale:")
  header = f"{'':<18} {'loss scale':>10} {'flush to 0':>11} {'subnormal':>10} {'overflow':>9}"
  print(header + "\n" + "-" * len(header))
  for name, tree in trees.items():
    for scale in (1.0, scaled["final_scale"]):
      report = jaxmp.tools.underflow_report(tree, "float16", loss_scale=scale)
      print(f"{name:<18} {scale:>10g} {100 * report.underflow_fraction:>10.2f}% "
            f"{100 * report.subnormal_fraction:>9.2f}% {100 * report.overflow_fraction:>8.2f}%")
  print("(subnormal float16 values keep fewer than 10 bits, flushed ones none; the "
        "loss scale moves them back into float16's normal range)")


def plot(results, path: pathlib.Path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(13, 4.5))
  for r in results:
    smooth = np.convolve(r["losses"], np.ones(10) / 10, mode="valid")
    ax_loss.plot(smooth, label=r["name"], linestyle="--" if r["note"] else "-")
  ax_loss.set(xlabel="step", ylabel="train loss (10-step mean)", title="Loss curves")
  ax_loss.legend()
  fp16 = next(r for r in results if r["name"] == "float16 + loss scaling")
  ax_scale.semilogy(fp16["scales"])
  ax_scale.set(xlabel="step", ylabel="loss scale", title="float16 dynamic loss scale")
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  parser.add_argument("--steps", type=int)
  parser.add_argument("--batch", type=int)
  parser.add_argument("--lr", type=float)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--runs", nargs="*", help="names of the runs to do (default: all)")
  parser.add_argument("--plot", default="outputs/train_lm.png")
  args = parser.parse_args(argv)
  preset = PRESETS[args.preset]
  args.steps = args.steps or preset["steps"]
  args.batch = args.batch or preset["batch"]
  args.lr = args.lr or preset["lr"]
  config = preset["config"]

  corpus = load_corpus()
  split = int(len(corpus) * 0.95)
  train_data, val_data = corpus[:split], corpus[split:]
  val_stream = batches(val_data, args.batch, config.context, seed=12345)
  val_batches = [next(val_stream) for _ in range(preset["eval_batches"])]
  fused = preset.get("fused_attention", False)
  device = jax.devices()[0]
  print(f"jaxmp demo: {len(corpus):,} bytes of Python stdlib source; device {device.platform}"
        f" ({device.device_kind}); transformer width {config.width}, depth {config.depth}, "
        f"context {config.context}; batch {args.batch}; {args.steps} steps"
        + ("; fused attention" if fused else ""))

  runs = [r for r in RUNS if not args.runs or r.name in args.runs]
  results = [train(run, args, config, train_data, val_batches, fused) for run in runs]
  baseline = results[0]
  print_table(results, baseline)
  gradients_in_float16(results, val_batches[0])
  if any(r["name"] == "float16 + loss scaling" for r in results):
    path = pathlib.Path(args.plot).resolve()
    plot(results, path)
    print(f"\nplot of the loss curves and the fp16 loss scale: {path}")


if __name__ == "__main__":
  main()
