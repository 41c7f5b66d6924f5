"""Shared pytest set-up: the suite's XLA flags, names the docstring examples use."""

import os

from tests import xla_flags

# Before JAX starts its backend: faster XLA:CPU compiles (see tests/xla_flags.py).
xla_flags.use_fast_compile()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jaxmp  # noqa: E402

# A pytest plugin, loaded only by `-p tests.gpu_arithmetic`: importing it changes how
# XLA:CPU lowers float32 division and GEMMs for the rest of the process, so the
# --doctest-modules collection must not import it beside the other tests.
collect_ignore = ["tests/gpu_arithmetic.py"]


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
  doctest_namespace.update(jax=jax, jnp=jnp, np=np, jaxmp=jaxmp)


@pytest.fixture(autouse=True)
def _on_cpu(request):
  """A test marked ``on_cpu`` checks XLA:CPU's exact arithmetic or what XLA:CPU compiles:
  where another backend is the default (a GPU), it computes on the CPU device, which
  every JAX install has (arrays not placed on a device follow it, and jaxmp traces for
  it: ``jaxmp._src.dtypes.default_device``)."""
  if request.node.get_closest_marker("on_cpu") is None or jax.default_backend() == "cpu":
    yield
    return
  with jax.default_device(jax.devices("cpu")[0]):
    yield


@pytest.fixture(autouse=True)
def _highest_precision(request):
  """A test marked ``highest_precision`` compares two float32 formulations of one
  computation (Flax's attention and jaxmp's, say) at about 1e-6: its float32 GEMMs run
  at full precision, which is XLA:CPU's default and not a GPU's (TF32 operands, about
  1e-3 off: tests/backends.py)."""
  if request.node.get_closest_marker("highest_precision") is None:
    yield
    return
  with jax.default_matmul_precision("highest"):
    yield


def pytest_report_header():
  return f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')!r} (tests/xla_flags.py)"
