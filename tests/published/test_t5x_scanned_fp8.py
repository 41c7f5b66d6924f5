"""t5x's scalable T5, unchanged, under jaxmp: its scanned layers and what fp8 can reach.

The model (``t5x_scalable_t5/``, copied verbatim) scans its encoder and decoder layers
with ``flax.linen.partitioning.scan_with_axes`` (``param_scan_axis=1``, ``ScanIn`` after
init), over ``partitioning.remat`` when ``remat_policy`` is not ``'none'``. Its
projections are t5x's own ``layers.DenseGeneral``, which calls ``lax.dot_general``
itself: it has no ``dot_general`` hook, so an fp8 rule cannot reach it. jaxmp says so
by name at init (the class's module and name: it is not Flax's ``nn.DenseGeneral``),
creates no fp8 state and leaves the step as the rule-less one; the policy does reach
every layer inside the scan, and each scanned layer trains as the same layer of the
unrolled model (``scan_layers=False``), bit for bit.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from tests.published import matmuls
from tests.published import scanned as s
from tests.published.t5x_scalable_t5 import layers
from tests.published.t5x_scalable_t5 import network

LAYERS, BATCH, LENGTH, VOCAB = 2, 4, 8, 64
STACKS = ("encoder", "decoder")
# Each scanned layer's DenseGeneral projections (encoder: q, k, v, out, wi, wo; decoder:
# both attentions' four and wi, wo), each a forward GEMM and two gradient GEMMs.
PROJECTION_GEMMS = 3 * (6 + 10)
BF16_RULES = jaxmp.PolicyRules(s.BF16)
FP8_RULE = jaxmp.PolicyRules(s.BF16, [jaxmp.Rule(layers.DenseGeneral, fp8=s.RECIPE)])


def config(scan_layers=True, remat_policy="none") -> network.T5Config:
  """A tiny T5Config; the rest (float32 dtype, relu MLP, param_scan_axis=1) as published."""
  return network.T5Config(vocab_size=VOCAB, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
                          num_encoder_layers=LAYERS, num_decoder_layers=LAYERS,
                          remat_policy=remat_policy, scan_layers=scan_layers)


def tokens(key=1):
  """Encoder inputs and decoder targets: no padding (id 0), so every position counts."""
  kx, ky = jax.random.split(jax.random.key(key))
  return (jax.random.randint(kx, (BATCH, LENGTH), 1, VOCAB),
          jax.random.randint(ky, (BATCH, LENGTH), 1, VOCAB))


def wrap(rules=BF16_RULES, **kwargs):
  return jaxmp.linen.mixed_precision(network.Transformer(config(**kwargs)), rules)


def init(wrapped) -> dict:
  inputs, targets = tokens()
  return nn.meta.unbox(wrapped.init(jax.random.key(0), inputs, targets, targets,
                                    enable_dropout=False))


def init_params(wrapped) -> dict:
  return init(wrapped)["params"]  # params_axes: the partitioning's axis names only


def loss(apply, variables, inputs, targets):
  # Eval mode (no dropout), so that runs compare bit for bit; the decoder input is the
  # target itself: what is learned does not matter here, only that it is learned.
  logits = apply(variables, inputs, targets, targets, enable_dropout=False)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets).mean()


def step(state, inputs, targets):
  value, grads = state.value_and_grad(lambda v: loss(state.apply_fn, v, inputs, targets))()
  return state.apply_gradients(grads), value


def step_jaxpr(wrapped, params):
  return jax.make_jaxpr(step)(s.linen_state(wrapped, {"params": params}), *tokens())


def unrolled_params(params: dict) -> dict:
  """The scanned model's params for ``scan_layers=False``: layer i is index i of axis 1."""
  out = dict(params)
  for stack in STACKS:
    out[stack] = {k: v for k, v in params[stack].items() if k != stack}
    for i in range(LAYERS):
      out[stack][f"layers_{i}"] = jax.tree_util.tree_map(
          lambda a, i=i: jnp.take(a, i, axis=config().param_scan_axis), params[stack][stack])
  return out


def train(wrapped, params, steps):
  state, losses = s.linen_state(wrapped, {"params": params}), []
  jitted = jax.jit(step)
  for _ in range(steps):
    state, value = jitted(state, *tokens())
    losses.append(float(value))
  return state, losses


# ---- the policy inside the scan; what an fp8 rule does -----------------------------------


@pytest.mark.parametrize("remat_policy", ["none", "minimal", "full"])
def test_the_policy_puts_every_gemm_inside_the_scanned_layers_in_bfloat16(remat_policy):
  # Published with dtype=float32 throughout (its logits_dense too): jaxmp's compute dtype
  # reaches the layers inside scan_with_axes (and remat), forward and backward.
  wrapped = wrap(remat_policy=remat_policy)
  params = init_params(wrapped)
  assert params["encoder"]["encoder"]["attention"]["query"]["kernel"].shape == (32, LAYERS,
                                                                               2, 16)
  jaxpr = step_jaxpr(wrapped, params)
  in_scans = matmuls.count_matmuls(jaxpr, only_in_scans=True)
  assert list(in_scans) == ["bfloat16"] and in_scans["bfloat16"] >= PROJECTION_GEMMS, in_scans
  assert list(matmuls.count_matmuls(jaxpr)) == ["bfloat16"]
  float32 = matmuls.count_matmuls(step_jaxpr(wrap(jaxmp.PolicyRules("float32"),
                                                  remat_policy=remat_policy), params))
  assert float32 == {"float32": sum(matmuls.count_matmuls(jaxpr).values())}


def test_an_fp8_rule_on_t5x_dense_general_names_it_and_changes_nothing():
  wrapped = wrap(FP8_RULE)
  with pytest.warns(UserWarning) as caught:
    variables = init(wrapped)
  message = " ".join(str(w.message) for w in caught)
  assert ("rule 0 (DenseGeneral) has an fp8 recipe but matches no layer fp8 applies to "
          "(nn.Dense, nn.DenseGeneral, nn.MultiHeadDotProductAttention, nn.Einsum): it "
          f"matches only {layers.__name__}.DenseGeneral, whose matmuls stay in the compute "
          "dtype") in message, message
  assert set(variables) == {"params", "params_axes"}  # no fp8 state
  params = variables["params"]
  assert str(step_jaxpr(wrapped, params)) == str(step_jaxpr(wrap(), params))


# ---- scanned as unrolled, layer by layer; training --------------------------------------


def logits(wrapped, params):
  inputs, targets = tokens()
  return jax.jit(lambda p: wrapped.apply({"params": p}, inputs, targets, targets,
                                         enable_dropout=False))(params)


@pytest.mark.parametrize("remat_policy", ["none", "minimal"])
def test_each_scanned_layer_computes_as_the_same_unrolled_layer(remat_policy):
  # The unrolled twin is always remat 'none': remat does not change the forward values,
  # and t5x's unrolled loop passes its flags to the remat'ed layer by keyword, which
  # Flax's remat drops (it warns), so that the layer runs with deterministic=False.
  scanned = wrap(remat_policy=remat_policy)
  params = init_params(scanned)
  np.testing.assert_array_equal(logits(scanned, params),
                                logits(wrap(scan_layers=False), unrolled_params(params)))


# XLA:CPU computes the scanned encoder layers' gradients a few float32 ulps away from the
# unrolled ones with no jaxmp at all (plain Flax, float32: 1.7e-8 at most, seen; the
# decoder's agree bit for bit); Adam's first steps move a param by about the learning
# rate whatever its gradient's size, so a near-zero gradient of the other sign puts a
# param 2e-2 away: the runs' losses agree closely, their params not bit for bit.
@pytest.mark.slow  # compiles the train step twice (~40 s on a loaded 2-core machine)
@pytest.mark.parametrize("remat_policy", ["none", "minimal"])
def test_t5x_trains_with_its_layers_scanned_as_unrolled(remat_policy):
  steps = 5
  scanned = wrap(remat_policy=remat_policy)
  params = init_params(scanned)
  _, losses = train(scanned, params, steps)
  _, unrolled_losses = train(wrap(scan_layers=False), unrolled_params(params), steps)
  assert all(np.isfinite(losses)) and all(np.diff(losses) < 0), losses
  assert losses[-1] < 0.5 * losses[0], losses
  np.testing.assert_allclose(losses, unrolled_losses, rtol=1e-2)
