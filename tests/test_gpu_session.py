"""benchmarks/gpu_session.py: the prepared GPU run keeps going past failures and can run anywhere.

The stages' own figures need a GPU; what is checked here is what a session relies on
when it has one: a stage that fails or overruns its budget is recorded and the next
one runs, results are on disk after every stage, every test's outcome is kept as it
finishes, and (``--dry-run``, slow) every stage runs end to end on the CPU at tiny
sizes, so that the script cannot rot between sessions.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_session  # noqa: E402  pylint: disable=g-import-not-at-top

_TABLE = "### figures\\n\\n| variant | ms |\\n|---|---:|\\n| a | 1.5 |\\n| b | 2.0 |"


def _stage(name, code):
  return gpu_session.Stage(name, [sys.executable, "-c", code])


def test_a_failing_or_overrunning_stage_is_recorded_and_the_next_one_runs(tmp_path):
  chosen = [_stage("tests", "import sys; print('partial'); sys.exit(3)"),
            _stage("llama", "import time; print('started', flush=True); time.sleep(60)"),
            _stage("demo", f"print('{_TABLE}')")]
  budgets = {"tests": 60, "llama": 1, "demo": 60}
  session = {"stages": {}, "machine": {}, "commit": "c0ffee", "started": "now",
             "dry_run": False}
  written = []
  real_write = gpu_session.write

  def write(session, base):  # what is on disk after each stage
    real_write(session, base)
    written.append(json.loads(base.with_suffix(".json").read_text())["stages"].keys())

  gpu_session.write, original = write, gpu_session.write
  try:
    gpu_session.run(chosen, tmp_path, "t", budgets, total=120, session=session)
  finally:
    gpu_session.write = original
  stages = session["stages"]
  assert stages["tests"]["status"] == "failed" and stages["tests"]["returncode"] == 3
  assert "partial" in stages["tests"]["output_tail"]
  assert stages["llama"]["status"] == "timed out"
  assert "started" in stages["llama"]["output_tail"]
  assert stages["llama"]["seconds"] < 1 + gpu_session.GRACE + 10
  assert stages["demo"]["status"] == "ok"
  assert stages["demo"]["tables"] == [{"title": "figures", "header": ["variant", "ms"],
                                       "rows": [{"variant": "a", "ms": "1.5"},
                                                {"variant": "b", "ms": "2.0"}]}]
  assert [list(keys) for keys in written[:3]] == [["tests"], ["tests", "llama"],
                                                   ["tests", "llama", "demo"]]
  md = (tmp_path / "gpu-session-t.md").read_text()
  assert "| llama | timed out |" in md and "| a | 1.5 |" in md
  assert "started" in (tmp_path / "gpu-session-t.log").read_text()


def test_a_stage_is_not_started_without_time_left(tmp_path):
  session = {"stages": {}, "machine": {}, "commit": "c", "started": "now", "dry_run": False}
  gpu_session.run([_stage("tests", "print(1)")], tmp_path, "t", {"tests": 60}, total=5,
                  session=session)
  assert session["stages"]["tests"]["status"] == "not run: no time left"


def test_the_test_stage_records_each_outcome_as_the_tests_finish(tmp_path):
  (tmp_path / "test_sample.py").write_text(textwrap.dedent("""\
      import pytest

      def test_passes():
        pass

      def test_fails():
        assert 1 == 2, "one is not two"

      @pytest.mark.skip(reason="not here")
      def test_skipped():
        pass
      """))
  log = tmp_path / "outcomes.jsonl"
  path = os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])
  env = dict(os.environ, JAXMP_SESSION_TEST_LOG=str(log), PYTHONPATH=path)
  # Under pytest-xdist only the controller writes: each test is recorded once.
  run = subprocess.run([sys.executable, "-m", "pytest", "-p", "gpu_session", "-p",
                        "no:cacheprovider", "-n", "2", "-q", str(tmp_path / "test_sample.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
                       check=False)
  assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]  # 1: a test failed
  outcomes = gpu_session.outcomes_of(log)
  assert outcomes["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
  assert [f["test"] for f in outcomes["failures"]] == ["test_sample.py::test_fails"]
  assert "one is not two" in outcomes["failures"][0]["error"]


def test_budgets_and_stages_are_checked():
  assert gpu_session._budgets("tests=200, quantize=5")["tests"] == 200
  assert gpu_session._budgets(None, 900) == dict.fromkeys(gpu_session.BUDGETS, 900)
  with pytest.raises(ValueError, match="unknown stage 'test'"):
    gpu_session._budgets("test=200")
  assert sum(gpu_session.BUDGETS.values()) <= gpu_session.TOTAL_BUDGET <= 9 * 60
  with pytest.raises(SystemExit):
    gpu_session.main(["--stages", "tests,lama"])


def test_the_block_gemm_stage_names_schedules_the_benchmark_has():
  # The session's names go through bench_block_gemm's --variants, which refuses an
  # unknown one: a renamed schedule would cost the device run its block GEMM table.
  import bench_block_gemm  # pylint: disable=g-import-not-at-top
  names = gpu_session.BLOCK_GEMM_VARIANTS.split(";")
  known = {f"{family} {name}" for family, (_, configs) in bench_block_gemm.KERNELS.items()
           for name in configs}
  assert set(names) <= known and {"block defaults", "mosaic defaults"} <= set(names), names
  assert "8192x8192x8192" in gpu_session.BLOCK_GEMM_SHAPES.split(",")


def test_the_gpu_tests_exist_and_the_deselected_ones_too():
  for path in gpu_session.GPU_TESTS:
    assert (ROOT / path).exists(), path
  for test in gpu_session.DESELECTED:
    file, name = test.split("::")
    assert f"def {name}(" in (ROOT / file).read_text(), test


@pytest.mark.slow
def test_dry_run_runs_every_stage_on_the_cpu(tmp_path):
  # What a session with a GPU runs, at tiny sizes: every stage must finish.
  session = gpu_session.main(["--dry-run", "--out", str(tmp_path)])
  stages = session["stages"]
  assert list(stages) == list(gpu_session.BUDGETS)
  assert {name: r["status"] for name, r in stages.items()} == dict.fromkeys(stages, "ok"), {
      name: r.get("output_tail", "")[-2000:] for name, r in stages.items()}
  assert "tests collected" in stages["tests"]["summary"]
  assert list(stages["llama"]["results"]["llama: one decoder layer, batch 1 x context 16, "
                                         "train step (SGD)"]) == list(gpu_session.LLAMA_VARIANTS)
  demo = next(v for k, v in stages["demo"]["results"].items() if k.startswith("demo"))
  assert list(demo) == list(gpu_session.DEMO_VARIANTS)
  assert list(stages["memory"]["results"]["memory"]) == [
      *gpu_session.MEMORY_RUNS, *(f"{run}, dot merger off" for run in gpu_session.MEMORY_RUNS)]
  assert len(stages["block_gemm"]["tables"][0]["rows"]) >= 3
  assert {row["variant"] for row in stages["quantize"]["tables"][0]["rows"]} == {
      "copy", "amax", "codes", "codes, both layouts", "amax, codes, both layouts"}
  files = sorted(p.suffix for p in tmp_path.iterdir() if p.name.startswith("gpu-session-"))
  assert {".json", ".md", ".log"} <= set(files)
  assert "DRY RUN" in next(tmp_path.glob("gpu-session-*.md")).read_text()
