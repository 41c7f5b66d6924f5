"""fp8 by rule: Rule(layer, fp8=recipe) through jaxmp.linen.mixed_precision."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp import fp8

OWG = "_overwrite_with_gradient"
BF16 = "params=float32,compute=bfloat16,output=float32"
DELAYED = fp8.DelayedScaling(amax_history_length=4)


def _rules(match, recipe=DELAYED, default=BF16, extra=()):
  return jaxmp.PolicyRules(default, [*extra, jaxmp.Rule(match, fp8=recipe)])


class TwoDense(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name="out")(nn.relu(nn.Dense(8, name="hidden")(x)))


def test_dense_rule_creates_state_and_matches_explicit_fp8_layer():
  x = jax.random.normal(jax.random.key(1), (4, 5))
  wrapped = jaxmp.linen.mixed_precision(TwoDense(), _rules(nn.Dense, default="float32"))
  variables = wrapped.init(jax.random.key(0), x)
  for name in ("hidden", "out"):
    state = variables[OWG][name]["Fp8DotGeneral_0"]
    assert state["input_amax_history"].shape == (4,)
    assert state["kernel_scale"].dtype == jnp.float32

  class Explicit(nn.Module):

    @nn.compact
    def __call__(self, x):
      cls = functools.partial(jaxmp.linen.Fp8DotGeneral, recipe=DELAYED)
      h = nn.Dense(8, name="hidden", dot_general_cls=cls)(x)
      return nn.Dense(3, name="out", dot_general_cls=cls)(nn.relu(h))

  ours = wrapped.apply(variables, x)
  explicit = Explicit().apply(variables, x)
  np.testing.assert_array_equal(ours, explicit)
  plain = TwoDense().apply({"params": variables["params"]}, x)
  np.testing.assert_allclose(ours, plain, rtol=0.15, atol=0.15)


def test_first_match_wins_keeps_a_layer_out_of_fp8():
  rules = _rules(nn.Dense, extra=[jaxmp.Rule("out")])
  variables = jaxmp.linen.mixed_precision(TwoDense(), rules).init(jax.random.key(0),
                                                                  jnp.ones((1, 5)))
  assert set(variables[OWG]) == {"hidden"}


def test_fp8_output_dtype_follows_compute_dtype():

  class Probe(nn.Module):

    @nn.compact
    def __call__(self, x):
      h = nn.Dense(4, name="d")(x)
      self.sow("intermediates", "h", h)
      return h

  wrapped = jaxmp.linen.mixed_precision(Probe(), _rules(nn.Dense))
  variables = wrapped.init(jax.random.key(0), jnp.ones((2, 3)))
  out, state = wrapped.apply(variables, jnp.ones((2, 3)), mutable=["intermediates"])
  assert state["intermediates"]["h"][0].dtype == jnp.bfloat16
  assert out.dtype == jnp.float32


def test_dense_general():

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.DenseGeneral((2, 3), axis=-1, name="proj")(x)

  wrapped = jaxmp.linen.mixed_precision(Net(), _rules(nn.DenseGeneral))
  x = jax.random.normal(jax.random.key(1), (4, 5))
  variables = wrapped.init(jax.random.key(0), x)
  assert "Fp8DotGeneral_0" in variables[OWG]["proj"]
  out = wrapped.apply(variables, x)
  assert out.shape == (4, 2, 3)
  np.testing.assert_allclose(out, Net().apply({"params": variables["params"]}, x),
                             rtol=0.2, atol=0.2)


def test_attention_projections_by_class_rule():

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(x, x)

  x = jax.random.normal(jax.random.key(1), (2, 3, 8))
  wrapped = jaxmp.linen.mixed_precision(Net(), _rules(nn.MultiHeadDotProductAttention))
  variables = wrapped.init(jax.random.key(0), x)
  assert set(variables[OWG]["attn"]) == {"query", "key", "value", "out"}
  assert "Fp8DotGeneral_0" in variables[OWG]["attn"]["query"]
  out = wrapped.apply(variables, x)
  np.testing.assert_allclose(out, Net().apply({"params": variables["params"]}, x),
                             rtol=0.2, atol=0.2)


def test_attention_projections_by_regex_and_dense_general_rule_together():

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(x, x)

  rules = jaxmp.PolicyRules(BF16, [
      jaxmp.Rule(nn.MultiHeadDotProductAttention, fp8=DELAYED),
      jaxmp.Rule(nn.DenseGeneral, fp8=DELAYED),
  ])
  variables = jaxmp.linen.mixed_precision(Net(), rules).init(jax.random.key(0),
                                                             jnp.ones((1, 2, 8)))
  assert set(variables[OWG]["attn"]) == {"query", "key", "value", "out"}


def test_einsum_rule_matches_fp8_einsum_by_hand():

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Einsum((5, 2, 3), "btd,dnh->btnh", name="proj")(x)

  x = jax.random.normal(jax.random.key(1), (2, 4, 5))
  wrapped = jaxmp.linen.mixed_precision(Net(), _rules(nn.Einsum, default="float32"))
  variables = wrapped.init(jax.random.key(0), x)
  state = variables[OWG]["proj"]["Fp8Einsum_0"]
  out = wrapped.apply(variables, x)
  params = variables["params"]["proj"]
  by_hand = fp8.fp8_einsum("btd,dnh->btnh", x, params["kernel"],
                           state=fp8.DelayedScalingState.from_variables(state), recipe=DELAYED)
  np.testing.assert_array_equal(out, by_hand + params["bias"])
  np.testing.assert_allclose(out, Net().apply({"params": variables["params"]}, x),
                             rtol=0.2, atol=0.2)


def test_current_scaling_keeps_no_state():
  wrapped = jaxmp.linen.mixed_precision(TwoDense(), _rules(nn.Dense, fp8.CurrentScaling()))
  variables = wrapped.init(jax.random.key(0), jnp.ones((2, 5)))
  assert OWG not in variables or not variables[OWG]
  assert wrapped.apply(variables, jnp.ones((2, 5))).shape == (2, 3)


def test_summary_shows_fp8():
  rules = _rules(nn.Dense, extra=[jaxmp.Rule("out")])
  rows = {r.path: r for r in jaxmp.tools.summary(TwoDense(), rules, jnp.ones((1, 5))).rows}
  assert rows["hidden"].fp8 == "DelayedScaling"
  assert rows["out"].fp8 == "-"
  assert "Fp8DotGeneral_0" not in str(rows)


def test_custom_dot_general_is_not_overridden():

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(2, dot_general=jax.lax.dot_general, name="mine")(x)

  wrapped = jaxmp.linen.mixed_precision(Net(), _rules(nn.Dense))
  with pytest.raises(ValueError, match="'mine'.*already has a custom dot_general"):
    wrapped.init(jax.random.key(0), jnp.ones((1, 3)))


def test_fp8_rule_on_layer_without_matmul_warns():

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Conv(2, (3,), name="conv")(x)

  wrapped = jaxmp.linen.mixed_precision(Net(), _rules(nn.Conv))
  with pytest.warns(UserWarning, match=r"rule 0 \(Conv\) has an fp8 recipe but matches no "
                    r"layer fp8 applies to"):
    variables = wrapped.init(jax.random.key(0), jnp.ones((1, 4, 3)))
  assert OWG not in variables


def test_interceptor_leaves_attributes_as_they_were():
  dense = nn.Dense(2)
  wrapped = jaxmp.linen.mixed_precision(dense, _rules(nn.Dense))
  wrapped.init(jax.random.key(0), jnp.ones((1, 3)))
  assert dense.dot_general_cls is None
  assert "param" not in dense.__dict__
