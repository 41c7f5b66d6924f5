"""The README's quickstart runs as written and does what it says; the README stays short."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from tests.doc_snippets import ROOT
from tests.doc_snippets import snippet

README = ROOT / "README.md"


def test_the_readme_stays_short():
  # The guides live under docs/ (`make docs`); the README is the front page.
  assert len(README.read_text().splitlines()) <= 250


@pytest.mark.slow  # about 10 s: every op of the quickstart runs (and compiles) eagerly
def test_the_quickstart_runs_as_written():
  source = snippet(README, "quickstart")
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
