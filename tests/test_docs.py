"""The docs pages' examples run as written, and the API reference covers every public module.

`make docs` builds the site (warnings and broken cross-references fail it); these tests
run the code the pages teach, which the build does not execute.
"""

import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest

import jaxmp
from tests import xla_flags
from tests.doc_snippets import ROOT
from tests.doc_snippets import snippet

DOCS = ROOT / "docs"
SHARDING = DOCS / "guides" / "sharding.md"


def _public_modules() -> set[str]:
  """``jaxmp``, its namespaces in ``__all__``, and their submodules in theirs."""
  names = {"jaxmp"}
  for name in jaxmp.__all__:
    module = getattr(jaxmp, name)
    if isinstance(module, types.ModuleType):
      names.add(module.__name__)
      names.update(getattr(module, n).__name__ for n in module.__all__
                   if isinstance(getattr(module, n), types.ModuleType))
  return names


def test_the_api_reference_documents_every_public_module():
  documented = set()
  for page in (DOCS / "api").glob("*.md"):
    documented.update(re.findall(r"^\.\. automodule:: (\S+)$", page.read_text(), re.M))
  public = _public_modules()
  assert {"jaxmp.linen", "jaxmp.fp8.state", "jaxmp.tools"} <= public  # the walk finds them
  assert documented == public, (sorted(public - documented), sorted(documented - public))


@pytest.mark.slow
def test_the_sharding_examples_run_after_the_quickstart_on_8_cpu_devices():
  # As the sharding guide says: 8 CPU devices from XLA_FLAGS, set before JAX starts.
  report = ("print('devices', jax.device_count(), 'step', int(state.step), 'skipped', "
            "int(jaxmp.loss_scaling_metrics(state.opt_state)['skipped_steps']), "
            "'loss', float(loss))\n")
  program = (snippet(ROOT / "README.md", "quickstart") + snippet(SHARDING, "sharded jit")
             + report + snippet(SHARDING, "shard_map") + report)
  env = xla_flags.environ("--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
                         PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  result = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                          text=True, timeout=900, cwd=ROOT)
  assert result.returncode == 0, result.stderr[-4000:]
  lines = [line.split() for line in result.stdout.splitlines() if line.startswith("devices")]
  assert len(lines) == 2, result.stdout
  for line in lines:  # each example: one step on 8 devices, taken, with a finite loss
    assert line[:6] == ["devices", "8", "step", "1", "skipped", "0"], line
    assert np.isfinite(float(line[7])), line
