"""BlockScaling's GEMM on a GPU: jaxmp's block-scaled fp8 kernels beside bf16 and per-tensor fp8.

At the GEMM shapes of a Llama-3-8B layer (``llama_layer.py``; 8192 tokens: the
q/o, k/v, gate/up and down projections, and a 4096 x 4096 x 8192 weight-gradient-like
product) it times, side by side (``timing.interleaved``):

* ``bf16``: a bfloat16 GEMM with a bfloat16 output (what the bf16 policy runs);
* ``fp8 per-tensor``: the fp8 operands with one scale, bfloat16 output (cuBLASLt);
* ``block <name>``: jaxmp's kernel (``jaxmp/_src/fp8/block_gemm.py``) on 1x128
  tiled activations and 128x128 blocked weights (the forward and input-gradient
  GEMMs' layout), for each schedule of :data:`CONFIGS` (keyword arguments of
  ``block_gemm.gemm``: tile, warps, stages, ``prefetch``, ``one_b_scale_per_tile``,
  ``group_columns``; the first is its defaults), and any :data:`BASELINES`;
* ``mosaic <name>``: jaxmp's Mosaic GPU kernel (``jaxmp/_src/fp8/block_gemm_mosaic.py``)
  on the same operands, for each schedule of :data:`MOSAIC_CONFIGS` (keyword arguments
  of ``block_gemm_mosaic.gemm``: tile, stages, split, ``group_columns``);
* ``block 1x128 x 1x128``, ``mosaic 1x128 x 1x128``: each kernel at its default
  configuration on two 1x128-tiled operands (the weight-gradient GEMM's layout).

After each shape's table a line names each kernel's fastest schedule and its speed
against bf16 and the other kernel's: the figures that decide which kernel the chip
table (``jaxmp/_src/fp8/chips.py``, ``HOPPER_BLOCK_FP8_KERNELS``) puts first, and
which schedule becomes the Mosaic kernel's default.

Each kernel's product is checked against the float32 product of the dequantized
operands (largest difference over the largest magnitude: bfloat16 output rounding
is 2^-9 of a value). Prints a Markdown table of ms, TFLOP/s and the ratio to bf16.

Run on a GPU: ``python benchmarks/bench_block_gemm.py`` (``--preset gpu``; ``--shapes
8192x4096x4096,...`` for some only). ``--preset smoke``: tiny shapes with the kernels
interpreted (Pallas' interpreter, Mosaic GPU's; any platform; the tests run it), each
at its first two schedules.
"""

from __future__ import annotations

import argparse
import functools
import math

import jax
import jax.numpy as jnp
import timing  # pylint: disable=g-import-not-at-top

from jaxmp._src.fp8 import block_gemm
from jaxmp._src.fp8 import block_gemm_mosaic
from jaxmp._src.fp8 import grouped
from jaxmp._src.fp8 import quantize as q

SHAPES = {
    "gpu": [(8192, 4096, 4096), (8192, 1024, 4096), (8192, 14336, 4096),
            (8192, 4096, 14336), (4096, 4096, 8192)],
    "smoke": [(64, 128, 256)],
}
"""``(M, N, K)`` per preset: tokens x output features x contracted."""

CONFIGS = {
    "defaults": {},
    "no prefetch": {"prefetch": False},
    "weight scales per row": {"one_b_scale_per_tile": False},
    "column order": {"group_columns": 1},
    "2 stages": {"num_stages": 2},
    "4 stages": {"num_stages": 4},
    "128x128/8w": {"tile": (128, 128), "num_warps": 8},
    "untuned": {"num_stages": 4, "prefetch": False, "one_b_scale_per_tile": False,
                "group_columns": 1},
}
"""Schedules of the kernel to time, by name: keyword arguments of :func:`block_gemm.gemm`
changed from its defaults (64 x 128 tiles, 4 warps, 3 stages, ``prefetch``, one weight
scale per tile, 16 columns grouped). "untuned": the schedule before they were measured,
except that the scales are loaded as vectors (benchmarks/RESULTS.md, fourth H200 run)."""

MOSAIC_CONFIGS = {
    "defaults": {},
    "3 stages": {"stages": 3},
    "5 stages": {"stages": 5},
    "64x256, columns split": {"tile": (64, 256), "split": block_gemm_mosaic.COLUMNS},
    "column order": {"group_columns": 1},
}
"""Schedules of the Mosaic kernel to time, by name: keyword arguments of
:func:`block_gemm_mosaic.gemm` changed from its defaults (128 x 128 tiles shared by
rows, 4 stages, 8 columns grouped). None has run on a GPU; each compiles for an H100
within its shared memory (5 stages of 128 x 128 is the most that fits; 6 does not:
tests/fp8/test_block_gemm_mosaic.py compiles the defaults, 5 stages and 64 x 256)."""

KERNELS = {"block": (block_gemm.gemm, CONFIGS), "mosaic": (block_gemm_mosaic.gemm, MOSAIC_CONFIGS)}
"""Each kernel's family name in the table: its function and its schedules."""

BASELINES: dict = {}
"""Other kernels to time beside these, ``{name: gemm-like function}`` (e.g. an earlier
version of ``block_gemm.gemm``, to compare the two in one run)."""

TILE, BLOCK = grouped.Grouping(1, 128), grouped.Grouping(128, 128)


def _operands(m: int, n: int, k: int, weight: grouped.Grouping):
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (1, m, k), jnp.float32)
  w = jax.random.normal(kw, (1, n, k), jnp.float32)
  quantized = [grouped.quantize(v, g, q.E4M3, grouped.scales(v, g, q.E4M3))
               for v, g in ((x, TILE), (w, weight))]
  return x, w, quantized


def variants(m: int, n: int, k: int, interpret: bool, only: set[str] | None = None):
  """``{name: (fn, check)}``: zero-argument steps and each kernel's relative error.

  ``only``: the kernels' schedules to time, by name (``None``: every one); bf16,
  per-tensor fp8 and each kernel on 1x128 x 1x128 operands are always timed.
  """
  x, w, (a, b) = _operands(m, n, k, BLOCK)
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  exact = jnp.einsum("bpc,bqc->bpq", grouped.dequantize(a, TILE),
                     grouped.dequantize(b, BLOCK), precision="highest")
  error = lambda out: float(jnp.max(jnp.abs(out.astype(jnp.float32) - exact))
                            / jnp.max(jnp.abs(exact)))
  bf16 = jax.jit(lambda x, w: jnp.einsum("bpc,bqc->bpq", x, w))
  per_tensor = jax.jit(lambda a, b: jax.lax.dot_general(
      a, b, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.bfloat16)
                       * jnp.bfloat16(0.5))
  steps = {"bf16": (lambda: jax.block_until_ready(bf16(xb, wb)), None),
           "fp8 per-tensor": (lambda: jax.block_until_ready(per_tensor(a.data, b.data)), None)}
  kernels = {}
  for family, (gemm, configs) in KERNELS.items():
    configs = dict(list(configs.items())[:2]) if interpret else configs
    kernels.update({f"{family} {name}": functools.partial(gemm, **kwargs)
                    for name, kwargs in configs.items()
                    if only is None or f"{family} {name}" in only})
  kernels.update(BASELINES)
  for name, kernel in kernels.items():
    fn = jax.jit(functools.partial(kernel, grouping_b=BLOCK, out_dtype=jnp.bfloat16,
                                   interpret=interpret))
    steps[name] = (functools.partial(lambda f: jax.block_until_ready(f(a, b)), fn),
                   error(fn(a, b)))
  _, _, (a2, b2) = _operands(m, n, k, TILE)
  exact2 = jnp.einsum("bpc,bqc->bpq", grouped.dequantize(a2, TILE), grouped.dequantize(b2, TILE),
                      precision="highest")
  for family, (gemm, _) in KERNELS.items():
    fn = jax.jit(functools.partial(gemm, grouping_b=TILE, out_dtype=jnp.bfloat16,
                                   interpret=interpret))
    steps[f"{family} 1x128 x 1x128"] = (
        functools.partial(lambda f: jax.block_until_ready(f(a2, b2)), fn),
        float(jnp.max(jnp.abs(fn(a2, b2).astype(jnp.float32) - exact2))
              / jnp.max(jnp.abs(exact2))))
  return steps


def fastest(timings: dict) -> dict[str, tuple[str, float]]:
  """``{family: (variant, ms)}``: each kernel's fastest schedule at ``B x 128x128`` blocks.

  Example:
    >>> t = lambda ms: type("T", (), {"ms": ms})
    >>> fastest({"bf16": t(2.0), "block defaults": t(1.5), "mosaic defaults": t(1.2),
    ...          "mosaic 3 stages": t(1.1), "mosaic 1x128 x 1x128": t(0.5)})
    {'block': ('block defaults', 1.5), 'mosaic': ('mosaic 3 stages', 1.1)}
  """
  best = {}
  for name, t in timings.items():
    family = name.split(" ", 1)[0]
    if family in KERNELS and not name.endswith("1x128 x 1x128") and (
        family not in best or t.ms < best[family][1]):
      best[family] = (name, t.ms)
  return best


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", choices=sorted(SHAPES), default="gpu")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--calls", type=int, default=10)
  parser.add_argument("--shapes", help="only these M x N x K, e.g. 8192x4096x4096,8192x14336x4096")
  parser.add_argument("--variants", help="only these schedules of the kernels, semicolon-"
                      "separated, e.g. 'block defaults;mosaic defaults' (default: all)")
  args = parser.parse_args(argv)
  only = None if args.variants is None else set(args.variants.split(";"))
  known = {f"{family} {name}" for family, (_, configs) in KERNELS.items() for name in configs}
  if only is not None and not only <= known:
    parser.error(f"unknown variant(s) {sorted(only - known)}; accepted: {sorted(known)}")
  interpret = jax.devices()[0].platform != "gpu"
  print(f"jax {jax.__version__}; {timing.device_description()}"
        + ("; kernel interpreted (no GPU)" if interpret else ""))
  print("\n| M x N x K | variant | ms | TFLOP/s | vs bf16 | max error / max |\n"
        "|---|---|---:|---:|---:|---:|")
  results = {}
  shapes = SHAPES[args.preset] if not args.shapes else [
      tuple(int(d) for d in shape.split("x")) for shape in args.shapes.split(",")]
  for m, n, k in shapes:
    steps = variants(m, n, k, interpret, only)
    timings = timing.interleaved({name: fn for name, (fn, _) in steps.items()},
                                 baseline="bf16", rounds=args.rounds, calls=args.calls)
    flops = 2 * math.prod((m, n, k))
    for name, t in timings.items():
      check = steps[name][1]
      print(f"| {m}x{n}x{k} | {name} | {t.ms:.3f} | {flops / t.ms / 1e9:.0f} | "
            f"{1 / t.ratio:.2f}x | {'' if check is None else f'{check:.1e}'} |")
    results[(m, n, k)] = {name: (t, steps[name][1]) for name, t in timings.items()}
  print()  # after the table: each shape's fastest schedule of each kernel
  for (m, n, k), rows in results.items():
    timings = {name: t for name, (t, _) in rows.items()}
    best = fastest(timings)
    print(f"{m}x{n}x{k} fastest: " + "; ".join(
        f"{variant} {timings['bf16'].ms / ms:.2f}x bf16" for variant, ms in best.values())
          + (f"; mosaic / triton {best['block'][1] / best['mosaic'][1]:.2f}x"
             if len(best) == 2 else ""))
  return results


if __name__ == "__main__":
  main()
