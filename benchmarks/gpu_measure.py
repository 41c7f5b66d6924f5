"""Measured on a real GPU: the ``gpu_report`` workloads timed, counted and weighed.

``gpu_report.py`` estimates from HLO compiled deviceless for an H100; this script runs
the same cases (its ``llama``, ``memory`` and ``demo`` workloads, built by the same
functions) on the local GPU and prints what it **measured**:

* time per step: every variant of a table compiled once (``jit(...).lower().compile()``,
  XLA autotuning on the real chip), warmed up, then timed in interleaved rounds
  (:func:`timing.interleaved`: medians of per-round means, ratios taken round by
  round), each step fed the state the previous one returned (a train step's state
  donated, as a training loop runs it). Two times per step: ten steps dispatched back to
  back and waited for once (what a training loop that does not read every step's loss
  gets: the host prepares the next step while the GPU runs this one), and each step
  waited for before the next is dispatched (the host's time per step, dispatch and
  command-buffer updates, then adds to the GPU's; an H200 run of the demo step showed
  13-24 ms of such host time per step). Ratios are taken from the first;
* what that real compile runs: kernels launched per step, GEMMs in fp8 / all, and the
  GEMM TFLOP/s the measured time implies (FLOPs from the optimized HLO);
* memory (``memory`` workload): each run's train step in a fresh process (the
  allocator's peak counter only grows), its state built as zeros of the right shapes
  and dtypes (so initialisation's temporaries do not count), the allocator's
  ``peak_bytes_in_use`` after three donated steps, beside XLA's own accounting of the
  compiled step; the :data:`LEAN_RUNS` again compiled without XLA's dot merger
  (``gpu_report.LEAN_MEMORY``, each row against float32 compiled the same way);
* first, a plain bf16 8192^3 matmul's TFLOP/s in the same process: the ceiling the
  tables are read against (``--preset gpu``);
* with ``--profile DIR``, each timed variant traced for a few steps
  (``jax.profiler``): the GPU's busy time per step split into GEMM, attention,
  transposing and other kernels (with the bandwidth the last two achieved, their bytes
  read from the compiled HLO), the idle rest of the measured (back-to-back) step, and the kernels that took
  longest, by name and HLO op; each trace is also copied to ``DIR/<table>/<variant>
  .trace.json.gz``.

Run on a machine with a GPU: ``python benchmarks/gpu_measure.py`` (every workload)
or ``--workloads llama,memory``, ``--variants "bf16;fp8 per-tensor"`` for some rows
(or memory runs) only; ``--preset smoke`` runs tiny shapes (on a CPU too: a check that
the script runs; its figures mean nothing). The demo's table also has float16 without
loss scaling, the baseline of loss scaling's cost (``benchmarks/gpu_session.py`` runs
both). Output is Markdown on stdout,
progress on stderr; ``--json PATH`` also writes every figure.

Compile time on the chip: XLA autotunes each new GEMM shape; the first fp8 variant of
the ``llama`` table took 160 s on an H200 (the next one 2 s).
``XLA_FLAGS=--xla_gpu_autotune_level=0`` skips autotuning (and so times XLA's default
GEMM configurations, not its tuned ones).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from typing import Any, Callable

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import gpu_report  # noqa: E402  (it puts examples/ on the path)
import timing  # noqa: E402
import train_lm  # noqa: E402

import jaxmp  # noqa: E402
from jaxmp._src.tools import audit as audit_lib  # noqa: E402
from jaxmp._src.tools import memory as memory_lib  # noqa: E402
from jaxmp._src.tools import targets as targets_lib  # noqa: E402

WORKLOADS = ("llama", "attention", "memory", "demo")
MEMORY_STEPS = 3
# Interleaved timing rounds per preset: a smoke run checks that the script runs, and its
# figures mean nothing, so it times one round.
ROUNDS = {"gpu": 7, "smoke": 1}


def reference_gemm_tflops(size: int = 8192, calls: int = 20) -> float:
  """A plain jitted bf16 ``size``-cubed matmul's TFLOP/s in this process.

  The ceiling the tables' figures are read against: a chip throttled, shared or
  misconfigured shows here first (an H100/H200 runs this at roughly 750-800).
  """
  a = jax.random.normal(jax.random.key(0), (size, size), jax.numpy.bfloat16)
  matmul = jax.jit(lambda a: a @ a)
  jax.block_until_ready(matmul(a))
  start = time.perf_counter()
  for _ in range(calls):
    out = matmul(a)
  jax.block_until_ready(out)
  return 2 * size**3 * calls / (time.perf_counter() - start) / 1e12


def _zeros_like_shapes(tree: Any) -> Any:
  """Device arrays of zeros with ``tree``'s shapes and dtypes (PRNG keys: key 0).

  Built leaf by leaf, so creating them allocates nothing but the result: a run's
  allocator peak is then the step's, not its initialisation's (which computes float32
  params before casting them).
  """
  def zeros(s):
    if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
      return jax.random.split(jax.random.key(0), s.shape) if s.shape else jax.random.key(0)
    return jax.numpy.zeros(s.shape, s.dtype)
  return jax.tree_util.tree_map(zeros, tree)


def _compile(case: gpu_report.Case, zeros: bool = False, options: dict | None = None
             ) -> tuple[Any, tuple, bool]:
  """The case's step compiled for the local device (with XLA ``options``), its arguments
  (on the device), and whether the step returns its state.

  A train step given as a plain function is compiled as a training loop runs it (and as
  ``examples/train_lm.py`` does): its state donated, so each step writes its new state
  into the buffers of the old one. A case that is already jitted keeps its own options.
  """
  args = _zeros_like_shapes(jax.eval_shape(case.make)) if zeros else case.make()
  feeds_back = gpu_report.returns_its_state(case.fn, args)
  fn = case.fn if hasattr(case.fn, "trace") else jax.jit(
      case.fn, donate_argnums=(0,) if feeds_back else ())
  return fn.trace(*args).lower().compile(options), args, feeds_back


def _runner(compiled: Any, args: tuple, feeds_back: bool) -> Callable[[int], None]:
  """``run(steps)``: that many steps, each fed the state the previous one returned,
  dispatched back to back (as a training loop that does not read every step's loss);
  it returns when the last one has finished."""
  box = list(args)

  def run(steps: int = 1) -> None:
    for _ in range(steps):
      out = compiled(*box)
      if feeds_back:
        box[0] = out[0]
    jax.block_until_ready(out)
  return run


def _report(compiled: Any) -> jaxmp.tools.AuditReport:
  device = jax.devices()[0]
  return audit_lib.analyze(compiled.as_text(), device.platform,
                             targets_lib.gpu_spec_for(device.device_kind), "",
                             device.device_kind)


PROFILED_STEPS = 3
# Steps per timed round (dispatched back to back, or each waited for).
STEPS = 10
_GEMM = re.compile(r"gemm|xmma|cutlass|cublas|wgmma|sm90_", re.I)
_ATTENTION = re.compile(r"fmha|cudnn|flash|sdpa", re.I)


CLASSES = ("GEMM", "attention", "transposing", "other")
"""What :func:`kernel_class` sorts kernels into."""


def kernel_class(name: str) -> str:
  """``"GEMM"``, ``"attention"``, ``"transposing"`` or ``"other"``, from a kernel's name.

  "transposing": XLA's fusions whose hero is a transpose (``input_transpose_fusion``,
  ``input_convert_transpose_fusion``, ``wrapped_transpose``...). On an H200 they moved
  0.3-2.9 TB/s where most other fusions moved 3-4.4 (fp8's quantized operands are
  transposed for cuBLASLt; benchmarks/RESULTS.md, "Fifth run"), so they are counted
  apart.
  """
  if _ATTENTION.search(name):
    return "attention"
  if _GEMM.search(name):
    return "GEMM"
  return "transposing" if "transpose" in hlo_name(name) else "other"


def hlo_name(kernel: str) -> str:
  """The HLO instruction a kernel's trace name is for: ``"input_transpose_fusion_4
  [command_buffer_1]"`` -> ``"input_transpose_fusion.4"`` (the trace writes XLA's
  ``.N`` suffix as ``_N``)."""
  return re.sub(r"_(\d+)$", r".\1", kernel.split(" [")[0])


def device_kernels(trace: dict) -> list[tuple[str, float]]:
  """``(name, microseconds)`` of every GPU kernel in a profiler trace (Chrome JSON).

  Kernels are the complete events (``"ph": "X"``) of the ``/device:GPU:*`` processes,
  on their stream threads where the trace names streams (other device threads repeat
  the same time as XLA ops and modules). The kernel's HLO op, where the trace gives
  one (``args.hlo_op``), follows its name.
  """
  events = trace.get("traceEvents", [])
  meta = lambda kind: {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
                       if e.get("ph") == "M" and e.get("name") == kind}
  gpus = {pid for (pid, _), name in meta("process_name").items() if "GPU" in name}
  streams = {key for key, name in meta("thread_name").items()
             if key[0] in gpus and name.startswith("Stream")}
  kernels = []
  for e in events:
    if e.get("ph") != "X" or e.get("pid") not in gpus:
      continue
    if streams and (e["pid"], e.get("tid")) not in streams:
      continue
    op = (e.get("args") or {}).get("hlo_op")
    kernels.append((f"{e['name']} [{op}]" if op else e["name"], float(e.get("dur", 0.0))))
  return kernels


def profile_summary(kernels: list[tuple[str, float]], steps: int, wall_ms: float,
                    top: int = 8, bytes_of: dict[str, int] | None = None) -> dict:
  """Per step: kernels, GPU busy time by class, the gap to ``wall_ms``, the top kernels.

  With ``bytes_of`` (HLO instruction -> bytes one execution moves, e.g. from
  ``jaxmp.tools.audit``'s kernels), also each class's achieved bandwidth (``<class>
  _tbps``: bytes over time of its kernels whose bytes are known; None without any).
  """
  by_class = dict.fromkeys(CLASSES, 0.0)
  moved = {c: [0, 0.0] for c in CLASSES}  # bytes and microseconds of the known kernels
  by_name: dict[str, list[float]] = {}
  for name, us in kernels:
    cls = kernel_class(name)
    by_class[cls] += us / 1e3 / steps
    by_name.setdefault(name, []).append(us)
    known = bytes_of.get(hlo_name(name)) if bytes_of else None
    if known is not None:
      moved[cls][0] += known
      moved[cls][1] += us
  busy = sum(by_class.values())
  ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
  bandwidth = {f"{c}_tbps": (b / (us * 1e-6) / 1e12 if us else None)
               for c, (b, us) in moved.items()} if bytes_of else {}
  return {"kernels": len(kernels) / steps, "busy_ms": busy, "idle_ms": wall_ms - busy,
          **{f"{k}_ms": v for k, v in by_class.items()}, **bandwidth,
          "top": [(name, sum(us) / 1e3 / steps, len(us) / steps) for name, us in ranked]}


def profile_table(runs: dict, measured: dict, directory: pathlib.Path, results: dict,
                  bytes_of: dict[str, dict[str, int]] | None = None) -> None:
  """Traces :data:`PROFILED_STEPS` steps of each variant; prints where the GPU time went.

  ``bytes_of``: per variant, its kernels' bytes by HLO instruction (its compile's
  audit), for the bandwidth columns.
  """
  summaries = {}
  for name, run in runs.items():
    where = directory / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    with jax.profiler.trace(str(where)):
      run(PROFILED_STEPS)
    trace_file = max(where.glob("plugins/profile/*/*.trace.json.gz"), key=os.path.getmtime)
    # A copy beside the folder: the profiler's own path is six folders deep.
    shutil.copyfile(trace_file, where.parent / f"{where.name}.trace.json.gz")
    kernels = device_kernels(json.loads(gzip.open(trace_file).read()))
    summaries[name] = profile_summary(kernels, PROFILED_STEPS, measured[name].ms,
                                      bytes_of=(bytes_of or {}).get(name))
  print(f"\nprofiled (jax.profiler, {PROFILED_STEPS} steps dispatched back to back; ms per "
        "step; idle = measured step (back to back) - GPU busy; TB/s: bytes (operands and "
        "outputs, from the compiled HLO) over time, of the transposing and the other "
        "fusions)\n")
  print("| variant | kernels | GPU busy | GEMM | attention | transposing | other | idle | "
        "TB/s transposing | TB/s other |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  tbps = lambda v: "-" if v is None else f"{v:.2f}"
  for name, row in summaries.items():
    print(f"| {name} | {row['kernels']:.0f} | {row['busy_ms']:.3f} | {row['GEMM_ms']:.3f} | "
          f"{row['attention_ms']:.3f} | {row['transposing_ms']:.3f} | {row['other_ms']:.3f} | "
          f"{row['idle_ms']:.3f} | {tbps(row.get('transposing_tbps'))} | "
          f"{tbps(row.get('other_tbps'))} |")
  for name, row in summaries.items():
    print(f"\n{name}: top kernels (ms per step, launches per step)")
    for kernel, ms, count in row["top"]:
      print(f"  {ms:8.3f} ms {count:5.0f}x  {kernel[:150]}")
  results.update(summaries)
  sys.stdout.flush()


def time_table(title: str, cases: dict[str, gpu_report.Case], results: dict,
               baselines: tuple[str, ...] = ("float32", "bf16"),
               profile: pathlib.Path | None = None, rounds: int = 7) -> None:
  """Compiles, counts and times every case of one table; prints it, with each row's
  speed against the row it differs from in one respect (``Case.against``: precision
  or attention alone) and against each of ``baselines`` (rows of the table)."""
  runs, reports = {}, {}
  # Ratios against each baseline the table runs; with none of them chosen, its first row.
  baselines = tuple(b for b in baselines if b in cases) or tuple(cases)[:1]
  for name, case in cases.items():
    start = time.perf_counter()
    compiled, args, feeds_back = _compile(case)
    reports[name], runs[name] = _report(compiled), _runner(compiled, args, feeds_back)
    gpu_report.progress(f"compiled {title}: {name} in {time.perf_counter() - start:.0f} s")
  first = next(iter(runs))
  # Back to back: a round's STEPS steps dispatched, then waited for once, as a training
  # loop runs; the host prepares step n+1 while the GPU runs step n. One at a time: each
  # step waited for (as a loop that reads every loss does), so the host's time per step
  # (dispatch, command-buffer updates) adds to the GPU's.
  back_to_back = timing.interleaved({n: functools.partial(r, STEPS) for n, r in runs.items()},
                                    baseline=first, rounds=rounds, calls=1, warmup=1)
  measured = {n: t._replace(ms=t.ms / STEPS) for n, t in back_to_back.items()}
  one_at_a_time = timing.interleaved(runs, baseline=first, rounds=rounds, calls=STEPS,
                                     warmup=3)
  base = {b: measured[b].ms for b in baselines}
  print(f"\n### {title}\n\nmeasured on {timing.device_description()}, jax {jax.__version__}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}\n")
  print(f"| variant | ms/step | like for like | {' | '.join(f'vs {b}' for b in base)} | "
        f"TFLOP/s (GEMMs) | kernels | GEMMs fp8/all | ms/step, one at a time |\n"
        f"|---|---:|---|{'---:|' * len(base)}---:|---:|---|---:|")
  table = results.setdefault(title, {})
  for name, t in measured.items():
    r = reports[name]
    tflops = r.gemm_flops / (t.ms * 1e-3) / 1e12
    fp8 = sum(g.fp8 * g.count for g in r.gemms)
    ratios = " | ".join(f"{ms / t.ms:.2f}x" for ms in base.values())
    synced = one_at_a_time[name].ms
    like = gpu_report.like_for_like(cases, {n: m.ms for n, m in measured.items()}, name)
    print(f"| {name} | {t.ms:.3f} | {like} | {ratios} | {tflops:.0f} | "
          f"{r.launches} | {fp8}/{sum(g.count for g in r.gemms)} | {synced:.3f} |")
    table[name] = {"ms": t.ms, "tflops": tflops, "kernels": r.launches, "fp8_gemms": fp8,
                   "ms_one_at_a_time": synced}
  sys.stdout.flush()
  if profile is not None:
    profile_table(runs, measured, profile / re.sub(r"\W+", "_", title.split(":")[0]),
                  results.setdefault(f"{title}, profiled", {}),
                  {n: {k.name: k.bytes for k in r.kernels} for n, r in reports.items()})


LEAN_RUNS = ("float32", "(b) master + bf16 Adam")
"""The memory runs measured a second time with :data:`gpu_report.LEAN_MEMORY`."""
LEAN_ROW = "{}, dot merger off"
"""The memory table's row of a :data:`LEAN_RUNS` run measured that way."""


def memory_run(name: str, preset: str, lean: bool = False) -> dict:
  """One ``memory`` run in this (fresh) process: the allocator's peak and XLA's."""
  compiled, args, feeds_back = _compile(gpu_report.memory_cases(preset)[name], zeros=True,
                                        options=gpu_report.LEAN_MEMORY if lean else None)
  _runner(compiled, args, feeds_back)(MEMORY_STEPS)
  stats = jax.devices()[0].memory_stats() or {}
  memory = memory_lib.compiled_memory(compiled)
  return {"peak_bytes_in_use": stats.get("peak_bytes_in_use"),
          "xla_peak_bytes": memory.peak_bytes if memory else None}


def memory_table(preset: str, results: dict, names: list[str] | None = None) -> None:
  """Each ``memory`` run (every one, or ``names``) in its own process, then the
  :data:`LEAN_RUNS` among them again without the dot merger; prints measured and XLA
  peaks."""
  names = list(gpu_report.memory_cases(preset)) if names is None else names
  rows = {}
  lean_runs = [n for n in LEAN_RUNS if n in names]
  for name, lean in [(n, False) for n in names] + [(n, True) for n in lean_runs]:
    start = time.perf_counter()
    row = LEAN_ROW.format(name) if lean else name
    out = subprocess.run([sys.executable, __file__, "--memory-run", name, "--preset", preset,
                          *(["--lean"] if lean else [])],
                         capture_output=True, text=True, check=False)
    if out.returncode:
      print(out.stderr[-3000:], file=sys.stderr)
      rows[row] = None
    else:
      rows[row] = json.loads(out.stdout.strip().splitlines()[-1])
    gpu_report.progress(f"memory run {row} in {time.perf_counter() - start:.0f} s")
  base = (rows.get("float32") or {}).get("peak_bytes_in_use")
  lean_base = (rows.get(LEAN_ROW.format("float32")) or {}).get("peak_bytes_in_use")
  print(f"\n### memory: one Llama-3-8B-shaped layer train step (clipped AdamW, state "
        f"donated), measured\n\nmeasured on {timing.device_description()}, jax "
        f"{jax.__version__}; peak = the allocator's peak_bytes_in_use after "
        f"{MEMORY_STEPS} steps, in a fresh process per run\n")
  print("| run | measured peak GiB | vs float32 | XLA's peak GiB |\n|---|---:|---:|---:|")
  for name, row in rows.items():
    if row is None:
      print(f"| {name} | failed (stderr above) | - | - |")
      continue
    peak, xla = row["peak_bytes_in_use"], row["xla_peak_bytes"]
    # No allocator statistics on some backends (XLA:CPU): XLA's figure only.
    against = lean_base if name in {LEAN_ROW.format(n) for n in LEAN_RUNS} else base
    print(f"| {name} | {f'{peak / 2**30:.3f}' if peak else 'n/a'} | "
          f"{f'{peak / against:.3f}x' if peak and against else '-'} | "
          f"{f'{xla / 2**30:.3f}' if xla else '-'} |")
  results["memory"] = rows
  sys.stdout.flush()


def check_variants(names: str | None, cases: dict[str, dict[str, gpu_report.Case]]
                   ) -> list[str] | None:
  """The semicolon-separated ``names`` as a list (``None``: every variant).

  Args:
    names: the ``--variants`` text, or None.
    cases: each chosen timed workload's cases, by workload.

  Raises:
    ValueError: a name that none of ``cases`` has; the message lists the names they
      have.
  """
  if names is None:
    return None
  wanted = [n.strip() for n in names.split(";") if n.strip()]
  known = {n for table in cases.values() for n in table}
  unknown = [n for n in wanted if n not in known]
  if unknown:
    raise ValueError(f"unknown variant(s) {unknown}; the chosen workloads have: "
                     f"{sorted(known)}")
  return wanted


def demo_cases(preset: str) -> dict[str, gpu_report.Case]:
  """``gpu_report``'s demo cases and float16 without loss scaling, the baseline of loss
  scaling's cost on the step (``"fp16 + loss scaling"`` against it)."""
  runs = {r.name: r for r in train_lm.RUNS}
  fused = train_lm.PRESETS[preset].get("fused_attention", False)
  return {**gpu_report.demo_cases(preset), "fp16, no loss scaling": gpu_report._demo_case(
      runs["float16, no loss scaling"], preset, fused)}


# Each workload's cases, by workload (building them compiles and runs nothing); the
# memory workload's run in processes of their own, by name.
_CASES = {"llama": gpu_report.llama_cases, "attention": gpu_report.attention_cases,
          "demo": demo_cases, "memory": gpu_report.memory_cases}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workloads", default=",".join(WORKLOADS),
                      help=f"comma-separated, from: {', '.join(WORKLOADS)}")
  parser.add_argument("--preset", choices=("gpu", "smoke"), default="gpu")
  parser.add_argument("--variants",
                      help="semicolon-separated variant names (exact, as the tables print "
                           "them; some contain commas) "
                           "to run instead of every variant of each chosen workload; the "
                           "first one a table runs is its baseline")
  parser.add_argument("--json", help="also write every figure to this file")
  parser.add_argument("--profile", type=pathlib.Path,
                      help="also trace each timed variant (jax.profiler) into this folder "
                           "and print where its GPU time went")
  parser.add_argument("--memory-run", help=argparse.SUPPRESS)  # one memory run (a child)
  parser.add_argument("--lean", action="store_true", help=argparse.SUPPRESS)  # its options
  args = parser.parse_args(argv)
  if args.memory_run:
    print(json.dumps(memory_run(args.memory_run, args.preset, args.lean)))
    return
  chosen = [w for w in args.workloads.split(",") if w]
  unknown = [w for w in chosen if w not in WORKLOADS]
  if unknown:
    parser.error(f"unknown workload(s) {unknown}; accepted: {', '.join(WORKLOADS)}")
  cases_of = {w: _CASES[w](args.preset) for w in chosen if w in _CASES}
  try:
    wanted = check_variants(args.variants, cases_of)
  except ValueError as e:
    parser.error(str(e))
  results: dict = {"device": timing.device_description(), "jax": jax.__version__,
                   "xla_flags": os.environ.get("XLA_FLAGS", "")}
  if args.preset == "gpu":
    results["reference_bf16_gemm_tflops"] = reference_gemm_tflops()
    print(f"Reference: a jitted bf16 8192^3 matmul runs at "
          f"{results['reference_bf16_gemm_tflops']:.0f} TFLOP/s in this process.")
  batch, context = gpu_report.LLAMA_TOKENS[args.preset]
  for workload in chosen:
    cases = cases_of.get(workload, {})
    if wanted is not None:
      cases = {n: cases[n] for n in wanted if n in cases}  # in the order asked
      if not cases:
        continue
    gpu_report.progress(f"workload {workload}")
    if workload == "llama":
      time_table(f"llama: one decoder layer, batch {batch} x context {context}, train step "
                 "(SGD)", cases, results, profile=args.profile,
                 rounds=ROUNDS[args.preset])
    elif workload == "attention":
      time_table(f"attention alone (the llama layer's), batch {batch} x context {context}, "
                 "forward + backward, bfloat16", cases,
                 results, baselines=("cuDNN, causal mask tensor",), profile=args.profile,
                 rounds=ROUNDS[args.preset])
    elif workload == "memory":
      memory_table(args.preset, results, list(cases))
    else:
      time_table(f"demo train step, examples/train_lm.py --preset {args.preset} (AdamW)",
                 cases, results, profile=args.profile,
                 rounds=ROUNDS[args.preset])
    if args.json:
      pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
