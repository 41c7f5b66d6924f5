"""jaxmp.tools.sensitivity / deviation / relative_error: which modules can compute in half precision."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp


# ---- sensitivity ------------------------------------------------------------------------------


def _fragile(x):
  # Normalizes with the variance computed as E[x^2] - E[x]^2 of data shifted by 100:
  # the two terms are ~10^4 and differ by ~1, which 16-bit floats (spacing 8 and 64
  # there) cannot resolve. XLA cannot simplify it away, unlike (x + c) - c.
  shifted = x + 100.0
  mean = jnp.mean(shifted, -1, keepdims=True)
  var = jnp.mean(jnp.square(shifted), -1, keepdims=True) - jnp.square(mean)
  return (shifted - mean) * jax.lax.rsqrt(jnp.abs(var) + 0.1)


class Fragile(nn.Module):

  def __call__(self, x):
    return _fragile(x)


class Net(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, name="body")(x)
    x = Fragile(name="fragile")(nn.LayerNorm(name="norm")(x))
    return nn.Dense(3, name="head")(nn.gelu(x))


X = jnp.linspace(-1.0, 1.0, 40).reshape(8, 5)
PATHS = {"", "body", "norm", "fragile", "head"}


@pytest.fixture(scope="module")
def linen_report():
  variables = Net().init(jax.random.key(0), X)
  return variables, jaxmp.tools.sensitivity(Net(), variables, X)


def test_sensitivity_finds_the_fragile_module(linen_report):
  _, report = linen_report
  assert report.candidates == ("bfloat16", "float16")
  assert {r.path for r in report.rows} == PATHS
  assert report.rows[0].path == "fragile" and report.rows[0].module == "Fragile"
  assert report.deviation("fragile", "bf16") > 0.5
  assert report.deviation("fragile", "float16") > 0.5
  for row in report.rows[1:]:
    assert max(row.deviations) < 0.01, row
  worst = [r.worst for r in report.rows]
  assert worst == sorted(worst, reverse=True)
  assert all(d > 0 for d in report.whole_model)


def test_recommended_rules_keep_only_the_fragile_module(linen_report):
  variables, report = linen_report
  rules = report.recommended_rules(threshold=0.01)
  assert rules.default == jaxmp.Policy("float32", "bfloat16", "float32")
  assert [(r.match, r.policy) for r in rules.rules] == [("fragile", jaxmp.Policy("float32"))]
  assert rules.float32_normalization
  assert report.recommended == rules
  assert report.sensitive(0.01, "float16") == ("fragile",)
  f16 = report.recommended_rules(0.01, "float16", float32_normalization=False)
  assert f16.default.compute_dtype == np.dtype(jnp.float16) and not f16.float32_normalization
  assert report.recommended_rules(threshold=1e9).rules == ()
  # The recommendation is closer to float32 than computing everything in bfloat16.
  all_bf16, recommended = jaxmp.tools.deviation(
      Net(), variables, X, rules=["params=float32,compute=bfloat16,output=float32", rules])
  assert recommended < 0.01 < all_bf16
  assert jaxmp.tools.deviation(Net(), variables, X, rules="float32") == 0.0


def test_sensitivity_table_text(linen_report):
  _, report = linen_report
  lines = str(report).splitlines()
  assert lines[0].startswith("Net: relative L2 error of the output vs float32")
  assert lines[1].split() == ["rank", "path", "module", "bfloat16", "float16"]
  assert lines[3].split()[:3] == ["1", "fragile", "Fragile"]
  assert "<root>" in str(report)
  assert lines[-1].split()[:2] == ["whole", "model"]


def test_sensitivity_of_a_wrapper_ignores_its_rules(linen_report):
  variables, report = linen_report
  wrapped = jaxmp.linen.mixed_precision(Net(), "bfloat16")
  again = jaxmp.tools.sensitivity(wrapped, variables, X, candidates=["bfloat16"], modules="fragile")
  assert again.rows[0].deviations == (report.deviation("fragile", "bfloat16"),)


def test_sensitivity_custom_metric_and_module_filter():
  variables = Net().init(jax.random.key(0), X)

  def max_abs_error(reference, output):
    return jnp.max(jnp.abs(reference - output))

  report = jaxmp.tools.sensitivity(Net(), variables, X, candidates=["float16"],
                             metric=max_abs_error, modules=r"body|head")
  assert [r.path for r in report.rows][0] in ("body", "head") and len(report.rows) == 2
  assert report.metric == "max_abs_error"
  assert str(report).startswith("Net: max_abs_error of the output")


def test_sensitivity_with_call_kwargs():

  class Flagged(nn.Module):

    @nn.compact
    def __call__(self, x, fragile: bool):
      x = nn.Dense(4, name="dense")(x)
      return Fragile(name="fragile")(x) if fragile else x

  variables = Flagged().init(jax.random.key(0), X, True)
  report = jaxmp.tools.sensitivity(Flagged(), variables, X, candidates=["bf16"], modules="fragile",
                             fragile=True)
  assert report.rows[0].deviations[0] > 0.5
  report = jaxmp.tools.sensitivity(Flagged(), variables, X, candidates=["bf16"], fragile=False)
  assert {r.path for r in report.rows} == {"", "dense"}


def _without_seconds(line):
  return re.sub(r" \(\d+\.\d s\)$", " (_ s)", line)


def test_sensitivity_reports_each_module_on_stderr_by_default_or_to_a_callable(capsys):
  variables = Net().init(jax.random.key(0), X)
  messages = []
  report = jaxmp.tools.sensitivity(Net(), variables, X, candidates=["bfloat16"],
                                   modules="fragile|head", progress=messages.append)
  text = lambda path: f"{report.deviation(path, 'bfloat16'):.2e}"
  assert [_without_seconds(m) for m in messages] == [
      "2 module(s) x 1 dtype(s): 4 compilations",
      f"module 1/2 fragile (Fragile): bfloat16 {text('fragile')} (_ s)",
      f"module 2/2 head (Dense): bfloat16 {text('head')} (_ s)",
      f"whole model: bfloat16 {report.whole_model[0]:.2e} (_ s)",
  ]
  assert capsys.readouterr() == ("", "")

  jaxmp.tools.sensitivity(Net(), variables, X, candidates=["bfloat16"], modules="fragile|head")
  out, err = capsys.readouterr()
  assert out == ""  # stdout stays the caller's (for the printed report)
  lines = err.splitlines()
  assert all(re.match(r"\[jaxmp\.tools\.sensitivity \d\d:\d\d:\d\d\] ", line) for line in lines)
  assert [_without_seconds(line.split("] ", 1)[1]) for line in lines] == [
      _without_seconds(m) for m in messages]

  jaxmp.tools.sensitivity(Net(), variables, X, candidates=["bfloat16"], modules="fragile",
                          progress=False)
  assert capsys.readouterr() == ("", "")


class NnxFragile(nnx.Module):

  def __call__(self, x):
    return _fragile(x)


class NnxNet(nnx.Module):

  def __init__(self, rngs):
    self.body = nnx.Linear(5, 8, rngs=rngs)
    self.fragile = NnxFragile()
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(self.fragile(self.body(x)))


def test_sensitivity_nnx():
  model = NnxNet(nnx.Rngs(0))
  kernel = model.body.kernel[...]
  report = jaxmp.tools.sensitivity(model, None, X, candidates=["bfloat16"])
  assert {r.path for r in report.rows} == {"", "body", "fragile", "head"}
  assert report.rows[0].path == "fragile"
  assert [r.match for r in report.recommended_rules(0.01).rules] == ["fragile"]
  assert model.body.kernel[...] is kernel   # the model is not changed
  wrapped = jaxmp.nnx.mixed_precision(NnxNet(nnx.Rngs(0)),
                                      "params=float32,compute=bfloat16,output=float32")
  again = jaxmp.tools.sensitivity(wrapped, None, X, candidates=["bfloat16"], modules="fragile")
  assert again.rows[0].deviations == report.rows[0].deviations


@pytest.mark.parametrize("call, error, text", [
    (lambda v: jaxmp.tools.sensitivity("model", v, X), TypeError, "got 'model' of type str"),
    (lambda v: jaxmp.tools.sensitivity(Net(), None, X), TypeError, "needs its variables"),
    (lambda v: jaxmp.tools.sensitivity(NnxNet(nnx.Rngs(0)), v, X), TypeError, "pass variables=None"),
    (lambda v: jaxmp.tools.sensitivity(Net(), v, X, candidates="bfloat16"), TypeError,
     "got 'bfloat16'"),
    (lambda v: jaxmp.tools.sensitivity(Net(), v, X, candidates=()), TypeError, "got ()"),
    (lambda v: jaxmp.tools.sensitivity(Net(), v, X, candidates=["int8"]), ValueError, "'int8'"),
    (lambda v: jaxmp.tools.sensitivity(Net(), v, X, candidates=["bf16", "bfloat16"]), ValueError,
     "name a dtype twice"),
    (lambda v: jaxmp.tools.sensitivity(Net(), v, X, metric="l2"), TypeError, "got 'l2' of type str"),
    (lambda v: jaxmp.tools.sensitivity(Net(), v, X, modules="nothing"), ValueError,
     "modules='nothing' matches none"),
    (lambda v: jaxmp.tools.sensitivity(Net(), v, X, modules="("), ValueError, "modules='('"),
    (lambda v: jaxmp.tools.sensitivity(Net(), v, X, modules=3), TypeError, "got 3 of type int"),
    (lambda v: jaxmp.tools.sensitivity(Net(), v, X, progress="yes"), TypeError,
     "progress must be True (lines on stderr), False (quiet) or a callable taking each message, "
     "got 'yes' of type str"),
    (lambda v: jaxmp.tools.sensitivity(Net(), v, X, modules="head",
                                 metric=lambda r, o: jnp.abs(r - o)), ValueError,
     "metric must return a scalar"),
])
def test_sensitivity_bad_inputs(call, error, text):
  variables = Net().init(jax.random.key(0), X)
  with pytest.raises(error, match=re.escape(text)):
    call(variables)


def test_recommended_rules_bad_inputs(linen_report):
  _, report = linen_report
  with pytest.raises(ValueError, match=re.escape("got -0.1")):
    report.recommended_rules(threshold=-0.1)
  with pytest.raises(ValueError, match=re.escape("got nan")):
    report.recommended_rules(threshold=float("nan"))
  with pytest.raises(TypeError, match=re.escape("got '0.1' of type str")):
    report.recommended_rules(threshold="0.1")
  with pytest.raises(ValueError, match=re.escape("'float32' was not measured")):
    report.recommended_rules(low="float32")
  with pytest.raises(KeyError, match="'nope'"):
    report.deviation("nope", "bf16")


def test_relative_error():
  assert float(jaxmp.tools.relative_error({"a": jnp.array([3.0, 4.0])},
                                          {"a": jnp.array([3.0, 6.5])})) == 0.5
  assert float(jaxmp.tools.relative_error(jnp.zeros(2), jnp.array([3.0, 4.0]))) == 5.0
  assert float(jaxmp.tools.relative_error(jnp.ones(2), jnp.array([1.0, jnp.nan]))) == np.inf
  with pytest.raises(ValueError, match="1 float leaves and the output 2"):
    jaxmp.tools.relative_error(jnp.ones(2), (jnp.ones(2), jnp.ones(2)))


def test_relative_error_of_trees_that_do_not_match_is_refused():
  # Paired by position, {"a": x} and {"b": x} read as equal: 0.0, silently.
  with pytest.raises(ValueError, match=re.escape(
      "relative_error: the reference and the output differ in structure: float leaf 0 is "
      "'a' in the reference and 'b' in the output")):
    jaxmp.tools.relative_error({"a": jnp.ones(2)}, {"b": jnp.ones(2)})
  with pytest.raises(ValueError, match=re.escape(
      "relative_error: float leaf 'w' has shape (3,) in the reference and (4,) in the output")):
    jaxmp.tools.relative_error({"w": jnp.ones(3)}, {"w": jnp.ones(4)})
  with pytest.raises(ValueError, match=re.escape("float leaf '<root>' has shape (3,) in the "
                                                 "reference and (3, 1) in the output")):
    jaxmp.tools.relative_error(jnp.ones(3), jnp.ones((3, 1)))   # would broadcast to (3, 3)
  # Dtypes may differ (that is what is measured), and containers of the same paths match.
  assert float(jaxmp.tools.relative_error({"w": jnp.ones(2)},
                                          {"w": jnp.ones(2, jnp.bfloat16)})) == 0.0
  assert float(jax.jit(jaxmp.tools.relative_error)([jnp.ones(2)], (jnp.ones(2),))) == 0.0
