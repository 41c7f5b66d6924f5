"""The examples run end to end and show what they claim (short settings)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import train_classifier  # pylint: disable=g-import-not-at-top
import train_lm  # pylint: disable=g-import-not-at-top


@pytest.mark.slow
def test_classifier_mixed_precision_matches_float32():
  results = train_classifier.main(["--epochs", "4"])
  for name, accuracy in results.items():
    assert abs(accuracy - results["float32"]) <= 0.01, (name, results)
  assert results["float32"] > 0.9


@pytest.mark.slow
def test_train_lm_runs_every_configuration(tmp_path, capsys):
  plot = tmp_path / "curves.png"
  train_lm.main(["--steps", "12", "--batch", "4", "--plot", str(plot)])
  out = capsys.readouterr().out
  for run in train_lm.RUNS:
    assert run.name in out
  assert "val vs f32" in out
  assert plot.exists() and plot.stat().st_size > 10_000


@pytest.mark.slow
def test_fp8_example_trains_like_bfloat16(capsys):
  import train_fp8  # pylint: disable=g-import-not-at-top
  fp8_loss, bf16_loss = train_fp8.main(["--steps", "60"])
  assert abs(fp8_loss - bf16_loss) <= 0.1 * bf16_loss
  assert "DelayedScaling" in capsys.readouterr().out
