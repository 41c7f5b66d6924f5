"""fp8 matmuls: jaxmp vs Flax's fp8 vs bf16 vs float32, side by side in one run.

Two workloads, each timed as a jitted forward + backward step (no optimizer):

* ``dense``: one ``nn.Dense`` (no bias) of ``M x K`` inputs by a ``K x N`` kernel: the
  forward GEMM and the two backward GEMMs, ``6 * M * K * N`` flops.
* ``block``: a pre-norm transformer block (attention projections and MLP through the
  layer's dot_general, attention scores and softmax in bf16), GEMM-heavy at the GPU
  preset's sizes.

Variants: ``float32``; ``bf16`` (``dtype=bfloat16``, float32 params, the baseline);
``jaxmp_fp8`` (bf16 compute, ``jaxmp.linen.Fp8DotGeneral`` with delayed scaling, the
sound state update included: ``for_grad`` in the loss, ``merge`` after);
``jaxmp_fp8_current`` (current scaling, no state); ``flax_fp8`` (bf16 compute,
Flax's ``nn.Fp8DirectDotGeneralOp``, state overwritten from its gradient).

On a CPU fp8 is emulated (XLA converts fp8 operands and multiplies in a wider type),
so the CPU preset only checks that the overhead of fp8 stays bounded. On a GPU with
fp8 tensor cores (H100/H200) the GPU preset measures the speed-up and prints TFLOP/s
beside the H100 SXM dense peaks (bf16 989, fp8 1979 TFLOP/s).

Run: ``.venv/bin/python benchmarks/bench_fp8.py`` (CPU, 1024^3 Dense) or
``.venv/bin/python benchmarks/bench_fp8.py --preset gpu`` (8192^3 Dense and a
d_model 4096 block); ``--preset smoke`` runs tiny shapes once (the tests).
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import timing  # pylint: disable=g-import-not-at-top
import jaxmp  # pylint: disable=g-import-not-at-top
from jaxmp import fp8  # pylint: disable=g-import-not-at-top

OWG = fp8.OVERWRITE_WITH_GRADIENT
PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}  # H100 SXM dense

PRESETS = {
    "cpu": dict(dense=(1024, 1024, 1024), block=dict(batch=2, seq=128, d_model=256, heads=4,
                                                       d_ff=1024),
                rounds=5, calls=3),
    "gpu": dict(dense=(8192, 8192, 8192), block=dict(batch=4, seq=2048, d_model=4096, heads=32,
                                                       d_ff=16384),
                rounds=7, calls=10),
    "smoke": dict(dense=(32, 32, 32), block=dict(batch=1, seq=8, d_model=16, heads=2, d_ff=32),
                  rounds=1, calls=1),
}


def variants_of(recipe_length: int, power_of_two: bool = False):
  """name -> (compute dtype, dot_general_cls, whether the state update is jaxmp's)."""
  delayed = fp8.DelayedScaling(amax_history_length=recipe_length, power_of_two=power_of_two)
  return {
      "float32": (jnp.float32, None, None),
      "bf16": (jnp.bfloat16, None, None),
      "jaxmp_fp8": (jnp.bfloat16, functools.partial(jaxmp.linen.Fp8DotGeneral, recipe=delayed), "jaxmp"),
      "jaxmp_fp8_current": (jnp.bfloat16, functools.partial(
          jaxmp.linen.Fp8DotGeneral, recipe=fp8.CurrentScaling()), None),
      "flax_fp8": (jnp.bfloat16, functools.partial(
          nn.Fp8DirectDotGeneralOp, amax_history_length=recipe_length), "flax"),
  }


class Block(nn.Module):
  """Pre-norm transformer block whose projections and MLP go through dot_general_cls."""
  d_model: int
  heads: int
  d_ff: int
  dtype: jnp.dtype
  dot_general_cls: object = None

  @nn.compact
  def __call__(self, x):
    dense = functools.partial(nn.Dense, dtype=self.dtype, dot_general_cls=self.dot_general_cls)
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.MultiHeadDotProductAttention(
        num_heads=self.heads, dtype=self.dtype, qkv_dot_general_cls=self.dot_general_cls,
        out_dot_general_cls=self.dot_general_cls)(h, mask=nn.make_causal_mask(x[..., 0]))
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = dense(self.d_ff)(h)
    h = nn.gelu(h)
    h = dense(self.d_model)(h)
    return x + h


def make_step(model, state_update, loss_scale: float = 1.0):
  """A jitted forward+backward step: (variables, x, g) -> (new variables, dx, loss).

  ``loss_scale`` multiplies the loss and divides the parameter gradients, as loss
  scaling does for float16.
  """

  def loss(params, fp8_state, x, g):
    if state_update == "jaxmp":
      fp8_state = fp8.state.for_grad(fp8_state)
    variables = {"params": params}
    if fp8_state is not None:
      variables[OWG] = fp8_state
    y = model.apply(variables, x)
    return jnp.sum(y.astype(jnp.float32) * g) * loss_scale

  @jax.jit
  def step(variables, x, g):
    fp8_state = variables.get(OWG)
    # value_and_grad: returning the loss keeps the forward GEMM (with jax.grad alone
    # XLA drops it, as the loss is linear in the output and only g * kernel is needed).
    value, (grads, state_ct, dx) = jax.value_and_grad(loss, argnums=(0, 1, 2))(
        variables["params"], fp8_state, x, g)
    if loss_scale != 1.0:
      grads = jax.tree_util.tree_map(lambda t: t / loss_scale, grads)
    new = {"params": grads}
    if state_update == "jaxmp":
      new[OWG] = fp8.state.merge(fp8_state, state_ct, jnp.array(True))
    elif state_update == "flax":
      new[OWG] = state_ct
    return new, dx, value

  return step


def build(workload: str, preset: dict, dtype, dg_cls, state_update, key):
  if workload == "dense":
    m, k, n = preset["dense"]
    model = nn.Dense(n, use_bias=False, dtype=dtype, dot_general_cls=dg_cls)
    x_shape, g_shape = (m, k), (m, n)
  else:
    b = preset["block"]
    model = Block(b["d_model"], b["heads"], b["d_ff"], dtype, dg_cls)
    x_shape = g_shape = (b["batch"], b["seq"], b["d_model"])
  kx, kg, kp = jax.random.split(key, 3)
  x = jax.random.normal(kx, x_shape, jnp.float32).astype(dtype)
  g = jax.random.normal(kg, g_shape, jnp.float32)
  variables = jax.jit(model.init)(kp, x)
  variables = {"params": variables["params"], **({OWG: variables[OWG]} if OWG in variables else {})}
  step = make_step(model, state_update)
  # Two warm steps so that delayed scaling runs with real scales, not the initial 1s.
  for _ in range(2):
    new, _, _ = step(variables, x, g)
    if OWG in variables:
      variables = {**variables, OWG: new[OWG]}

  def run():
    jax.block_until_ready(step(variables, x, g))

  return run


def flops(workload: str, preset: dict) -> float:
  if workload == "dense":
    m, k, n = preset["dense"]
    return 6.0 * m * k * n
  b = preset["block"]
  tokens, d, f = b["batch"] * b["seq"], b["d_model"], b["d_ff"]
  projections = 2 * tokens * (4 * d * d + 2 * d * f)   # qkv + out, two MLP matmuls
  attention = 2 * 2 * b["batch"] * b["seq"] * b["seq"] * d  # scores and weighted sum
  return 3.0 * (projections + attention)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  parser.add_argument("--workloads", default="dense,block")
  parser.add_argument("--variants", default=None,
                      help="comma-separated subset of float32,bf16,jaxmp_fp8,"
                           "jaxmp_fp8_current,flax_fp8")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--calls", type=int, default=None)
  parser.add_argument("--history", type=int, default=1024, help="amax_history_length")
  parser.add_argument("--dense", default=None, help="M,K,N of the dense workload")
  args = parser.parse_args(argv)
  preset = dict(PRESETS[args.preset])
  if args.dense:
    preset["dense"] = tuple(int(v) for v in args.dense.split(","))
  rounds = args.rounds or preset["rounds"]
  calls = args.calls or preset["calls"]
  all_variants = variants_of(args.history)
  names = args.variants.split(",") if args.variants else list(all_variants)
  if hasattr(os, "getloadavg"):
    print(f"load average before: {os.getloadavg()[0]:.2f}")

  results = {}
  for workload in args.workloads.split(","):
    runs = {name: build(workload, preset, *all_variants[name], jax.random.key(0))
            for name in names}
    baseline = "bf16" if "bf16" in runs else names[0]
    result = timing.interleaved(runs, baseline=baseline, rounds=rounds, calls=calls)
    total = flops(workload, preset)
    extra = {}
    for name, t in result.items():
      tflops = total / (t.ms * 1e-3) / 1e12
      peak = PEAK_TFLOPS["fp8" if "fp8" in name else "bf16"]
      row = {"TFLOP/s": f"{tflops:.3g}"}
      if jax.devices()[0].platform == "gpu":
        row["% H100 peak"] = f"{100 * tflops / peak:.1f}"
      if "flax_fp8" in result:
        row["vs flax_fp8"] = f"{t.ms / result['flax_fp8'].ms:.3f}"
      if "float32" in result:
        row["vs float32"] = f"{t.ms / result['float32'].ms:.3f}"
      extra[name] = row
    size = ("x".join(map(str, preset["dense"])) if workload == "dense" else
            ", ".join(f"{k}={v}" for k, v in preset["block"].items()))
    timing.print_table(f"{workload} fwd+bwd ({size}); ratio = ms / {baseline} ms", result, extra)
    if jax.devices()[0].platform == "gpu":
      print(f"peaks (H100 SXM dense): bf16 {PEAK_TFLOPS['bf16']:.0f}, "
            f"fp8 {PEAK_TFLOPS['fp8']:.0f} TFLOP/s")
    results[workload] = result
  if hasattr(os, "getloadavg"):
    print(f"load average after: {os.getloadavg()[0]:.2f}")
  return results


if __name__ == "__main__":
  main()
