"""The examples run end to end and show what they claim (short settings)."""

import argparse
import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import flax.linen as nn
import pytest

import jaxmp
from tests import xla_flags

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import train_classifier  # pylint: disable=g-import-not-at-top
import train_lm  # pylint: disable=g-import-not-at-top
import transformer  # pylint: disable=g-import-not-at-top

BF16 = "params=float32,compute=bfloat16,output=float32"


@pytest.mark.slow
def test_classifier_mixed_precision_matches_float32():
  results = train_classifier.main(["--epochs", "4"])
  for name, accuracy in results.items():
    assert abs(accuracy - results["float32"]) <= 0.01, (name, results)
  assert results["float32"] > 0.9


@pytest.mark.slow
def test_train_lm_runs_every_configuration(tmp_path, capsys):
  plot = tmp_path / "curves.png"
  # The smoke preset (the demo's tiny model): every run's code path, as in the default
  # preset, at a fraction of the compile time; the checks do not depend on the size.
  train_lm.main(["--preset", "smoke", "--steps", "12", "--batch", "4", "--plot", str(plot)])
  out = capsys.readouterr().out
  for run in train_lm.RUNS:
    assert run.name in out
  assert "val vs f32" in out
  assert plot.exists() and plot.stat().st_size > 10_000


def test_the_demo_builds_a_run_from_a_policy_or_from_policy_rules():
  # benchmarks/bench_recipes.py gives train_lm one PolicyRules per fp8 recipe.
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule("head"),
                                   jaxmp.Rule(nn.Dense, fp8=jaxmp.fp8.RowwiseScaling())])
  config = transformer.Config(context=8, width=16, depth=1, heads=2)
  run = train_lm.Run("rowwise", rules, jaxmp.NoOpLossScale)
  assert train_lm.make_model(run, config).rules == rules
  # With fused attention the 16-bit runs also declare the blocks' attention causal.
  assert (train_lm.make_model(run, config, fused_attention=True).rules
          == dataclasses.replace(rules, fused_attention=True,
                                 rules=rules.rules + (train_lm.CAUSAL_ATTENTION,)))
  by_string = train_lm.make_model(train_lm.Run("bf16", BF16, jaxmp.NoOpLossScale), config)
  assert by_string.rules == jaxmp.PolicyRules(BF16)
  # The float32 run keeps Flax's attention even when the preset fuses it.
  float32 = train_lm.make_model(train_lm.RUNS[0], config, fused_attention=True)
  assert float32.rules == jaxmp.PolicyRules("float32")


@pytest.mark.slow
def test_the_demo_lm_trains_in_int8_like_bfloat16():
  # Every Dense and DenseGeneral but the head in int8 (forward and both gradient GEMMs),
  # against the demo's bfloat16 run: the same data, seed and steps.
  config = transformer.Config(context=32, width=64, depth=2, heads=4)
  args = argparse.Namespace(steps=150, batch=8, lr=2e-3, seed=0)
  corpus = train_lm.load_corpus()
  split = int(len(corpus) * 0.95)
  stream = train_lm.batches(corpus[split:], args.batch, config.context, seed=12345)
  val_batches = [next(stream) for _ in range(4)]
  int8 = train_lm.Run("bfloat16 + int8", jaxmp.PolicyRules(BF16, [
      jaxmp.Rule("head"),
      jaxmp.Rule((nn.Dense, nn.DenseGeneral), fp8=jaxmp.fp8.Int8Scaling())]), jaxmp.NoOpLossScale)
  bf16 = next(run for run in train_lm.RUNS if run.name == "bfloat16")
  val = {run.name: train_lm.train(run, args, config, corpus[:split], val_batches)["val"]
         for run in (bf16, int8)}
  assert abs(val["bfloat16 + int8"] - val["bfloat16"]) <= 0.01 * val["bfloat16"], val
  assert val["bfloat16"] < 3.0, val                            # it learned something


@pytest.mark.slow
def test_fp8_example_trains_like_bfloat16(capsys):
  import train_fp8  # pylint: disable=g-import-not-at-top
  fp8_loss, bf16_loss = train_fp8.main(["--steps", "60"])
  assert abs(fp8_loss - bf16_loss) <= 0.1 * bf16_loss
  assert "DelayedScaling" in capsys.readouterr().out


@pytest.mark.slow
def test_nnx_example_matches_float32_and_keeps_float32_params(capsys):
  import train_nnx  # pylint: disable=g-import-not-at-top
  results = train_nnx.main(["--epochs", "4"])
  baseline = results["float32"]["accuracy"]
  assert baseline > 0.9
  for name, r in results.items():
    assert abs(r["accuracy"] - baseline) <= 0.01, (name, results)
    assert r["kernel_dtype"] == "float32" and r["skipped"] == 0
  assert results["float16 + loss scaling"]["scale"] == 2.0**15
  assert "DelayedScaling" in capsys.readouterr().out


@pytest.mark.slow
def test_find_overflow_names_the_layer_and_direction_of_each_injected_fault(capsys):
  import find_overflow  # pylint: disable=g-import-not-at-top
  found = find_overflow.main(["--steps", "7", "--forward-step", "2", "--backward-step", "5"])
  assert found == {2: "forward output of block_1/mlp/down",
                   5: "backward input gradient of block_0/mlp"}
  out = capsys.readouterr().out
  assert ("step 2: nonfinite_origin: skipped step 2: first non-finite value: forward output "
          "of block_1/mlp/down (amax inf)") in out
  assert ("step 5: nonfinite_origin: skipped step 5: first non-finite value: backward input "
          "gradient of block_0/mlp (amax inf)") in out
  row = next(line for line in out.splitlines() if line.startswith("block_1/mlp/down "))
  assert row.split()[2] == "inf" and row.endswith("<- output"), row
  skipped = [line.split()[1] for line in out.splitlines() if line.endswith("  skipped")]
  assert skipped == ["2", "5"], out  # the faults' steps only


@pytest.mark.slow
def test_adaptive_precision_moves_the_overflowing_attention_to_float32_and_trains(tmp_path,
                                                                                   capsys):
  import adaptive_precision  # pylint: disable=g-import-not-at-top
  plot = tmp_path / "adaptive.png"
  results = adaptive_precision.main(["--steps", "16", "--plot", str(plot)])
  skips, heals = results["skips"], results["heals"]
  # Without the controller every step is skipped and the scale collapses to its floor.
  assert all(skips["skipped"]) and skips["scales"][-1] == 1.0, skips["scales"]
  assert "scale_collapse" in skips["anomalies"] and not skips["changes"]
  # With it: three skipped steps name the attention layer, which alone moves to float32.
  layer = "/".join(adaptive_precision.LAYER)
  (change,) = heals["changes"]
  assert change.applied and change.step == 2 and change.module == layer
  assert heals["rules"].rules == (jaxmp.Rule(layer, "params=float32,compute=float32"),)
  assert heals["skipped"] == [True] * 3 + [False] * 13
  assert heals["scales"][2:] == [4096.0] * 14  # the scale goes on, not reset
  assert heals["losses"][-1] < heals["losses"][3] - 0.5, heals["losses"]
  out = capsys.readouterr().out
  assert f"[heals] step 2: applied {layer} in float32: forward output of {layer}" in out
  assert "skips: 16 of 16 steps skipped" in out and "heals: 3 of 16 steps skipped" in out
  assert plot.exists() and plot.stat().st_size > 10_000


# The sharded example runs in a subprocess: JAX fixes its device count when it starts,
# and JAX in this process has (or will have) one CPU device.


def _run_example(args, env, timeout=300):
  return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                        timeout=timeout, cwd=EXAMPLES.parent)


@pytest.mark.slow
def test_sharded_example_matches_one_device_and_keeps_the_loss_scale_replicated():
  env = xla_flags.environ("--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  result = _run_example([str(EXAMPLES / "train_sharded.py"), "--steps", "12",
                         "--compare-steps", "3"], env)
  out = result.stdout
  assert result.returncode == 0, f"{out[-2000:]}\n{result.stderr[-4000:]}"
  assert "8 cpu devices; mesh {'data': 4, 'fsdp': 2}" in out, out
  # FSDP: the embedding split in two over 'fsdp', a bias replicated.
  assert re.search(r"embed/embedding +\(256, 128\) +P\('fsdp', None\) +per device \(128, 128\)",
                   out), out
  assert re.search(r"block_0/mlp/up/bias +\(512,\) +P\(\) +per device \(512,\)", out), out

  first, last = map(float, re.search(
      r"loss ([\d.]+) \(mean of the first 5\) -> ([\d.]+) \(last 5\)", out).groups())
  assert last < 0.8 * first, (first, last)
  # Ten finite steps grow the scale once (growth_interval=10): 4096 -> 8192, on every
  # device, read from each device's own buffer.
  scales = re.search(r"^loss scale on each of the 8 devices: \[(.*)\]$", out, re.M).group(1)
  assert [float(s) for s in scales.split(",")] == [8192.0] * 8, scales
  assert "skipped steps on each of the 8 devices: [0, 0, 0, 0, 0, 0, 0, 0]" in out
  assert "loss-scaling state identical on every device: True" in out
  assert "fp8 state replicated and identical on every device: True" in out
  # bfloat16 + fp8: the sharded sums round differently from one device's, within 1%.
  relative = float(re.search(r"max \|sharded - one device\| loss difference: \S+ "
                             r"\((\S+) relative\)", out).group(1))
  assert relative <= 1e-2, out


@pytest.mark.parametrize("env_change, expected_flags", [
    ({"XLA_FLAGS": None, "JAX_PLATFORMS": "cpu"},
     "--xla_force_host_platform_device_count=8"),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"},
     "--xla_force_host_platform_device_count=2"),
    ({"XLA_FLAGS": None, "JAX_PLATFORMS": "tpu"}, None),
], ids=["unset-on-cpu", "user-flags-kept", "not-cpu"])
def test_sharded_example_forces_cpu_devices_only_when_xla_flags_is_unset(env_change,
                                                                          expected_flags):
  env = dict(os.environ)
  for name, value in env_change.items():
    env.pop(name, None)
    if value is not None:
      env[name] = value
  probe = ("import os, train_sharded, jax; print(repr(os.environ.get('XLA_FLAGS')))\n"
           "if os.environ.get('JAX_PLATFORMS') == 'cpu': print(jax.device_count())")
  result = _run_example(["-c", f"import sys; sys.path.insert(0, {str(EXAMPLES)!r})\n{probe}"],
                        env, timeout=120)
  assert result.returncode == 0, result.stderr[-4000:]
  lines = result.stdout.split()
  assert lines[0] == repr(expected_flags), result.stdout
  if expected_flags is not None:
    assert int(lines[1]) == int(expected_flags.rsplit("=", 1)[1]), result.stdout
