"""fp8 quantization on its own: what XLA's kernels move per second on the Llama layer's operands.

An fp8 train step quantizes every GEMM operand: it reads a bfloat16 tensor, takes its
amax (for the scale, or for delayed scaling's history), and writes the fp8 codes in the
layout each GEMM reads, for Hopper's cuBLASLt row-major for one GEMM and transposed
for the other. These kernels are memory-bound, so their figure is bandwidth: bytes
read and written (each operand and result once) over the time. This script times,
side by side (``timing.interleaved``), on the bfloat16 operands of a Llama-3-8B-shaped
layer at 8192 tokens (``--preset gpu``):

* ``copy``: ``-x``, a bfloat16 read and write: the bandwidth a simple kernel reaches;
* ``amax``: ``quantize.amax(x)``, a read;
* ``codes``: ``quantize.quantize(x, E4M3, scale)`` with a given scale (delayed
  scaling's forward): a read and an fp8 write;
* ``codes, both layouts``: the codes and their transpose, both written;
* ``amax, codes, both layouts``: current scaling: the amax, the scale from it, then
  both layouts (two reads of ``x``, counted as such);
* ``fused: amax, codes, both layouts``: jaxmp's fused kernel
  (``jaxmp._src.fp8.fused_quantize``, Pallas Mosaic GPU) with a given scale (delayed
  scaling: the amax for the history, the codes in both layouts, one read). Its bytes are
  a read and two fp8 writes; set against ``codes, both layouts`` (the same writes, no
  amax) and ``amax`` + ``codes, both layouts``, what XLA's fusions take for the same
  work; also with the other tiles of :data:`FUSED_TILES`. It runs only on CUDA
  (Hopper); elsewhere (``--preset smoke`` on a CPU) it is left out, with the reason
  printed.

Prints a Markdown table: ms, TB/s, and TB/s against ``copy``'s. Run on a GPU:
``python benchmarks/bench_quantize.py``; ``--preset smoke`` runs tiny shapes on any
device (the tests run it; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import timing  # noqa: E402  pylint: disable=g-import-not-at-top

from jaxmp._src.fp8 import fused_quantize  # noqa: E402
from jaxmp._src.fp8 import quantize as q  # noqa: E402

SHAPES = {
    "gpu": [(8192, 4096), (8192, 14336), (14336, 4096)],
    "smoke": [(64, 256)],
}
"""``(rows, columns)`` of the bfloat16 operands per preset: the layer's activations at
8192 tokens (model and FFN width) and its largest weight."""


FUSED_TILES = ((128, 128), (128, 256), (256, 128))
"""The fused kernel's tiles measured (its default first): the next device picks one."""


def _both_layouts(codes: jax.Array) -> tuple[jax.Array, jax.Array]:
  return codes, codes.T


def variants(shape: tuple[int, int]) -> dict[str, tuple[callable, int]]:
  """Each variant's ``run()`` (blocking on its result) and the bytes it moves."""
  x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
  scale = jnp.float32(0.5)
  n = x.size

  def current(x):  # the scale is a dequantization multiplier: amax maps to fp8's max
    return _both_layouts(q.quantize(x, q.E4M3, q.amax(x) / q.fp8_max(q.E4M3)))

  fns = {
      "copy": (lambda x: -x, 2 * n + 2 * n),
      "amax": (q.amax, 2 * n),
      "codes": (lambda x: q.quantize(x, q.E4M3, scale), 2 * n + n),
      "codes, both layouts": (lambda x: _both_layouts(q.quantize(x, q.E4M3, scale)),
                              2 * n + 2 * n),
      "amax, codes, both layouts": (current, 2 * (2 * n) + 2 * n),
  }
  if fused_unavailable(shape) is None:
    for tile in FUSED_TILES:
      name = "fused: amax, codes, both layouts" + (
          "" if tile == fused_quantize.TILE else f" (tile {tile[0]}x{tile[1]})")
      fns[name] = (functools.partial(
          lambda x, tile: fused_quantize.quantize_2d(x, q.E4M3, scale, tile=tile), tile=tile),
                   2 * n + 2 * n)
  out = {}
  for name, (fn, moved) in fns.items():
    jitted = jax.jit(fn)
    out[name] = (functools.partial(lambda f: jax.block_until_ready(f(x)), jitted), moved)
  return out


def fused_unavailable(shape: tuple[int, int]) -> str | None:
  """Why the fused kernel cannot run here at ``shape`` (``None``: it can)."""
  if jax.default_backend() != "gpu":
    return f"the kernel runs on CUDA GPUs only (the backend here is {jax.default_backend()})"
  if not fused_quantize.available():
    return "this JAX's Pallas Mosaic GPU back end lacks what the kernel uses"
  if not fused_quantize.supports(shape, jnp.bfloat16):
    return f"not a multiple of the kernel's tile {fused_quantize.TILE}"
  return None


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", choices=sorted(SHAPES), default="gpu")
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--calls", type=int, default=20)
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__}; {timing.device_description()}")
  for shape in SHAPES[args.preset]:
    reason = fused_unavailable(shape)
    if reason is not None:
      print(f"variant 'fused: amax, codes, both layouts' left out at {shape}: {reason}")
  print("\n| operand (bfloat16) | variant | ms | TB/s | vs copy's TB/s |\n"
        "|---|---|---:|---:|---:|")
  results = {}
  for shape in SHAPES[args.preset]:
    steps = variants(shape)
    timings = timing.interleaved({name: run for name, (run, _) in steps.items()},
                                 baseline="copy", rounds=args.rounds, calls=args.calls)
    tbps = {name: steps[name][1] / (t.ms * 1e-3) / 1e12 for name, t in timings.items()}
    for name, t in timings.items():
      print(f"| {shape[0]}x{shape[1]} | {name} | {t.ms:.4f} | {tbps[name]:.2f} | "
            f"{tbps[name] / tbps['copy']:.2f} |")
    results[shape] = {name: {"ms": t.ms, "tbps": tbps[name]} for name, t in timings.items()}
  return results


if __name__ == "__main__":
  main()
