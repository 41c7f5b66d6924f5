"""Non-finite tracing: what the trace holds, how it composes, and that off changes nothing.

Locating overflows end to end (linen, NNX, published models, sharded) is in
``test_nonfinite_locate.py``.
"""

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp._src import engine
from jaxmp._src import nonfinite
from jaxmp._src.tools import nonfinite as nonfinite_report  # pylint: disable=g-import-not-at-top
from tests import nonfinite_golden

TRACE = jaxmp.PolicyRules("float32", trace_nonfinite=True)
X = jnp.array([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]])


def _columns(trace, path, method="__call__"):
  """The decoded row of one call site, by column name."""
  row = nonfinite_report.decoded(trace)[trace.calls.index((path, method))]
  return dict(zip(nonfinite.COLUMNS, row.tolist()))


def _amax(x):
  return float(jnp.max(jnp.abs(x)))


class _Two(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name="b")(nn.Dense(4, name="a")(x))


def test_amaxes_and_positions_are_those_of_the_values_and_gradients():
  model = jaxmp.linen.mixed_precision(_Two(), TRACE)
  variables = model.init(jax.random.key(0), X)
  loss = lambda v, x: 0.5 * jnp.sum(model.apply(v, x) ** 2)
  _, grads = jax.jit(jaxmp.linen.value_and_grad(loss))(variables, X)
  # The same computation by hand, differentiated by JAX with no tracing.
  p = variables["params"]
  dense = lambda x, q: x @ q["kernel"] + q["bias"]
  ya, vjp_a = jax.vjp(lambda x, q: dense(x, q), X, p["a"])
  yb, vjp_b = jax.vjp(lambda h, q: dense(h, q), ya, p["b"])
  g_ya, g_b = vjp_b(yb)
  g_x, g_a = vjp_a(g_ya)
  expected = {
      "": dict(input=_amax(X), output=_amax(yb), output_grad=_amax(yb), input_grad=_amax(g_x),
               forward=3, backward=1),
      "a": dict(input=_amax(X), output=_amax(ya), output_grad=_amax(g_ya), input_grad=_amax(g_x),
                param_grad=max(_amax(g_a["kernel"]), _amax(g_a["bias"])), forward=1, backward=2),
      "b": dict(input=_amax(ya), output=_amax(yb), output_grad=_amax(yb), input_grad=_amax(g_ya),
                param_grad=max(_amax(g_b["kernel"]), _amax(g_b["bias"])), forward=2, backward=3),
  }
  assert grads.nonfinite.calls == (("", "__call__"), ("a", "__call__"), ("b", "__call__"))
  for path, want in expected.items():
    got = _columns(grads.nonfinite, path)
    assert got["count"] == 1.0
    for name, value in want.items():
      np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=f"{path} {name}")
  assert _columns(grads.nonfinite, "")["param_grad"] == -np.inf  # the root owns no params
  assert nonfinite_report.first_nonfinite(grads.nonfinite) is None


def test_backward_amaxes_are_of_the_scaled_gradients():
  model = jaxmp.linen.mixed_precision(_Two(), TRACE)
  variables = model.init(jax.random.key(0), X)
  grad_fn = jax.jit(jaxmp.linen.value_and_grad(lambda v: jnp.sum(model.apply(v, X))))
  one = nonfinite_report.decoded(grad_fn(variables)[1].nonfinite)
  eight = nonfinite_report.decoded(grad_fn(variables, loss_scale=jaxmp.StaticLossScale(8.0))[1]
                            .nonfinite)
  backward = [nonfinite.OUTPUT_GRAD, nonfinite.INPUT_GRAD, nonfinite.PARAM_GRAD]
  np.testing.assert_array_equal(eight[1:, backward], 8 * one[1:, backward])
  np.testing.assert_array_equal(eight[:, :nonfinite.OUTPUT_GRAD], one[:, :nonfinite.OUTPUT_GRAD])


class _Cell(nn.Module):
  @nn.compact
  def __call__(self, c, _):
    return nn.Dense(3, name="dense")(c), None


class _Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    scan = nn.scan(_Cell, variable_broadcast="params", split_rngs={"params": False}, length=3)
    c, _ = scan(name="cell")(x, None)
    return nn.remat(nn.Dense)(3, name="head")(c)


def test_a_module_inside_scan_reports_the_max_over_iterations_and_remat_changes_nothing():
  model = jaxmp.linen.mixed_precision(_Scanned(), TRACE)
  variables = model.init(jax.random.key(0), X)
  kernel = variables["params"]["cell"]["dense"]["kernel"]
  bias = variables["params"]["cell"]["dense"]["bias"]
  outputs, c = [], X
  for _ in range(3):
    c = c @ kernel + bias
    outputs.append(_amax(c))
  loss = lambda v, x: jnp.sum(model.apply(v, x))
  _, grads = jax.jit(jaxmp.linen.value_and_grad(loss))(variables, X)
  dense = _columns(grads.nonfinite, "cell/dense")
  np.testing.assert_allclose(dense["output"], max(outputs), rtol=1e-6)
  assert dense["count"] == 1.0  # max-accumulated over the iterations, not summed
  head = _columns(grads.nonfinite, "head")
  np.testing.assert_allclose(head["input"], outputs[-1], rtol=1e-6)
  np.testing.assert_allclose(head["output_grad"], 1.0)  # d sum / d output, through remat

  # An inf made in the second iteration only is still the scanned layer's output.
  big = {**variables, "params": jax.tree.map(lambda a: a, variables["params"])}
  big["params"]["cell"]["dense"]["kernel"] = kernel * 1e30
  _, grads = jax.jit(jaxmp.linen.value_and_grad(loss))(big, X)
  origin = nonfinite_report.first_nonfinite(grads.nonfinite)
  assert (origin.path, origin.direction, origin.value) == ("cell/dense", "forward", "output")


def test_vmap_sums_are_divided_back_out():
  model = jaxmp.linen.mixed_precision(_Two(), TRACE)
  variables = model.init(jax.random.key(0), X)
  single = jaxmp.linen.value_and_grad(lambda v, x: jnp.sum(model.apply(v, x)))(variables, X)
  mapped = jaxmp.linen.value_and_grad(lambda v, xs: jnp.sum(jax.vmap(
      lambda x: model.apply(v, x))(xs)))(variables, jnp.stack([X, X, X]))
  one, three = (nonfinite_report.decoded(g.nonfinite) for g in (single[1], mapped[1]))
  np.testing.assert_array_equal(three[:, nonfinite.COUNT], [3.0, 3.0, 3.0])
  positions = [nonfinite.FORWARD, nonfinite.BACKWARD]
  np.testing.assert_array_equal(three[:, positions], one[:, positions])
  np.testing.assert_allclose(three[:, :nonfinite.PARAM_GRAD], one[:, :nonfinite.PARAM_GRAD],
                             rtol=1e-6)  # three equal copies: their mean is each


class _Widening(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name="wide")(x) + nn.Dense(2, name="narrow")(x)


def test_tracing_changes_no_value_and_no_cast():
  # bfloat16 root handing its (rounded) input to a float32 layer: the layer must be
  # given the value the input was rounded from, traced or not.
  def run(trace):
    rules = jaxmp.PolicyRules("p=f32,c=bf16,o=f32", [jaxmp.Rule("wide", "float32")],
                              trace_nonfinite=trace)
    model = jaxmp.linen.mixed_precision(_Widening(), rules)
    variables = model.init(jax.random.key(0), X)
    x = X + 1e-3  # not representable in bfloat16
    out = model.apply(variables, x)
    loss = lambda v: jnp.sum(model.apply(v, x) ** 2)
    _, grads = jax.jit(jaxmp.linen.value_and_grad(loss))(variables)
    return out, grads.params

  (out_off, grads_off), (out_on, grads_on) = run(False), run(True)
  np.testing.assert_array_equal(out_on, out_off)
  chex.assert_trees_all_equal(grads_on, grads_off)


def test_plain_jax_grad_of_the_probe_is_the_trace():
  model = jaxmp.linen.mixed_precision(_Two(), TRACE)
  variables = model.init(jax.random.key(0), X)
  probe = variables[jaxmp.linen.NONFINITE_COLLECTION]

  def loss(params, probe):
    return jnp.sum(model.apply({"params": params, "jaxmp_nonfinite": probe}, X * jnp.inf))

  _, trace = jax.grad(loss, argnums=(0, 1))(variables["params"], probe)
  assert isinstance(trace, jaxmp.tools.NonfiniteTrace) and trace.calls == probe.calls
  assert str(nonfinite_report.first_nonfinite(trace)) == "forward input of <root>"
  assert _columns(trace, "a")["param_grad"] == -np.inf  # filled by jaxmp's value_and_grad only


def test_nonfinite_probe_builds_one_for_another_call():
  class Coder(nn.Module):
    def setup(self):
      self.enc, self.dec = nn.Dense(3), nn.Dense(3)

    def __call__(self, x):
      return self.enc(x)

    def decode(self, x):
      return self.dec(x)

  model = jaxmp.linen.mixed_precision(Coder(), TRACE)
  variables = model.init(jax.random.key(0), X)
  variables = {**variables, "params": model.init(jax.random.key(0), X, method="decode")["params"]}
  with pytest.raises(ValueError, match="no row for the module call <root>.decode"):
    model.apply(variables, X, method="decode")
  probe = model.nonfinite_probe(variables, X, method="decode")
  assert probe.calls == (("", "decode"), ("dec", "__call__"))
  out = model.apply({**variables, jaxmp.linen.NONFINITE_COLLECTION: probe}, X, method="decode")
  assert out.shape == (2, 3)


def test_a_shared_modules_parameter_gradient_is_not_made_by_the_call_that_got_a_finite_one():
  # A tied embedding (WMT's shared_embedding): looked up at the start, its attend makes
  # the logits. A backward overflow in "block" reaches the lookup's output gradient; the
  # table's gradient sums both uses, so attend, whose output gradient was finite, did
  # not make it non-finite.
  inf = np.inf
  calls = (("", "__call__"), ("embed", "__call__"), ("block", "__call__"), ("embed", "attend"))
  rows = [  # input, output, output_grad, input_grad, param_grad, made_f, made_b, fwd, bwd, count
      [-inf, 2.0, 1.0, -inf, -inf, 0.0, -inf, 4.0, 1.0, 1.0],
      [-inf, 2.0, inf, -inf, inf, 0.0, -inf, 1.0, 2.0, 1.0],
      [2.0, 2.0, 1.0, inf, 3.0, 0.0, 1.0, 2.0, 3.0, 1.0],
      [2.0, 2.0, 1.0, 1.0, inf, 0.0, 0.0, 3.0, 4.0, 1.0],
  ]
  trace = nonfinite.NonfiniteTrace(calls, jnp.array(rows, jnp.float32))
  assert str(nonfinite_report.first_nonfinite(trace)) == "backward input gradient of block"
  # Had every call site of embed got a finite output gradient, embed made its own.
  rows[1][2] = 1.0
  rows[2][3], rows[2][6] = 1.0, 0.0
  trace = nonfinite.NonfiniteTrace(calls, jnp.array(rows, jnp.float32))
  assert str(nonfinite_report.first_nonfinite(trace)) == "backward parameter gradient of embed.attend"


def test_micro_batch_traces_combine_by_max():
  model = jaxmp.linen.mixed_precision(_Two(), TRACE)
  variables = model.init(jax.random.key(0), X)
  grad_fn = jaxmp.linen.value_and_grad(lambda v, x: jnp.sum(model.apply(v, x)))
  (_, a), (_, b) = grad_fn(variables, X), grad_fn(variables, 10 * X)
  total = jaxmp.linen.accumulate_gradients(a, b)
  np.testing.assert_array_equal(total.nonfinite.values,
                                np.maximum(a.nonfinite.values, b.nonfinite.values))
  assert jaxmp.linen.accumulate_gradients(a, b._replace(nonfinite=None)).nonfinite is a.nonfinite


def test_nnx_wrapper_has_a_row_per_module_and_public_method():
  class Tied(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(5, 3, rngs=rngs)

    def __call__(self, tokens):
      return self.embed.attend(self.embed(tokens))

  model = jaxmp.nnx.mixed_precision(Tied(nnx.Rngs(0)), TRACE)
  assert set(model.nonfinite.calls) == {("", "__call__"), ("embed", "__call__"),
                                        ("embed", "attend")}
  _, grads = jaxmp.nnx.value_and_grad(lambda m, t: jnp.sum(m(t)))(model, jnp.array([1, 2]))
  embed, attend = (_columns(grads.nonfinite, "embed", m) for m in ("__call__", "attend"))
  assert embed["input"] == -np.inf and attend["input"] > 0  # token ids are not measured
  assert attend["forward"] > embed["forward"] and attend["backward"] > embed["backward"]
  assert embed["param_grad"] == attend["param_grad"] > 0  # one table, both methods


# ---- off: exactly what jaxmp built before tracing existed --------------------------------


@pytest.mark.golden
@pytest.mark.parametrize("framework", sorted(nonfinite_golden.JAXPRS))
def test_tracing_off_builds_the_jaxpr_of_jaxmp_before_tracing(framework):
  golden = nonfinite_golden.read(nonfinite_golden.golden_path(framework))
  assert nonfinite_golden.JAXPRS[framework]() == golden


def test_a_golden_file_of_other_versions_fails_naming_them_and_the_command(tmp_path):
  stale = tmp_path / "stale.jaxpr.txt"
  stale.write_text("# jax 0.4.1, flax 0.8.0; regenerate: make golden\n{ lambda ; }")
  with pytest.raises(pytest.fail.Exception) as failed:  # a failure, not a skip
    nonfinite_golden.read(stale)
  assert str(failed.value) == (
      f"{stale} was written with jax 0.4.1, flax 0.8.0, but jax {jax.__version__}, flax "
      f"{flax.__version__} is installed: regenerate it with `make golden` (it writes what the "
      "current code builds with tracing off; check the diff before committing it).")
  unlabelled = tmp_path / "unlabelled.jaxpr.txt"
  unlabelled.write_text("{ lambda ; }")
  with pytest.raises(pytest.fail.Exception, match="regenerate it with `make golden`"):
    nonfinite_golden.read(unlabelled)


def test_a_regenerated_golden_file_names_the_installed_versions_and_reads_back(tmp_path):
  path = tmp_path / "off.jaxpr.txt"
  nonfinite_golden.write(path, "{ lambda ; }")
  assert path.read_text().splitlines()[0] == (
      f"# jax {jax.__version__}, flax {flax.__version__}; regenerate: make golden")
  assert nonfinite_golden.read(path) == "{ lambda ; }"


@pytest.mark.parametrize("framework", sorted(nonfinite_golden.JAXPRS))
def test_tracing_off_touches_none_of_the_tracing_code(framework, monkeypatch):
  rules = jaxmp.PolicyRules(nonfinite_golden.POLICY, trace_nonfinite=True)
  traced = nonfinite_golden.JAXPRS[framework](rules)
  assert "custom_vjp_call" in traced  # the identities, when on

  def refuse(*args, **kwargs):
    raise AssertionError("tracing code ran with tracing off")

  for name in ("Tracer", "enter", "leave", "probe", "with_param_grads", "accumulate"):
    monkeypatch.setattr(nonfinite, name, refuse)
  off = nonfinite_golden.JAXPRS[framework]()
  assert "custom_vjp_call" not in off and off != traced


def test_engine_refuses_a_probe_under_rules_that_do_not_trace():
  with pytest.raises(ValueError, match="trace_nonfinite=True"):
    engine.Call(jaxmp.PolicyRules("float32"), lambda t: False,
                hooks=nonfinite.hooks(jaxmp.PolicyRules("float32"),
                                      nonfinite.probe((("", "__call__"),))))
