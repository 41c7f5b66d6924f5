"""A CNN with BatchNorm on scikit-learn's bundled digits: mixed precision matches float32.

Trains the same small convolutional network (Flax linen, with BatchNorm) on the 8x8
digits that ship with scikit-learn, with Flax's own ``TrainState``, in float32,
bfloat16 and float16 with dynamic loss scaling, and prints the validation accuracy of
each: the claim of mixed-precision training (Micikevicius et al., 2018) is that the
mixed runs match float32.

Run: ``python examples/train_classifier.py`` (about a minute on a laptop CPU).
"""

from __future__ import annotations

import argparse
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from sklearn.datasets import load_digits

import jaxmp


class CNN(nn.Module):
  """Two conv blocks with BatchNorm, then a dense head; no precision code."""

  @nn.compact
  def __call__(self, x, train: bool):
    for features in (32, 64):
      x = nn.Conv(features, (3, 3))(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
      x = nn.relu(x)
    x = nn.avg_pool(x, (2, 2), (2, 2)).reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(128)(x))
    return nn.Dense(10)(x)


class State(train_state.TrainState):
  batch_stats: Any


RUNS = {
    "float32": ("float32", None),
    "bfloat16": ("params=float32,compute=bfloat16,output=float32", None),
    "float16 + loss scaling": ("params=float32,compute=float16,output=float32",
                               jaxmp.DynamicLossScale),
}


def load(seed: int):
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order]
  split = int(0.8 * len(x))
  return (x[:split], y[:split]), (x[split:], y[split:])


def train(name: str, args, train_data, val_data) -> float:
  policy, loss_scale = RUNS[name]
  model = jaxmp.linen.mixed_precision(CNN(), policy)
  x_train, y_train = train_data
  variables = model.init(jax.random.key(args.seed), x_train[:2], train=False)
  tx = optax.adam(args.lr)
  if loss_scale is not None:
    tx = jaxmp.loss_scaling(tx, loss_scale())
  state = State.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                       batch_stats=variables["batch_stats"])

  @jax.jit
  def step(state, x, y):
    def loss_fn(params):
      logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                       x, train=True, mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return loss, updates

    # A float32 run has no loss-scaling state; NoOpLossScale makes its scale a no-op.
    scale = jaxmp.get_loss_scale(state.opt_state, default=jaxmp.NoOpLossScale())
    (loss, updates), grads = scale.value_and_grad(loss_fn, has_aux=True)(state.params)
    # A step that loss scaling skips must not write its batch statistics either: an
    # overflowed forward pass can leave inf in the running mean.
    batch_stats = jaxmp.select_tree(jaxmp.all_finite(grads), updates["batch_stats"],
                                    state.batch_stats)
    state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    return state, loss

  @jax.jit
  def accuracy(state, x, y):
    logits = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats}, x,
                            train=False)
    return jnp.mean(jnp.argmax(logits, -1) == y)

  rng = np.random.default_rng(args.seed)
  for _ in range(args.epochs):
    order = rng.permutation(len(x_train))
    for i in range(0, len(order) - args.batch + 1, args.batch):
      idx = order[i:i + args.batch]
      state, _ = step(state, x_train[idx], y_train[idx])
  return float(accuracy(state, *val_data))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=8)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  train_data, val_data = load(args.seed)
  print(f"digits: {len(train_data[0])} train, {len(val_data[0])} validation images")
  results = {name: train(name, args, train_data, val_data) for name in RUNS}
  baseline = results["float32"]
  print(f"\n{'run':<24} {'val accuracy':>12} {'vs float32':>11}")
  for name, acc in results.items():
    print(f"{name:<24} {100 * acc:>11.2f}% {100 * (acc - baseline):>+10.2f}")
  return results


if __name__ == "__main__":
  main()
