"""Adaptive precision on Flax's published models: the overflowing module moves to float32.

Each run (``tests/adaptive_models.py``) trains a published model in float16 with one
injected fault, a forward one (an attention layer's logits overflow) or a backward one
(a module's gradient overflows, every forward value finite), with
:class:`jaxmp.tools.PrecisionController` applying its changes. Two skipped steps name
the module; the controller keeps that module alone in float32; the run goes on with
the same params, optimizer state, loss scale and fp8 state, and the step is traced
once more (the jit cache grows by one). linen (lm1b, with fp8 layers) and NNX (ViT),
under ``jit`` and, in a subprocess, under sharded ``jit`` on 8 devices
(``adaptive_checks.py``).
"""

import logging
import pathlib

import pytest

from tests import adaptive_models
from tests import eight_devices

SCRIPT = pathlib.Path(__file__).with_name("adaptive_checks.py")
CHECKS = ("linen_sharded_jit", "nnx_sharded_jit")

eight_device_results, test_eight_devices, test_the_check_names_match_the_script = (
    eight_devices.make_tests(SCRIPT, CHECKS, cwd=SCRIPT.parents[1]))


@pytest.mark.slow  # a published model compiled twice (10-20 s)
@pytest.mark.parametrize("fault", ["forward", "backward"])
@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_the_module_that_overflows_moves_to_float32_and_the_run_goes_on(framework, fault, caplog):
  with caplog.at_level(logging.WARNING, logger="jaxmp"):
    run = adaptive_models.RUNS[framework](fault)
  adaptive_models.check(framework, fault, run)
  (change,) = run.changes
  assert [r.getMessage() for r in caplog.records if r.name == "jaxmp"] == [
      f"jaxmp.tools.PrecisionController: {change}"]
