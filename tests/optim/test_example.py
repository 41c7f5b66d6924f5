"""examples/train_memory.py runs end to end and reports what it claims (short settings)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))

import train_memory  # pylint: disable=g-import-not-at-top


@pytest.mark.slow
def test_train_memory_reports_bytes_per_param_and_losses(capsys):
  names = ["(b) remainders", train_memory.NEAREST]
  # The smoke preset (the demo's tiny model): bytes per parameter do not depend on the size.
  rows = train_memory.main(["--preset", "smoke", "--steps", "10", "--batch", "4",
                            "--runs", *names])
  out = capsys.readouterr().out
  assert [r.name for r in rows] == names
  per_param = {r.name: r.bytes_per_param for r in rows}
  assert per_param["(b) remainders"]["params"] == 2.0
  assert per_param["(b) remainders"]["master"] == 2.0
  assert per_param[train_memory.NEAREST]["master"] == 0.0
  assert all(r.val > 0 and r.peak_bytes > 0 for r in rows)
  assert "round-to-nearest drops" in out and "p+m+opt" in out
