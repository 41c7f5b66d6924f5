"""Eight-device checks of adaptive precision under sharded jit (run by test_adaptive_precision.py).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/adaptive_checks.py [NAME ...]

Each check prints ``PASS <name>: ...`` or ``FAIL <name>: ...``. The runs are those of
``tests/adaptive_models.py`` (Flax's published lm1b and NNX ViT, a forward and a
backward fault each) with the batch sharded over 8 devices (``NamedSharding`` on an
Auto mesh, the state replicated). The controller decides from the loss scale, the skip
flag and the non-finite trace, which a sharded step returns fully replicated, so every
device (and host) holds the same evidence: the change, its step and the rules must be
those of one device (``adaptive_models.check``).
"""

from __future__ import annotations

import logging
import pathlib
import sys

import jax
from jax.sharding import AxisType

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tests import adaptive_models  # pylint: disable=g-import-not-at-top
from tests import eight_devices  # pylint: disable=g-import-not-at-top


def _sharded(framework: str) -> str:
  mesh = jax.make_mesh((eight_devices.DEVICES,), ("data",), axis_types=(AxisType.Auto,))
  lines = []
  for fault in ("forward", "backward"):
    run = adaptive_models.RUNS[framework](fault, mesh=mesh)
    lines.append(adaptive_models.check(framework, fault, run, one_device=False))
  return "; ".join(lines)


def check_linen_sharded_jit() -> str:
  return _sharded("linen")


def check_nnx_sharded_jit() -> str:
  return _sharded("nnx")


CHECKS = {
    "linen_sharded_jit": check_linen_sharded_jit,
    "nnx_sharded_jit": check_nnx_sharded_jit,
}


if __name__ == "__main__":
  logging.getLogger("jaxmp").setLevel(logging.ERROR)  # the changes are checked, not printed
  sys.exit(eight_devices.main(CHECKS, sys.argv[1:]))
