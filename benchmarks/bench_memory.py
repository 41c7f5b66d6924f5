"""Memory per parameter against validation loss: jaxmp.optim on the demo LM, side by side.

Trains the demo transformer (``examples/train_lm.py``: model, data, schedule, seed)
with each way of storing params and AdamW's state in ``examples/train_memory.py``:
float32, (a) today's mixed precision, (b) bfloat16 params + float32 master (full
copy, or 16-bit remainder) + bfloat16 moments, (c) pure bfloat16 with round-to-nearest,
(d) with stochastic rounding, (e) with Kahan summation, and (a)/(b) with AdamW's
moments in 8 bits (``jaxmp.optim.quantized_moments``); at two settings:

* the demo's: 600 steps, peak learning rate 2e-3 (cosine to 2e-4);
* a low learning rate: 300 steps, peak 3e-4 (cosine to 3e-5), where most AdamW
  updates are below half a bfloat16 ulp of their weight.

and prints one table: bytes per parameter of params, master, optimizer state and
gradients (``jaxmp.tools.memory_report``), params + master + optimizer state against
(a), the compiled step's peak memory (``compiled.memory_analysis()``: arguments +
outputs + temporaries - aliased) against (a), and the validation loss of each setting
against float32; then the share of updates round-to-nearest drops in (c).

Run: ``.venv/bin/python benchmarks/bench_memory.py`` (2-core CPU: about 6 minutes;
``--settings demo`` for the first only; ``--runs`` to pick runs; ``--preset smoke --steps
2`` for the demo's tiny test model).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import jax  # pylint: disable=g-import-not-at-top
import train_lm  # pylint: disable=g-import-not-at-top
import train_memory  # pylint: disable=g-import-not-at-top

SETTINGS = {
    "demo": dict(steps=600, lr=2e-3),
    "low-lr": dict(steps=300, lr=3e-4),
}
BASELINE, REFERENCE = "(a) mixed", "float32"


def ratio(a: float, b: float) -> str:
  return f"{a / b:.2f}x"


def print_table(rows: dict[str, train_memory.Row], vals: dict[str, dict[str, float]]) -> None:
  base = rows[BASELINE]
  base_state = sum(base.bytes_per_param[k] for k in ("params", "master", "optimizer state"))
  header = [f"{'run':<28}", f"{'params':>6}", f"{'master':>6}", f"{'opt':>5}", f"{'grads':>5}",
            f"{'p+m+opt':>7}", f"{'vs (a)':>6}", f"{'peak MiB':>8}", f"{'vs (a)':>6}"]
  for setting in vals:
    header += [f"{'val ' + setting:>11}", f"{'vs f32':>7}"]
  print("\n" + "  ".join(header) + "\n" + "-" * len("  ".join(header)))
  for name, row in rows.items():
    b = row.bytes_per_param
    state = b["params"] + b["master"] + b["optimizer state"]
    cells = [f"{name:<28}", f"{b['params']:>6.2f}", f"{b['master']:>6.2f}",
             f"{b['optimizer state']:>5.2f}", f"{b['gradients']:>5.2f}", f"{state:>7.2f}",
             f"{ratio(state, base_state):>6}", f"{row.peak_bytes / 2**20:>8.2f}",
             f"{ratio(row.peak_bytes, base.peak_bytes):>6}"]
    for setting, val in vals.items():
      delta = (val[name] - val[REFERENCE]) / val[REFERENCE] * 100
      cells += [f"{val[name]:>11.4f}", f"{delta:>+6.2f}%"]
    print("  ".join(cells))
  print("(bytes per parameter; opt = optimizer state besides the master: moments, Kahan's "
        "compensation, counters; peak = arguments + outputs + temporaries - aliased)")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--settings", nargs="*", choices=sorted(SETTINGS),
                      default=list(SETTINGS))
  parser.add_argument("--preset", choices=sorted(train_lm.PRESETS), default="cpu",
                      help="the demo's model (and the default batch)")
  parser.add_argument("--batch", type=int)
  parser.add_argument("--steps", type=int, help="steps of every setting (default: its own)")
  parser.add_argument("--runs", nargs="*", choices=[run.name for run in train_memory.RUNS],
                      metavar="RUN", help=f"runs besides {REFERENCE!r} and {BASELINE!r}, which "
                      "the table compares against (default: all)")
  args = parser.parse_args(argv)
  runs = [run for run in train_memory.RUNS
          if not args.runs or run.name in (REFERENCE, BASELINE, *args.runs)]
  preset = train_lm.PRESETS[args.preset]
  args.batch = args.batch or preset["batch"]
  start = time.perf_counter()
  data = train_memory.load_data(args.batch, args.preset)
  device = jax.devices()[0]
  print(f"device {device.platform} ({device.device_kind}), {jax.device_count()} device(s); "
        f"jax {jax.__version__}; batch {args.batch} x {preset['config'].context} tokens")

  settings = {name: {**SETTINGS[name], "steps": args.steps or SETTINGS[name]["steps"]}
              for name in args.settings}
  rows, vals, lost = {}, {}, {}
  for setting in args.settings:
    results = train_memory.train_runs(runs, batch=args.batch, seed=train_memory.SEED,
                                      data=data, preset=args.preset, **settings[setting])
    vals[setting] = {r["name"]: r["val"] for r in results}
    for result in results:
      rows.setdefault(result["name"], train_memory.report(result))
      if result["name"] == train_memory.NEAREST:
        lost[setting] = train_memory.lost_share(result, data[1][0])

  print_table(rows, vals)
  for setting, share in lost.items():
    print(f"{train_memory.NEAREST}, {setting} ({settings[setting]['steps']} steps, peak LR "
          f"{settings[setting]['lr']:g}): round-to-nearest drops {100 * share:.1f}% of the "
          "nonzero updates of one more step at the end")
  print(f"(total {time.perf_counter() - start:.0f} s)")
  return rows, vals


if __name__ == "__main__":
  main()
