"""A float16 run that keeps overflowing heals itself: one layer moves to float32, by rule.

Flax's published lm1b ``TransformerLM`` (``tests/published/flax_lm1b``, copied verbatim
from the Flax repository) trains on bytes in float16 with dynamic loss scaling. One
layer is broken on purpose: the query and key kernels of
``decoder/encoderdecoderblock_1``'s attention are multiplied by ``--factor``, so its
logits (``q . k``) exceed float16's 65504 while ``q`` and ``k`` do not. Every step is
then non-finite, whatever the loss scale.

Two runs from the same params:

* **skips**: loss scaling as usual. Every step is skipped and the scale halves until it
  collapses; the model learns nothing.
* **heals**: the same, with non-finite tracing and
  ``jaxmp.tools.PrecisionController(auto_apply=True)``. After ``--culprit-steps``
  skipped steps that name the same module as the first to overflow, it adds one rule
  keeping that attention module in float32, swaps it into the train state (params,
  optimizer state and loss scale kept), and the run goes on; the step is compiled once
  more.

A plot of both loss scales, with the change point, goes to ``--plot``
(``outputs/adaptive_precision.png``).

Run: ``python examples/adaptive_precision.py`` (``--steps``, ``--factor``...).
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

import jaxmp  # pylint: disable=g-import-not-at-top
import train_lm  # pylint: disable=g-import-not-at-top
from tests.published.flax_lm1b import models  # pylint: disable=g-import-not-at-top

POLICY = "params=float32,compute=float16,output=float32"
LAYER = ("decoder", "encoderdecoderblock_1", "MultiHeadDotProductAttention_0")


def make_model(context: int) -> models.TransformerLM:
  """The published model at a small size: bytes in, no dropout (lm1b's eval config)."""
  return models.TransformerLM(models.TransformerConfig(
      vocab_size=256, output_vocab_size=256, emb_dim=64, num_heads=4, num_layers=2,
      qkv_dim=64, mlp_dim=256, max_len=context, deterministic=True))


def break_layer(params, factor: float):
  """``params`` with the attention layer's query and key kernels times ``factor``."""
  params = jax.tree.map(lambda a: a, params, is_leaf=nn.meta.is_axis_metadata)
  layer = params
  for key in LAYER:
    layer = layer[key]
  for name in ("query", "key"):
    kernel = layer[name]["kernel"]
    layer[name]["kernel"] = kernel.replace_boxed(kernel.unbox() * factor)
  return params


@jax.jit
def step(state, tokens):
  # lm1b's TransformerLM shifts its inputs right itself: the targets are the inputs.
  def loss_fn(variables):
    logits = state.apply_fn(variables, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens).mean()

  loss, grads = state.value_and_grad(loss_fn)()
  new_state = state.apply_gradients(grads)
  return new_state, loss, jaxmp.tools.training_metrics(grads.params, new_state.opt_state,
                                                       nonfinite_trace=grads.nonfinite)


def train(name: str, heal: bool, args, corpus) -> dict:
  """One run; returns its loss and scale series, skips and the controller's changes."""
  model = jaxmp.linen.mixed_precision(make_model(args.context),
                                      jaxmp.PolicyRules(POLICY, trace_nonfinite=True))
  data = train_lm.batches(corpus, args.batch, args.context - 1, seed=0)
  variables = model.init(jax.random.key(0), jnp.ones((1, args.context), jnp.int32))
  variables = {**variables, "params": break_layer(variables["params"], args.factor)}
  state = jaxmp.linen.TrainState.create(
      apply_fn=model.apply, variables=variables,
      tx=jaxmp.loss_scaling(optax.adamw(args.lr), jaxmp.DynamicLossScale()))
  monitor = jaxmp.tools.Monitor()
  controller = None
  if heal:
    controller = jaxmp.tools.PrecisionController(
        state, monitor, window=args.window, culprit_steps=args.culprit_steps, auto_apply=True)
  losses, scales, skipped = [], [], []
  for i in range(args.steps):
    state, loss, metrics = step(state, next(data))
    anomalies = monitor.update(metrics, loss, step=i)
    for anomaly in anomalies:
      if anomaly.kind != "nonfinite_origin":  # one line per skipped step: too many
        print(f"  [{name}] {anomaly}")
    if controller is not None:
      state, change = controller.update(state)
      if change is not None:
        print(f"  [{name}] {change}")
    losses.append(float(loss))
    scales.append(float(metrics["loss_scale"]))
    skipped.append(not bool(metrics["last_step_finite"]))
  changes = controller.changes if controller is not None else ()
  print(f"{name}: {sum(skipped)} of {args.steps} steps skipped, final loss scale "
        f"{scales[-1]:g}, last loss {losses[-1]:.4f}")
  return {"losses": losses, "scales": scales, "skipped": skipped, "changes": changes,
          "anomalies": [a.kind for a in monitor.anomalies], "rules": state.apply_fn.__self__.rules}


def plot(results: dict, path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (ax_scale, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.2))
  for name, r in results.items():
    ax_scale.semilogy(r["scales"], label=name)
    label = f"{name} (no step applied)" if all(r["skipped"]) else name
    ax_loss.plot(np.where(r["skipped"], np.nan, r["losses"]), label=label)
  for change in results["heals"]["changes"]:
    for ax in (ax_scale, ax_loss):
      ax.axvline(change.step + 0.5, color="gray", linestyle=":",
                 label=f"step {change.step}: {change.module.rsplit('/', 1)[-1]} -> float32")
  ax_scale.set(xlabel="step", ylabel="loss scale", title="Dynamic loss scale (float16)")
  ax_loss.set(xlabel="step", ylabel="train loss (applied steps)", title="Loss",
              xlim=(0, len(results["heals"]["losses"]) - 1))
  ax_scale.legend()
  ax_loss.legend()
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=120)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--context", type=int, default=64)
  parser.add_argument("--factor", type=float, default=300.0)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--window", type=int, default=10)
  parser.add_argument("--culprit-steps", type=int, default=3)
  parser.add_argument("--plot", default="outputs/adaptive_precision.png")
  args = parser.parse_args(argv)
  # The controller logs each change on the "jaxmp" logger; this script prints them.
  logging.getLogger("jaxmp").setLevel(logging.ERROR)

  corpus = train_lm.load_corpus(max_bytes=200_000)
  print(f"lm1b TransformerLM in {POLICY}, {'/'.join(LAYER)}'s query and key kernels x "
        f"{args.factor:g}")
  results = {name: train(name, heal, args, corpus)
             for name, heal in (("skips", False), ("heals", True))}
  print("rules after healing (the default: " f"{results['heals']['rules'].default}):")
  for rule in results["heals"]["rules"].rules:
    print(f"  Rule({rule.describe()}, {rule.policy})")
  if args.plot:
    plot(results, pathlib.Path(args.plot))
    print(f"plot: {args.plot}")
  return results


if __name__ == "__main__":
  main()
