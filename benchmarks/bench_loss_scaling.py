"""Cost of loss scaling: a jitted train step with and without jaxmp.loss_scaling.

An MLP of four 768-wide Dense layers (ReLU between them), batch 256, mean squared
error, Adam, float32. Every variant times the same full train step (forward, backward,
optimizer update, apply_updates), jitted with the parameters and optimizer state
donated, as a training loop runs it:

* ``plain``: ``optax.adam``; the baseline.
* ``jaxmp``: ``jaxmp.loss_scaling(optax.adam, DynamicLossScale())`` with the loss scaled
  through ``get_loss_scale(state).value_and_grad``; the shipped formulation: unscale,
  check with one plain float32 sum per gradient leaf (exact ``all_finite`` fallback
  only when that sum is not finite), then ``lax.cond`` runs the inner update or the
  skip.
* ``cond_unscale_in_branch``: the same, but the unscaling is done inside the taken
  branch (fused by XLA into the inner update) and the check sums the scaled
  gradients (exact when ``scale >= 1``).
* ``cond_all_finite``: the shipped ``lax.cond``, with the finite check done by a
  ``x * 0`` probe per leaf (what ``jaxmp.all_finite`` runs on GPUs and TPUs) instead
  of the plain sum.
* ``naive_select``: the shipped check, then always run ``adam.update`` and
  ``jaxmp.select_tree`` between the new and the old updates/state.
* ``optax_apply_if_finite``: ``optax.apply_if_finite(adam)`` on unscaled gradients
  (no loss scaling at all, only the skip), for reference.

Measurements are interleaved: each round runs every variant for a block of
``--steps`` steps, in an order rotated from round to round, timing every step on its
own (dispatch to ``block_until_ready``). A block during which other processes used
more than ``--max-other-load`` CPU cores (read from ``/proc/stat``) is discarded, and
rounds go on until every variant has ``--blocks`` quiet blocks (or ``--max-seconds``
pass). The table reports the lower quartile (p25) and the median of the kept
per-step times and their ratios to ``plain``.

Run: ``.venv/bin/python benchmarks/bench_loss_scaling.py`` (``--help`` for options;
``--width 8 --batch 4 --blocks 2 --steps 1 --max-other-load inf`` runs a tiny MLP once).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import statistics
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

import jaxmp
from jaxmp._src import tree

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import timing  # pylint: disable=g-import-not-at-top

WIDTH = 768
LAYERS = 4
BATCH = 256


def _initial_state(inner, loss_scale):
  """The ``init`` of every hand-written variant: the shipped ``LossScalingState``."""

  def init(params):
    return jaxmp.LossScalingState(jax.tree_util.tree_map(jnp.array, loss_scale),
                                  inner.init(params), jnp.zeros((), jnp.int32),
                                  jnp.ones((), jnp.bool_), jnp.zeros((), jnp.int32))

  return init


def init_params(key, width: int = WIDTH):
  params = []
  for k in jax.random.split(key, LAYERS):
    w = jax.random.normal(k, (width, width), jnp.float32) / jnp.sqrt(width)
    params.append({"w": w, "b": jnp.zeros((width,), jnp.float32)})
  return params


def loss_fn(params, x, y):
  h = x
  for i, layer in enumerate(params):
    h = h @ layer["w"] + layer["b"]
    if i < LAYERS - 1:
      h = jax.nn.relu(h)
  return jnp.mean((h - y) ** 2)


# ---------------------------------------------------------------------------------------
# Alternative formulations of the skip, for comparison with the shipped one.


def naive_select_loss_scaling(inner, loss_scale):
  """Always runs the inner update, then selects new or old with jaxmp.select_tree.

  The finite check is the shipped one, so that this differs from ``jaxmp`` only in
  how the skip is done.
  """

  init = _initial_state(inner, loss_scale)

  def update(updates, state, params=None):
    grads = state.loss_scale.unscale(updates)
    finite = jaxmp.all_finite(grads)
    new_updates, new_inner = inner.update(grads, state.inner_state, params)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, new_updates)
    new_updates = jaxmp.select_tree(finite, new_updates, zeros)
    new_inner = jaxmp.select_tree(finite, new_inner, state.inner_state)
    return new_updates, jaxmp.LossScalingState(
        state.loss_scale.adjust(finite), new_inner,
        jnp.where(finite, state.skipped_steps, state.skipped_steps + 1), finite,
        jnp.where(finite, 0, state.consecutive_skips + 1))

  return optax.GradientTransformation(init, update)


def cond_all_finite_loss_scaling(inner, loss_scale):
  """lax.cond as shipped, but with the x * 0 probe of the unscaled grads as the check."""

  init = _initial_state(inner, loss_scale)

  def update(updates, state, params=None):
    ls = state.loss_scale
    grads = ls.unscale(updates)
    finite = tree._finite_by_zero_product(*jax.tree_util.tree_leaves(grads))

    def apply_inner():
      return inner.update(grads, state.inner_state, params)

    def skip():
      return jax.tree_util.tree_map(jnp.zeros_like, updates), state.inner_state

    new_updates, new_inner = jax.lax.cond(finite, apply_inner, skip)
    return new_updates, jaxmp.LossScalingState(
        state.loss_scale.adjust(finite), new_inner,
        jnp.where(finite, state.skipped_steps, state.skipped_steps + 1), finite,
        jnp.where(finite, 0, state.consecutive_skips + 1))

  return optax.GradientTransformation(init, update)


def cond_unscale_in_branch_loss_scaling(inner, loss_scale):
  """lax.cond with the unscaling inside the branch; the plain-sum check on scaled grads."""

  init = _initial_state(inner, loss_scale)

  def update(updates, state, params=None):
    ls = state.loss_scale
    total = sum(jnp.sum(g, dtype=jnp.float32) for g in jax.tree_util.tree_leaves(updates))
    finite = jnp.isfinite(total) & (ls.loss_scale >= 1)

    def apply_inner():
      return inner.update(ls.unscale(updates), state.inner_state, params)

    def skip():
      return jax.tree_util.tree_map(jnp.zeros_like, updates), state.inner_state

    new_updates, new_inner = jax.lax.cond(finite, apply_inner, skip)
    return new_updates, jaxmp.LossScalingState(
        ls.adjust(finite), new_inner,
        jnp.where(finite, state.skipped_steps, state.skipped_steps + 1), finite,
        jnp.where(finite, 0, state.consecutive_skips + 1))

  return optax.GradientTransformation(init, update)


# ---------------------------------------------------------------------------------------


class Variant(NamedTuple):
  name: str
  tx: optax.GradientTransformation
  scaled: bool  # whether the loss is scaled through the state's loss scale


def make_step(variant: Variant) -> Callable:
  tx = variant.tx

  def step(params, opt_state, x, y):
    if variant.scaled:
      value_and_grad = jaxmp.get_loss_scale(opt_state).value_and_grad(loss_fn)
    else:
      value_and_grad = jax.value_and_grad(loss_fn)
    loss, grads = value_and_grad(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def variants(lr: float) -> list[Variant]:
  adam = optax.adam(lr)
  scale = jaxmp.DynamicLossScale()
  return [
      Variant("plain", adam, False),
      Variant("jaxmp", jaxmp.loss_scaling(adam, scale), True),
      Variant("cond_unscale_in_branch", cond_unscale_in_branch_loss_scaling(adam, scale), True),
      Variant("cond_all_finite", cond_all_finite_loss_scaling(adam, scale), True),
      Variant("naive_select", naive_select_loss_scaling(adam, scale), True),
      Variant("optax_apply_if_finite", optax.apply_if_finite(adam, 10), False),
  ]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--width", type=int, default=WIDTH, help="width of the MLP's layers")
  parser.add_argument("--batch", type=int, default=BATCH)
  parser.add_argument("--blocks", type=int, default=40,
                      help="quiet blocks to collect per variant")
  parser.add_argument("--steps", type=int, default=5, help="timed steps per block")
  parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
  parser.add_argument("--max-other-load", type=float, default=0.25,
                      help="discard a block if other processes used more CPU cores than this "
                           "while it ran (inf: keep every block)")
  parser.add_argument("--max-seconds", type=float, default=900,
                      help="stop collecting after this long, quiet blocks or not")
  args = parser.parse_args(argv)

  key_p, key_x, key_y = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(key_x, (args.batch, args.width), jnp.float32)
  y = jax.random.normal(key_y, (args.batch, args.width), jnp.float32)
  vs = variants(lr=1e-4)

  states = {}
  steps = {}
  for v in vs:
    params = init_params(key_p, args.width)
    opt_state = v.tx.init(params)
    step = make_step(v)
    for _ in range(args.warmup):
      params, opt_state, loss = step(params, opt_state, x, y)
    jax.block_until_ready(loss)
    states[v.name] = (params, opt_state)
    steps[v.name] = step

  load = timing.OtherLoad()
  times = {v.name: [] for v in vs}
  kept = {v.name: 0 for v in vs}
  total_blocks = 0
  started = time.perf_counter()
  r = 0
  while (min(kept.values()) < args.blocks
         and time.perf_counter() - started < args.max_seconds):
    order = vs[r % len(vs):] + vs[:r % len(vs)]
    r += 1
    for v in order:
      params, opt_state = states[v.name]
      step = steps[v.name]
      block = []
      load.start()
      for _ in range(args.steps):
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, x, y)
        jax.block_until_ready((params, opt_state, loss))
        block.append(time.perf_counter() - start)
      other = load.stop()
      states[v.name] = (params, opt_state)
      total_blocks += 1
      if other <= args.max_other_load:
        times[v.name].extend(block)
        kept[v.name] += 1

  # Every variant must have trained (no skipped step) for the timings to compare like
  # with like.
  for v in vs:
    _, opt_state = states[v.name]
    if v.scaled:
      metrics = jaxmp.loss_scaling_metrics(opt_state)
      assert int(metrics["skipped_steps"]) == 0, (v.name, metrics)

  device = jax.devices()[0]
  print(f"device: jax.devices()[0].device_kind={device.device_kind!r}, {os.cpu_count()} CPU "
        f"cores ({timing.cpu_model()}); jax {jax.__version__}, optax {optax.__version__}")
  print(f"MLP {LAYERS}x{args.width}, batch {args.batch}, Adam, float32, jitted full train "
        f"step with donated state; interleaved blocks of {args.steps} steps; kept "
        f"{sum(kept.values())}/{total_blocks} blocks during which other processes used "
        f"<= {args.max_other_load} cores\n")
  if min(kept.values()) < 2:
    print("Too few quiet blocks to report; raise --max-other-load or --max-seconds.")
    return
  print("| variant | ms/step p25 | ms/step median | ratio vs plain (p25) | "
        "ratio vs plain (median) | blocks |")
  print("| --- | ---: | ---: | ---: | ---: | ---: |")
  plain_q1 = statistics.quantiles(times["plain"], n=4, method="inclusive")[0]
  plain_median = statistics.median(times["plain"])
  for v in vs:
    t = times[v.name]
    q1 = statistics.quantiles(t, n=4, method="inclusive")[0]
    median = statistics.median(t)
    print(f"| {v.name} | {q1 * 1e3:.2f} | {median * 1e3:.2f} | {q1 / plain_q1:.3f} | "
          f"{median / plain_median:.3f} | {kept[v.name]} |")
  return times


if __name__ == "__main__":
  main()
