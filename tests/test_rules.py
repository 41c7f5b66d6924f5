"""Rule matching, PolicyRules resolution order, normalization defaults and bad rules."""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp._src import rules as rules_lib

BF16 = jaxmp.get_policy("p=f32,c=bf16,o=f32")


class Custom(nn.Module):

  @nn.compact
  def __call__(self, x):
    return x


class CustomDense(nn.Dense):
  pass


def test_class_match_uses_isinstance():
  rule = jaxmp.Rule(nn.Dense, "f32")
  assert rule.matches("anything", nn.Dense)
  assert rule.matches("anything", CustomDense)
  assert not rule.matches("anything", nn.DenseGeneral)


def test_tuple_of_classes():
  rule = jaxmp.Rule((nn.Dense, nn.Conv), "f32")
  assert rule.matches("a", nn.Conv) and rule.matches("b", nn.Dense)
  assert not rule.matches("c", nn.Embed)


def test_regex_is_fullmatched_against_path():
  rule = jaxmp.Rule(r"Block_\d+/Dense_0", "f32")
  assert rule.matches("Block_3/Dense_0", nn.Dense)
  assert not rule.matches("Block_3/Dense_0/inner", nn.Dense)
  assert not rule.matches("x/Block_3/Dense_0", nn.Dense)
  subtree = jaxmp.Rule(r"encoder(/.*)?", "f32")
  assert subtree.matches("encoder", Custom) and subtree.matches("encoder/a/b", nn.Dense)
  assert not subtree.matches("encoder2", Custom)


def test_root_path_is_empty_string():
  assert jaxmp.Rule("", "f32").matches("", Custom)


def test_first_matching_rule_wins():
  rules = jaxmp.PolicyRules(BF16, [
      jaxmp.Rule(r"head", "f16"),
      jaxmp.Rule(nn.Dense, "f32"),
  ])
  assert rules.resolve("head", nn.Dense).policy.compute_dtype == jnp.float16
  assert rules.resolve("body", nn.Dense).policy.compute_dtype == jnp.float32
  assert rules.resolve("body", Custom).policy == BF16
  assert rules.resolve("body", Custom).rule is None


def test_policy_none_keeps_default():
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule(r"head"), jaxmp.Rule(nn.Dense, "f32")])
  resolved = rules.resolve("head", nn.Dense)
  assert resolved.policy == BF16
  assert resolved.rule is rules.rules[0]


@pytest.mark.parametrize("norm", [nn.BatchNorm, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm,
                                  nn.InstanceNorm, nnx.BatchNorm, nnx.LayerNorm, nnx.RMSNorm,
                                  nnx.GroupNorm])
def test_normalization_computes_in_float32_by_default(norm):
  rules = jaxmp.PolicyRules("p=bf16,c=bf16,o=bf16")
  resolved = rules.resolve("x", norm)
  assert resolved.policy.compute_dtype == jnp.float32
  assert resolved.policy.param_dtype == jnp.bfloat16
  assert resolved.output_dtype is None  # handed back in the caller's dtype


def test_normalization_default_can_be_turned_off_or_overridden():
  off = jaxmp.PolicyRules(BF16, float32_normalization=False)
  assert off.resolve("ln", nn.LayerNorm).policy == BF16
  overridden = jaxmp.PolicyRules(BF16, [jaxmp.Rule(nn.LayerNorm, "c=bf16")])
  assert overridden.resolve("ln", nn.LayerNorm).policy.compute_dtype == jnp.bfloat16


def test_normalization_never_lowers_precision():
  rules = jaxmp.PolicyRules("f64")
  assert rules.resolve("ln", nn.LayerNorm).policy.compute_dtype == jnp.float64


def test_output_is_local_unless_named():
  assert jaxmp.Rule("a", "float32").output_dtype is None
  assert jaxmp.Rule("a", "c=f32").output_dtype is None
  assert jaxmp.Rule("a", "p=f32,c=f32,o=f32").output_dtype == np.dtype("float32")
  assert jaxmp.Rule("a", "c=bf16, output=float32").output_dtype == np.dtype("float32")
  assert jaxmp.Rule("a", jaxmp.Policy("f32", "bf16", "f32")).output_dtype == np.float32
  assert jaxmp.Rule("a", jaxmp.Policy("f32", "f32", "f32")).output_dtype is None
  assert jaxmp.Rule("a", "f32", output_dtype="bf16").output_dtype == np.dtype(jnp.bfloat16)
  assert jaxmp.Rule("a", output_dtype="f16").output_dtype == np.float16


def test_rules_are_hashable_and_comparable():
  a = jaxmp.PolicyRules(BF16, [jaxmp.Rule(nn.Dense, "f32"), jaxmp.Rule("x.*", "f16")])
  b = jaxmp.PolicyRules("p=f32,c=bf16,o=f32", (jaxmp.Rule(nn.Dense, "float32"),
                                              jaxmp.Rule("x.*", "float16")))
  assert a == b and hash(a) == hash(b)


def test_as_rules():
  assert rules_lib.as_rules("bf16") == jaxmp.PolicyRules("bf16")
  rules = jaxmp.PolicyRules("bf16")
  assert rules_lib.as_rules(rules) is rules
  with pytest.raises(TypeError, match="PolicyRules"):
    rules_lib.as_rules([jaxmp.Rule(nn.Dense, "f32")])
  with pytest.raises(TypeError, match="PolicyRules"):
    rules_lib.as_rules(jaxmp.Rule(nn.Dense, "f32"))


# ---- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("match", [3, None, nn.Dense(3), [nn.Dense], (nn.Dense, "x"), ()])
def test_bad_match_type(match):
  with pytest.raises(TypeError, match="module class.*regex"):
    jaxmp.Rule(match, "f32")


def test_invalid_regex_names_it():
  with pytest.raises(ValueError, match=r"'Block_\(' is not a valid regular expression"):
    jaxmp.Rule("Block_(", "f32")


def test_policy_that_does_not_parse():
  with pytest.raises(ValueError, match="'f8'"):
    jaxmp.Rule(nn.Dense, "c=f8")
  with pytest.raises(ValueError, match="int8"):
    jaxmp.PolicyRules("int8")


def test_conflicting_output_dtypes():
  with pytest.raises(ValueError, match="two output dtypes"):
    jaxmp.Rule("a", "c=f32,o=f32", output_dtype="bf16")


def test_bad_fp8_recipe():
  with pytest.raises(TypeError, match="Rule fp8: recipe must be.*'delayed'"):
    jaxmp.Rule(nn.Dense, fp8="delayed")


def test_rules_must_be_rule_objects():
  with pytest.raises(TypeError, match="jaxmp.Rule"):
    jaxmp.PolicyRules(BF16, [(nn.Dense, "f32")])
  with pytest.raises(TypeError, match="sequence of jaxmp.Rule"):
    jaxmp.PolicyRules(BF16, jaxmp.Rule(nn.Dense, "f32"))
