"""Eight-device checks of non-finite tracing under sharded jit (run by test_nonfinite_locate.py).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/nonfinite_checks.py [NAME ...]

Each check prints ``PASS <name>: ...`` or ``FAIL <name>: ...``. The models and faults are
those of ``tests/nonfinite_models.py``: a forward overflow in ``down`` and a
backward-only overflow in ``boom``, in linen and in NNX, run with the batch sharded
over 8 devices (``NamedSharding`` on an Auto mesh, params replicated). Every reduction is global, so the
trace must locate the same origins, and hold the same statistics, as the same steps on
one device; a NaN in one device's rows alone is the whole step's.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tests import eight_devices  # pylint: disable=g-import-not-at-top
from tests import nonfinite_models  # pylint: disable=g-import-not-at-top

from jaxmp._src import nonfinite  # pylint: disable=g-import-not-at-top
from jaxmp._src.tools import nonfinite as nonfinite_report  # pylint: disable=g-import-not-at-top

DEVICES = eight_devices.DEVICES


def _sharded_and_single(runs) -> str:
  x = nonfinite_models.data(2 * DEVICES)
  # GSPMD's sharded jit: shardings propagated by XLA (Auto axes), the batch split.
  mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Auto,))
  sharded = runs(jax.device_put(x, NamedSharding(mesh, P("data"))))
  summary = nonfinite_models.check_runs(sharded)
  single = runs(jax.device_put(x, jax.devices()[0]))
  exact = [nonfinite.MADE_FORWARD, nonfinite.MADE_BACKWARD, nonfinite.FORWARD,
           nonfinite.BACKWARD, nonfinite.COUNT]
  for fault in nonfinite_models.EXPECTED:
    a, b = (nonfinite_report.decoded(r[fault]["nonfinite_trace"]) for r in (sharded, single))
    np.testing.assert_array_equal(a[:, exact], b[:, exact], err_msg=f"{fault}: flags")
    # Global maxima: equal up to the float16 rounding of gradients summed across devices
    # in another order (a per-device maximum would differ by far more).
    np.testing.assert_allclose(a, b, rtol=1e-2, err_msg=f"{fault}: amaxes")
  return summary + "; statistics those of one device"


def check_linen_sharded_jit() -> str:
  summary = _sharded_and_single(nonfinite_models.linen_runs)
  # A NaN in the rows of one device only is seen by the whole step.
  mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Auto,))
  x = nonfinite_models.data(2 * DEVICES).at[5, 3].set(np.nan)
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  holders = [s.device.id for s in xs.addressable_shards if np.isnan(s.data).any()]
  assert len(holders) == 1, holders
  metrics = nonfinite_models.linen_runs(xs)["clean"]
  assert nonfinite_models.located(metrics) == ("", "forward", "input"), metrics
  return summary + f"; a NaN on device {holders[0]} alone: forward input of <root>"


def check_nnx_sharded_jit() -> str:
  return _sharded_and_single(nonfinite_models.nnx_runs)


CHECKS = {
    "linen_sharded_jit": check_linen_sharded_jit,
    "nnx_sharded_jit": check_nnx_sharded_jit,
}


if __name__ == "__main__":
  sys.exit(eight_devices.main(CHECKS, sys.argv[1:]))
