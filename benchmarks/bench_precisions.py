"""Step time and memory of the demo's configurations against float32, side by side.

Times the full jitted train step (forward, backward, clipped AdamW update, and for the
mixed runs loss scaling and the fp8 state merge) of the demo's transformer LM
(``examples/train_lm.py``) in each configuration, interleaved in one run, and prints
ms/step, tokens/s, the ratio to float32, and the compiled step's peak memory
(``compiled.memory_analysis()``: arguments + outputs + temporaries - aliased).

On a CPU, bfloat16/float16 are emulated and fp8 is widened to a wider type, so the
mixed runs are *not* faster there; the CPU figures bound the overhead. Use
``--preset gpu`` on a GPU (bf16 should be >= 2x float32 per step on an H100).

Run: ``.venv/bin/python benchmarks/bench_precisions.py [--preset gpu]`` (``--preset
smoke --rounds 1 --calls 1``: the demo's tiny test model, once).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jaxmp  # pylint: disable=g-import-not-at-top
import timing  # pylint: disable=g-import-not-at-top
import train_lm  # pylint: disable=g-import-not-at-top


def build_step(run: train_lm.Run, config, batch: int):
  """The demo's jitted step for ``run`` and a state to feed it."""
  model = train_lm.make_model(run, config)
  tokens = jax.random.randint(jax.random.key(1), (batch, config.context + 1), 0, config.vocab)
  variables = model.init(jax.random.key(0), tokens[:, :-1])
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.01))
  if run.loss_scale is not None:
    tx = jaxmp.loss_scaling(tx, run.loss_scale())
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply, variables=variables, tx=tx)

  def step(state, tokens):
    loss, grads = state.value_and_grad(
        lambda v: train_lm.loss_fn(state.apply_fn, v, tokens))()
    return state.apply_gradients(grads), loss

  compiled = jax.jit(step, donate_argnums=0).lower(state, tokens).compile()
  return compiled, state, tokens


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", choices=sorted(train_lm.PRESETS), default="cpu")
  parser.add_argument("--batch", type=int)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--calls", type=int, default=5)
  args = parser.parse_args(argv)
  preset = train_lm.PRESETS[args.preset]
  config, batch = preset["config"], args.batch or preset["batch"]
  runs = [r for r in train_lm.RUNS if not r.note]  # the unscaled fp16 run is a demo only

  variants, extra = {}, {}
  for run in runs:
    compiled, state, tokens = build_step(run, config, batch)
    memory = compiled.memory_analysis()
    peak = (memory.temp_size_in_bytes + memory.argument_size_in_bytes
            + memory.output_size_in_bytes - memory.alias_size_in_bytes)
    extra[run.name] = {"peak MiB": f"{peak / 2**20:.1f}"}
    holder = [state]

    def call(compiled=compiled, holder=holder, tokens=tokens):
      holder[0], loss = compiled(holder[0], tokens)
      loss.block_until_ready()

    variants[run.name] = call

  timings = timing.interleaved(variants, baseline="float32", rounds=args.rounds,
                               calls=args.calls)
  tokens_per_step = batch * config.context
  for name, t in timings.items():
    extra[name]["tokens/s"] = f"{tokens_per_step / t.ms * 1e3:.0f}"
    extra[name]["speed-up"] = f"{1 / t.ratio:.2f}x"
  timing.print_table(
      f"train step of the demo transformer (width {config.width}, depth {config.depth}, "
      f"context {config.context}, batch {batch})", timings, extra)
  return timings


if __name__ == "__main__":
  main()
