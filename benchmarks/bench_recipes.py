"""fp8 recipes side by side: quality on the demo LM, and what each compiles to.

Two parts, either or both (``--parts``):

* ``quality``: the demo transformer (``examples/train_lm.py``: same data, initial
  weights, seed, clipped AdamW schedule) trained in bfloat16 and, for each recipe,
  bfloat16 with that recipe on every Dense/DenseGeneral but the output head (the
  demo's fp8 rule), through ``jaxmp.linen.TrainState``. Prints the validation loss of
  each against bfloat16's. On a CPU the fp8 GEMMs are emulated (the numerics are the
  recipe's, the speed is not).
* ``support``: a 512^3 fp8 Dense forward + backward (three GEMMs) per recipe, compiled
  deviceless for an H100 (sm_90), a B200 (sm_100) and, with libtpu, a TPU v7; from the
  optimized HLO, which GEMMs run as fp8 (or MX) GEMMs and which fall back, and whether
  jaxmp warned (``jaxmp.fp8.Fp8FallbackWarning``). Needs JAX's CUDA plugin: run it with
  ``make gpu-report``'s environment, ``JAX_PLATFORMS=cpu .venv-cuda/bin/python
  benchmarks/bench_recipes.py --parts support``.

Run: ``.venv/bin/python benchmarks/bench_recipes.py`` (quality, a few minutes on a
2-core CPU); ``--steps`` shortens it, ``--recipes`` picks recipes, ``--preset`` the
demo's model size (``smoke``: a tiny model, for the tests).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import warnings

import flax.linen as nn
import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import jaxmp  # pylint: disable=g-import-not-at-top
import train_lm  # pylint: disable=g-import-not-at-top
from jaxmp import fp8  # pylint: disable=g-import-not-at-top

POLICY = "params=float32,compute=bfloat16,output=float32"

RECIPES = {
    "per-tensor delayed": fp8.DelayedScaling(),
    "per-tensor delayed, power-of-two": fp8.DelayedScaling(power_of_two=True),
    "per-tensor current": fp8.CurrentScaling(),
    "rowwise": fp8.RowwiseScaling(),
    "rowwise, bf16 weight gradient": fp8.GemmRecipes(
        forward=fp8.RowwiseScaling(), input_grad=fp8.RowwiseScaling()),
    "torchao rowwise_with_gw_hp": fp8.GemmRecipes.rowwise_with_gw_hp(),
    "block 1x128 / 128x128": fp8.BlockScaling(),
    "MXFP8": fp8.MXScaling(),
    "MXFP8, ceil scales": fp8.MXScaling(scale_rounding="ceil"),
    "MXFP8, rceil scales": fp8.MXScaling(scale_rounding="rceil"),
    "MXFP8, even scales": fp8.MXScaling(scale_rounding="even"),
}


def rules_for(recipe) -> jaxmp.PolicyRules:
  """The demo's fp8 rule with ``recipe``: every Dense/DenseGeneral but the head."""
  return jaxmp.PolicyRules(POLICY, [
      jaxmp.Rule("head"),
      jaxmp.Rule((nn.Dense, nn.DenseGeneral), fp8=recipe),
  ])


def quality(steps: int | None, seed: int, preset_name: str, recipes: dict) -> None:
  preset = train_lm.PRESETS[preset_name]
  config = preset["config"]
  steps = steps or preset["steps"]
  args = argparse.Namespace(steps=steps, batch=preset["batch"], lr=preset["lr"], seed=seed)
  corpus = train_lm.load_corpus()
  split = int(len(corpus) * 0.95)
  val_stream = train_lm.batches(corpus[split:], args.batch, config.context, seed=12345)
  val_batches = [next(val_stream) for _ in range(preset["eval_batches"])]
  runs = [train_lm.Run("bfloat16", POLICY, jaxmp.NoOpLossScale)]
  runs += [train_lm.Run(name, rules_for(recipe), jaxmp.NoOpLossScale)
           for name, recipe in recipes.items()]
  results = []
  with warnings.catch_warnings():
    # On a CPU every fine-grained recipe warns that its GEMMs are emulated.
    warnings.simplefilter("ignore", fp8.Fp8FallbackWarning)
    for run in runs:
      results.append(train_lm.train(run, args, config, corpus[:split], val_batches,
                                    preset.get("fused_attention", False)))
  base = results[0]
  device = jax.devices()[0]
  print(f"\nfp8 recipes on the demo LM: {steps} steps, batch {args.batch} x {config.context}, "
        f"width {config.width}, depth {config.depth}; device {device.platform} "
        f"({device.device_kind}); jax {jax.__version__}")
  header = f"{'run':<34} {'train':>7} {'val':>7} {'val vs bf16':>11}"
  print(header + "\n" + "-" * len(header))
  for r in results:
    delta = (r["val"] - base["val"]) / base["val"] * 100
    print(f"{r['name']:<34} {r['train']:>7.4f} {r['val']:>7.4f} {delta:>+10.2f}%")


def support(recipes: dict) -> None:
  from jaxmp._src.tools import audit  # pylint: disable=g-import-not-at-top
  from jaxmp._src.tools import targets  # pylint: disable=g-import-not-at-top
  chips = ["h100", "b200"] + (["v7"] if targets.installed("libtpu") else [])
  print(f"\nWhat the GEMMs of a 512^3 fp8 Dense forward + backward compile to (deviceless, "
        f"jax {jax.__version__}): fp8 = fp8 GEMM, mx = MX block-scaled GEMM, otherwise "
        f"the dtype the GEMM falls back to; 'warns' = Fp8FallbackWarning at use\n")
  print("| recipe | " + " | ".join(chips) + " |\n|---|" + "---|" * len(chips))
  for name, recipe in recipes.items():
    cells = []
    for chip in chips:
      kinds, warned = audit.compiled_gemms(recipe, chip)
      cells.append(", ".join(kinds) + (" (warns)" if warned else ""))
    print(f"| {name} | " + " | ".join(cells) + " |")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--parts", default="quality", help="quality,support")
  parser.add_argument("--steps", type=int, help="training steps (default: the preset's)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--preset", choices=sorted(train_lm.PRESETS), default="cpu",
                      help="the demo's model and batch size (quality)")
  parser.add_argument("--recipes", nargs="*", choices=list(RECIPES), metavar="RECIPE",
                      help=f"names of the recipes to run (default: all): {list(RECIPES)}")
  args = parser.parse_args(argv)
  recipes = {name: RECIPES[name] for name in args.recipes or RECIPES}
  parts = args.parts.split(",")
  unknown = set(parts) - {"quality", "support"}
  if unknown:
    parser.error(f"unknown parts {sorted(unknown)}; accepted: quality, support")
  if "quality" in parts:
    quality(args.steps, args.seed, args.preset, recipes)
  if "support" in parts:
    support(recipes)


if __name__ == "__main__":
  main()
