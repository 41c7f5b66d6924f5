"""jaxmp.tools.underflow_report / underflow_stats / suggest_scale: what a dtype does to values."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp._src.tools import underflow as diagnostics

F16, BF16, E4M3, E5M2 = "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"


def _f32_after(x: float) -> float:
  return float(np.nextafter(np.float32(x), np.float32(np.inf)))


def _f32_before(x: float) -> float:
  return float(np.nextafter(np.float32(x), np.float32(0)))


def _counts(values, dtype, loss_scale=1.0):
  s = jaxmp.tools.underflow_stats({"x": jnp.asarray(values, jnp.float32)}, dtype, loss_scale)
  s = jax.device_get(s["x"])
  return (int(s.nonzero), int(s.underflow), int(s.subnormal), int(s.overflow),
          int(s.nonfinite))


# ---- underflow_stats: exact classes ------------------------------------------------------------


def test_hand_constructed_float16():
  values = [1e-8, -1e-8, 2.0**-20, 1.0, -70000.0, 0.0, np.inf, np.nan]
  # nonzero finite: 1e-8 (x2, flush), 2**-20 (subnormal), 1.0, -70000 (overflow).
  assert _counts(values, F16) == (5, 2, 1, 1, 2)


@pytest.mark.parametrize("dtype, zero, normal, overflow, inclusive", [
    # (min_subnormal / 2, min_normal - min_subnormal / 2, max + ulp(max) / 2)
    (F16, 2.0**-25, 2.0**-14 - 2.0**-25, 65520.0, True),
    (E4M3, 2.0**-10, 2.0**-6 - 2.0**-10, 464.0, False),
    (E5M2, 2.0**-17, 2.0**-14 - 2.0**-17, 61440.0, True),
])
def test_rounding_boundaries(dtype, zero, normal, overflow, inclusive):
  # The midpoint to zero flushes (ties to even 0); just above it is subnormal.
  assert _counts([zero], dtype)[1:4] == (1, 0, 0)
  assert _counts([_f32_after(zero)], dtype)[1:4] == (0, 1, 0)
  # The midpoint below min_normal rounds up to a normal number; just below stays subnormal.
  assert _counts([normal], dtype)[1:4] == (0, 0, 0)
  assert _counts([_f32_before(normal)], dtype)[1:4] == (0, 1, 0)
  # Rounding to max is not overflow; the midpoint overflows only with infinities.
  assert _counts([_f32_before(overflow)], dtype)[3] == 0
  assert _counts([overflow], dtype)[3] == int(inclusive)
  assert _counts([_f32_after(overflow)], dtype)[3] == 1


@pytest.mark.parametrize("dtype", [F16, BF16, E4M3, E5M2])
def test_classes_agree_with_xla_conversion(dtype):
  fmt = jaxmp.tools.float_format(dtype)
  rng = np.random.default_rng(0)
  lo, hi = max(np.log2(fmt.min_subnormal) - 3, -125), min(np.log2(fmt.max) + 2, 127.9)
  random = 2.0 ** rng.uniform(lo, hi, 4000) * rng.choice([-1, 1], 4000)
  bounds = diagnostics._boundaries(fmt)
  edges = [bounds.zero, bounds.normal, bounds.overflow, fmt.max, fmt.min_normal,
           fmt.min_subnormal]
  edges = [f(e) for e in edges for f in (float, _f32_after, _f32_before)
           if np.isfinite(np.float32(e)) and np.float32(e) >= 2.0**-126]
  x = jnp.asarray(np.concatenate([random, edges]), jnp.float32)
  converted = np.abs(np.asarray(x.astype(dtype).astype(jnp.float32)))
  expected = (int(np.sum(converted == 0)),
              int(np.sum((converted > 0) & (converted < fmt.min_normal))),
              int(np.sum(~np.isfinite(converted))))
  assert expected[0] + expected[1] + expected[2] > 0 or dtype == BF16
  assert _counts(x, dtype)[1:4] == expected


def test_loss_scale_shifts_values():
  assert _counts([1e-8], F16, 1024.0)[1:4] == (0, 1, 0)   # 1.02e-5: subnormal
  assert _counts([1e-8], F16, 2.0**13)[1:4] == (0, 0, 0)  # 8.2e-5: normal
  assert _counts([100.0], F16, 1024.0)[1:4] == (0, 0, 1)  # 102400: overflow
  assert _counts([1e-8], F16, jaxmp.StaticLossScale(1024.0))[1:4] == (0, 1, 0)


def test_stats_jit_with_traced_scale():
  fun = jax.jit(jaxmp.tools.underflow_stats, static_argnums=1)
  stats = fun({"a": [jnp.array([1e-8, 3.0])]}, F16, jnp.float32(4096.0))
  assert list(stats) == ["a/0"]
  assert int(stats["a/0"].subnormal) == 1
  assert float(stats["a/0"].max_abs) == 3.0
  assert float(stats["a/0"].min_abs) == np.float32(1e-8)


def test_max_and_min_ignore_zero_and_nonfinite():
  stats = jaxmp.tools.underflow_stats(jnp.array([0.0, -2.5, 1e-3, np.inf]), F16)
  assert list(stats) == ["<root>"]
  assert float(stats["<root>"].max_abs) == 2.5
  assert float(stats["<root>"].min_abs) == np.float32(1e-3)


# ---- underflow_report ----------------------------------------------------------------------------


def test_report_rows_totals_and_fractions():
  tree = {"w": jnp.array([1e-8, 2.0**-20, 1.0, 0.0]), "b": [jnp.array([7e4], jnp.float32)],
          "step": jnp.array(3), "key": jax.random.key(0), "none": None}
  report = jaxmp.tools.underflow_report(tree, "f16")
  assert [r.path for r in report.rows] == ["b/0", "w"]
  w = report.row("w")
  assert (w.size, w.nonzero, w.underflow, w.subnormal, w.overflow) == (4, 3, 1, 1, 0)
  assert report.row("b/0").overflow == 1
  total = report.total
  assert (total.size, total.nonzero, total.underflow, total.subnormal, total.overflow) == (
      5, 4, 1, 1, 1)
  assert (report.underflow_fraction, report.subnormal_fraction,
          report.overflow_fraction) == (0.25, 0.25, 0.25)
  assert report.dtype == np.dtype(jnp.float16)
  assert report.loss_scale == 1.0
  with pytest.raises(KeyError, match="'nope'"):
    report.row("nope")


def test_report_suggested_scale_and_remaining_underflow():
  report = jaxmp.tools.underflow_report({"g": jnp.array([1.0, 1e-12, 1e-6])}, F16)
  # 2**14 * 1.0 <= 65504 / 2 < 2**15 * 1.0
  assert report.suggested_scale == 2.0**14
  remaining = report.at_suggested
  assert (remaining.underflow, remaining.subnormal, remaining.overflow) == (1, 0, 0)
  assert (report.total.underflow, report.total.subnormal) == (1, 1)


def test_report_overflowing_values_suggest_a_scale_below_one():
  report = jaxmp.tools.underflow_report(jnp.array([1e6, 1.0]), F16)
  assert report.suggested_scale == 2.0**-5   # 1e6 / 32 = 31250 <= 32752
  assert report.at_suggested.overflow == 0
  assert report.total.overflow == 1


@pytest.mark.parametrize("max_abs, min_abs, dtype, expected", [
    (1.0, 1e-12, F16, 2.0**14),        # capped: 2**14 <= 65504 / 2 < 2**15
    (32752.0, 1e-12, F16, 1.0),
    (32753.0, 1e-12, F16, 0.5),
    (1e-3, 2.0**-20, F16, 2.0**6),     # just enough: 2**-20 * 2**6 = 2**-14
    (1e-3, 1.01 * 2.0**-20, F16, 2.0**6),
    (1e-3, 0.99 * 2.0**-20, F16, 2.0**7),
    (1.0, 0.5, F16, 1.0),              # already normal: no scaling
    (1e6, 1.0, F16, 2.0**-5),          # overflow: scale down
    (1e-3, 1e-6, BF16, 1.0),
    (1.0, 1e-3, E4M3, 16.0),           # min_normal 2**-6: 1e-3 * 16 >= 2**-6
    (0.0, 0.0, F16, None), (float("inf"), 1.0, F16, None), (1.0, float("inf"), F16, None),
    (1e-45, 1e-45, F16, 2.0**126),
])
def test_suggest_scale(max_abs, min_abs, dtype, expected):
  assert jaxmp.tools.suggest_scale(max_abs, min_abs, dtype) == expected


@pytest.mark.parametrize("args, error, text", [
    ((-1.0, 1e-3, F16), ValueError,
     "max_abs must be a magnitude: >= 0 (inf when there is none), got -1.0"),
    ((1.0, -1e-3, F16), ValueError,
     "min_abs must be a magnitude: >= 0 (inf when there is none), got -0.001"),
    ((float("nan"), 1e-3, F16), ValueError, "max_abs must be a magnitude: >= 0 (inf when there "
     "is none), got nan"),
    ((1e-3, 1.0, F16), ValueError,
     "min_abs (1.0) is larger than max_abs (0.001): the arguments are (max_abs, min_abs)"),
    ((0.0, 1e-3, F16), ValueError, "min_abs (0.001) is larger than max_abs (0.0)"),
    (("1", 1e-3, F16), TypeError, "max_abs must be a real number, got '1'"),
])
def test_suggest_scale_bad_inputs(args, error, text):
  with pytest.raises(error, match=re.escape(f"suggest_scale: {text}")):
    jaxmp.tools.suggest_scale(*args)


def test_report_all_zero():
  report = jaxmp.tools.underflow_report({"g": jnp.zeros(3)}, BF16)
  assert report.suggested_scale is None and report.at_suggested is None
  assert report.underflow_fraction == 0.0
  assert "no suggested loss scale" in str(report)


def test_report_fp8_and_float16_leaves_and_nnx_state():
  tree = {"q": jnp.array([1.0, 2.0], jnp.float8_e4m3fn), "h": jnp.array([1e-7], jnp.float16)}
  report = jaxmp.tools.underflow_report(tree, "e5m2")
  assert report.row("q").nonzero == 2
  assert report.row("h").underflow == 1       # 1.19e-7 <= 2**-17 / ... flushes in e5m2
  assert report.dtype == np.dtype(jnp.float8_e5m2)
  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  report = jaxmp.tools.underflow_report(nnx.state(model, nnx.Param), F16)
  assert [r.path for r in report.rows] == ["bias", "kernel"]


def test_report_table_text():
  report = jaxmp.tools.underflow_report({"w": jnp.array([1e-8, 1.0]), "b": jnp.array([2.0])}, F16,
                                  loss_scale=2.0)
  lines = str(report).splitlines()
  assert lines[0] == ("float16 at loss scale 2**1 = 2: of 3 nonzero finite values, 33.33% "
                      "flush to zero, 0% become subnormal, 0% overflow")
  assert lines[1].split() == ["path", "dtype", "nonzero", "flush", "%", "subnormal", "%",
                              "overflow", "%", "max", "|x|", "min", "|x|"]
  assert lines[4].split() == ["w", "float32", "2", "50.00", "0", "0", "1.00e+00", "1.00e-08"]
  assert lines[5].split()[:3] == ["<all>", "3", "33.33"]
  assert lines[6] == ("suggested loss scale 2**13 = 8192 (the smallest that makes every "
                      "nonzero |x| normal): 0% flush to zero, 0% subnormal, 0% overflow")


@pytest.mark.parametrize("kwargs, error, text", [
    (dict(dtype="int8"), ValueError, "'int8'"),
    (dict(dtype="floaty"), ValueError, "'floaty'"),
    (dict(loss_scale=0.0), ValueError, "got 0.0"),
    (dict(loss_scale=-2), ValueError, "got -2"),
    (dict(loss_scale=float("inf")), ValueError, "got inf"),
    (dict(loss_scale=1e-50), ValueError, "positive and finite in float32 (values are scaled in "
     "float32), got 1e-50"),
    (dict(loss_scale=1e39), ValueError, "got 1e+39"),
    (dict(loss_scale=float("nan")), ValueError, "got nan"),
    (dict(loss_scale="8"), TypeError, "got '8' of type str"),
    (dict(loss_scale=True), TypeError, "got True"),
    (dict(loss_scale=jnp.ones(2)), ValueError, "shape (2,)"),
])
def test_report_bad_inputs(kwargs, error, text):
  kwargs = {"dtype": F16, **kwargs}
  with pytest.raises(error, match=re.escape(text)):
    jaxmp.tools.underflow_report({"g": jnp.ones(2)}, **kwargs)


def test_report_no_float_leaves():
  with pytest.raises(ValueError, match="no floating-point array leaves"):
    jaxmp.tools.underflow_report({"ids": jnp.arange(3)}, F16)


def test_stats_bad_concrete_scale():
  with pytest.raises(ValueError, match="got -1.0"):
    jaxmp.tools.underflow_stats({"g": jnp.ones(2)}, F16, -1.0)



@pytest.mark.parametrize("values, text", [
    ([1.0, 1e-12], "suggested loss scale 2**14 = 16384 (the largest with max |x| x scale <= max "
                   "/ 2: the values span more than float16's range): 50.00% flush to zero"),
    ([1.0, 0.5], "suggested loss scale 2**0 = 1 (no scaling needed): 0% flush to zero"),
    ([1e6, 1.0], "suggested loss scale 2**-5 = 0.03125 (the largest with max |x| x scale <= "
                 "max / 2): 0% flush to zero"),
])
def test_report_explains_its_suggestion(values, text):
  last = str(jaxmp.tools.underflow_report(jnp.array(values), F16)).splitlines()[-1]
  assert last.startswith(text), last
