"""Different fp8 recipes in one model, by rule, on Flax's published models (linen and NNX).

Each fp8 layer's matmul is recorded as it reaches ``fp8_dot_general``: which recipe
it runs under is checked against the rules, layer by layer, and a train step through
``jaxmp.linen`` / ``jaxmp.nnx`` trains the model with no fp8 state to carry.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
from jaxmp import fp8
from jaxmp._src.fp8 import dot_general as dot_general_lib
from tests.published import models as registry

BF16 = "params=float32,compute=bfloat16,output=float32"
ROWS = fp8.RowwiseScaling()
MLP_IN = fp8.GemmRecipes(fp8.MXScaling(scale_rounding="rceil"), fp8.BlockScaling(block_size=16),
                         None)
GW_HP = fp8.GemmRecipes.rowwise_with_gw_hp()  # a recipe per operand in its input gradient
MLP_OUT = fp8.BlockScaling(block_size=16, power_of_two=True)


@pytest.fixture
def recorded(monkeypatch):
  """``{kernel shape: {recipes}}`` of every fp8 matmul traced while the fixture is active."""
  calls = {}
  original = dot_general_lib.dot_general  # what the fp8 layers call

  def recorder(lhs, rhs, *args, recipe=None, **kwargs):
    calls.setdefault(tuple(rhs.shape), set()).add(recipe)
    return original(lhs, rhs, *args, recipe=recipe, **kwargs)

  monkeypatch.setattr(dot_general_lib, "dot_general", recorder)
  return calls


@pytest.mark.slow
def test_linen_lm1b_attention_rowwise_and_mlp_per_gemm(recorded):
  entry = registry.BY_NAME["lm1b_transformer_lm"]
  rules = jaxmp.PolicyRules(BF16, [
      jaxmp.Rule("decoder/logitdense"),                      # the head stays out of fp8
      jaxmp.Rule(nn.MultiHeadDotProductAttention, fp8=ROWS),
      jaxmp.Rule(r".*/MlpBlock_0/Dense_0", fp8=MLP_IN),
      jaxmp.Rule(r".*/MlpBlock_0/Dense_1", fp8=MLP_OUT),
  ])
  batch = entry.batch(jax.random.key(1))
  model = jaxmp.linen.mixed_precision(entry.module("train"), rules)
  variables = entry.init(model, jax.random.key(0), batch)
  assert set(variables) == {"params"}                       # no fp8 state: current scaling
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply, variables=variables,
                                        tx=jaxmp.loss_scaling(optax.adam(1e-3)))

  @jax.jit
  def step(state):
    def loss(v):
      logits, _ = entry.forward(model, v, batch, "train", jax.random.key(2))
      return registry.cross_entropy(logits, batch.targets)
    value, grads = state.value_and_grad(loss)()
    return state.apply_gradients(grads), value

  new_state, first = step(state)
  _, second = step(new_state)
  width, heads = registry.WIDTH, registry.HEADS
  assert recorded == {
      (width, heads, width // heads): {ROWS},               # query, key, value
      (heads, width // heads, width): {ROWS},               # out
      (width, 2 * width): {MLP_IN},
      (2 * width, width): {MLP_OUT},
  }
  assert np.isfinite(first) and float(second) < float(first)


@pytest.mark.slow
def test_nnx_mnist_cnn_two_recipes_in_one_model(recorded):
  # torchao's rowwise_with_gw_hp on one layer, MX forward / block weight gradient on the other.
  entry = registry.BY_NAME["mnist_cnn"]
  rules = jaxmp.PolicyRules(BF16, [
      jaxmp.Rule("linear1", fp8=GW_HP),
      jaxmp.Rule("linear2", fp8=fp8.GemmRecipes(fp8.MXScaling(), None,
                                                fp8.BlockScaling(power_of_two=True))),
  ])
  model = jaxmp.nnx.mixed_precision(entry.module(nnx.Rngs(0)), rules)
  batch = entry.batch(jax.random.key(1))
  optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(optax.adam(1e-3)), wrt=nnx.Param)
  assert not nnx.state(model, jaxmp.nnx.Fp8State)          # no fp8 state

  @nnx.jit
  def step(model, optimizer):
    def loss(model):
      return registry.cross_entropy(entry.forward(model, batch, "train", jax.random.key(2)),
                                    batch.targets)
    value, grads = jaxmp.nnx.value_and_grad(loss)(
        model, loss_scale=jaxmp.get_loss_scale(optimizer.opt_state))
    jaxmp.nnx.apply_gradients(optimizer, model, grads)
    return value

  first = step(model, optimizer)
  second = step(model, optimizer)
  linear1 = entry.module(nnx.Rngs(0)).linear1.kernel.shape
  linear2 = entry.module(nnx.Rngs(0)).linear2.kernel.shape
  assert recorded == {tuple(linear1): {GW_HP},
                      tuple(linear2): {fp8.GemmRecipes(fp8.MXScaling(), None,
                                                       fp8.BlockScaling(power_of_two=True))}}
  assert np.isfinite(first) and float(second) < float(first)


def test_summary_names_each_layers_recipe():
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule("layers_0", fp8=ROWS),
                                   jaxmp.Rule("layers_1", fp8=MLP_IN)])
  model = nn.Sequential([nn.Dense(64), nn.Dense(32)])
  rows = {r.path: r for r in jaxmp.tools.summary(model, rules, jnp.ones((4, 32))).rows}
  assert (rows["layers_0"].fp8, rows["layers_0"].ran) == ("RowwiseScaling", "float8_e4m3fn")
  # MX's forward GEMM on a CPU: the dequantized (exact) bfloat16 operands.
  assert (rows["layers_1"].fp8, rows["layers_1"].ran) == ("GemmRecipes", "bfloat16")
