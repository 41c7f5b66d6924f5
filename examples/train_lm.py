"""Trains a small character-level language model in float32 and with a bfloat16 policy.

The text is Python's own standard library source, so nothing is downloaded. This
first version applies a `jaxmp.Policy` by hand (cast the float32 master params and the
inputs to the compute dtype, cast the output back); later versions wrap a Flax model.

Run:  make demo     (or: python examples/train_lm.py --steps 200)
"""

from __future__ import annotations

import argparse
import pathlib
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp


def load_corpus(max_bytes: int) -> np.ndarray:
  """Bytes of the standard library's source files, as a uint8 array."""
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  chunks, total = [], 0
  for path in sorted(stdlib.glob("*.py")):
    data = path.read_bytes()
    chunks.append(data)
    total += len(data)
    if total >= max_bytes:
      break
  return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def init_params(key, vocab: int, context: int, embed: int, hidden: int):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
      "embed": jax.random.normal(k1, (vocab, embed)) * 0.02,
      "w1": jax.random.normal(k2, (context * embed, hidden)) / np.sqrt(context * embed),
      "b1": jnp.zeros(hidden),
      "w2": jax.random.normal(k3, (hidden, vocab)) / np.sqrt(hidden),
      "b2": jnp.zeros(vocab),
  }


def forward(params, tokens, policy: jaxmp.Policy):
  params = policy.cast_to_compute(params)
  x = params["embed"][tokens].reshape(tokens.shape[0], -1)
  x = jax.nn.gelu(x @ params["w1"] + params["b1"])
  logits = x @ params["w2"] + params["b2"]
  return policy.cast_to_output(logits)


def make_batches(data: np.ndarray, context: int, batch: int, seed: int):
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - context - 1, size=batch)
    idx = starts[:, None] + np.arange(context + 1)
    window = data[idx].astype(np.int32)
    yield window[:, :-1], window[:, -1]


def train(policy: jaxmp.Policy, data, val, args):
  params = init_params(jax.random.key(args.seed), 256, args.context, 32, 256)
  tx = optax.adam(args.lr)
  opt_state = tx.init(params)

  def loss_fn(params, tokens, targets):
    logits = forward(params, tokens, policy).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  @jax.jit
  def step(params, opt_state, tokens, targets):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  batches = make_batches(data, args.context, args.batch, args.seed)
  start = time.perf_counter()
  for _ in range(args.steps):
    params, opt_state, loss = step(params, opt_state, *next(batches))
  loss.block_until_ready()
  seconds = time.perf_counter() - start
  val_tokens, val_targets = next(make_batches(val, args.context, 2048, args.seed + 1))
  val_loss = float(jax.jit(loss_fn)(params, val_tokens, val_targets))
  return float(loss), val_loss, args.steps * args.batch / seconds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--context", type=int, default=16)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  corpus = load_corpus(2_000_000)
  split = int(0.9 * len(corpus))
  data, val = corpus[:split], corpus[split:]
  print(f"corpus: {len(corpus):,} bytes of stdlib source; device: {jax.devices()[0].device_kind}")

  print(f"{'policy':<50} {'train loss':>10} {'val loss':>9} {'samples/s':>10}")
  for spec in ("float32", "p=f32,c=bf16,o=f32"):
    policy = jaxmp.get_policy(spec)
    train_loss, val_loss, speed = train(policy, data, val, args)
    print(f"{str(policy):<50} {train_loss:>10.4f} {val_loss:>9.4f} {speed:>10.0f}")


if __name__ == "__main__":
  main()
