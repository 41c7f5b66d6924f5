"""One prepared run on a machine with a GPU: the GPU's tests, the measured tables, the kernels.

Every session that is lent a GPU runs this first (``benchmarks/gpu_session.sh``, or
``make gpu-session``; CONTRIBUTING.md gives the device command). In this order, each
stage a process of its own with its own time budget (seconds, :data:`BUDGETS`), all
within :data:`TOTAL_BUDGET` (9 minutes):

1. ``tests``: pytest over :data:`GPU_TESTS` (``-m "not slow"``, spread over the
   machine's cores), every test's outcome recorded as it finishes;
2. ``llama``: ``gpu_measure.py``'s Llama-3-8B-shaped layer, bf16 and fp8 per-tensor,
   rowwise and block (jaxmp's Triton kernel, as the chip table chooses, and its Mosaic
   GPU kernel), each with causal attention (:data:`LLAMA_VARIANTS`);
3. ``demo``: the demo's train step at ``--preset gpu`` (:data:`DEMO_VARIANTS`: bf16, fp8,
   and float16 with and without loss scaling);
4. ``memory``: the memory workload's :data:`MEMORY_RUNS` (allocator peak, fresh
   processes);
5. ``block_gemm``: ``bench_block_gemm.py`` at :data:`BLOCK_GEMM_SHAPES`, the Triton
   and Mosaic GPU kernels' :data:`BLOCK_GEMM_VARIANTS`;
6. ``quantize``: ``bench_quantize.py``.

A stage that fails or runs out of its budget is recorded (its return code, the end of
its output), and the next one runs. After every stage the results so far are written,
so a run cut short still leaves them, three files: ``<out>/gpu-session-<UTC time>.json``
(the machine, jax and jaxlib, the commit, each stage's status, seconds, the Markdown
tables it printed, parsed into rows, the JSON it wrote, and the test stage's outcome
per test), ``.md`` (the same as tables) and ``.log`` (every stage's output).

``--dry-run`` runs every stage on the CPU at tiny sizes (``--preset smoke``; the test
stage only collects its tests), so that the script cannot rot: ``tests/test_benchmarks
.py`` runs it. Its figures mean nothing.

Budget: 9 minutes in all, as measured on an H200 in earlier sessions: the fp8 layer's
first compile with cuBLASLt autotuning took 160 s, so the measured tables pin
``--xla_gpu_enable_triton_gemm=false`` (the figures of RESULTS.md's later H200 runs were
measured so).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]

TOTAL_BUDGET = 540
"""Seconds for every stage together (the device allows a 10-minute command)."""

BUDGETS = {"tests": 170, "llama": 120, "demo": 110, "memory": 60, "block_gemm": 50,
           "quantize": 30}
"""Seconds per stage, in the order they run."""

DRY_RUN_BUDGET = 900
"""Seconds per stage of a dry run (tiny sizes, but on a CPU that may be busy: a dry run
checks that every stage runs, not how fast)."""

GPU_TESTS = (
    "tests/fp8", "tests/optim", "tests/linen", "tests/nnx", "tests/tools", "tests/published",
    "tests/test_loss_scaling.py", "tests/test_loss_scale.py", "tests/test_engine.py",
    "tests/test_attention.py", "tests/test_nonfinite.py", "tests/test_nonfinite_locate.py",
    "tests/test_dtypes.py", "tests/test_step.py", "tests/test_adapter.py",
    "tests/test_policy.py", "tests/test_rules.py", "tests/test_tree.py",
    "tests/test_adaptive_precision.py", "tests/test_faults.py", "tests/test_checkpoint.py",
    "tests/test_properties.py", "tests/test_bad_inputs.py", "jaxmp")
"""What the ``tests`` stage runs: every test that computes on the default device, and
the docstring examples. Left out: the tests that read files, compile for other chips
in subprocesses or run the examples and benchmarks (docs, README, packaging, layers,
references, examples, benchmarks, distributed: an 8-device CPU subprocess)."""

DESELECTED = {
    "tests/test_nonfinite.py::test_tracing_off_builds_the_jaxpr_of_jaxmp_before_tracing":
        "its golden jaxprs name the JAX and Flax versions that wrote them (tests/golden); a "
        "machine with other versions fails it by design, whatever its device",
}
"""Tests the ``tests`` stage leaves out, with the reason (recorded in the results)."""

LLAMA_VARIANTS = ("bf16 + causal attention", "fp8 per-tensor + causal attention",
                  "fp8 per-tensor, fused quantize + causal attention",
                  "fp8 rowwise + causal attention",
                  "fp8 block 1x128/128x128 + causal attention",
                  "fp8 block, Mosaic kernel + causal attention")
DEMO_VARIANTS = ("bf16", "bf16 + jaxmp fp8", "fp16 + loss scaling", "fp16, no loss scaling")
MEMORY_RUNS = ("float32", "(b) master + bf16 Adam")
BLOCK_GEMM_SHAPES = "8192x8192x8192,8192x4096x4096,8192x14336x4096"
BLOCK_GEMM_VARIANTS = ("block defaults;mosaic defaults;mosaic 3 stages;mosaic 5 stages;"
                       "mosaic column order")
"""The block kernels' schedules the session times: the Triton kernel's default (its
schedules were measured in earlier sessions, benchmarks/RESULTS.md) and the Mosaic
kernel's untried ones with 128 x 128 tiles (its 256-column tiles hung in Mosaic GPU's
interpreter, see tests/fp8/test_block_gemm_mosaic.py: they are left to a run of their
own, ``--variants "mosaic 64x256, columns split"``, where a hang costs nothing else)."""
# The measured tables' XLA flags (see the module docstring).
MEASURE_XLA_FLAGS = "--xla_gpu_enable_triton_gemm=false"

# How long a stage gets to stop after SIGINT (pytest then prints its summary) before
# it is killed.
GRACE = 15


@dataclasses.dataclass
class Stage:
  """One stage: its command (run in the repository's root) and its environment."""
  name: str
  argv: list[str]
  env: dict[str, str] = dataclasses.field(default_factory=dict)
  json_path: pathlib.Path | None = None  # a JSON file the stage writes, read back
  test_log: pathlib.Path | None = None  # where a pytest stage records each outcome


def _python() -> str:
  return sys.executable


def _workers() -> int:
  # One GPU shared by every worker; leave two cores for the controller and XLA.
  return max(1, min(14, (os.cpu_count() or 2) - 2))


def stages(work: pathlib.Path, dry_run: bool) -> list[Stage]:
  """The session's stages in order (``dry_run``: the CPU, tiny sizes); their own files
  go to ``work`` (the session's JSON holds what they write)."""
  preset = "smoke" if dry_run else "gpu"
  measure = [_python(), "benchmarks/gpu_measure.py", "--preset", preset]
  measure_env = {} if dry_run else {"XLA_FLAGS": MEASURE_XLA_FLAGS}
  deselect = [arg for test in DESELECTED for arg in ("--deselect", test)]
  pytest = [_python(), "-m", "pytest", "-p", "no:cacheprovider", "-p", "gpu_session",
            "-o", "addopts=", "--doctest-modules", "--strict-markers", "-q", "-rfE",
            "--tb=short", *deselect, *GPU_TESTS]
  pytest += (["--collect-only"] if dry_run else ["-m", "not slow", "-n", str(_workers()),
                                                "--dist", "loadfile"])
  tables = lambda name: work / f"{name}.json"
  return [
      # Several workers share the GPU: none may take most of its memory up front.
      Stage("tests", pytest, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
            test_log=work / "tests.jsonl"),
      Stage("llama", measure + ["--workloads", "llama", "--variants", ";".join(LLAMA_VARIANTS),
                                "--json", str(tables("llama"))], measure_env, tables("llama")),
      Stage("demo", measure + ["--workloads", "demo", "--variants", ";".join(DEMO_VARIANTS),
                               "--json", str(tables("demo"))], measure_env, tables("demo")),
      Stage("memory", measure + ["--workloads", "memory", "--variants", ";".join(MEMORY_RUNS),
                                 "--json", str(tables("memory"))], measure_env,
            tables("memory")),
      Stage("block_gemm", [_python(), "benchmarks/bench_block_gemm.py", "--preset", preset,
                           *([] if dry_run else ["--shapes", BLOCK_GEMM_SHAPES,
                                                 "--variants", BLOCK_GEMM_VARIANTS]),
                           *(["--rounds", "1", "--calls", "1"] if dry_run else [])]),
      Stage("quantize", [_python(), "benchmarks/bench_quantize.py", "--preset", preset,
                         *(["--rounds", "1", "--calls", "1"] if dry_run else [])]),
  ]


# ---- running a stage -------------------------------------------------------------------


def run_stage(stage: Stage, budget: float, log) -> dict[str, Any]:
  """Runs ``stage`` for at most ``budget`` seconds; its record (status, seconds, output).

  Over budget, the stage's process group gets SIGINT (pytest then reports what ran),
  and SIGKILL :data:`GRACE` seconds later.
  """
  env = dict(os.environ, **stage.env)
  if stage.test_log is not None:
    env["JAXMP_SESSION_TEST_LOG"] = str(stage.test_log)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT), str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  log.write(f"\n===== {stage.name} (budget {budget:.0f} s): {' '.join(stage.argv)}\n")
  log.flush()
  start = time.monotonic()
  process = subprocess.Popen(stage.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
  timed_out = False
  try:
    output, _ = process.communicate(timeout=budget)
  except subprocess.TimeoutExpired:
    timed_out = True
    os.killpg(process.pid, signal.SIGINT)
    try:
      output, _ = process.communicate(timeout=GRACE)
    except subprocess.TimeoutExpired:
      os.killpg(process.pid, signal.SIGKILL)
      output, _ = process.communicate()
  seconds = time.monotonic() - start
  log.write(output)
  log.flush()
  status = "timed out" if timed_out else ("ok" if process.returncode == 0 else "failed")
  record = {"status": status, "returncode": process.returncode, "seconds": round(seconds, 1),
            "budget": budget, "command": stage.argv, "tables": markdown_tables(output),
            "output_tail": output[-4000:]}
  if stage.json_path is not None and stage.json_path.exists():
    record["results"] = json.loads(stage.json_path.read_text())
  summary = _PYTEST_SUMMARY.findall(output)
  if summary:
    record["summary"] = summary[-1].strip("= ")
  return record


# pytest's last line: "=== 3 failed, 1700 passed in 12.3s ===", "1712 tests collected in
# 9s" or, with tests deselected, "1710/1712 tests collected (2 deselected) in 9s".
_PYTEST_SUMMARY = re.compile(r"^=*\s*(?:\d+ \w+(?:, )?)+ in [\d.]+s.*$"
                             r"|^\d+(?:/\d+)? tests? collected.*$", re.M)


_SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")


def markdown_tables(text: str) -> list[dict[str, Any]]:
  """The Markdown tables in ``text``: each as its title (the last ``#`` heading or plain
  line before it), its header and its rows (dicts by column)."""
  lines = text.splitlines()
  tables, title = [], ""
  i = 0
  while i < len(lines):
    line = lines[i].strip()
    if (line.startswith("|") and i + 1 < len(lines)
        and _SEPARATOR.match(lines[i + 1].strip())):
      header = _cells(line)
      rows = []
      i += 2
      while i < len(lines) and lines[i].strip().startswith("|"):
        rows.append(dict(zip(header, _cells(lines[i].strip()))))
        i += 1
      tables.append({"title": title, "header": header, "rows": rows})
      continue
    if line and not line.startswith("|"):
      title = line.lstrip("#").strip()
    i += 1
  return tables


def _cells(line: str) -> list[str]:
  return [cell.strip() for cell in line.strip().strip("|").split("|")]


# ---- the test stage's per-test outcomes (a pytest plugin: -p gpu_session) --------------


_XDIST_WORKER = {"this process": False}


def pytest_configure(config):
  # An xdist worker's config has workerinput. Not PYTEST_XDIST_WORKER: a pytest run from
  # inside an xdist worker (this module's own test) inherits that variable.
  _XDIST_WORKER["this process"] = hasattr(config, "workerinput")


def pytest_runtest_logreport(report):
  """Appends the test's outcome to ``$JAXMP_SESSION_TEST_LOG`` as it finishes (a JSON line).

  Written as tests finish, so a stage stopped at its budget keeps what ran. Under
  pytest-xdist the controller receives every worker's reports: only it writes.
  """
  target = os.environ.get("JAXMP_SESSION_TEST_LOG")
  if not target or _XDIST_WORKER["this process"]:
    return
  if report.when != "call" and not (report.failed or report.skipped):
    return
  line = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
          "seconds": round(report.duration, 2)}
  if report.failed:
    line["error"] = str(report.longrepr)[-3000:]
  elif report.skipped and isinstance(report.longrepr, tuple):
    line["reason"] = report.longrepr[2]
  with open(target, "a") as f:
    f.write(json.dumps(line) + "\n")


def outcomes_of(path: pathlib.Path) -> dict[str, Any]:
  """Counts by outcome and the failures, from the per-test lines the plugin wrote."""
  if not path.exists():
    return {"counts": {}, "failures": []}
  lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  counts: dict[str, int] = {}
  for line in lines:
    counts[line["outcome"]] = counts.get(line["outcome"], 0) + 1
  failures = [{"test": line["test"], "when": line["when"], "error": line.get("error", "")}
              for line in lines if line["outcome"] == "failed"]
  return {"counts": counts, "failures": failures}


# ---- the machine, and the files written ------------------------------------------------

_MACHINE = """\
import json, jax, jaxlib
d = jax.devices()[0]
print(json.dumps({"platform": d.platform, "device_kind": d.device_kind,
                  "devices": jax.device_count(), "jax": jax.__version__,
                  "jaxlib": jaxlib.__version__}))
"""


def machine(dry_run: bool) -> dict[str, Any]:
  """The device, jax and jaxlib (asked in a child process: this one holds no GPU)."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             **({"JAX_PLATFORMS": "cpu"} if dry_run else {}))
  found = subprocess.run([_python(), "-c", _MACHINE], capture_output=True, text=True, env=env,
                         check=False)
  info = (json.loads(found.stdout.strip().splitlines()[-1]) if found.returncode == 0
          else {"error": found.stderr[-2000:]})
  smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                        "--format=csv,noheader"], capture_output=True, text=True,
                       check=False) if not dry_run and _on_path("nvidia-smi") else None
  if smi is not None and smi.returncode == 0:
    info["nvidia_smi"] = smi.stdout.strip()
  return info


def _on_path(program: str) -> bool:
  return any((pathlib.Path(d) / program).exists() for d in os.environ.get("PATH", "").split(":"))


def commit(given: str | None) -> str:
  """The commit measured: ``given`` (the device's copy of the tree has no .git), else git's."""
  if given:
    return given
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                        text=True, check=False)
  if head.returncode:
    return "unknown (no .git here: pass --commit)"
  dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                         capture_output=True, text=True, check=False).stdout.strip()
  return head.stdout.strip() + (" + uncommitted changes" if dirty else "")


def markdown(session: dict[str, Any]) -> str:
  """The session as Markdown: the machine, a row per stage, then each stage's tables."""
  m = session["machine"]
  smi = f"; {m['nvidia_smi']}" if "nvidia_smi" in m else ""
  dry = "; DRY RUN (CPU, tiny sizes: the figures mean nothing)" if session["dry_run"] else ""
  lines = [f"# GPU session {session['started']}", "",
           f"Device: {m.get('device_kind', '?')} ({m.get('platform', '?')}, "
           f"{m.get('devices', '?')} device(s)){smi}; jax {m.get('jax', '?')}, jaxlib "
           f"{m.get('jaxlib', '?')}; commit {session['commit']}{dry}.",
           "", "| stage | status | seconds | budget |", "|---|---|---:|---:|"]
  for name, record in session["stages"].items():
    status = record["status"] + (f" ({record['summary']})" if "summary" in record else "")
    lines.append(f"| {name} | {status} | {record.get('seconds', '-')} | "
                 f"{record.get('budget', '-')} |")
  tests = session["stages"].get("tests", {}).get("outcomes")
  if tests:
    counts = ", ".join(f"{n} {k}" for k, n in sorted(tests["counts"].items()))
    lines += ["", "## tests", "", f"Outcomes: {counts or 'none recorded'}."]
    if session.get("deselected"):
      lines += ["", "Deselected: " + "; ".join(f"`{t}` ({why})"
                                              for t, why in session["deselected"].items())]
    for failure in tests["failures"]:
      lines += ["", f"- FAILED `{failure['test']}` ({failure['when']})", "", "```",
                failure["error"][-1500:], "```"]
  for name, record in session["stages"].items():
    if name == "tests":
      continue
    lines += ["", f"## {name}", ""]
    if record["status"] != "ok":
      lines += [f"Status: {record['status']} (return code {record.get('returncode')}); the "
                "end of its output:", "", "```", record.get("output_tail", "")[-2000:], "```"]
    for table in record.get("tables", []):
      lines += ["", f"**{table['title']}**" if table["title"] else "", "",
                "| " + " | ".join(table["header"]) + " |",
                "|" + "---|" * len(table["header"])]
      lines += ["| " + " | ".join(row.get(h, "") for h in table["header"]) + " |"
                for row in table["rows"]]
  return "\n".join(lines) + "\n"


def write(session: dict[str, Any], base: pathlib.Path) -> None:
  base.with_suffix(".json").write_text(json.dumps(session, indent=1, default=str))
  base.with_suffix(".md").write_text(markdown(session))


def run(chosen: list[Stage], out: pathlib.Path, stamp: str, budgets: dict[str, float],
        total: float, session: dict[str, Any]) -> dict[str, Any]:
  """Runs ``chosen`` in order within ``total`` seconds; writes the results after each."""
  base = out / f"gpu-session-{stamp}"
  deadline = time.monotonic() + total
  with open(base.with_suffix(".log"), "a") as log:
    for stage in chosen:
      left = deadline - time.monotonic() - GRACE
      if left < 5:
        session["stages"][stage.name] = {"status": "not run: no time left", "budget": 0}
        continue
      record = run_stage(stage, min(budgets[stage.name], left), log)
      if stage.test_log is not None:
        record["outcomes"] = outcomes_of(stage.test_log)
      session["stages"][stage.name] = record
      write(session, base)
      print(f"{stage.name}: {record['status']} in {record['seconds']} s", file=sys.stderr,
            flush=True)
  write(session, base)
  return session


def _budgets(text: str | None, every: float | None = None) -> dict[str, float]:
  """:data:`BUDGETS` (or ``every`` for each stage), with the ``--budgets`` text's changes."""
  budgets = dict(BUDGETS) if every is None else dict.fromkeys(BUDGETS, every)
  for item in (text or "").split(","):
    if item.strip():
      name, _, seconds = item.partition("=")
      if name.strip() not in BUDGETS:
        raise ValueError(f"unknown stage {name.strip()!r} in --budgets; stages: {list(BUDGETS)}")
      budgets[name.strip()] = float(seconds)
  return budgets


def main(argv=None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results",
                      help="folder for the JSON, Markdown and log (default benchmarks/results)")
  parser.add_argument("--dry-run", action="store_true",
                      help="every stage on the CPU at tiny sizes (the figures mean nothing)")
  parser.add_argument("--stages", help=f"comma-separated, from {', '.join(BUDGETS)} (default all)")
  parser.add_argument("--budgets", help="seconds per stage, e.g. tests=200,llama=90")
  parser.add_argument("--total", type=float,
                      help=f"seconds for all stages (default {TOTAL_BUDGET}; a dry run: "
                           f"{len(BUDGETS)} x {DRY_RUN_BUDGET})")
  parser.add_argument("--list-tests", action="store_true",
                      help="print the tests stage's pytest arguments (paths, deselections) "
                           "and exit")
  parser.add_argument("--commit", help="the commit measured (the device's tree has no .git)")
  args = parser.parse_args(argv)
  if args.list_tests:
    print(" ".join([*GPU_TESTS, *(f"--deselect={t}" for t in DESELECTED)]))
    return {}
  try:
    budgets = _budgets(args.budgets, DRY_RUN_BUDGET if args.dry_run else None)
  except ValueError as e:
    parser.error(str(e))
  total = args.total or (len(BUDGETS) * DRY_RUN_BUDGET if args.dry_run else TOTAL_BUDGET)
  wanted = [s.strip() for s in (args.stages or ",".join(BUDGETS)).split(",") if s.strip()]
  unknown = [s for s in wanted if s not in BUDGETS]
  if unknown:
    parser.error(f"unknown stage(s) {unknown}; stages: {', '.join(BUDGETS)}")
  args.out.mkdir(parents=True, exist_ok=True)
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
  if args.dry_run:
    os.environ["JAX_PLATFORMS"] = "cpu"
  session = {"started": stamp, "dry_run": args.dry_run, "commit": commit(args.commit),
             "machine": machine(args.dry_run), "deselected": DESELECTED, "stages": {}}
  work = pathlib.Path(tempfile.mkdtemp(prefix="gpu-session-"))
  chosen = [s for s in stages(work, args.dry_run) if s.name in wanted]
  return run(chosen, args.out, stamp, budgets, total, session)


if __name__ == "__main__":
  main()
