"""Cost of the linen interceptor: a wrapped model vs the same model written by hand.

The model is the example transformer LM (``examples/transformer.py``). Variants, all
timed as a full jitted train step (forward, backward, Adam update) in one run:

* ``hand_bf16``: the model built with ``dtype=jnp.bfloat16`` on every layer (params
  float32): the hand-written mixed-precision baseline.
* ``jaxmp_bf16``: the model built with no dtype at all, wrapped with
  ``jaxmp.linen.mixed_precision(model, "params=float32,compute=bfloat16,output=float32")``.
* ``float32``: the model with no dtype and no wrapper, for reference.

Also prints the number of ``convert`` ops in each compiled step: the wrapper should add
none beyond the casts a hand-written model does.

Run: ``.venv/bin/python benchmarks/bench_linen.py`` (``--preset gpu`` for a larger model,
``--preset smoke --rounds 1 --calls 1`` for a tiny one, once).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jaxmp  # pylint: disable=g-import-not-at-top
import timing  # pylint: disable=g-import-not-at-top
import transformer  # pylint: disable=g-import-not-at-top

PRESETS = {
    "cpu": dict(config=transformer.Config(context=64, width=128, depth=2, heads=4), batch=16),
    "gpu": dict(config=transformer.Config(context=1024, width=1024, depth=8, heads=16),
                batch=32),
    "smoke": dict(config=transformer.Config(context=8, width=16, depth=1, heads=2), batch=2),
}


def make_step(apply, tx):

  def loss_fn(params, tokens):
    logits = apply({"params": params}, tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def convert_count(step, *args) -> int:
  return len(re.findall(r"\bconvert\(", step.lower(*args).compile().as_text()))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--calls", type=int, default=5)
  args = parser.parse_args(argv)
  preset = PRESETS[args.preset]
  config, batch = preset["config"], preset["batch"]

  tokens = jax.random.randint(jax.random.key(1), (batch, config.context + 1), 0, config.vocab)
  plain = transformer.TransformerLM(config)
  params = plain.init(jax.random.key(0), tokens[:, :-1])["params"]
  tx = optax.adam(1e-3)
  applies = {
      "hand_bf16": transformer.TransformerLM(config, dtype=jnp.bfloat16).apply,
      "jaxmp_bf16": jaxmp.linen.mixed_precision(
          plain, "params=float32,compute=bfloat16,output=float32").apply,
      "float32": plain.apply,
  }

  variants, converts = {}, {}
  for name, apply in applies.items():
    step = make_step(apply, tx)
    state = [jax.tree.map(jnp.copy, params), tx.init(params)]
    converts[name] = {"converts": convert_count(step, *state, tokens)}

    def run(step=step, state=state):
      state[0], state[1], loss = step(state[0], state[1], tokens)
      loss.block_until_ready()

    variants[name] = run

  timings = timing.interleaved(variants, baseline="hand_bf16", rounds=args.rounds,
                               calls=args.calls)
  timing.print_table(
      f"linen interceptor, transformer LM width {config.width} depth {config.depth} "
      f"context {config.context} batch {batch}", timings, converts)
  return timings, converts


if __name__ == "__main__":
  main()
