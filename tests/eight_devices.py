"""Running a script of eight-device checks in a subprocess and reading its verdicts.

JAX fixes its device count when it starts, so multi-device checks live in scripts run
in a fresh process with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``. Each
check prints one line, ``PASS <name>: ...`` or ``FAIL <name>: ...``. A test module
gets its tests with :func:`make_tests`:

  eight_device_results, test_eight_devices, test_the_check_names_match_the_script = (
      eight_devices.make_tests(SCRIPT, CHECKS, cwd=ROOT))
"""

import pathlib
import re
import subprocess
import sys
import time
import traceback

import pytest

from tests import xla_flags

DEVICES = 8


def main(checks: dict, names: list) -> int:
  """A check script's entry point: runs ``names`` (all when empty), one line each.

  Meant to run inside the eight-device process the script was started in (see
  :func:`run_checks`); returns the process's exit status.
  """
  import jax  # pylint: disable=g-import-not-at-top
  if jax.device_count() != DEVICES:
    print(f"FAIL setup: {jax.device_count()} devices; run with "
          f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}")
    return 1
  failed = 0
  for name in names or checks:
    start = time.perf_counter()
    try:
      report = checks[name]()
    except Exception as e:  # pylint: disable=broad-except
      failed += 1
      traceback.print_exc()
      message = " ".join(f"{type(e).__name__}: {e}".split())
      print(f"FAIL {name}: {message}", flush=True)
    else:
      print(f"PASS {name}: {report} ({time.perf_counter() - start:.1f} s)", flush=True)
  return 1 if failed else 0


def run_checks(script: pathlib.Path, names: tuple, cwd: pathlib.Path, timeout: int = 300):
  """Runs ``script`` with 8 forced CPU devices; returns ({name: line}, the process)."""
  env = xla_flags.environ("--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, str(script), *names], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)
  lines = {m.group(1): m.group(0)
           for m in re.finditer(r"^(?:PASS|FAIL) (\w+): .*$", result.stdout, re.M)}
  return lines, result


def assert_passed(results, name: str) -> None:
  """Fails with the check's own line (or the script's output if it printed none)."""
  lines, result = results
  line = lines.get(name)
  assert line is not None, (
      f"check {name} printed nothing (exit {result.returncode}):\n{result.stdout[-2000:]}\n"
      f"{result.stderr[-4000:]}")
  assert line.startswith("PASS"), f"{line}\n{result.stderr[-4000:]}"


def check_names(script: pathlib.Path) -> set:
  """The names in the script's ``CHECKS`` dict (``"name": check_...`` lines)."""
  return set(re.findall(r'^    "(\w+)": check_', script.read_text(), re.M))


def make_tests(script: pathlib.Path, names: tuple, cwd: pathlib.Path):
  """The module fixture running ``script`` once and one test per check, plus a name check.

  Returns ``(eight_device_results, test_eight_devices,
  test_the_check_names_match_the_script)``, to be bound under those names in a test
  module (pytest finds fixtures and tests by their module attribute names).
  """

  @pytest.fixture(scope="module")
  def eight_device_results():
    return run_checks(script, names, cwd=cwd)

  @pytest.mark.slow
  @pytest.mark.parametrize("name", names)
  def test_eight_devices(eight_device_results, name):  # pylint: disable=redefined-outer-name
    assert_passed(eight_device_results, name)

  def test_the_check_names_match_the_script():
    assert check_names(script) == set(names)

  return eight_device_results, test_eight_devices, test_the_check_names_match_the_script
