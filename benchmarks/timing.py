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


class OtherLoad:
  """CPU time used by *other* processes while a block of steps ran, in cores.

  Linux only (``/proc/stat``); elsewhere it reports 0 and nothing is filtered. The
  machine this was written on is shared with other jobs that come and go; a block
  that ran next to one of them measures the contention, not the step.
  """

  def __init__(self):
    self.available = os.path.exists("/proc/stat")
    self._hz = os.sysconf("SC_CLK_TCK") if self.available else 1

  def _snapshot(self):
    wall = time.perf_counter()
    own = sum(os.times()[:2])  # user + system time of every thread of this process
    if not self.available:
      return wall, own, own
    with open("/proc/stat") as f:
      ticks = [int(v) for v in f.readline().split()[1:9]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / self._hz  # all but idle and iowait
    return wall, own, busy

  def start(self):
    self._begin = self._snapshot()

  def stop(self) -> float:
    (w0, own0, busy0), (w1, own1, busy1) = self._begin, self._snapshot()
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / (w1 - w0)


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



class QuietTiming(NamedTuple):
  p25_ms: float       # lower quartile of the kept per-step times
  median_ms: float    # their median
  p25_ratio: float    # p25 / the baseline's p25
  paired_ratio: float  # median over rounds of (block mean / the baseline's block mean)
  cpu_ms: float       # median over kept blocks of this process's CPU time per step
  cpu_ratio: float    # median over rounds of (block CPU time / the baseline's)
  blocks: int         # quiet blocks kept


def quiet_blocks(variants: Mapping[str, Callable[[], object]], *, baseline: str, blocks: int = 30,
                 steps: int = 5, max_other_load: float = 0.25, max_seconds: float = 600,
                 warmup: int = 2) -> dict[str, QuietTiming]:
  """Times variants in interleaved blocks, keeping the blocks no other process disturbed.

  Each round runs a block of ``steps`` calls of every variant, in an order rotated from
  round to round, timing each call on its own. A block during which other processes
  used more than ``max_other_load`` CPU cores (:class:`OtherLoad`) is dropped; rounds go
  on until every variant has ``blocks`` kept blocks or ``max_seconds`` have passed. The
  paired ratio compares blocks of the same round (both kept), which cancels the drift
  of a shared machine between rounds. CPU time (this process's, every thread) counts
  the work done rather than the time waited for a core, so other load inflates it less.
  """
  names = list(variants)
  for name in names:
    for _ in range(warmup):
      variants[name]()
  load = OtherLoad()
  kept: dict[str, list[float]] = {name: [] for name in names}
  cpu: dict[str, list[float]] = {name: [] for name in names}
  rounds: list[dict[str, tuple[float, float]]] = []
  deadline = time.perf_counter() + max_seconds
  while (min(len(t) for t in kept.values()) < blocks * steps
         and time.perf_counter() < deadline):
    means = {}
    for name in names[len(rounds) % len(names):] + names[:len(rounds) % len(names)]:
      times = []
      load.start()
      cpu_start = sum(os.times()[:2])
      for _ in range(steps):
        begin = time.perf_counter()
        variants[name]()
        times.append((time.perf_counter() - begin) * 1e3)
      cpu_ms = (sum(os.times()[:2]) - cpu_start) / steps * 1e3
      if load.stop() <= max_other_load:
        kept[name].extend(times)
        cpu[name].append(cpu_ms)
        means[name] = (statistics.fmean(times), cpu_ms)
    rounds.append(means)
  counts = {name: len(c) for name, c in cpu.items()}
  if min(counts.values()) < 2:
    raise RuntimeError(f"too few quiet blocks ({counts}); raise max_other_load or max_seconds")
  # "inclusive": the quartile of the times measured. The default ("exclusive")
  # extrapolates below the fastest time for few samples, down to zero or less.
  p25 = {name: statistics.quantiles(t, n=4, method="inclusive")[0] for name, t in kept.items()}

  def paired(name, i):
    # CPU time comes in clock ticks (10 ms): a short block can read 0, and says nothing.
    ratios = [r[name][i] / r[baseline][i] for r in rounds
              if name in r and baseline in r and r[baseline][i] > 0]
    return statistics.median(ratios) if ratios else float("nan")

  return {name: QuietTiming(p25[name], statistics.median(kept[name]), p25[name] / p25[baseline],
                            paired(name, 0), statistics.median(cpu[name]), paired(name, 1),
                            counts[name]) for name in names}


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
