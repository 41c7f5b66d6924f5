"""jaxmp.nnx fp8: NNX fp8 layers, fp8 by rule, and sound training of their state."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
from jaxmp._src.fp8 import maxgrad
from jaxmp import fp8
from tests.nnx.test_wrapper import build
from tests.nnx.test_wrapper import LinenBlock
from tests.nnx.test_wrapper import twin_models

BF16 = "params=float32,compute=bfloat16,output=float32"
RECIPE = fp8.DelayedScaling(amax_history_length=4)
DIMS = (((1,), (0,)), ((), ()))


class TwoLinear(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(5, 8, rngs=rngs)
    self.out = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def _two_linear():
  return build(lambda: TwoLinear(nnx.Rngs(0)))


def _wrap(model, match=nnx.Linear, recipe=RECIPE, default="float32", extra=()):
  rules = jaxmp.PolicyRules(default, [*extra, jaxmp.Rule(match, fp8=recipe)])
  return jaxmp.nnx.mixed_precision(model, rules)


def _data(n=16):
  x = jax.random.normal(jax.random.key(1), (n, 5))
  return x, jnp.tanh(x @ jax.random.normal(jax.random.key(2), (5, 3)))


def _mse(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def _state(wrapped, path):
  return {k: v[...] for k, v in nnx.state(wrapped.fp8[path], jaxmp.nnx.Fp8State).items()}


def _step(wrapped, optimizer, x, y):
  loss, grads = jaxmp.nnx.value_and_grad(_mse)(
      wrapped, x, y, loss_scale=jaxmp.get_loss_scale(optimizer.opt_state, default=jaxmp.NoOpLossScale()))
  jaxmp.nnx.apply_gradients(optimizer, wrapped, grads)
  return loss


# ---- the layers ------------------------------------------------------------------------------


def test_explicit_layers_match_the_pure_functions():
  x, w = jax.random.normal(jax.random.key(1), (4, 3)), jax.random.normal(jax.random.key(2), (3, 2))
  op = jaxmp.nnx.Fp8DotGeneral(RECIPE)
  expected = fp8.fp8_dot_general(x, w, DIMS, state=fp8.init_state(RECIPE), recipe=RECIPE)
  np.testing.assert_array_equal(op(x, w, DIMS), expected)
  assert op.input_scale[...].dtype == jnp.float32 and op.input_amax_history.shape == (4,)
  assert nnx.state(jaxmp.nnx.Fp8DotGeneral(fp8.CurrentScaling())) == nnx.State({})
  einsum = jaxmp.nnx.Fp8Einsum(RECIPE)
  np.testing.assert_array_equal(
      einsum("bd,dh->bh", x, w),
      fp8.fp8_einsum("bd,dh->bh", x, w, state=fp8.init_state(RECIPE), recipe=RECIPE))
  with pytest.raises(ValueError, match="out_sharding"):
    einsum("bd,dh->bh", x, w, out_sharding=jax.sharding.PartitionSpec())
  with pytest.raises(TypeError, match="recipe"):
    jaxmp.nnx.Fp8DotGeneral(fp8.DelayedScaling)


def test_fp8_state_is_linens_fp8_collection_for_nnx_bridge():
  assert nnx.variablelib.variable_type_from_name(fp8.OVERWRITE_WITH_GRADIENT) is jaxmp.nnx.Fp8State


# ---- fp8 by rule -----------------------------------------------------------------------------


def test_linear_rule_creates_state_and_matches_explicit_fp8_layers():
  x, _ = _data(4)
  model = _two_linear()
  explicit = nnx.clone(model)
  # NNX 0.12 refuses a module in a static attribute after construction without nnx.data.
  explicit.hidden.dot_general = nnx.data(jaxmp.nnx.Fp8DotGeneral(RECIPE))
  explicit.out.dot_general = nnx.data(jaxmp.nnx.Fp8DotGeneral(RECIPE))
  wrapped = _wrap(model)
  assert list(wrapped.fp8) == ["hidden", "out"]
  assert _state(wrapped, "hidden")["input_amax_history"].shape == (4,)
  ours = wrapped(x)
  np.testing.assert_array_equal(ours, explicit(x))
  np.testing.assert_allclose(ours, model(x), rtol=0.15, atol=0.15)
  # Explicit fp8 layers are left as they are: no second fp8 module, no error.
  assert list(_wrap(explicit).fp8) == []
  assert model.hidden.dot_general is jax.lax.dot_general  # the model was not changed


def test_first_match_wins_keeps_a_layer_out_of_fp8_and_output_follows_compute():
  wrapped = _wrap(_two_linear(), default=BF16, extra=[jaxmp.Rule("out")])
  assert list(wrapped.fp8) == ["hidden"]
  rows = {r.path: r for r in jaxmp.tools.summary(wrapped, None, jnp.ones((1, 5))).rows}
  assert rows["hidden"].fp8 == "DelayedScaling" and rows["out"].fp8 == "-"
  assert rows["hidden"].output_dtype == "bfloat16"
  assert wrapped(jnp.ones((2, 5))).dtype == jnp.float32


def test_linear_general_einsum_and_attention_projections():

  class Net(nnx.Module):

    def __init__(self, rngs):
      self.proj = nnx.LinearGeneral(8, (2, 4), rngs=rngs)
      self.mix = nnx.Einsum("btnh,nhd->btd", (2, 4, 8), (8,), rngs=rngs)
      self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False, rngs=rngs)

    def __call__(self, x):
      return self.attn(self.mix(self.proj(x)))

  model = build(lambda: Net(nnx.Rngs(0)))
  x = jax.random.normal(jax.random.key(1), (2, 3, 8))
  call = nnx.jit(lambda m, x: m(x))
  expected = call(model, x)
  wrapped = _wrap(model, match=(nnx.LinearGeneral, nnx.Einsum, nnx.MultiHeadAttention))
  assert set(wrapped.fp8) == {"proj", "mix", "attn/query", "attn/key", "attn/value", "attn/out"}
  assert isinstance(wrapped.fp8["mix"], jaxmp.nnx.Fp8Einsum)
  np.testing.assert_allclose(call(wrapped, x), expected, rtol=0.2, atol=0.2)
  _, grads = nnx.jit(jaxmp.nnx.value_and_grad(lambda m, x: jnp.sum(m(x) ** 2)))(wrapped, x)
  for path in wrapped.fp8:
    assert float(grads.fp8["fp8"][path]["input_amax_history"][...][0]) > 0, path


def test_current_scaling_keeps_no_state():
  wrapped = _wrap(_two_linear(), recipe=fp8.CurrentScaling())
  assert len(nnx.state(wrapped, jaxmp.nnx.Fp8State)) == 0
  assert wrapped(jnp.ones((2, 5))).shape == (2, 3)


def test_custom_dot_general_is_not_overridden():
  model = _two_linear()
  model.out.dot_general = lambda *args, **kwargs: jax.lax.dot_general(*args, **kwargs)
  with pytest.raises(ValueError, match="'out'.*already has a custom dot_general"):
    _wrap(model)


def test_fp8_rule_on_layer_without_matmul_warns_with_nnx_names():
  model = build(lambda: nnx.Sequential(nnx.Conv(3, 2, (3,), rngs=nnx.Rngs(0))))
  with pytest.warns(UserWarning, match=r"rule 0 \(Conv\) has an fp8 recipe but matches no "
                    r"layer fp8 applies to \(nnx.Linear, nnx.LinearGeneral"):
    wrapped = _wrap(model, match=nnx.Conv)
  assert list(wrapped.fp8) == []


# ---- sound training of the state (same guarantees as jaxmp.linen for linen) ------------------


def test_trains_under_nnx_jit_with_loss_scaling():
  x, y = _data()
  wrapped = _wrap(_two_linear(), default=BF16)
  optimizer = nnx.Optimizer(wrapped, jaxmp.loss_scaling(optax.adam(3e-2)), wrt=nnx.Param)
  step = nnx.jit(_step)
  losses = [float(step(wrapped, optimizer, x, y)) for _ in range(25)]
  assert losses[-1] < 0.3 * losses[0]
  hidden = _state(wrapped, "hidden")
  # Delayed scaling: the scale is amax/448 of the recorded history.
  np.testing.assert_allclose(hidden["input_scale"][0],
                             np.max(hidden["input_amax_history"]) / 448, rtol=0.02)
  assert float(hidden["output_grad_scale"][0]) != 1.0
  for leaf in jax.tree.leaves(nnx.state(wrapped)):
    assert not isinstance(leaf, jax.core.Tracer) and leaf.dtype != maxgrad.max_float32


def test_zero_cotangent_keeps_the_state():

  class Net(nnx.Module):

    def __init__(self, rngs):
      self.side = nnx.Linear(5, 4, rngs=rngs)
      self.main = nnx.Linear(5, 3, rngs=rngs)

    def __call__(self, x):
      return self.main(x) + jax.lax.stop_gradient(self.side(x)).sum() * 0.0

  x, y = _data()
  wrapped = _wrap(build(lambda: Net(nnx.Rngs(0))))
  optimizer = nnx.Optimizer(wrapped, optax.sgd(1e-2), wrt=nnx.Param)
  before = _state(wrapped, "side")
  for _ in range(2):
    _step(wrapped, optimizer, x, y)
  # Kept, not zeroed.
  chex.assert_trees_all_equal(nnx.as_pure(_state(wrapped, "side")), nnx.as_pure(before))
  assert np.all(np.isfinite(wrapped(x)))
  assert float(_state(wrapped, "main")["kernel_scale"][0]) != 1.0


def test_layer_used_twice_records_the_max_not_the_sum():

  class Twice(nnx.Module):

    def __init__(self, rngs):
      self.shared = nnx.Linear(5, 5, rngs=rngs)

    def __call__(self, x):
      return self.shared(x) + self.shared(3.0 * x)

  x = jnp.full((2, 5), 2.0)
  wrapped = _wrap(build(lambda: Twice(nnx.Rngs(0))))
  _, grads = jaxmp.nnx.value_and_grad(lambda m: jnp.sum(m(x)))(wrapped)
  history = grads.fp8["fp8"]["shared"]["input_amax_history"][...]
  np.testing.assert_array_equal(history, [6.0, 0.0, 0.0, 0.0])  # max(2, 6), not 8


def test_accumulated_micro_batches_take_the_max():
  x, y = _data()
  wrapped = _wrap(_two_linear())
  grad = lambda xs, ys: jaxmp.nnx.value_and_grad(_mse)(wrapped, xs, ys)[1]
  small, large = grad(0.5 * x[:8], y[:8]), grad(4.0 * x[8:], y[8:])
  total = jaxmp.nnx.accumulate_gradients(small, large)
  history = lambda g: float(g.fp8["fp8"]["hidden"]["input_amax_history"][...][0])
  assert history(total) == max(history(small), history(large))
  assert history(total) == pytest.approx(float(jnp.max(jnp.abs(4.0 * x[8:]))))
  chex.assert_trees_all_close(total.params, jax.tree.map(jnp.add, small.params, large.params),
                              rtol=1e-6)


def test_skipped_step_leaves_params_fp8_and_optimizer_untouched():
  x, y = _data()
  wrapped = _wrap(_two_linear())
  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10))
  optimizer = nnx.Optimizer(wrapped, tx, wrt=nnx.Param)
  _step(wrapped, optimizer, x, y)
  state = nnx.clone(nnx.state(wrapped))
  inner = nnx.clone(optimizer.opt_state).inner_state
  _step(wrapped, optimizer, x.at[0, 0].set(jnp.inf), y)
  chex.assert_trees_all_equal(nnx.as_pure(nnx.state(wrapped)), nnx.as_pure(state))
  chex.assert_trees_all_equal(nnx.as_pure(optimizer.opt_state.inner_state), nnx.as_pure(inner))
  metrics = jaxmp.loss_scaling_metrics(optimizer.opt_state)
  assert int(metrics["skipped_steps"]) == 1 and float(metrics["loss_scale"]) == 2.0**9
  _step(wrapped, optimizer, x, y)  # the next clean step trains from the kept state
  assert not np.array_equal(_state(wrapped, "hidden")["input_amax_history"],
                            state["fp8"]["hidden"]["input_amax_history"][...])


def test_non_finite_step_without_loss_scaling_never_enters_the_history():
  x, y = _data()
  wrapped = _wrap(_two_linear())
  optimizer = nnx.Optimizer(wrapped, optax.sgd(1e-2), wrt=nnx.Param)
  _step(wrapped, optimizer, x, y)
  before = nnx.clone(nnx.state(wrapped, jaxmp.nnx.Fp8State))
  _step(wrapped, optimizer, x.at[0, 0].set(jnp.nan), y)
  chex.assert_trees_all_equal(nnx.as_pure(nnx.state(wrapped, jaxmp.nnx.Fp8State)),
                              nnx.as_pure(before))
  for leaf in jax.tree.leaves(nnx.state(wrapped, jaxmp.nnx.Fp8State)):
    assert np.all(np.isfinite(leaf))


def test_loss_scale_multiplies_params_gradients_only():
  x, y = _data()
  wrapped = _wrap(_two_linear())
  grad_fn = jaxmp.nnx.value_and_grad(_mse)
  loss1, g1 = grad_fn(wrapped, x, y)
  loss8, g8 = grad_fn(wrapped, x, y, loss_scale=jaxmp.StaticLossScale(8.0))
  assert float(loss1) == float(loss8)
  chex.assert_trees_all_close(jax.tree.map(lambda g: 8 * g, g1.params), g8.params, rtol=1e-6)
  np.testing.assert_array_equal(g1.fp8["fp8"]["hidden"]["input_scale"][...],
                                g8.fp8["fp8"]["hidden"]["input_scale"][...])


def test_for_grad_puts_the_float32_values_back():
  wrapped = _wrap(_two_linear())
  before = nnx.clone(nnx.state(wrapped, jaxmp.nnx.Fp8State))
  with pytest.raises(RuntimeError, match="inside"):
    with jaxmp.nnx.fp8_for_grad(wrapped):
      assert wrapped.fp8["hidden"].input_scale.get_raw_value().dtype == maxgrad.max_float32
      raise RuntimeError("inside")
  chex.assert_trees_all_equal(nnx.as_pure(nnx.state(wrapped, jaxmp.nnx.Fp8State)),
                              nnx.as_pure(before))
  assert wrapped.fp8["hidden"].input_scale[...].dtype == jnp.float32


def test_a_scanned_stack_gives_each_layer_its_own_state():

  class Block(nnx.Module):

    def __init__(self, rngs):
      self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      return nnx.relu(self.linear(x))

  class Stack(nnx.Module):

    def __init__(self, rngs):
      @nnx.split_rngs(splits=3)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return Block(rngs)
      self.blocks = make(rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def body(x, block):
        return block(x)
      return body(x, self.blocks)

  model = build(lambda: Stack(nnx.Rngs(0)))
  kernels = model.blocks.linear.kernel[...]
  wrapped = _wrap(model)
  assert list(wrapped.fp8) == ["blocks/linear"]
  _, grads = jaxmp.nnx.value_and_grad(lambda m, x: jnp.sum(m(x) ** 2))(wrapped, jnp.ones((2, 4)))
  history = grads.fp8["fp8"]["blocks/linear"]["kernel_amax_history"][...]
  # One history per layer, each from its own layer's kernel: not the max over the stack.
  assert history.shape == (3, 4)
  np.testing.assert_array_equal(history[:, 0], jnp.max(jnp.abs(kernels), axis=(1, 2)))
  assert len(set(np.asarray(history[:, 0]).tolist())) == 3


# ---- the same model in linen and NNX, one training step --------------------------------------


def _linen_fp8_collection(wrapped):
  """The linen fp8 collection holding the NNX wrapper's (initial) fp8 state."""
  collection = {}
  for path, module in wrapped.fp8.items():
    node = collection
    for key in path.split("/"):
      node = node.setdefault(key, {})
    name = "Fp8Einsum_0" if isinstance(module, jaxmp.nnx.Fp8Einsum) else "Fp8DotGeneral_0"
    node[name] = {k: v[...] for k, v in nnx.state(module, jaxmp.nnx.Fp8State).items()}
  return collection


def test_linen_and_nnx_fp8_give_identical_gradients_and_state_after_a_step():
  rules = jaxmp.PolicyRules(BF16, [
      jaxmp.Rule("head", "float32", fp8=RECIPE),
      jaxmp.Rule(r"attn|up|down", fp8=RECIPE),
  ])
  params, model, ids = twin_models()
  target = jnp.zeros((2, 5, 13))
  linen = jaxmp.linen.mixed_precision(LinenBlock(), rules)
  wrapped = jaxmp.nnx.mixed_precision(model, rules)
  fp8_state = _linen_fp8_collection(wrapped)
  abstract = jax.eval_shape(linen.init, jax.random.key(0), ids)[fp8.OVERWRITE_WITH_GRADIENT]
  assert jax.tree.structure(abstract) == jax.tree.structure(fp8_state)
  tx = optax.sgd(0.1)
  loss_scale = jaxmp.StaticLossScale(8.0)

  @jax.jit
  def linen_grads(params, fp8_state):
    loss_fn = lambda v: jnp.mean((linen.apply(v, ids) - target) ** 2)
    return jaxmp.linen.value_and_grad(loss_fn)(
        jaxmp.linen.join_variables(params, fp8_state), loss_scale=loss_scale)

  nnx_grads = nnx.jit(lambda m: jaxmp.nnx.value_and_grad(lambda m: _mse(m, ids, target))(
      m, loss_scale=loss_scale))

  loss_linen, g_linen = linen_grads(params, fp8_state)
  loss_nnx, g_nnx = nnx_grads(wrapped)
  assert float(loss_nnx) == float(loss_linen)
  for path, grad in nnx.to_flat_state(g_nnx.params):
    np.testing.assert_array_equal(grad[...], _at(g_linen.params, path[1:]), err_msg=str(path))

  # One optimizer step on each side: params through sgd, fp8 state merged.
  params, fp8_state, _ = jaxmp.linen.apply_gradients(
      jaxmp.loss_scaling(tx, loss_scale), params, fp8_state,
      jaxmp.loss_scaling(tx, loss_scale).init(params), g_linen)
  optimizer = nnx.Optimizer(wrapped, jaxmp.loss_scaling(tx, loss_scale), wrt=nnx.Param)
  jaxmp.nnx.apply_gradients(optimizer, wrapped, g_nnx)
  checked = 0
  for path, variable in nnx.to_flat_state(nnx.state(wrapped)):
    if path[0] == "model":
      expected = _at(params, path[1:])
    else:
      layer, name = path[1], path[-1]
      expected = _at(fp8_state, layer.split("/"))
      expected = expected["Fp8Einsum_0" if layer == "head" else "Fp8DotGeneral_0"][name]
    np.testing.assert_array_equal(variable[...], expected, err_msg=str(path))
    checked += 1
  assert checked == 19 + 7 * 6
  assert float(_state(wrapped, "up")["input_scale"][0]) == 1.0  # delayed: next step's scale
  assert float(_state(wrapped, "up")["input_amax_history"][0]) > 0


def _at(tree, path):
  for key in path:
    tree = tree[key]
  return tree


# ---- misuse: fp8 state that would never update ------------------------------------------------


NNX_MISUSE = r"fp8 state .* would never update.*jaxmp\.nnx\.value_and_grad.*jaxmp\.nnx\.apply_gradients"


def test_a_plain_nnx_grad_loop_is_refused():
  # nnx.grad differentiates the params only: the layers' new fp8 state (their state
  # "gradient") would be dropped and the state would never update.
  x, y = _data()
  wrapped = _wrap(_two_linear())
  optimizer = nnx.Optimizer(wrapped, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def plain_step(model, optimizer, x, y):
    grads = nnx.grad(_mse)(model, x, y)
    optimizer.update(model, grads)

  with pytest.raises(ValueError, match=NNX_MISUSE):
    plain_step(wrapped, optimizer, x, y)
  with pytest.raises(ValueError, match=NNX_MISUSE):
    nnx.value_and_grad(_mse)(wrapped, x, y)
  # The explicit layer too, not only fp8 by rule.
  layer = nnx.Linear(5, 3, dot_general=jaxmp.nnx.Fp8DotGeneral(RECIPE), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=NNX_MISUSE):
    nnx.grad(_mse)(layer, x, y)


def test_evaluation_input_gradients_and_state_gradients_are_not_refused():
  x, y = _data()
  wrapped = _wrap(_two_linear())
  assert wrapped(x).shape == (16, 3)
  # Differentiating the input alone (saliency) trains nothing: allowed.
  saliency = nnx.grad(lambda x, model: jnp.sum(model(x)))(x, wrapped)
  assert saliency.shape == x.shape
  # Differentiating params and fp8 state together, as value_and_grad does, is fine.
  grads = nnx.grad(_mse, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, jaxmp.nnx.Fp8State)))(
      wrapped, x, y)
  assert len(nnx.filter_state(grads, jaxmp.nnx.Fp8State))


# ---- stacks: nnx.vmap-built layers under nnx.scan, nnx.remat, nnx.vmap ----------------------


class _Layer(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    return nnx.relu(self.linear(x)) + x


def _stack(n=3):
  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return _Layer(rngs)
  return make(nnx.Rngs(0))


class _RematScan(nnx.Module):

  def __init__(self):
    self.layers = _stack()

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def body(x, layer):
      return layer(x)
    return body(x, self.layers)


class _Ensemble(nnx.Module):  # the stack run side by side: nnx.vmap in the forward too

  def __init__(self):
    self.layers = _stack()

  def __call__(self, x):
    return nnx.vmap(lambda layer, x: layer(x), in_axes=(0, None))(self.layers, x)


class _Broadcast(nnx.Module):  # a StateAxes that slices the params but not the rest

  def __init__(self):
    self.layers = _stack()

  def __call__(self, x):
    axes = nnx.StateAxes({nnx.Param: 0, ...: None})
    @nnx.scan(in_axes=(nnx.Carry, axes), out_axes=nnx.Carry)
    def body(x, layer):
      return layer(x)
    return body(x, self.layers)


def _sequential():  # nnx.Sequential of plain layers and a stack that scans itself
  return nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(1)), _RematScan(),
                        nnx.Linear(4, 4, rngs=nnx.Rngs(2)))


@pytest.mark.parametrize("model", [_RematScan, _Ensemble, _sequential],
                         ids=["scan_of_remat", "vmap", "sequential_holding_a_stack"])
def test_a_stack_gets_one_state_per_layer_from_its_own_kernel(model):
  wrapped = _wrap(model())
  (path,) = [p for p in wrapped.fp8 if p.endswith("layers/linear")]
  loss = lambda m, x: jnp.sum(m(x) ** 2)
  _, grads = jaxmp.nnx.value_and_grad(loss)(wrapped, jnp.ones((2, 4)))
  history = grads.fp8["fp8"][path]["kernel_amax_history"][...]
  (kernel,) = [v[...] for p, v in nnx.to_flat_state(nnx.state(wrapped.model, nnx.Param))
               if p[-1] == "kernel" and len(v[...].shape) == 3]
  assert history.shape == (3, 4)
  np.testing.assert_array_equal(history[:, 0], jnp.max(jnp.abs(kernel), axis=(1, 2)))
  for other in set(wrapped.fp8) - {path}:  # the Sequential's plain layers: one state each
    assert grads.fp8["fp8"][other]["kernel_amax_history"][...].shape == (4,)


def test_a_transform_that_broadcasts_the_state_is_refused_by_name():
  wrapped = _wrap(_Broadcast())
  with pytest.raises(ValueError, match=r"layer at 'layers/linear' reads its delayed-scaling "
                     r"variable 'input_scale' with shape \(3, 1\), the state of a stack of 3 "
                     r"layers.*StateAxes that gives jaxmp\.nnx\.Fp8State the nnx\.Param axis"):
    wrapped(jnp.ones((2, 4)))
