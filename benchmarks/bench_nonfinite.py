"""Cost of non-finite tracing: the demo model's train step with tracing off and on.

The demo transformer (``examples/transformer.py``, ``examples/train_lm.py``'s preset)
trains in float16 with dynamic loss scaling; one jitted step (forward, backward,
optimizer, ``jaxmp.tools.training_metrics``), the train state donated, as a training
loop runs it. Variants, timed side by side in interleaved blocks of steps; a block
during which other processes used more than ``--max-other-load`` CPU cores is dropped
(``timing.quiet_blocks``):

* ``off``: ``PolicyRules(policy)``; the baseline.
* ``on``: ``PolicyRules(policy, trace_nonfinite=True)``: the probe differentiated with
  the params, the per-module trace (with each module's parameter-gradient amax)
  returned in the metrics.

Also printed: the number of traced call sites, and the compiled steps' sizes (HLO
instructions), which say how much tracing adds whatever the device.

Run: ``.venv/bin/python benchmarks/bench_nonfinite.py`` (``--preset gpu`` on an
accelerator; ``--help`` for options).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jaxmp  # pylint: disable=g-import-not-at-top
import timing  # pylint: disable=g-import-not-at-top
import train_lm  # pylint: disable=g-import-not-at-top
import transformer  # pylint: disable=g-import-not-at-top

POLICY = "params=float32,compute=float16,output=float32"


def make_step(trace: bool, config: transformer.Config, tokens: jax.Array):
  """A jitted train step and its initial state, tracing or not."""
  model = jaxmp.linen.mixed_precision(transformer.TransformerLM(config), jaxmp.PolicyRules(
      POLICY, trace_nonfinite=trace))
  tx = jaxmp.loss_scaling(train_lm.adamw(1e-3), jaxmp.DynamicLossScale(2.0**10))
  state = jaxmp.linen.TrainState.create(
      apply_fn=model.apply, variables=model.init(jax.random.key(0), tokens[:, :-1]), tx=tx)

  def step(state, tokens):
    loss, grads = state.value_and_grad(lambda v: train_lm.loss_fn(state.apply_fn, v, tokens))()
    new_state = state.apply_gradients(grads)
    metrics = jaxmp.tools.training_metrics(grads.params, new_state.opt_state,
                                           nonfinite_trace=grads.nonfinite)
    return new_state, loss, metrics

  return jax.jit(step, donate_argnums=0), state


def hlo_instructions(step, state, tokens) -> int:
  text = step.lower(state, tokens).compile().as_text()
  return sum(1 for line in text.splitlines() if " = " in line and not line.lstrip().startswith("ROOT"))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", choices=sorted(train_lm.PRESETS), default="cpu")
  parser.add_argument("--blocks", type=int, default=30, help="quiet blocks per variant")
  parser.add_argument("--steps", type=int, default=5, help="timed steps per block")
  parser.add_argument("--max-other-load", type=float, default=0.25,
                      help="drop a block during which other processes used more CPU cores")
  parser.add_argument("--max-seconds", type=float, default=900)
  args = parser.parse_args(argv)
  preset = train_lm.PRESETS[args.preset]
  config, batch = preset["config"], preset["batch"]
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, config.vocab, (batch, config.context + 1)), jnp.int32)

  states, steps, sizes = {}, {}, {}
  for name, trace in (("off", False), ("on", True)):
    step, state = make_step(trace, config, tokens)
    sizes[name] = hlo_instructions(step, state, tokens)
    steps[name], states[name] = step, state
  calls = len(states["on"].collections[jaxmp.linen.NONFINITE_COLLECTION].calls)

  def variant(name):
    def run():
      states[name], loss, metrics = steps[name](states[name], tokens)
      jax.block_until_ready((loss, metrics))
    return run

  timings = timing.quiet_blocks({name: variant(name) for name in steps}, baseline="off",
                                blocks=args.blocks, steps=args.steps,
                                max_other_load=args.max_other_load,
                                max_seconds=args.max_seconds)
  print(f"\nNon-finite tracing, {args.preset} preset: width {config.width}, depth "
        f"{config.depth}, context {config.context}, batch {batch}, float16 + dynamic loss "
        f"scaling, AdamW; {calls} traced call sites  [{timing.device_description()}, jax "
        f"{jax.__version__}]; blocks of {args.steps} steps, kept when other processes used "
        f"<= {args.max_other_load} cores")
  print("| variant | ms/step p25 | ms/step median | ratio (p25) | ratio (paired median) | "
        "CPU ms/step | CPU ratio (paired median) | HLO instructions | blocks | skipped steps |")
  print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
  for name, t in timings.items():
    skipped = int(jaxmp.loss_scaling_metrics(states[name].opt_state)["skipped_steps"])
    print(f"| {name} | {t.p25_ms:.2f} | {t.median_ms:.2f} | {t.p25_ratio:.3f} | "
          f"{t.paired_ratio:.3f} | {t.cpu_ms:.2f} | {t.cpu_ratio:.3f} | {sizes[name]} | "
          f"{t.blocks} | {skipped} |")
  return timings


if __name__ == "__main__":
  main()
