"""Flax NNX: one model, three precisions, with nnx.Optimizer, nnx.jit and fp8 by rule.

An MLP classifier written in plain NNX (Linear, BatchNorm, LayerNorm; no precision
code) is trained on scikit-learn's bundled 8x8 digits three ways from the same initial
weights and data order:

  float32                 the baseline
  float16 + loss scaling  compute float16, ``jaxmp.loss_scaling`` around AdamW
  bfloat16 + fp8          compute bfloat16, the hidden ``nnx.Linear`` layers in fp8
                          (delayed scaling), the output layer kept out by a rule

``jaxmp.nnx.mixed_precision`` wraps the model; its params stay the model's own
``nnx.Param`` variables in float32, so ``nnx.Optimizer(wrapped, tx, wrt=nnx.Param)``
and ``nnx.jit`` work as usual. ``jaxmp.nnx.value_and_grad`` and
``jaxmp.nnx.apply_gradients`` keep params, loss scale and fp8 state in step. The script
prints the resolved precision table of the fp8 run (``jaxmp.tools.summary`` on an NNX model)
and each run's validation accuracy, skipped steps and final loss scale.

Run: ``python examples/train_nnx.py`` (about half a minute on a CPU).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import jaxmp


class MLP(nnx.Module):
  """Two hidden blocks (Linear, BatchNorm, relu) and a LayerNorm before the head."""

  def __init__(self, rngs: nnx.Rngs, width: int = 256):
    self.hidden = nnx.List([nnx.Linear(64, width, rngs=rngs), nnx.Linear(width, width, rngs=rngs)])
    self.norms = nnx.List([nnx.BatchNorm(width, momentum=0.9, rngs=rngs) for _ in range(2)])
    self.final_norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, 10, rngs=rngs)

  def __call__(self, x):
    for linear, norm in zip(self.hidden, self.norms):
      x = nnx.relu(norm(linear(x)))
    return self.head(self.final_norm(x))


FP8_RULES = jaxmp.PolicyRules("params=float32,compute=bfloat16,output=float32", [
    jaxmp.Rule("head"),  # first match wins: the output layer stays out of fp8
    jaxmp.Rule(nnx.Linear, fp8=jaxmp.fp8.DelayedScaling(amax_history_length=16)),
])

RUNS = {
    "float32": ("float32", jaxmp.NoOpLossScale),
    "float16 + loss scaling": ("params=float32,compute=float16,output=float32",
                               jaxmp.DynamicLossScale),
    "bfloat16 + fp8": (FP8_RULES, jaxmp.NoOpLossScale),
}


def load(seed: int):
  """Digits as flat 64-pixel rows in [0, 1], shuffled, split 80/20."""
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  split = int(0.8 * len(x))
  return (x[order[:split]], y[order[:split]]), (x[order[split:]], y[order[split:]])


def cross_entropy(model, x, y):
  logits = model(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


@nnx.jit
def train_step(model, optimizer, x, y):
  loss_scale = jaxmp.get_loss_scale(optimizer.opt_state)
  loss, grads = jaxmp.nnx.value_and_grad(cross_entropy)(model, x, y, loss_scale=loss_scale)
  jaxmp.nnx.apply_gradients(optimizer, model, grads)  # unscales; skips non-finite steps
  return loss


@nnx.jit
def accuracy(model, x, y):
  return jnp.mean(jnp.argmax(model(x), -1) == y)


def train(name: str, args, train_data, val_data, verbose: bool) -> dict:
  policy, loss_scale = RUNS[name]
  model = jaxmp.nnx.mixed_precision(MLP(nnx.Rngs(args.seed)), policy)
  x_train, y_train = train_data
  if verbose:
    print(f"{name}: the precision of each module for one call\n"
          f"{jaxmp.tools.summary(model, None, jnp.asarray(x_train[:2]))}\n")
  tx = jaxmp.loss_scaling(optax.adamw(args.lr, weight_decay=1e-4), loss_scale())
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  rng = np.random.default_rng(args.seed)
  model.train()
  for _ in range(args.epochs):
    order = rng.permutation(len(x_train))
    for i in range(0, len(order) - args.batch + 1, args.batch):
      idx = order[i:i + args.batch]
      train_step(model, optimizer, jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx]))
  model.eval()
  metrics = jaxmp.loss_scaling_metrics(optimizer.opt_state)
  return dict(accuracy=float(accuracy(model, *map(jnp.asarray, val_data))),
              skipped=int(metrics["skipped_steps"]), scale=float(metrics["loss_scale"]),
              kernel_dtype=model.model.hidden[0].kernel[...].dtype)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=10)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--lr", type=float, default=2e-3)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  train_data, val_data = load(args.seed)
  print(f"digits: {len(train_data[0])} train, {len(val_data[0])} validation images\n")
  results = {name: train(name, args, train_data, val_data, verbose=name == "bfloat16 + fp8")
             for name in RUNS}
  baseline = results["float32"]["accuracy"]
  print(f"{'run':<24} {'val accuracy':>12} {'vs float32':>11} {'skipped':>8} {'loss scale':>11}"
        f" {'params':>8}")
  for name, r in results.items():
    print(f"{name:<24} {100 * r['accuracy']:>11.2f}% {100 * (r['accuracy'] - baseline):>+10.2f}"
          f" {r['skipped']:>8} {r['scale']:>11g} {str(r['kernel_dtype']):>8}")
  return results


if __name__ == "__main__":
  main()
