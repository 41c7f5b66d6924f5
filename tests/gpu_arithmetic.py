"""A pytest plugin that makes XLA:CPU round float32 as GPUs do, to find tests that assume a CPU.

Tests run on the CPU are exact about the CPU's arithmetic; on a CUDA GPU XLA rounds
differently, and a test that compares bit for bit (or at 1e-6) what a GPU computes
otherwise fails there. This plugin changes the CPU's arithmetic in the three ways a
GPU differs that the suite's first run on an H100 showed (benchmarks/RESULTS.md, "On a
real H100"), so that such tests fail on a CPU too:

* **fused multiply-adds**: XLA on GPUs contracts ``a * b + c`` into one rounding, in
  some fusions and not in others, so two programs that compute the same operations
  differ in the last bit. The plugin compiles with XLA:CPU's default flags (FMA on)
  instead of the suite's ``tests/xla_flags.py``;
* **float32 division**: an H100 computed ``448 / a`` one ulp away from IEEE division for
  29% of random ``a``. The plugin lowers a float32 ``div`` as ``x * (1 / y)``, two
  roundings, which differs from IEEE division by an ulp about as often;
* **float32 GEMMs in TF32**: at XLA's default precision a float32 ``dot_general`` on
  an Ampere or Hopper GPU multiplies operands rounded to 10 mantissa bits. The plugin
  rounds both float32 operands so (``reduce_precision``) when the precision is the
  default.

It does not simulate the rest: GEMM algorithms that sum in another order, cuBLASLt's
fp8 fast accumulation, reductions in another order, transcendental functions of
other accuracy, XLA's excess precision for bfloat16 inside fusions.

Use: ``pytest -p tests.gpu_arithmetic tests/...`` (``make test-gpu-arithmetic`` runs the
subset the GPU session runs). A test that fails here and passes without the plugin
assumes the CPU's rounding: it either runs on the CPU device on every machine
(``@pytest.mark.on_cpu``: the plugin deselects it, since GPU rounding never reaches
it), runs its float32 GEMMs at full precision (``@pytest.mark.highest_precision``), or
runs per device with a stated GPU tolerance (``tests/backends.py``, whose ``exact``
is False under this plugin, so that the GPU tolerances are exercised here).
"""

import os

import numpy as np

# Before JAX starts its backend (plugins given with -p load before the root conftest):
# XLA:CPU's defaults, FMA included, instead of tests/xla_flags.py's flags.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=2"]).strip()

from jax._src.interpreters import mlir  # noqa: E402
from jax._src.lax import lax as lax_lax  # noqa: E402
from jax._src.lib.mlir.dialects import hlo  # noqa: E402

_DEFAULT_PRECISIONS = (None, (lax_lax.Precision.DEFAULT, lax_lax.Precision.DEFAULT))


def _division_in_two_roundings(ctx, x, y, **params):
  """float32 ``x / y`` as ``x * (1 / y)``, except where ``1 / y`` would be subnormal
  (which XLA:CPU flushes to zero, where a GPU's full-range division scales its
  operands); other dtypes as XLA divides them."""
  aval_out, = ctx.avals_out
  if aval_out.dtype != np.float32:
    return lax_lax._nary_lower_hlo(hlo.divide, ctx, x, y, **params)
  one = mlir.full_like_aval(ctx, 1.0, aval_out)
  limit = mlir.full_like_aval(ctx, 2.0**126, aval_out)

  def divide(x, y):
    in_range = hlo.compare(hlo.abs(y), limit, hlo.ComparisonDirectionAttr.get("LT"))
    return hlo.select(in_range, hlo.multiply(x, hlo.divide(one, y)), hlo.divide(x, y))
  return lax_lax._nary_lower_hlo(divide, ctx, x, y, **params)


def _tf32_operands(ctx, lhs, rhs, *, precision, **params):
  """A default-precision float32 GEMM of operands rounded to TF32's 10 mantissa bits."""
  if (precision in _DEFAULT_PRECISIONS
      and all(aval.dtype == np.float32 for aval in ctx.avals_in)):
    tf32 = lambda x: hlo.reduce_precision(x, mlir.i32_attr(8), mlir.i32_attr(10))
    lhs, rhs = tf32(lhs), tf32(rhs)
  return lax_lax._dot_general_lower(ctx, lhs, rhs, precision=precision, platform="cpu",
                                    **params)


mlir.register_lowering(lax_lax.div_p, _division_in_two_roundings, platform="cpu")
mlir.register_lowering(lax_lax.dot_general_p, _tf32_operands, platform="cpu")


def pytest_collection_modifyitems(config, items):
  # A test marked on_cpu checks XLA:CPU's own arithmetic and runs on the CPU on every
  # machine: GPU rounding never reaches it. Tests parametrized by device take their
  # GPU tolerances here (tests/backends.exact).
  kept = [item for item in items if item.get_closest_marker("on_cpu") is None]
  if len(kept) < len(items):
    config.hook.pytest_deselected(items=[i for i in items if i not in kept])
    items[:] = kept


def pytest_report_header():
  return ("tests/gpu_arithmetic.py: float32 division in two roundings, float32 GEMMs on "
          "TF32 operands, XLA:CPU's default flags (FMA)")
