"""fp8 by rule: Rule(layer, fp8=recipe) through jaxmp.linen.mixed_precision."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
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


class DenseGeneral(nn.Module):
  """A layer of the user's own, named like Flax's, that calls lax.dot_general itself."""

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.ones, (x.shape[-1], 2))
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def test_fp8_rule_on_a_namesake_of_flax_dense_general_names_both_classes():
  # Before: "rule 0 (DenseGeneral) ... matches no layer fp8 applies to (Dense,
  # DenseGeneral, ...)": the user's class and Flax's read alike (t5x and MaxText define
  # their own DenseGeneral).
  wrapped = jaxmp.linen.mixed_precision(DenseGeneral(), _rules(DenseGeneral))
  with pytest.warns(UserWarning) as caught:
    variables = wrapped.init(jax.random.key(0), jnp.ones((1, 3)))
  message = " ".join(str(w.message) for w in caught)
  assert (f"layer fp8 applies to (nn.Dense, nn.DenseGeneral, "
          f"nn.MultiHeadDotProductAttention, nn.Einsum): it matches only "
          f"{__name__}.DenseGeneral") in message, message
  assert OWG not in variables


def test_interceptor_leaves_attributes_as_they_were():
  dense = nn.Dense(2)
  wrapped = jaxmp.linen.mixed_precision(dense, _rules(nn.Dense))
  wrapped.init(jax.random.key(0), jnp.ones((1, 3)))
  assert dense.dot_general_cls is None
  assert "param" not in dense.__dict__


def _rnn_fp8_state(rnn_kwargs=None):
  """One training step of nn.RNN(SimpleCell) with fp8 by rule; the merged fp8 state."""
  cell = nn.SimpleCell(1, activation_fn=lambda h: h, kernel_init=nn.initializers.ones,
                       recurrent_kernel_init=nn.initializers.ones)
  model = jaxmp.linen.mixed_precision(nn.RNN(cell, **(rnn_kwargs or {})),
                                      _rules(nn.Dense, default="float32"))
  x = jnp.array([1.0, 3.0, 2.0]).reshape(1, 3, 1)  # one sequence of three steps
  state = jaxmp.linen.TrainState.create(
      apply_fn=model.apply, variables=jax.jit(model.init)(jax.random.key(0), x),
      tx=optax.sgd(0.0))  # no loss scaling: the output gradients are the true ones
  _, grads = state.value_and_grad(lambda v: jnp.sum(state.apply_fn(v, x)))()
  fp8_state = state.apply_gradients(grads).fp8["cell"]
  return {name: layer["Fp8DotGeneral_0"] for name, layer in fp8_state.items()}


def test_nn_rnn_cell_shares_one_fp8_state_across_time_steps():
  # nn.RNN's scan passes on only "params"; the wrapper adds the fp8 collection to its
  # variable_broadcast, so each gate keeps one state, read by every step, and records
  # the max over the steps, as a layer called three times does. The cell computes
  # h_t = x_t + h_{t-1} (h_0 = 0) and the loss is h_1 + h_2 + h_3 for x = 1, 3, 2.
  state = _rnn_fp8_state()
  # The input layer "i" sees x = 1, 3, 2; the recurrent "h" sees h_0..h_2 = 0, 1, 4.
  np.testing.assert_array_equal(state["i"]["input_amax_history"], [3, 0, 0, 0])  # not 6
  np.testing.assert_array_equal(state["h"]["input_amax_history"], [4, 0, 0, 0])  # not 5
  # dloss/dh_t = 3, 2, 1 for t = 1, 2, 3: the output gradient of both layers.
  for name in ("i", "h"):
    np.testing.assert_array_equal(state[name]["output_grad_amax_history"], [3, 0, 0, 0])
    np.testing.assert_array_equal(state[name]["kernel_amax_history"], [1, 0, 0, 0])  # not 3
  # A scan that already lists the collection is left as it is: the same state.
  listed = _rnn_fp8_state({"variable_broadcast": ["params", OWG]})
  chex.assert_trees_all_equal(listed, state)
