"""Where a test computes, and by how much a GPU may differ from the CPU's exact answer.

On XLA:CPU the suite checks jaxmp's arithmetic bit for bit. A CUDA GPU rounds
differently, legitimately (benchmarks/RESULTS.md, "On a real H100"): float32 division is
not IEEE (one ulp off for 29% of quotients), a float32 GEMM at XLA's default precision
multiplies TF32 operands, fused multiply-adds round once. So a test of exact arithmetic
either runs on the CPU device (``@pytest.mark.on_cpu``, conftest.py) or runs once per
device in :data:`DEVICES` (parametrized: ``"cpu"`` everywhere, ``"gpu"`` where JAX has
one) and states its GPU tolerance from this module, each with the figure it comes
from. No test is skipped for want of a GPU: a CPU-only machine runs the ``"cpu"`` case.

The tolerances marked UNMEASURED are reasoned bounds that no GPU run has checked yet;
the next run on a GPU (``make gpu-session``) measures them: their tests report the
figure in their failure message.
"""

from __future__ import annotations

import contextlib
import sys

import jax
import numpy as np


def _gpu_present() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:  # no GPU backend in this JAX install, or no GPU
    return False


DEVICES = ("cpu", "gpu") if _gpu_present() else ("cpu",)
"""The platforms a per-device test runs on here."""


def exact(platform: str) -> bool:
  """Whether ``platform`` rounds as XLA:CPU does under the suite's flags, so that
  bit-exact checks hold there: the CPU, except under tests/gpu_arithmetic.py, which
  makes it round as a GPU does so that the GPU cases of the tests run on a CPU too."""
  return platform == "cpu" and "tests.gpu_arithmetic" not in sys.modules


@contextlib.contextmanager
def on(platform: str):
  """Computes on ``platform``'s first device (arrays not placed on a device follow, and
  jaxmp traces for it: ``jaxmp._src.dtypes.default_device``)."""
  with jax.default_device(jax.devices(platform)[0]):
    yield


DIVISION_ULPS = 1
"""float32 quotients on a GPU: within one ulp of IEEE division (an H100: ``448 / a``
differed in the last bit for 29% of 100,000 random ``a``, never by more; RESULTS.md).
Scales computed by one division (int8's ``amax / 127``) inherit it."""

SCALE_ULPS = 2 * DIVISION_ULPS
"""fp8 scales on a GPU: TransformerEngine's and Flax's ``1 / (fp8_max / amax)`` divides
twice, an ulp each."""

CODES_OFF_BY_ONE_STEP = 0.01
"""UNMEASURED. Where a GPU's scale is an ulp off the reference's, a quantized value
within an ulp of a rounding boundary lands on the neighbouring code (one step away).
Values that close to a boundary are about 2**-20 of random data (an ulp of the
quotient against the spacing of 8-bit codes, 2**-3 to 2**-7 relative): at most this
fraction of codes may differ, each by one step."""

TF32_GEMM_RTOL = 2.0**-9
"""float32 GEMMs at XLA's default precision on an Ampere or Hopper GPU multiply
operands rounded to TF32 (10 explicit mantissa bits: a relative error up to 2**-11 per
operand, 2**-10 per product). UNMEASURED on jaxmp's tests: a sum of such products
relative to the largest result stays within 2**-9 for the sizes the tests use
(tests/gpu_arithmetic.py's TF32 simulation measured 3e-4 on a 64 x 64 x 64 product)."""

BF16_PROGRAMS_RTOL = 2.0**-7
"""Two separately compiled programs of the same bfloat16 model on a GPU: XLA fuses each
differently and keeps float32 inside fusions where the program rounds to bfloat16
("excess precision"), so results differ by bfloat16 roundings. Measured: linen and NNX
outputs of one bfloat16 model about 1e-3 relative apart on an H100 (RESULTS.md); the
bound is two bfloat16 ulps (2**-7), relative to the largest value. UNMEASURED for
gradients."""


def max_ulps(actual, expected) -> int:
  """The largest distance in float32 ulps between two arrays of finite float32 values."""
  a = np.asarray(actual, np.float32).view(np.int32).astype(np.int64)
  b = np.asarray(expected, np.float32).view(np.int32).astype(np.int64)
  # Map the sign-magnitude bit patterns onto a line where neighbours differ by one.
  a, b = (np.where(v < 0, np.int64(-2**31) - v, v) for v in (a, b))
  return int(np.max(np.abs(a - b), initial=0))


def assert_close_to_largest(actual, expected, rtol: float, what: str = "") -> None:
  """``|actual - expected| <= rtol * max|expected|``, elementwise; the message says the
  largest relative difference found (the figure a GPU run measures)."""
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  scale = float(np.max(np.abs(expected), initial=0.0)) or 1.0
  found = float(np.max(np.abs(actual - expected), initial=0.0)) / scale
  assert found <= rtol, f"{what}: largest difference {found:.3g} of the largest value > {rtol:.3g}"
