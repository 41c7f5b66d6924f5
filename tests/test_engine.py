"""The precision engine's decisions, as linen and NNX models see them.

Module dtype fields follow the policy, nothing is rounded through a narrower dtype on
its way into a wider computation, threaded state keeps its dtype, the float32 op list
is in effect only inside wrapped modules, and importing or running jaxmp leaves JAX
and Flax as they were.
"""

import subprocess
import sys
import textwrap
import threading

import flax.linen as nn
import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp

BF16 = "params=float32,compute=bfloat16,output=float32"


def _dot_dtypes(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args)
  return [str(e.invars[0].aval.dtype) for e in jaxpr.eqns if e.primitive.name == "dot_general"]


# ---- module dtype fields -------------------------------------------------------------------


def test_linen_dtype_field_follows_the_policy():
  model = nn.Dense(3, dtype=jnp.float32)  # a published config's default
  wrapped = jaxmp.linen.mixed_precision(model, BF16)
  x = jnp.ones((2, 4))
  variables = wrapped.init(jax.random.key(0), x)
  assert _dot_dtypes(lambda v: wrapped.apply(v, x), variables) == ["bfloat16"]
  assert model.dtype == jnp.float32  # the model itself is not changed
  model_wins = jaxmp.linen.mixed_precision(model, jaxmp.PolicyRules(BF16, module_dtypes="model"))
  assert _dot_dtypes(lambda v: model_wins.apply(v, x), variables) == ["float32"]


def test_nnx_embed_attend_computes_in_the_policy_dtype():
  # nnx.Embed fixes its dtype from its embedding (float32) at construction.
  embed = nnx.Embed(10, 4, rngs=nnx.Rngs(0))
  assert embed.dtype == jnp.float32
  wrapped = jaxmp.nnx.mixed_precision(embed, BF16)
  query = jnp.ones((2, 4))
  assert _dot_dtypes(lambda q: wrapped.attend(q), query) == ["bfloat16"]
  assert wrapped.attend(query).dtype == jnp.float32
  assert embed.dtype == jnp.float32  # only the wrapper's private copy changed


def test_bad_module_dtypes_value():
  with pytest.raises(ValueError, match=r"module_dtypes must be one of \('policy', 'model'\), "
                                       r"got 'config'"):
    jaxmp.PolicyRules(BF16, module_dtypes="config")
  with pytest.raises(TypeError, match="module_dtypes must be one of"):
    jaxmp.PolicyRules(BF16, module_dtypes=True)


# ---- no rounding through a narrower dtype -----------------------------------------------


class Sow(nn.Module):

  @nn.compact
  def __call__(self, x):
    self.sow("intermediates", "x", x)
    return x * 2


class PassThrough(nn.Module):

  @nn.compact
  def __call__(self, x):
    return Sow(name="wide")(x)  # x goes on untouched


def test_a_value_passed_on_untouched_reaches_a_wider_module_unrounded():
  x = jnp.array([1.0 + 2.0**-12, 3.0])  # not representable in bfloat16
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule("wide", "float32")])
  wrapped = jaxmp.linen.mixed_precision(PassThrough(), rules)
  _, state = wrapped.apply({}, x, mutable=["intermediates"])
  seen = state["intermediates"]["wide"]["x"][0]
  assert seen.dtype == jnp.float32
  np.testing.assert_array_equal(seen, x)  # not rounded to bfloat16 on the way
  # A value the bfloat16 root computed is what the wide module gets, as computed.
  class Computes(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Sow(name="wide")(x + 0)
  wrapped = jaxmp.linen.mixed_precision(Computes(), rules)
  _, state = wrapped.apply({}, x, mutable=["intermediates"])
  np.testing.assert_array_equal(state["intermediates"]["wide"]["x"][0],
                                x.astype(jnp.bfloat16).astype(jnp.float32))


def test_a_wide_output_handed_through_keeps_its_bits_to_the_model_output():
  # head computes in float32 and hands back bfloat16 to its caller; the root returns
  # that value untouched as the float32 model output: the float32 original comes back.
  class Head(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x / 3.0

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Head(name="head")(x)

  x = jnp.array([1.0, 2.0])
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule("head", "float32")])
  out = jaxmp.linen.mixed_precision(Net(), rules).apply({}, x)
  np.testing.assert_array_equal(out, x / 3.0)


# ---- threaded state ----------------------------------------------------------------------


class Cell(nn.Module):
  """(carry, x) -> (carry, y), like Flax's recurrent cells."""

  @nn.compact
  def __call__(self, carry, x):
    h = jnp.tanh(nn.Dense(carry.shape[-1], name="mix")(jnp.concatenate([carry, x], -1)))
    return h, h.sum(-1)


@pytest.mark.parametrize("carry_dtype", [jnp.float32, jnp.bfloat16])
def test_a_carry_comes_back_in_its_dtype_so_a_scan_typechecks(carry_dtype):
  wrapped = jaxmp.linen.mixed_precision(Cell(), BF16)
  carry, xs = jnp.zeros((2, 4), carry_dtype), jnp.ones((5, 2, 3))
  variables = wrapped.init(jax.random.key(0), carry, xs[0])
  step = lambda c, x: wrapped.apply(variables, c, x)
  final, ys = jax.lax.scan(step, carry, xs)
  assert final.dtype == carry_dtype
  assert ys.dtype == jnp.float32  # the other output: the model's output dtype


def test_nnx_carry_threaded_through_the_wrapper():

  class NnxCell(nnx.Module):
    def __init__(self, rngs):
      self.mix = nnx.Linear(7, 4, rngs=rngs)

    def __call__(self, carry, x):
      h = jnp.tanh(self.mix(jnp.concatenate([carry, x], -1)))
      return h, h.sum(-1)

  wrapped = jaxmp.nnx.mixed_precision(NnxCell(nnx.Rngs(0)), BF16)
  carry, y = wrapped(jnp.zeros((2, 4), jnp.bfloat16), jnp.ones((2, 3)))
  assert carry.dtype == jnp.bfloat16 and y.dtype == jnp.float32


# ---- caches written in place ---------------------------------------------------------------


def test_a_cache_is_read_in_the_compute_dtype_and_written_in_its_own():
  from jaxmp._src import engine  # pylint: disable=g-import-not-at-top
  call = engine.Call(jaxmp.PolicyRules(BF16), supports_fp8=lambda t: False)
  cache = {"k": jnp.full(3, 1 / 3, jnp.float32), "q": jnp.ones(3, jnp.float8_e4m3fn),
           "index": jnp.int32(2)}
  read = call.read_cache(cache, jnp.bfloat16)
  # A float cache is an input: read in the compute dtype. The index, and a cache the
  # model quantizes to 8 bits itself, are read as stored.
  assert {k: v.dtype.name for k, v in read.items()} == {
      "k": "bfloat16", "q": "float8_e4m3fn", "index": "int32"}
  new = engine.written({"k": read["k"] * 2, "q": read["q"], "index": read["index"] + 1}, cache)
  assert {k: v.dtype.name for k, v in new.items()} == {
      "k": "float32", "q": "float8_e4m3fn", "index": "int32"}
  assert float(new["k"][0]) == float(jnp.bfloat16(1 / 3)) * 2  # rounded once, kept exactly
  fresh = jnp.ones(2, jnp.bfloat16)
  assert engine.written(fresh, None) is fresh  # a variable that held no array


class LinenCacheWriter(nn.Module):
  """A cache written through put_variable/get_variable rather than self.variable."""

  @nn.compact
  def __call__(self, x):
    step = nn.Dense(x.shape[-1], name="proj")(x)
    if not self.has_variable("cache", "total"):
      self.put_variable("cache", "total", jnp.zeros(x.shape, jnp.float32))
      return step
    total = jax.lax.dynamic_update_slice(self.get_variable("cache", "total"), step, (0, 0))
    self.put_variable("cache", "total", total)
    return total


def test_linen_put_and_get_variable_keep_a_float32_cache_float32():
  wrapped = jaxmp.linen.mixed_precision(LinenCacheWriter(), BF16)
  x = jnp.ones((2, 4))
  variables = wrapped.init(jax.random.key(0), x)
  assert variables["cache"]["total"].dtype == jnp.float32
  out, updates = wrapped.apply(variables, x, mutable=["cache"])
  assert updates["cache"]["total"].dtype == jnp.float32 and out.dtype == jnp.float32
  assert _dot_dtypes(lambda v: wrapped.apply(v, x, mutable=["cache"]), variables) == ["bfloat16"]


# ---- the float32 op list ------------------------------------------------------------------


def test_softmax_is_float32_inside_wrapped_modules_only():

  class Attend(nn.Module):
    @nn.compact
    def __call__(self, x):
      return jax.nn.softmax(nn.Dense(4)(x)) @ x.T

  x = jnp.ones((3, 4))
  wrapped = jaxmp.linen.mixed_precision(Attend(), "float16")
  variables = wrapped.init(jax.random.key(0), x)
  jaxpr = jax.make_jaxpr(lambda v: wrapped.apply(v, x))(variables)
  assert _exp_dtypes(jaxpr) == ["float32"]
  # The softmax's result feeds the next matmul in the compute dtype.
  assert _dot_dtypes(lambda v: wrapped.apply(v, x), variables) == ["float16", "float16"]
  # Outside a wrapped call the function is JAX's own again.
  assert jax.nn.softmax.__module__.startswith("jax")
  half = jnp.ones(3, jnp.float16)
  assert [str(e.invars[0].aval.dtype) for e in jax.make_jaxpr(jax.nn.softmax)(half).eqns
          if e.primitive.name == "exp"] == ["float16"]


def _exp_dtypes(jaxpr) -> list[str]:
  """The input dtypes of every exp in ``jaxpr``, nested jaxprs (custom VJPs) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "exp":
      found.append(str(eqn.invars[0].aval.dtype))
    for sub in jax_core.jaxprs_in_params(eqn.params):
      found += _exp_dtypes(sub)
  return found


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_softmax_gradient_works_from_the_rounded_probabilities(dtype):
  # Forward: float32 arithmetic, rounded once. Backward: float32 arithmetic on the
  # rounded probabilities y (the values the next matmul saw): y * (g - sum(g * y)).
  class Probs(nn.Module):
    @nn.compact
    def __call__(self, x):
      return jax.nn.softmax(x, axis=-1)

  x = jax.random.normal(jax.random.key(0), (3, 5)) * 4
  g = jax.random.normal(jax.random.key(1), (3, 5))
  wrapped = jaxmp.linen.mixed_precision(Probs(), jaxmp.PolicyRules(
      str(np.dtype(dtype)), [jaxmp.Rule("", output_dtype=str(np.dtype(dtype)))]))
  xh, gh = x.astype(dtype), g.astype(dtype)
  y, vjp = jax.vjp(lambda x: wrapped.apply({}, x), xh)
  (dx,) = vjp(gh)
  y_ref = np.asarray(jax.nn.softmax(np.asarray(xh, np.float32), axis=-1)).astype(dtype)
  np.testing.assert_array_equal(np.asarray(y), y_ref)
  y32, g32 = y_ref.astype(np.float32), np.asarray(gh, np.float32)
  dx_ref = (y32 * (g32 - (g32 * y32).sum(-1, keepdims=True))).astype(dtype)
  assert dx.dtype == dtype
  np.testing.assert_array_equal(np.asarray(dx), dx_ref)


def test_softmax_with_where_keeps_jax_semantics_in_float32():
  class Masked(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
      return jax.nn.softmax(x, where=mask)

  x = jnp.arange(6.0).reshape(2, 3).astype(jnp.bfloat16)
  mask = jnp.array([[True, True, False], [True, False, True]])
  out = jaxmp.linen.mixed_precision(Masked(), "bfloat16").apply({}, x, mask)
  expected = jax.nn.softmax(x.astype(jnp.float32), where=mask).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_log_softmax_and_logsumexp_return_float32():

  class Scores(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.log_softmax(x), jax.scipy.special.logsumexp(x, axis=-1)

  log_probs, lse = jaxmp.linen.mixed_precision(Scores(), jaxmp.PolicyRules(
      "bfloat16", [jaxmp.Rule("", output_dtype="float32")])).apply({}, jnp.ones((2, 3)))
  assert log_probs.dtype == jnp.float32 and lse.dtype == jnp.float32
  np.testing.assert_allclose(lse, np.log(3.0) + 1.0, rtol=1e-6)


def test_float32_ops_bad_input():
  with pytest.raises(TypeError, match=r"float32_ops must be a tuple of op names.*got 'softmax'"):
    jaxmp.Rule("attn", float32_ops="softmax")
  with pytest.raises(ValueError, match=r"unknown float32 op 'softmx'; accepted: softmax, "
                                       r"log_softmax, logsumexp"):
    jaxmp.PolicyRules(BF16, float32_ops=("softmx",))


def test_a_rule_naming_an_op_jaxmp_cannot_intercept_warns_with_the_paths():
  model = nn.Sequential([nn.Dense(3), nn.Dense(2)])
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule(nn.Dense, float32_ops=("softmax", "exp"))])
  with pytest.warns(UserWarning, match=r"asks for exp in float32, which jaxmp cannot "
                                       r"intercept .*compute dtype in layers_0, layers_1"):
    jaxmp.linen.mixed_precision(model, rules).init(jax.random.key(0), jnp.ones((1, 4)))


def test_the_model_wide_list_naming_an_op_jaxmp_cannot_intercept_warns_like_a_rule():
  # PolicyRules(float32_ops=("exp",)) used to be ignored without a word.
  model = nn.Sequential([nn.Dense(3), nn.Dense(2)])
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule("layers_1", float32_ops=())],
                            float32_ops=("softmax", "exp"))
  with pytest.warns(UserWarning, match=r"PolicyRules float32_ops asks for exp in float32, "
                                       r"which jaxmp cannot intercept .*compute dtype in "
                                       r"<root>, layers_0\b"):
    jaxmp.linen.mixed_precision(model, rules).init(jax.random.key(0), jnp.ones((1, 4)))


def test_a_softmax_bound_before_the_call_is_not_seen():
  # float32_ops swaps the public functions for the call (its module docstring says why
  # nothing narrower finds the op); a name bound before the call keeps the original.
  # If the mechanism changes, this test and that paragraph change together.
  from jax.nn import softmax as bound_softmax  # pylint: disable=import-outside-toplevel

  class Both(nn.Module):
    @nn.compact
    def __call__(self, x):
      return jax.nn.softmax(x), bound_softmax(x)

  model = jaxmp.linen.mixed_precision(Both(), "params=float32,compute=float16,output=float16")
  jaxpr = jax.make_jaxpr(lambda x: model.apply({}, x))(jnp.ones(3))

  def exp_dtypes(jaxpr):  # in program order, inside custom_jvp/custom_vjp calls too
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "exp":
        yield str(eqn.invars[0].aval.dtype)
      for inner in jax_core.jaxprs_in_params(eqn.params):
        yield from exp_dtypes(inner)

  # The first softmax (found by name) runs in float32; the bound one in float16.
  assert list(exp_dtypes(jaxpr.jaxpr)) == ["float32", "float16"]


def test_other_threads_see_jax_unchanged_during_a_wrapped_call():
  seen = {}
  started, release = threading.Event(), threading.Event()

  class Slow(nn.Module):
    @nn.compact
    def __call__(self, x):
      started.set()
      release.wait(10)
      return jax.nn.softmax(x)

  def other():
    started.wait(10)
    half = jnp.ones(3, jnp.float16)
    seen["exp"] = [str(e.invars[0].aval.dtype) for e in jax.make_jaxpr(jax.nn.softmax)(half).eqns
                   if e.primitive.name == "exp"]
    release.set()

  thread = threading.Thread(target=other)
  thread.start()
  jaxmp.linen.mixed_precision(Slow(), "float16").apply({}, jnp.ones(3))
  thread.join()
  assert seen["exp"] == ["float16"]


def test_importing_jaxmp_changes_nothing_in_jax_or_flax():
  script = textwrap.dedent("""
      import jax, flax.linen, flax.nnx
      from jax._src import ad_util
      from flax.nnx import variablelib
      before = (jax.nn.softmax, jax.nn.log_softmax, jax.nn.logsumexp,
                dict(ad_util.raw_jaxval_adders), dict(variablelib.VariableTypeCache))
      import jaxmp, jaxmp.linen, jaxmp.fp8, jaxmp.tools
      after = (jax.nn.softmax, jax.nn.log_softmax, jax.nn.logsumexp,
               dict(ad_util.raw_jaxval_adders), dict(variablelib.VariableTypeCache))
      assert before == after, [b == a for b, a in zip(before, after)]
      import sys
      assert "jaxmp.nnx" not in sys.modules and "flax.nnx" in sys.modules
      print("unchanged")
  """)
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == "unchanged"


# ---- per-call hooks ------------------------------------------------------------------------


class _OutputDtypes:
  """A hook the engine does not know: records each call and its output dtypes.

  Defined here, against engine.CallHook alone, to show that a per-call feature plugs
  in without a change to the engine or the adapters.
  """

  def __init__(self):
    self.entered, self.left = [], []

  def enter(self, site, xs):
    self.entered.append((site.start, site.record.path, site.record.method))
    return xs, site.start

  def leave(self, site, xs, token):
    assert token == site.start  # the token of this call, not of a nested one
    assert {x.dtype for x in xs} <= {site.record.output_dtype}
    self.left.append((site.start, {x.dtype.name for x in xs}))
    return xs


def _check_hook_saw(hook, records):
  assert hook.entered == [(i + 1, r.path, r.method) for i, r in enumerate(records)]
  # Calls finish inside out: the model's own call (start 1) last.
  assert hook.left[-1][0] == 1 and sorted(s for s, _ in hook.left) == list(
      range(1, len(records) + 1))
  dtypes = dict(hook.left)
  for i, r in enumerate(records):
    assert dtypes[i + 1] <= {r.output_dtype.name}, (r.path, dtypes[i + 1])


def test_a_hook_defined_outside_the_engine_sees_every_call_of_a_published_linen_model():
  from jaxmp._src import nonfinite  # pylint: disable=g-import-not-at-top
  from tests.published import models as registry  # pylint: disable=g-import-not-at-top
  entry = registry.BY_NAME["lm1b_transformer_lm"]
  rules = jaxmp.PolicyRules(BF16, trace_nonfinite=True)
  wrapped = jaxmp.linen.mixed_precision(entry.module("eval"), rules)
  batch = entry.batch(jax.random.key(1))
  variables = entry.init(wrapped, jax.random.key(0), batch)
  params = {k: v for k, v in variables.items() if k != jaxmp.linen.NONFINITE_COLLECTION}

  def probe_grad(hooks, probe):
    def loss(probe):
      out, records = wrapped.trace(lambda: wrapped.model.apply(params, *batch.inputs),
                                   hooks=(*hooks, *nonfinite.hooks(rules, probe)))
      loss.records = records
      return jnp.sum(out.astype(jnp.float32)), out
    (_, out), grad = jax.value_and_grad(loss, has_aux=True)(probe)
    return out, grad, loss.records

  probe = variables[jaxmp.linen.NONFINITE_COLLECTION]
  hook = _OutputDtypes()
  out, grad, records = probe_grad((hook,), probe)
  _check_hook_saw(hook, records)
  assert len(records) > 10 and {"bfloat16", "float32"} <= {d for _, s in hook.left for d in s}
  # Beside the non-finite hook, it changes nothing: the output and the trace are the same.
  plain_out, plain_grad, _ = probe_grad((), probe)
  np.testing.assert_array_equal(out, plain_out)
  np.testing.assert_array_equal(grad.values, plain_grad.values)


def test_a_hook_defined_outside_the_engine_sees_every_call_of_a_published_nnx_model():
  from tests.published import models as registry  # pylint: disable=g-import-not-at-top
  entry = registry.BY_NAME["mnist_cnn"]
  wrapped = jaxmp.nnx.mixed_precision(entry.module(nnx.Rngs(0)), BF16)
  wrapped.eval()
  x = entry.batch(jax.random.key(1)).inputs[0]
  hook = _OutputDtypes()
  out, records = wrapped._trace("__call__", (x,), {}, hooks=(hook,))  # pylint: disable=protected-access
  _check_hook_saw(hook, records)
  assert {r.path for r in records} >= {"", "conv1", "linear2"}
  np.testing.assert_array_equal(out, wrapped(x))
