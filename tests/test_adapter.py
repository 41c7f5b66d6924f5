"""The adapter contract: linen and NNX implement one interface and state each rule once."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp import fp8
from jaxmp._src import adapter as adapter_lib
from jaxmp._src.linen import adapter as linen_adapter
from jaxmp._src.nnx import adapter as nnx_adapter

LINEN, NNX = linen_adapter.ADAPTER, nnx_adapter.ADAPTER
RECIPE = fp8.DelayedScaling(amax_history_length=4)
X = jax.random.normal(jax.random.key(1), (4, 3))


def _linen_model():
  return nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])


def _nnx_model():
  rngs = nnx.Rngs(0)
  return nnx.Sequential(nnx.Linear(3, 8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs),
                        nnx.Linear(8, 2, rngs=rngs))


@pytest.mark.parametrize("adapter", [LINEN, NNX], ids=["linen", "nnx"])
def test_both_adapters_implement_the_protocol(adapter):
  assert adapter_lib.missing_members(adapter) == []
  assert isinstance(adapter, adapter_lib.Adapter)
  assert adapter in adapter_lib.adapters()
  assert all(adapter.supports_fp8(t) for t in adapter.fp8_layer_types)


def test_a_partial_adapter_is_refused():
  class Partial:
    name = "partial"

  with pytest.raises(TypeError, match="lacks model_kind, fp8_layer_types"):
    adapter_lib.register(Partial())
  assert [a.name for a in adapter_lib.adapters()] == ["linen", "nnx"]


def test_each_model_and_wrapper_has_exactly_its_own_adapter():
  linen, nnx_model = _linen_model(), _nnx_model()
  cases = [(linen, LINEN), (jaxmp.linen.mixed_precision(linen, "bf16"), LINEN),
           (nnx_model, NNX), (jaxmp.nnx.mixed_precision(nnx_model, "float32"), NNX)]
  for model, adapter in cases:
    assert [a.owns(model) for a in (LINEN, NNX)] == [adapter is LINEN, adapter is NNX]
    assert adapter_lib.for_model(model, "test") is adapter
  with pytest.raises(TypeError, match=r"^test expects a flax linen Module, an NNX Module or a "
                     r"jaxmp mixed_precision wrapper, got 'model' of type str\.$"):
    adapter_lib.for_model("model", "test")


def test_both_adapters_run_one_call_alike():
  rules = jaxmp.PolicyRules("p=f32,c=bf16,o=f32")
  linen = _linen_model()
  variables = linen.init(jax.random.key(0), X)
  state, apply = LINEN.functional(linen, rules, variables)
  np.testing.assert_array_equal(jax.jit(apply)(state, X),
                                jaxmp.linen.mixed_precision(linen, rules).apply(variables, X))
  model = _nnx_model()
  kernel = model.layers[0].kernel[...]
  state, apply = NNX.functional(model, jaxmp.PolicyRules("bf16"), None)
  assert jax.jit(apply)(state, X).dtype == jnp.bfloat16
  assert model.layers[0].kernel[...] is kernel  # a copy was wrapped
  for adapter, model, extra in ((LINEN, linen, {"variables": variables}), (NNX, model, {})):
    used, records, _ = adapter.trace_abstract(model, rules, (X,), {}, **extra)
    assert used == rules
    assert [r.path for r in records if r.method == "__call__"][:2] == ["", "layers_0" if
                                                                      adapter is LINEN else
                                                                      "layers/0"]
  with pytest.raises(TypeError, match="variables= and rngs= are for linen models"):
    NNX.trace_abstract(model, rules, (X,), {}, variables=variables)


def test_a_custom_product_is_refused_by_one_rule_with_one_message():
  rules = jaxmp.PolicyRules("float32", [jaxmp.Rule((nn.Dense, nnx.Linear), fp8=RECIPE)])
  custom = functools.partial(jax.lax.dot_general)
  with pytest.raises(ValueError) as linen_error:
    jaxmp.linen.mixed_precision(nn.Dense(2, dot_general=custom), rules).init(
        jax.random.key(0), X)
  with pytest.raises(ValueError) as nnx_error:
    jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, dot_general=custom, rngs=nnx.Rngs(0)), rules)
  with pytest.raises(ValueError) as direct:
    adapter_lib.refuse_custom_product(nn.Dense, "", "dot_general", custom)
  assert str(linen_error.value) == str(direct.value)
  assert str(nnx_error.value) == str(direct.value).replace("Dense", "Linear")
  assert str(direct.value) == (
      f"An fp8 rule matches Dense at '<root>', which already has a custom dot_general="
      f"{custom!r}; remove one of the two (exclude the layer with an earlier Rule('') "
      f"without fp8).")


def test_both_adapters_create_the_fp8_core_s_initial_state():
  expected = fp8.init_state(RECIPE)._asdict()
  dense = nn.Dense(2, dot_general_cls=functools.partial(jaxmp.linen.Fp8DotGeneral,
                                                         recipe=RECIPE))
  linen_state = dense.init(jax.random.key(0), X)[fp8.OVERWRITE_WITH_GRADIENT]["Fp8DotGeneral_0"]
  nnx_state = {name: v[...] for name, v in nnx.state(jaxmp.nnx.Fp8DotGeneral(RECIPE)).items()}
  for state in (linen_state, nnx_state):
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
      assert state[name].dtype == value.dtype
      np.testing.assert_array_equal(state[name], value)


def test_both_fp8_einsums_take_out_sharding_with_one_meaning():
  x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
  expected = fp8.fp8_einsum("bd,dh->bh", x, w, recipe=fp8.CurrentScaling())
  linen = jaxmp.linen.Fp8Einsum(recipe=fp8.CurrentScaling())
  nnx_einsum = jaxmp.nnx.Fp8Einsum(fp8.CurrentScaling())
  np.testing.assert_array_equal(
      linen.apply({}, "bd,dh->bh", x, w, out_sharding=None), expected)
  np.testing.assert_array_equal(nnx_einsum("bd,dh->bh", x, w, out_sharding=None), expected)
  spec = jax.sharding.PartitionSpec()
  messages = []
  for call in (lambda: linen.apply({}, "bd,dh->bh", x, w, out_sharding=spec),
               lambda: nnx_einsum("bd,dh->bh", x, w, out_sharding=spec),
               lambda: fp8.fp8_einsum("bd,dh->bh", x, w, recipe=fp8.CurrentScaling(),
                                      out_sharding=spec)):
    with pytest.raises(ValueError, match="does not take out_sharding") as error:
      call()
    messages.append(str(error.value))
  assert messages[0] == messages[1] == messages[2]


def test_normalization_is_recognised_by_name_without_flax_classes():
  from jaxmp._src import rules  # pylint: disable=g-import-not-at-top

  class Renamed(nnx.BatchNorm):
    pass

  class Plain(nn.Dense):
    pass

  for cls in (nn.BatchNorm, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.InstanceNorm,
              nnx.BatchNorm, nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm, nnx.InstanceNorm,
              Renamed):
    assert rules.is_normalization(cls), cls
  assert not rules.is_normalization(Plain) and not rules.is_normalization(nnx.Linear)
