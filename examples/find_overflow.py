"""Where did the inf come from? Finding the layer that overflowed in a float16 run.

The demo transformer (``examples/transformer.py``, no precision code) trains in float16
with dynamic loss scaling and ``PolicyRules(trace_nonfinite=True)``: every module call
records, inside the compiled step, the absolute max of its inputs and output and of the
gradients flowing back through it. Two faults are injected, one step each, into an
otherwise healthy run:

* a forward overflow: ``block_1/mlp/down``'s kernel multiplied by 1e6 (its output
  exceeds float16's 65504);
* a backward-only overflow inside ``block_0/mlp``: the gradient between its two Dense
  layers multiplied by 2**200 (every forward value stays finite).

Loss scaling skips both steps; :class:`jaxmp.tools.Monitor` names the module and
direction of each step's first non-finite value, and the per-module amax table of the
forward fault is printed. No host callback runs inside the step: the statistics come
back as the gradient of a small probe (see docs/guides/diagnostics.md, "Where did the
inf come from").

Run: ``python examples/find_overflow.py`` (``--steps``, ``--forward-step``,
``--backward-step`` to move things).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jaxmp  # pylint: disable=g-import-not-at-top
import train_lm  # pylint: disable=g-import-not-at-top
import transformer  # pylint: disable=g-import-not-at-top

CONFIG = transformer.Config(context=32, width=64, depth=2, heads=4)
POLICY = "params=float32,compute=float16,output=float32"
FORWARD_LAYER = ("block_1", "mlp", "down")
BACKWARD_INSIDE = "block_0/mlp/up"  # the gradient into it is amplified, inside block_0/mlp


@jax.custom_vjp
def amplify_gradient(x, exponent):
  """The identity forward; backward, the gradient times ``2**exponent``."""
  del exponent
  return x


amplify_gradient.defvjp(
    lambda x, exponent: (x, exponent),
    lambda exponent, g: ((g.astype(jnp.float32) * jnp.exp2(exponent.astype(jnp.float32)))
                         .astype(g.dtype), None))


def with_forward_fault(params, factor):
  """``params`` with ``block_1/mlp/down``'s kernel times ``factor``."""
  params = jax.tree.map(lambda a: a, params)
  node = params
  for key in FORWARD_LAYER:
    node = node[key]
  node["kernel"] = node["kernel"] * factor
  return params


def gradient_fault(exponent):
  """A Flax interceptor multiplying the gradient into ``block_0/mlp/up`` by 2**exponent."""

  def intercept(next_fun, args, kwargs, context):
    if "/".join(context.module.path) == BACKWARD_INSIDE:
      args = (amplify_gradient(args[0], exponent), *args[1:])
    return next_fun(*args, **kwargs)

  return intercept


def make_step():
  def step(state, tokens, forward_factor, backward_exponent):
    def loss_fn(variables):
      variables = {**variables,
                   "params": with_forward_fault(variables["params"], forward_factor)}
      with nn.intercept_methods(gradient_fault(backward_exponent)):
        return train_lm.loss_fn(state.apply_fn, variables, tokens)

    loss, grads = state.value_and_grad(loss_fn)()
    new_state = state.apply_gradients(grads)
    metrics = jaxmp.tools.training_metrics(grads.params, new_state.opt_state,
                                           nonfinite_trace=grads.nonfinite)
    return new_state, loss, metrics

  return jax.jit(step)


def main(argv=None) -> dict[int, str]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--forward-step", type=int, default=4)
  parser.add_argument("--backward-step", type=int, default=8)
  parser.add_argument("--batch", type=int, default=8)
  args = parser.parse_args(argv)

  corpus = train_lm.load_corpus(max_bytes=200_000)
  data = train_lm.batches(corpus, args.batch, CONFIG.context, seed=0)
  model = jaxmp.linen.mixed_precision(transformer.TransformerLM(CONFIG), jaxmp.PolicyRules(
      POLICY, trace_nonfinite=True))
  first = next(data)
  tx = jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.DynamicLossScale(2.0**10))
  state = jaxmp.linen.TrainState.create(
      apply_fn=model.apply, variables=model.init(jax.random.key(0), first[:, :-1]), tx=tx)
  step = make_step()
  monitor = jaxmp.tools.Monitor()
  print(f"float16 transformer, width {CONFIG.width}, depth {CONFIG.depth}: a forward fault "
        f"at step {args.forward_step}, a backward fault at step {args.backward_step}")

  found, forward_report = {}, None
  for i in range(args.steps):
    factor = np.float32(1e6 if i == args.forward_step else 1.0)
    exponent = np.int32(200 if i == args.backward_step else 0)
    state, loss, metrics = step(state, next(data), factor, exponent)
    skipped = not bool(metrics["last_step_finite"])
    print(f"step {i:3d}  loss {float(loss):8.4f}  scale {float(metrics['loss_scale']):7g}"
          f"{'  skipped' if skipped else ''}")
    for anomaly in monitor.update(metrics, loss, step=i):
      print(f"  {anomaly}")
      if anomaly.kind == "nonfinite_origin":
        found[i] = str(jaxmp.tools.nonfinite_report(metrics["nonfinite_trace"]).origin)
    if i == args.forward_step:
      forward_report = jaxmp.tools.nonfinite_report(metrics["nonfinite_trace"],
                                                    loss_scale=metrics["loss_scale"])
  if forward_report is not None:
    print(f"\nThe step with the forward fault, module by module:\n{forward_report}")
  return found


if __name__ == "__main__":
  main()
