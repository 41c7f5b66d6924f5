"""8-bit optimizer state: torchao's quantization around any optimizer, bit for bit."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
from jaxmp._src.optim import dynamic_map
from tests import tree_asserts
from tests.optim import quantized_reference as ref

F32 = np.float32
LR, WD = 1e-2, 0.1
# By default "w" is stored in 8 bits; "b" is below the threshold of 4096 values; "odd"
# is above it but not whole blocks of 256 (nor of 128).
SHAPES = {"w": (32, 512), "b": (512,), "odd": (4100,)}


def _params(dtype=jnp.float32):
  key = jax.random.key(0)
  return {name: jax.random.normal(jax.random.fold_in(key, i), shape).astype(dtype)
          for i, (name, shape) in enumerate(SHAPES.items())}


def _grads(step, like):
  """Step ``step``'s gradients: bfloat16 values (the same for any param dtype), of
  magnitudes over several decades so that the blocks use the map's small codes."""
  key = jax.random.fold_in(jax.random.key(1), step)
  def one(i, p):
    k1, k2 = jax.random.split(jax.random.fold_in(key, i))
    g = jax.random.normal(k1, p.shape) * 10.0 ** jax.random.randint(k2, p.shape, -4, 1)
    return g.astype(jnp.bfloat16).astype(p.dtype)
  return {name: one(i, like[name]) for i, name in enumerate(sorted(like))}


def _adamw():
  return optax.adamw(LR, weight_decay=WD)


def _bits(x):
  return np.atleast_1d(np.asarray(x)).view(np.uint8)


def _assert_bitwise(a, b, what):
  leaves_a, def_a = jax.tree.flatten(a)
  leaves_b, def_b = jax.tree.flatten(b)
  assert def_a == def_b, what
  for x, y in zip(leaves_a, leaves_b):
    assert np.asarray(x).dtype == np.asarray(y).dtype, what
    np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=what)


def _run(tx, params, steps, grads=_grads):
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  state = tx.init(params)
  updates = None
  for i in range(steps):
    updates, state = step(params, state, grads(i, params))
    params = optax.apply_updates(params, updates)
  return params, state, updates


def _dequantized(moment, signed):
  if isinstance(moment, jaxmp.optim.QuantizedMoment):
    return dynamic_map.dequantize(moment.codes, moment.scale, signed=signed)
  return moment


def test_large_moments_are_stored_in_8_bits_and_the_rest_as_adam_keeps_it():
  tx = jaxmp.optim.quantized_moments(optax.inject_hyperparams(optax.adamw)(learning_rate=LR))
  state = tx.init(_params())
  adam = state.inner_state[0]
  for moment in (adam.mu["w"], adam.nu["w"]):
    assert isinstance(moment, jaxmp.optim.QuantizedMoment)
    assert moment.codes.dtype == jnp.uint8 and moment.codes.shape == (32, 512)
    assert moment.scale.dtype == jnp.float32 and moment.scale.shape == (32, 2)
  # Below the threshold, and not whole blocks: float32, as Adam keeps them.
  for leaf in (adam.mu["b"], adam.nu["b"], adam.mu["odd"], adam.nu["odd"]):
    assert leaf.dtype == jnp.float32
  assert adam.count.dtype == jnp.int32
  assert state.hyperparams["learning_rate"].dtype == jnp.float32
  # Zeros: the code of 0 in each map, and the scale floor.
  assert set(np.unique(adam.mu["w"].codes)) == {int(np.argmax(dynamic_map.SIGNED_MAP == 0))}
  assert set(np.unique(adam.nu["w"].codes)) == {0}
  np.testing.assert_array_equal(adam.mu["w"].scale, np.full((32, 2), F32(1e-12)))


def _assert_within_rounding(a, b, scale, what):
  """Within a few float32 roundings of values of magnitude ``scale`` (see below)."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), y, rtol=2**-21, atol=scale * 2**-21, err_msg=what)


def test_adamw_with_8_bit_moments_equals_the_numpy_port():
  steps = 5
  params32 = _params()
  grads = [{k: np.asarray(v) for k, v in _grads(i, params32).items()} for i in range(steps)]
  numpy_params = {k: np.asarray(v) for k, v in params32.items()}
  params, state, updates = _run(jaxmp.optim.quantized_moments(_adamw()), params32, steps)
  ref_params, ref_mu, ref_nu, ref_updates = ref.adamw_8bit(
      numpy_params, grads, lr=LR, weight_decay=WD, quantized=lambda name: name == "w")
  adam = state[0]
  # The stored state, bit for bit: codes and scales of "w", float32 moments of the rest.
  for moments, ref_moments in ((adam.mu, ref_mu), (adam.nu, ref_nu)):
    codes, scale = ref_moments.pop("w")
    np.testing.assert_array_equal(moments["w"].codes, codes)
    _assert_bitwise(moments["w"].scale, scale.reshape(moments["w"].scale.shape), "scales")
    _assert_bitwise({k: moments[k] for k in ref_moments}, ref_moments, "float32 moments")
  assert int(adam.count) == steps
  # The updates to a few float32 roundings: XLA rewrites Optax's (m / c1) / (sqrt(v / c2)
  # + eps) per program (as m * (1 / c1) / (...) in one, m / (c1 * (...)) in another), so
  # float32 Optax moves as far from the port, and from itself in another program.
  _, _, optax_updates = _run(_adamw(), params32, steps)
  plain = ref.adamw_8bit(numpy_params, grads, lr=LR, weight_decay=WD,
                         quantized=lambda name: False)
  _assert_within_rounding(optax_updates, plain[3], LR, "float32 optax")
  assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(optax_updates),
                                                       jax.tree.leaves(plain[3])))
  _assert_within_rounding(updates, ref_updates, LR, "updates")
  _assert_within_rounding(params, ref_params, 1.0, "params")
  # The 8 bits move Adam: the stored moments are not float32 Optax's.
  assert not np.array_equal(ref.dequantize(codes, scale, False), plain[2]["w"])


def test_each_step_equals_the_inner_optimizer_with_its_state_rounded_trip_after_each_step():
  inner = _adamw()
  tx = jaxmp.optim.quantized_moments(inner, block_size=128, min_size=0)
  params = _params()
  state = tx.init(params)
  step, inner_step = jax.jit(tx.update), jax.jit(inner.update)
  for i in range(4):
    adam = state[0]
    # By hand: the stored state dequantized, AdamW in float32, its new state quantized.
    mu = {k: _dequantized(adam.mu[k], True) for k in SHAPES}
    nu = {k: _dequantized(adam.nu[k], False) for k in SHAPES}
    widened = (adam._replace(mu=mu, nu=nu), *state[1:])
    expected_updates, new = inner_step(_grads(i, params), widened, params)
    updates, state = step(_grads(i, params), state, params)
    tree_asserts.assert_trees_equal(updates, expected_updates)
    for k in ("w", "b"):  # "odd" (4100 values) has no blocks of 128: float32
      codes, scale = dynamic_map.quantize(new[0].nu[k], signed=False, block_size=128)
      _assert_bitwise(state[0].nu[k], jaxmp.optim.QuantizedMoment(codes, scale),
                      f"nu {k} step {i}")
    assert state[0].mu["odd"].dtype == jnp.float32
    params = optax.apply_updates(params, updates)


def test_a_skipped_step_keeps_the_codes_and_scales_bit_for_bit():
  tx = jaxmp.loss_scaling(jaxmp.optim.quantized_moments(_adamw()), jaxmp.DynamicLossScale())
  params = _params()
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  state = tx.init(params)
  for i in range(2):
    updates, state = step(params, state, _grads(i, params))
    params = optax.apply_updates(params, updates)
  poisoned = _grads(2, params)
  poisoned["w"] = poisoned["w"].at[3, 7].set(jnp.inf)
  updates, after = step(params, state, poisoned)
  assert not bool(after.last_step_finite)
  _assert_bitwise(after.inner_state, state.inner_state, "codes, scales and the rest")
  _assert_bitwise(optax.apply_updates(params, updates), params, "params")


@pytest.mark.parametrize("remainders", [False, True])
def test_master_weights_over_8_bit_moments_follow_the_float32_run_bit_for_bit(remainders):
  steps = 5
  params16 = _params(jnp.bfloat16)
  params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params16)
  tx = jaxmp.loss_scaling(jaxmp.optim.master_weights(
      jaxmp.optim.quantized_moments(_adamw()), remainders=remainders), jaxmp.NoOpLossScale())
  params, state, _ = _run(tx, params16, steps)
  ref_params, ref_state, _ = _run(jaxmp.optim.quantized_moments(_adamw()), params32, steps)
  _assert_bitwise(jaxmp.optim.master_params(state, params), ref_params, "masters")
  _assert_bitwise(state.inner_state.inner_state, ref_state, "8-bit Adam state")
  assert params["w"].dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_params_alone_get_float32_updates_from_float32_moments(dtype):
  params = _params(dtype)
  params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  tx = jaxmp.optim.quantized_moments(_adamw())
  grads = _grads(0, params)
  grads32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  ref_updates, ref_state = jax.jit(tx.update)(grads32, tx.init(params32), params32)
  _assert_bitwise((updates, state), (ref_updates, ref_state), f"{jnp.dtype(dtype).name} params")
  assert optax.apply_updates(params, updates)["w"].dtype == dtype


def test_memory_report_counts_codes_and_scales():
  params = {"w": jnp.ones((64, 512), jnp.bfloat16)}
  tx = jaxmp.optim.master_weights(jaxmp.optim.quantized_moments(optax.adam(1e-3)))
  report = jaxmp.tools.memory_report(params, tx.init(params))
  n = 64 * 512
  assert report.master_bytes == 4 * n
  # Adam's count, and for each moment a byte per value and a float32 per 256 values.
  assert report.opt_state_bytes == 4 + 2 * (n + 4 * n // 256)
  assert report.bytes_per_param() == {"params": 2.0, "master": 4.0,
                                       "optimizer state": (4 + 2 * (n + n // 64)) / n,
                                       "gradients": 2.0}


def test_a_choice_per_leaf_and_block_size():
  seen = {}

  def nu_only(path, leaf):
    seen[path] = (leaf.shape, jnp.dtype(leaf.dtype).name)
    return "unsigned" if path.startswith("0/nu/") and leaf.size % 512 == 0 else None

  tx = jaxmp.optim.quantized_moments(_adamw(), block_size=512, quantize=nu_only)
  params = _params()
  state = tx.init(params)
  assert seen["0/mu/w"] == ((32, 512), "float32") and seen["0/count"] == ((), "int32")
  adam = state[0]
  assert isinstance(adam.nu["w"], jaxmp.optim.QuantizedMoment) and adam.nu["w"].scale.shape == (32, 1)
  assert isinstance(adam.nu["b"], jaxmp.optim.QuantizedMoment) and adam.nu["b"].scale.shape == (1,)
  assert adam.mu["w"].dtype == jnp.float32 and adam.nu["odd"].dtype == jnp.float32
  _, state = jax.jit(tx.update)(_grads(0, params), state, params)
  assert state[0].nu["b"].codes.dtype == jnp.uint8


def test_an_nnx_optimizer_and_a_linen_train_state_train_with_8_bit_moments():
  policy = "params=bfloat16,compute=bfloat16,output=float32"
  tx = jaxmp.loss_scaling(jaxmp.optim.master_weights(jaxmp.optim.quantized_moments(
      optax.adam(1e-2), block_size=64)), jaxmp.NoOpLossScale())
  x = jax.random.normal(jax.random.key(0), (32, 64))
  y = jnp.tanh(x[:, :64] @ jax.random.normal(jax.random.key(1), (64, 64)) / 8)

  model = jaxmp.nnx.mixed_precision(nnx.Linear(64, 64, rngs=nnx.Rngs(1)), policy)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def nnx_step(model, optimizer):
    loss, grads = jaxmp.nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    jaxmp.nnx.apply_gradients(optimizer, model, grads)
    return loss

  linen_model = jaxmp.linen.mixed_precision(nn.Dense(64), policy)
  state = jaxmp.linen.TrainState.create(apply_fn=linen_model.apply,
                                        variables=linen_model.init(jax.random.key(1), x), tx=tx)

  @jax.jit
  def linen_step(state):
    loss, grads = state.value_and_grad(lambda v: jnp.mean((state.apply_fn(v, x) - y) ** 2))()
    return state.apply_gradients(grads), loss

  nnx_losses, linen_losses = [], []
  for _ in range(20):
    nnx_losses.append(float(nnx_step(model, optimizer)))
    state, loss = linen_step(state)
    linen_losses.append(float(loss))
  for name, losses in (("nnx", nnx_losses), ("linen", linen_losses)):
    assert losses[-1] < 0.5 * losses[0], (name, losses)
  # NNX keeps the kernel's QuantizedMoment as one variable holding a mapping of its fields.
  kernel_mu = optimizer.opt_state.inner_state.inner_state[0].mu["model"]["kernel"].get_value()
  assert set(kernel_mu) == {"codes", "scale"}
  assert kernel_mu["codes"].dtype == jnp.uint8 and kernel_mu["scale"].shape == (64, 1)
  linen_mu = state.opt_state.inner_state.inner_state[0].mu["kernel"]
  assert linen_mu.codes.dtype == jnp.uint8 and linen_mu.scale.shape == (64, 1)


def test_bad_arguments_are_refused_by_name():
  adam = optax.adam(1e-3)
  quantized = jaxmp.optim.quantized_moments
  with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
    quantized(adam, block_size=0)
  with pytest.raises(TypeError, match="block_size must be an integer >= 1, got 2.5"):
    quantized(adam, block_size=2.5)
  with pytest.raises(TypeError, match="block_size must be an integer >= 1, got True"):
    quantized(adam, block_size=True)
  with pytest.raises(ValueError, match="min_size must be an integer >= 0, got -1"):
    quantized(adam, min_size=-1)
  with pytest.raises(TypeError, match="quantize must be a function .* got 'signed'"):
    quantized(adam, quantize="signed")
  with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation"):
    quantized(optax.adam)


@pytest.mark.parametrize("choice, error, message", [
    (lambda p, l: "int8", ValueError, "quantize returned 'int8' for the state leaf '0/count'; "
     "accepted: 'signed', 'unsigned' or None"),
    (lambda p, l: 8, TypeError, "quantize must return 'signed', 'unsigned' or None for each "
     "state leaf, got 8 of type int for '0/count'"),
    (lambda p, l: "signed" if p == "0/count" else None, TypeError,
     "the state leaf '0/count' has dtype int32; only float32 state leaves"),
    (lambda p, l: "signed" if p == "0/mu/odd" else None, ValueError,
     r"the state leaf '0/mu/odd' has shape \(4100,\), which is not made of whole blocks of "
     "block_size=256"),
])
def test_a_bad_choice_is_refused_naming_the_leaf(choice, error, message):
  with pytest.raises(error, match=f"quantized_moments: {message}"):
    jaxmp.optim.quantized_moments(optax.adam(1e-3), quantize=choice).init(_params())


def test_master_weights_inside_are_refused():
  tx = jaxmp.optim.quantized_moments(jaxmp.optim.master_weights(optax.adam(1e-3)))
  with pytest.raises(ValueError, match=re.escape("master_weights(quantized_moments(inner))")):
    tx.init(_params(jnp.bfloat16))


def test_a_state_of_another_structure_is_refused():
  params = _params()
  tx = jaxmp.optim.quantized_moments(optax.adam(1e-3))
  with pytest.raises(ValueError, match="quantized_moments: the state does not have the structure"):
    tx.update(_grads(0, params), optax.sgd(1e-3, momentum=0.9).init(params), params)
  with pytest.raises(ValueError, match="the state has ArrayImpl where this optimizer stores a "
                     "QuantizedMoment"):
    tx.update(_grads(0, params), optax.adam(1e-3).init(params), params)
  other = jaxmp.optim.quantized_moments(optax.adam(1e-3), min_size=0, block_size=4)
  with pytest.raises(ValueError, match="the state has QuantizedMoment where this optimizer "
                     "stores a float32 leaf; pass the state its init returned"):
    tx.update(_grads(0, params), other.init(params), params)
