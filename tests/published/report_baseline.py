"""Baseline: the published models unwrapped in float32, then under jaxmp's default bf16 policy.

Run from the repository root: ``python -m tests.published.report_baseline`` (``-v``
also lists every wrapped matmul with its operand shapes and dtypes).

For each model of :mod:`tests.published.models` it runs the forward unwrapped (train
mode, and one decode step where the model has a cache), then wraps the same model with
``jaxmp.linen.mixed_precision`` / ``jaxmp.nnx.mixed_precision`` and the policy
``params=float32,compute=bfloat16,output=float32``, traces the forward with
``jax.make_jaxpr`` and counts the matmuls (``dot_general``, ``conv_general_dilated``,
nested jaxprs included) by operand dtype. A model whose wrapped run raises is reported
with the error. It only traces the wrapped runs (nothing is compiled for them).
"""

from __future__ import annotations

import sys
import time
import traceback

import jax
import jax.numpy as jnp
from flax import nnx

import jaxmp
from tests.published import matmuls
from tests.published import models as registry

POLICY = "params=float32,compute=bfloat16,output=float32"


def _linen_closure(entry, model, key, batch, variant):
  """A function of the variables running `variant` ("train" or "decode"), and its args."""
  variables = entry.init(model, key, batch)
  if variant == "train":
    return (lambda v: entry.forward(model, v, batch, "train", key)[0]), variables
  cache = entry.decode.init_cache(model, key, batch)
  return (lambda v: entry.decode.step(model, v, cache, batch)[0]), variables


def _nnx_closure(entry, model, key, batch, variant):
  """A function of the model's state running `variant`, and the state (split/merge)."""
  if variant == "train":
    fn = lambda m: entry.forward(m, batch, "train", key)
  else:
    cache = entry.decode.init_cache(model, batch)
    fn = lambda m: entry.decode.step(m, cache, batch)[0]
  graphdef, state = nnx.split(model)
  return (lambda s: fn(nnx.merge(graphdef, s))), state


def _build(entry, variant, wrap):
  key = jax.random.key(0)
  batch = entry.batch(jax.random.key(1))
  if entry.framework == "linen":
    model = entry.module("decode" if variant == "decode" else "train")
    if wrap:
      model = jaxmp.linen.mixed_precision(model, POLICY)
    return _linen_closure(entry, model, key, batch, variant)
  model = entry.module(nnx.Rngs(0))
  if wrap:
    model = jaxmp.nnx.mixed_precision(model, POLICY)
  return _nnx_closure(entry, model, key, batch, variant)


def _short(exc: BaseException) -> str:
  text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
  return text[:300] + ("..." if len(text) > 300 else "")


def run(entries=registry.MODELS) -> list[dict]:
  rows = []
  for entry in entries:
    variants = ["train"] + (["decode"] if entry.decode else [])
    for variant in variants:
      row = {"model": entry.name, "framework": entry.framework, "variant": variant}
      start = time.perf_counter()
      try:  # unwrapped float32: must run
        fn, arg = _build(entry, variant, wrap=False)
        out = jax.jit(fn)(arg)
        row["shape"] = tuple(out.shape)
        row["f32_dtype"] = out.dtype.name
        row["f32_counts"] = matmuls.count_matmuls(jax.make_jaxpr(fn)(arg))
      except Exception as exc:  # pylint: disable=broad-except
        row["f32_error"] = _short(exc)
        traceback.print_exc(file=sys.stderr)
      try:  # wrapped bf16 policy: trace only
        fn, arg = _build(entry, variant, wrap=True)
        jaxpr = jax.make_jaxpr(fn)(arg)
        row["out_dtype"] = jaxpr.out_avals[0].dtype.name
        row["counts"] = matmuls.count_matmuls(jaxpr)
        row["matmuls"] = matmuls.describe_matmuls(jaxpr)
      except Exception as exc:  # pylint: disable=broad-except
        row["error"] = _short(exc)
      row["seconds"] = time.perf_counter() - start
      rows.append(row)
  return rows


def _table(rows: list[dict]) -> str:
  header = ("model", "fw", "variant", "f32 run: out shape", "#matmuls", "wrapped: #matmuls",
            "#bf16", "#f32", "#other", "out dtype", "s")
  lines = []
  for r in rows:
    counts = r.get("counts")
    if counts is None:
      cells = ("-", "-", "-", "-", "FAILED")
    else:
      total = sum(counts.values())
      bf16, f32 = counts.get("bfloat16", 0), counts.get("float32", 0)
      cells = (total, bf16, f32, total - bf16 - f32, r["out_dtype"])
    shape = r.get("shape", "FAILED")
    f32_total = sum(r["f32_counts"].values()) if "f32_counts" in r else "-"
    lines.append((r["model"], r["framework"], r["variant"], str(shape), str(f32_total))
                 + tuple(map(str, cells)) + (f"{r['seconds']:.1f}",))
  widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
  fmt = "  ".join(f"{{:<{w}}}" for w in widths)
  out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
  out += [fmt.format(*line) for line in lines]
  return "\n".join(out)


def main() -> None:
  start = time.perf_counter()
  verbose = "-v" in sys.argv[1:]
  rows = run()
  print(f"jax {jax.__version__}; policy {POLICY!r}; matmul = dot_general or "
        "conv_general_dilated equation (scan bodies counted once)\n")
  print(_table(rows))
  print()
  for r in rows:
    extra = {k: v for k, v in (r.get("counts") or {}).items()
             if k not in ("bfloat16", "float32")}
    if extra:
      print(f"{r['model']} [{r['variant']}] other operand dtypes: {dict(extra)}")
    if "f32_error" in r:
      print(f"{r['model']} [{r['variant']}] FAILS UNWRAPPED: {r['f32_error']}")
    if "error" in r:
      print(f"{r['model']} [{r['variant']}] FAILS WRAPPED: {r['error']}")
    if verbose and "matmuls" in r:
      print(f"{r['model']} [{r['variant']}] wrapped matmuls:")
      print("\n".join("  " + line for line in r["matmuls"]))
  print(f"\ntotal {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
  main()
