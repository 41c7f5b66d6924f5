"""The README's quickstart and sharding examples run as written and do what they say."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _snippet(name: str) -> str:
  """The Python block between ``<!-- name: begin -->`` and ``<!-- name: end -->``."""
  text = README.read_text()
  marked = re.search(rf"<!-- {name}: begin[^>]*-->(.*?)<!-- {name}: end -->", text, re.S)
  assert marked, f"README.md has no block marked <!-- {name}: begin/end -->"
  blocks = re.findall(r"```python\n(.*?)```", marked.group(1), re.S)
  assert len(blocks) == 1, f"expected one Python block between the {name} markers"
  return blocks[0]


@pytest.mark.slow  # about 10 s: every op of the quickstart runs (and compiles) eagerly
def test_the_quickstart_runs_as_written():
  source = _snippet("quickstart")
  assert len(source.splitlines()) <= 40, "keep the quickstart short"
  namespace = {"__name__": "quickstart"}
  exec(compile(source, "README.md quickstart", "exec"), namespace)  # pylint: disable=exec-used

  # 1. params stored in float32, the output returned in float32.
  dtypes = {a.dtype for a in jax.tree_util.tree_leaves(namespace["variables"])}
  assert dtypes == {jnp.dtype(jnp.float32)}, dtypes
  assert namespace["out"].dtype == jnp.float32
  # 2. one loss-scaled optimizer step, taken (not skipped).
  metrics = jaxmp.loss_scaling_metrics(namespace["opt_state"])
  assert int(metrics["skipped_steps"]) == 0 and float(metrics["loss_scale"]) == 2.0**15
  # 3. a TrainState step: params updated, loss scale kept, fp8 state recorded the amaxes.
  state = namespace["state"]
  assert int(state.step) == 1
  histories = [a for path, a in jax.tree_util.tree_leaves_with_path(state.fp8)
               if "amax_history" in jax.tree_util.keystr(path)]
  assert histories and all(np.asarray(h)[0] > 0 for h in histories), state.fp8
  assert np.isfinite(float(namespace["loss"]))



@pytest.mark.slow
def test_the_sharding_examples_run_after_the_quickstart_on_8_cpu_devices():
  # As the README says: 8 CPU devices from XLA_FLAGS, set before JAX starts.
  report = ("print('devices', jax.device_count(), 'step', int(state.step), 'skipped', "
            "int(jaxmp.loss_scaling_metrics(state.opt_state)['skipped_steps']), "
            "'loss', float(loss))\n")
  program = (_snippet("quickstart") + _snippet("sharded jit") + report
             + _snippet("shard_map") + report)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  result = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                          text=True, timeout=900, cwd=ROOT)
  assert result.returncode == 0, result.stderr[-4000:]
  lines = [line.split() for line in result.stdout.splitlines() if line.startswith("devices")]
  assert len(lines) == 2, result.stdout
  for line in lines:  # each example: one step on 8 devices, taken, with a finite loss
    assert line[:6] == ["devices", "8", "step", "1", "skipped", "0"], line
    assert np.isfinite(float(line[7])), line
