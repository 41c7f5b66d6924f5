"""Side-by-side timing for benchmarks: interleaved rounds, medians, ratios.

Every variant is a zero-argument callable that runs one step and blocks on its
result. Rounds run every variant in a rotated order, so slow drift of the machine
(frequency scaling, other load) hits all variants alike; the reported figure for each
variant is the median over rounds of its mean time per call, and its ratio to the
baseline is the median over rounds of the per-round ratios.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable, Mapping, NamedTuple

import jax


class Timing(NamedTuple):
  ms: float       # median over rounds of the mean milliseconds per call
  ratio: float    # median over rounds of (this variant / baseline)


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def device_description() -> str:
  """The device the figures come from, for RESULTS.md."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    return f"CPU: {cpu_model()}, {os.cpu_count()} cores"
  return f"{device.device_kind} ({device.platform})"


def interleaved(variants: Mapping[str, Callable[[], object]], *, baseline: str,
                rounds: int = 7, calls: int = 10, warmup: int = 2) -> dict[str, Timing]:
  """Times each variant in interleaved rounds; returns medians and ratios to baseline."""
  names = list(variants)
  for name in names:
    for _ in range(warmup):
      variants[name]()
  per_round: dict[str, list[float]] = {name: [] for name in names}
  for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
      start = time.perf_counter()
      for _ in range(calls):
        variants[name]()
      per_round[name].append((time.perf_counter() - start) / calls * 1e3)
  base = per_round[baseline]
  return {
      name: Timing(statistics.median(times),
                   statistics.median(t / b for t, b in zip(times, base)))
      for name, times in per_round.items()
  }


def print_table(title: str, timings: Mapping[str, Timing], extra: Mapping[str, Mapping[str, object]] = None) -> None:
  """Prints a table of ms/step and ratios (plus optional extra columns)."""
  extra = extra or {}
  columns = sorted({k for row in extra.values() for k in row})
  print(f"\n{title}  [{device_description()}, jax {jax.__version__}]")
  header = f"{'variant':<28} {'ms/step':>9} {'ratio':>7}" + "".join(f" {c:>12}" for c in columns)
  print(header)
  print("-" * len(header))
  for name, t in timings.items():
    cells = "".join(f" {str(extra.get(name, {}).get(c, '')):>12}" for c in columns)
    print(f"{name:<28} {t.ms:>9.2f} {t.ratio:>7.3f}{cells}")
