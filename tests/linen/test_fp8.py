"""Linen layers: Flax injection points, parity with nn.Fp8DotGeneral, sound training."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jaxmp
from jaxmp import fp8

OWG = fp8.OVERWRITE_WITH_GRADIENT
L = 4
RECIPE = fp8.DelayedScaling(amax_history_length=L)
DG = functools.partial(jaxmp.linen.Fp8DotGeneral, recipe=RECIPE)
FLAX_DG = functools.partial(nn.Fp8DirectDotGeneralOp, amax_history_length=L)
STATE_SHAPES = {"input_amax_history": (L,), "input_scale": (1,), "kernel_amax_history": (L,),
                "kernel_scale": (1,), "output_grad_amax_history": (L,), "output_grad_scale": (1,)}


def _normal(seed, shape, scale=1.0, dtype=np.float32):
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale
  return jnp.asarray(x.astype(dtype))


class TestInjection:

  def test_dense_and_dense_general(self):
    x = jnp.ones((2, 3, 4))
    for layer in (nn.Dense(5, dot_general_cls=DG),
                  nn.DenseGeneral((2, 5), axis=(-2, -1), dot_general_cls=DG)):
      y, v = jax.jit(layer.init_with_output)(jax.random.key(0), x)
      assert jax.tree_util.tree_map(jnp.shape, v[OWG]) == {"Fp8DotGeneral_0": STATE_SHAPES}
      assert y.shape[0] == 2

  def test_default_class_and_partial_recipe(self):
    v = nn.Dense(3, dot_general_cls=jaxmp.linen.Fp8DotGeneral).init(jax.random.key(0), jnp.ones((1, 2)))
    assert v[OWG]["Fp8DotGeneral_0"]["input_amax_history"].shape == (1024,)

  def test_attention_projections(self):
    mha = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, qkv_dot_general_cls=DG,
                                          out_dot_general_cls=DG)
    x = jnp.ones((1, 3, 8))
    y, v = jax.jit(mha.init_with_output)(jax.random.key(0), x)
    assert set(v[OWG]) == {"query", "key", "value", "out"}
    assert y.shape == (1, 3, 8)

  def test_current_scaling_creates_no_variables(self):
    layer = nn.Dense(3, dot_general_cls=functools.partial(
        jaxmp.linen.Fp8DotGeneral, recipe=fp8.CurrentScaling()))
    v = layer.init(jax.random.key(0), jnp.ones((1, 2)))
    assert set(v) == {"params"}

  def test_wrong_recipe_type(self):
    with pytest.raises(TypeError, match="Fp8DotGeneral: recipe must be .* got 'delayed'"):
      jaxmp.linen.Fp8DotGeneral(recipe="delayed")
    with pytest.raises(TypeError, match=r"Pass an instance, e.g. CurrentScaling\(\)"):
      jaxmp.linen.Fp8Einsum(recipe=fp8.CurrentScaling)
    layer = nn.Dense(3, dot_general_cls=functools.partial(jaxmp.linen.Fp8DotGeneral, recipe=16))
    with pytest.raises(TypeError, match="got 16 of type int"):
      layer.init(jax.random.key(0), jnp.ones((1, 2)))

  def test_fp8_einsum_module(self):
    x, w = _normal(0, (2, 3, 4)), _normal(1, (4, 5))
    layer = jaxmp.linen.Fp8Einsum(recipe=RECIPE)
    y, v = layer.init_with_output(jax.random.key(0), "btd,dh->bth", x, w)
    assert jax.tree_util.tree_map(jnp.shape, v[OWG]) == STATE_SHAPES
    expected = fp8.fp8_einsum("btd,dh->bth", x, w, state=fp8.init_state(RECIPE), recipe=RECIPE)
    np.testing.assert_array_equal(y, expected)


def _train(dg_cls, dtype=jnp.float32, ranges=(1.0, 10.0, 3.0, 0.5, 100.0)):
  """Dense steps with changing input ranges, state overwritten from its gradient."""
  model = nn.Dense(16, dot_general_cls=dg_cls, dtype=dtype)
  variables = jax.jit(model.init)(jax.random.key(0), jnp.ones((8, 32), dtype))

  @jax.jit
  def step(variables, x, g):
    def loss(variables, x):
      y = model.apply(variables, x)
      return jnp.sum(y.astype(jnp.float32) * g), y
    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(variables, x)
    return y, grads

  results = []
  for i, r in enumerate(ranges):
    x, g = _normal(10 + i, (8, 32), r, dtype), _normal(20 + i, (8, 16), i + 1)
    y, (grads, dx) = step(variables, x, g)
    (state,) = grads[OWG].values()
    results.append(dict(x=x, y=y, dx=dx, dk=grads["params"]["kernel"], state=state,
                        kernel=variables["params"]["kernel"]))
    variables = {"params": variables["params"], OWG: grads[OWG]}
  return results


# Flax's formula bit for bit, as XLA:CPU computes both. On CUDA jaxmp multiplies a short
# contraction (here the kernel gradient's, 8) as bfloat16 where Flax runs an fp8 GEMM
# (which returned NaN on an H100: benchmarks/RESULTS.md), by design.
@pytest.mark.on_cpu
def test_float32_matches_flax_fp8_dense_bit_for_bit():
  ours, flax = _train(DG), _train(FLAX_DG)
  for a, b in zip(ours, flax):
    for key in ("y", "dx", "dk"):
      np.testing.assert_array_equal(a[key], b[key])
    for name in STATE_SHAPES:
      np.testing.assert_array_equal(a["state"][name], b["state"][name])
  # The steps exercised real scaling: input scales follow the changing ranges.
  scales = [float(r["state"]["input_scale"][0]) for r in ours]
  assert scales[0] == 1.0 and len(set(scales)) >= 3


def test_bfloat16_matches_a_float32_scaling_reference_where_flax_does_not():
  ours, flax = _train(DG, jnp.bfloat16, (1.0, 3.0, 6.0)), _train(FLAX_DG, jnp.bfloat16,
                                                                  (1.0, 3.0, 6.0))
  flax_mismatches = 0
  for a, b in zip(ours, flax):
    sx, sk = a["state"]["input_scale"][0], a["state"]["kernel_scale"][0]
    quant = lambda v, s: np.clip(np.asarray(v, np.float64) / np.float64(s), -448, 448).astype(
        np.float32).astype(jnp.float8_e4m3fn).astype(np.float64)
    ref = (quant(a["x"], sx) @ quant(a["kernel"].astype(jnp.bfloat16), sk)) * (
        np.float64(sx) * np.float64(sk))
    ref = np.asarray(jnp.asarray(ref, jnp.float32).astype(jnp.bfloat16))
    # Equal here (0 of 384 differ); allow a last-bit difference in 1% of the values
    # for CPUs whose float32 GEMM sums in another order.
    ours_y = np.asarray(a["y"])
    np.testing.assert_allclose(ours_y.astype(np.float32), ref.astype(np.float32), rtol=2**-7)
    assert np.mean(ours_y != ref) <= 0.01
    flax_mismatches += int(np.sum(np.asarray(b["y"]) != ref))
  # Flax divides by the scale in bfloat16 and rescales in bfloat16: from the second
  # step on (scale != 1) most of its outputs differ from the float32-scaled product.
  assert flax_mismatches > 0.5 * 2 * ours[0]["y"].size


def _train_state(dg_cls, x):
  class TwoHeads(nn.Module):
    @nn.compact
    def __call__(self, x, use_second):
      h = nn.Dense(8, dot_general_cls=dg_cls, name="first")(x)
      second = nn.Dense(8, dot_general_cls=dg_cls, name="second")(x)
      # On some steps the second head is only used behind stop_gradient.
      return h + (second if use_second else jax.lax.stop_gradient(second))

  model = TwoHeads()
  variables = jax.jit(model.init, static_argnums=2)(jax.random.key(0), x, True)
  return model, train_state.TrainState.create(
      apply_fn=model.apply, params=variables, tx=optax.sgd(1e-3))


@pytest.mark.parametrize("dg_cls, sound", [(DG, True), (FLAX_DG, False)])
def test_raw_flax_train_state_after_a_zero_cotangent(dg_cls, sound):
  """Flax's TrainState writes the zero cotangent; jaxmp's layer recovers, Flax's dies.

  With scale 0, Flax's next step divides by 0: finite inputs saturate and are then
  multiplied by 0 (the head outputs 0), and an input that is exactly 0 (ReLU outputs,
  padding) becomes 0/0 = NaN, which reaches the gradients and the parameters.
  """
  x = _normal(0, (4, 8), 3.0).at[0, 0].set(0.0)
  model, state = _train_state(dg_cls, x)

  @functools.partial(jax.jit, static_argnums=1)
  def step(state, use_second):
    def loss(params):
      return jnp.sum(state.apply_fn(params, x, use_second) ** 2)
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  state = step(state, True)
  state = step(state, False)  # the second head's state "gradient" is all zeros
  (second,) = state.params[OWG]["second"].values()
  assert float(second["input_scale"][0]) == 0.0  # what the TrainState wrote
  for _ in range(3):
    state = step(state, True)

  @jax.jit
  def second_head_error(variables):
    out = model.apply(variables, x, True)
    f32 = nn.Dense(8).apply({"params": variables["params"]["second"]}, x)
    second_out = out - nn.Dense(8).apply({"params": variables["params"]["first"]}, x)
    return jnp.linalg.norm(second_out - f32) / jnp.linalg.norm(f32)

  error = float(second_head_error(state.params))
  if sound:
    assert bool(jaxmp.all_finite(state.params)) and error < 0.1
  else:
    assert not bool(jaxmp.all_finite(state.params["params"]["second"]))
    assert np.isnan(error)


def _sound_step(model, x):
  """A jaxmp-style step: for_grad inside the loss, merge afterwards."""
  @jax.jit
  def step(variables):
    def loss(params, fp8_state):
      fp8_state = fp8.state.for_grad(fp8_state)
      return jnp.sum(model.apply({"params": params, OWG: fp8_state}, x))
    grads, state_ct = jax.grad(loss, argnums=(0, 1))(variables["params"], variables[OWG])
    return {"params": variables["params"],
            OWG: fp8.state.merge(variables[OWG], state_ct, jaxmp.all_finite(grads))}
  return step


class Cell(nn.Module):
  recipe: fp8.Recipe = RECIPE

  @nn.compact
  def __call__(self, c, _):
    dg = functools.partial(jaxmp.linen.Fp8DotGeneral, recipe=self.recipe)
    y = nn.Dense(2, use_bias=False, dot_general_cls=dg, kernel_init=nn.initializers.ones)(c)
    return y * 0.5, y


@pytest.mark.parametrize("remat", [False, True])
def test_nn_scan_over_shared_weights_takes_the_max(remat):
  class RNN(nn.Module):
    @nn.compact
    def __call__(self, c):
      cell = nn.remat(Cell) if remat else Cell
      scan = nn.scan(cell, variable_broadcast=["params", OWG], split_rngs={"params": False},
                     length=3)
      return scan()(c, None)[1]

  model, c0 = RNN(), jnp.array([[4.0, 4.0]])
  variables = _sound_step(model, c0)(jax.jit(model.init)(jax.random.key(0), c0))
  (state,) = jax.tree_util.tree_leaves(variables[OWG], is_leaf=lambda t: "input_scale" in t)
  # Every step sees input 4 and kernel 1; the output gradients are 3, 2 and 1.
  np.testing.assert_array_equal(state["input_amax_history"], [4, 0, 0, 0])
  np.testing.assert_array_equal(state["kernel_amax_history"], [1, 0, 0, 0])
  np.testing.assert_array_equal(state["output_grad_amax_history"], [3, 0, 0, 0])


def test_a_module_called_twice_takes_the_max():
  class Twice(nn.Module):
    @nn.compact
    def __call__(self, x):
      dense = nn.Dense(2, use_bias=False, dot_general_cls=DG, kernel_init=nn.initializers.ones)
      return dense(x) + dense(3 * x)

  model, x = Twice(), jnp.array([[1.0, -1.0]])
  variables = _sound_step(model, x)(jax.jit(model.init)(jax.random.key(0), x))
  state = variables[OWG]["Dense_0"]["Fp8DotGeneral_0"]
  np.testing.assert_array_equal(state["input_amax_history"], [3, 0, 0, 0])  # not 1 + 3
  np.testing.assert_array_equal(state["kernel_scale"], [1.0])  # not 2


def test_nn_scan_over_layers_keeps_one_state_per_layer():
  class Layer(nn.Module):
    @nn.compact
    def __call__(self, c, _):
      return nn.Dense(2, use_bias=False, dot_general_cls=DG,
                      kernel_init=nn.initializers.constant(2.0))(c), None

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, c):
      scan = nn.scan(Layer, variable_axes={"params": 0, OWG: 0},
                     split_rngs={"params": True}, length=3)
      return scan()(c, None)[0]

  model, x = Stack(), jnp.array([[1.0, 0.0]])
  variables = _sound_step(model, x)(jax.jit(model.init)(jax.random.key(0), x))
  state = variables[OWG]["ScanLayer_0"]["Dense_0"]["Fp8DotGeneral_0"]
  # Layer inputs are 1, 2, 8 (each layer doubles and sums two features); the output
  # gradients of the three layers are 16, 4, 1.
  np.testing.assert_array_equal(state["input_amax_history"][:, 0], [1, 2, 8])
  np.testing.assert_array_equal(state["output_grad_amax_history"][:, 0], [16, 4, 1])


LINEN_MISUSE = (r"fp8 state .* would never update.*jaxmp\.linen\.value_and_grad.*"
                r"jaxmp\.linen\.TrainState")


def test_differentiating_the_params_alone_is_refused():
  # The fp8 state passed in, not differentiated: its new value would be dropped.
  x = _normal(0, (4, 3))
  model = jaxmp.linen.mixed_precision(nn.Dense(2), jaxmp.PolicyRules(
      "float32", [jaxmp.Rule(nn.Dense, fp8=RECIPE)]))
  variables = model.init(jax.random.key(0), x)
  loss = lambda params: jnp.sum(model.apply({**variables, "params": params}, x))
  with pytest.raises(ValueError, match=LINEN_MISUSE):
    jax.grad(loss)(variables["params"])
  with pytest.raises(ValueError, match=LINEN_MISUSE):
    jax.jit(jax.grad(loss))(variables["params"])
  # Differentiating the whole variables dict (Flax's TrainState) and the input alone are fine.
  grads = jax.grad(lambda v: jnp.sum(model.apply(v, x)))(variables)
  assert float(grads[OWG]["Fp8DotGeneral_0"]["input_amax_history"][0]) > 0
  assert jax.grad(lambda x: jnp.sum(model.apply(variables, x)))(x).shape == x.shape


# Flax's own Fp8Test.test_fp8_einsum (tests/linen/linen_test.py, lines 1294-1332, at
# https://github.com/google/flax/blob/18f8f311c275d57f46d95e41b15aa97b454754c0/tests/linen/linen_test.py;
# Copyright 2024 The Flax Authors, Apache License 2.0, tests/published/LICENSE): the
# body verbatim but for `nn.Fp8Einsum()` -> `jaxmp.linen.Fp8Einsum()`. It differentiates
# an einsum of two activations with respect to both inputs and not the variables: it
# trains nothing, so no state update is dropped and nothing may be refused.
@pytest.mark.parametrize("x_shape, y_shape, g_shape, eqn", [
    ((16, 32), (32, 64), (16, 64), 'mk,kn->mn'),
    ((2, 3, 32), (64, 32), (2, 3, 64), '...k,nk->...n'),
    ((2, 3, 64), (64, 32), (2, 3, 32), '...k,kn->...n'),
])
def test_flax_fp8_einsum_test_differentiates_the_inputs_alone(x_shape, y_shape, g_shape, eqn):
    from jax import random  # pylint: disable=g-import-not-at-top
    from flax.linen import fp8_ops  # pylint: disable=g-import-not-at-top
    rng, key1, key2, key3 = random.split(random.key(42), 4)
    x = random.normal(key1, x_shape)
    y = random.normal(key2, y_shape)
    g = random.normal(key3, g_shape)
    e4m3_dtype = jnp.float8_e4m3fn
    e5m2_dtype = jnp.float8_e5m2
    cast_to_representable = functools.partial(
        fp8_ops.qdq,
        scale=jnp.ones((1,)),
        compute_dtype=jnp.float32,
    )

    x = cast_to_representable(x, e4m3_dtype)
    y = cast_to_representable(y, e4m3_dtype)
    g = cast_to_representable(g, e5m2_dtype)

    p = jaxmp.linen.Fp8Einsum()
    vars = p.init(rng, eqn, x, y)
    def loss_fn(vars, x, y):
      out = p.apply(vars, eqn, x, y)
      return jnp.sum(out * g.astype(out.dtype))
    step_fn = jax.value_and_grad(loss_fn, argnums=[1, 2])
    out, grads = jax.jit(step_fn)(vars, x, y)

    def loss_fn_ref(x, y):
      out = jnp.einsum(eqn, x, y)
      return jnp.sum(out * g.astype(out.dtype))
    step_fn_ref = jax.value_and_grad(loss_fn_ref, argnums=[0, 1])
    out_ref, grads_ref = jax.jit(step_fn_ref)(x, y)

    np.testing.assert_allclose(out, out_ref, atol=1e-02, rtol=1e-02)
    np.testing.assert_allclose(grads[0], grads_ref[0], atol=1e-02, rtol=1e-02)
    np.testing.assert_allclose(grads[1], grads_ref[1], atol=1e-02, rtol=1e-02)


class _KernelEinsum(nn.Module):
  """An fp8 einsum behind a learnable kernel, as Fp8Einsum's docstring suggests."""

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.ones, (3, 2))
    return jaxmp.linen.Fp8Einsum(recipe=RECIPE)("bd,dh->bh", x, kernel)


class _ActivationEinsum(nn.Module):
  """An fp8 einsum of two activations, in a module that has params of its own."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(3, kernel_init=nn.initializers.ones)(x)
    return jaxmp.linen.Fp8Einsum(recipe=RECIPE)("bd,bd->b", x, h)


@pytest.mark.parametrize("module", [_KernelEinsum(), _ActivationEinsum()],
                         ids=["kernel", "two_activations"])
def test_an_fp8_einsum_in_a_trained_module_is_refused_without_its_state(module):
  # Training the einsum's module (its params differentiated) while the state is not
  # drops the state update, whatever the einsum's operands are; its input alone is fine.
  x = _normal(0, (4, 3))
  variables = module.init(jax.random.key(0), x)
  loss = lambda params, x: jnp.sum(module.apply({**variables, "params": params}, x))
  with pytest.raises(ValueError, match=r"fp8 state .* would never update"):
    jax.grad(loss)(variables["params"], x)
  assert jax.grad(loss, argnums=1)(variables["params"], x).shape == x.shape
  grads = jax.grad(lambda v: jnp.sum(module.apply(v, x)))(variables)
  assert float(grads[OWG]["Fp8Einsum_0"]["input_amax_history"][0]) > 0


MISSING_STATE = (r"fp8 state of the layer at 'ScanCell_0/Dense_0' .* lifted scan, which does not "
                 r"pass .* variable_broadcast=\['params', '_overwrite_with_gradient'\].*"
                 r"mixed_precision with an fp8 rule does this for you.*CurrentScaling\(\)")


class _SharedWeightsRNN(nn.Module):
  """A published-style scan over shared weights that lists only the params."""
  recipe: fp8.Recipe = RECIPE

  @nn.compact
  def __call__(self, c):
    layer = functools.partial(Cell, recipe=self.recipe)
    scan = nn.scan(layer, variable_broadcast="params", split_rngs={"params": False}, length=3)
    return scan()(c, None)[1]


def test_a_scan_that_does_not_pass_the_fp8_state_on_is_refused_by_name_outside_jaxmp():
  # A plain Flax model with the user's own fp8 layers: nn.scan passes on only the
  # collections it lists, so a layer inside can neither create nor read its state.
  c0 = jnp.array([[4.0, 4.0]])
  with pytest.raises(ValueError, match=MISSING_STATE):
    _SharedWeightsRNN().init(jax.random.key(0), c0)
  # What the message offers works: a stateless recipe, or the model wrapped by jaxmp,
  # which passes the state where the params go (broadcast: one state for the steps).
  assert _SharedWeightsRNN(fp8.CurrentScaling()).init(jax.random.key(0), c0).keys() == {
      "params"}
  wrapped = jaxmp.linen.mixed_precision(_SharedWeightsRNN(), jaxmp.PolicyRules(
      "float32", [jaxmp.Rule(nn.Dense, fp8=RECIPE)]))
  state = wrapped.init(jax.random.key(0), c0)[OWG]["ScanCell_0"]["Dense_0"]["Fp8DotGeneral_0"]
  assert jax.tree_util.tree_map(jnp.shape, state) == STATE_SHAPES


def test_a_lifted_transform_jaxmp_does_not_carry_through_is_refused_by_name():
  # nn.map_variables hands the variables it maps to a function of the user's; one that
  # passes the params alone keeps the state from the layer even under jaxmp.
  class Mapped(nn.Module):
    @nn.compact
    def __call__(self, x):
      dense = nn.map_variables(nn.Dense, "params", lambda p: p, init=True, variables="params")
      return dense(2)(x)

  wrapped = jaxmp.linen.mixed_precision(Mapped(), jaxmp.PolicyRules(
      "float32", [jaxmp.Rule(nn.Dense, fp8=RECIPE)]))
  with pytest.raises(ValueError, match=r"layer at 'Map_variablesDense_0' .* lifted "
                     r"map_variables; jaxmp passes the state through .*scan.* must list "
                     r"'_overwrite_with_gradient' itself"):
    wrapped.init(jax.random.key(0), jnp.ones((1, 3)))


def test_apply_without_the_fp8_state_is_refused_by_name():
  # Flax's own train loops pass {"params": params} alone.
  x = _normal(0, (4, 3))
  model = nn.Dense(2, dot_general_cls=DG)
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"fp8 state of the layer at '<root>'.*model\.init"):
    model.apply({"params": variables["params"]}, x)
