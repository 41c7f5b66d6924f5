"""jaxmp.nnx.mixed_precision: casting semantics, NNX transforms, training, linen parity."""

import functools
import re
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
from tests import backends

BF16 = "params=float32,compute=bfloat16,output=float32"

# The probes sow outside nnx.capture too (in plain calls), which NNX deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside")


def _dtypes(tree):
  return jax.tree.map(lambda x: np.dtype(x.dtype).name, nnx.as_pure(tree))


def _capture(wrapped, *args, **kwargs):
  """The output and the ``sow``-n intermediates of one call (NNX's nnx.capture)."""
  return nnx.capture(lambda m, *a: m(*a, **kwargs), nnx.Intermediate)(wrapped, *args)


class Probe(nnx.Module):
  """A Linear-like layer that sows the dtypes it sees; reads its param directly."""

  def __init__(self, din, dout, rngs):
    self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (din, dout)))

  def __call__(self, x):
    kernel = self.kernel[...]
    self.sow(nnx.Intermediate, "x", x)
    self.sow(nnx.Intermediate, "w", kernel)
    return x @ kernel


class Parent(nnx.Module):

  def __init__(self, rngs):
    self.child = Probe(3, 4, rngs)
    self.out = Probe(4, 4, rngs)

  def __call__(self, x):
    h = self.child(x)
    self.sow(nnx.Intermediate, "child_out", h)
    return self.out(h)


class ProbeLayerNorm(nnx.LayerNorm):

  def __call__(self, x, *args, **kwargs):
    self.sow(nnx.Intermediate, "x", x)
    return super().__call__(x, *args, **kwargs)


class MLP(nnx.Module):

  def __init__(self, rngs, dtype=None, norm_dtype=None):
    self.up = nnx.Linear(5, 16, dtype=dtype, rngs=rngs)
    self.norm = nnx.LayerNorm(16, dtype=norm_dtype, rngs=rngs)
    self.down = nnx.Linear(16, 3, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.down(self.norm(nnx.relu(self.up(x))))


def build(make, seed=0):
  """``make()`` built abstractly, its params filled from numpy.

  The model is the same as a real construction's but for the values; building it
  this way compiles no random initializers, which dominates a small test's time.
  """
  model = nnx.eval_shape(make)
  rng = np.random.default_rng(seed)
  for path, variable in nnx.to_flat_state(nnx.state(model)):
    shape = variable.get_raw_value()
    if not isinstance(variable, nnx.Param):
      raise TypeError(f"build() fills params only, {path} is a {type(variable).__name__}")
    offset = 1.0 if path[-1] == "scale" else 0.0
    variable.set_raw_value(
        jnp.asarray(offset + 0.3 * rng.standard_normal(shape.shape), shape.dtype))
  return model


def _first(intermediates, *path):
  node = intermediates
  for key in path:
    node = node[key]
  return node.get_value()[0]


# ---- storage, compute and output dtypes ------------------------------------------------------


def test_params_stored_in_param_dtype_and_are_the_models_own():
  model = build(lambda: Parent(nnx.Rngs(0)))
  kernel = model.child.kernel
  rules = jaxmp.PolicyRules("p=bf16,c=bf16,o=f32", [jaxmp.Rule("out", "p=f32,c=f32")])
  wrapped = jaxmp.nnx.mixed_precision(model, rules)
  assert wrapped.model is model and model.child.kernel is kernel
  assert kernel[...].dtype == jnp.bfloat16
  assert model.out.kernel[...].dtype == jnp.float32
  state = nnx.state(wrapped, nnx.Param)
  assert state["model"]["child"]["kernel"] is kernel


def test_module_sees_inputs_and_params_in_compute_dtype():
  wrapped = jaxmp.nnx.mixed_precision(build(lambda: Parent(nnx.Rngs(0))), BF16)
  out, inter = _capture(wrapped, jnp.ones((2, 3)))
  assert out.dtype == jnp.float32
  for name in ("child", "out"):
    assert _first(inter, "model", name, "x").dtype == jnp.bfloat16
    assert _first(inter, "model", name, "w").dtype == jnp.bfloat16
  assert wrapped.model.child.kernel[...].dtype == jnp.float32


@pytest.mark.parametrize("spec,expected", [(BF16, jnp.float32), ("p=f32,c=bf16,o=f16", jnp.float16),
                                           ("bf16", jnp.bfloat16)])
def test_model_output_has_default_output_dtype(spec, expected):
  wrapped = jaxmp.nnx.mixed_precision(build(lambda: Parent(nnx.Rngs(0))), spec)
  assert wrapped(jnp.ones((2, 3))).dtype == expected


def test_override_is_local_and_named_output_dtype():
  local = jaxmp.nnx.mixed_precision(
      build(lambda: Parent(nnx.Rngs(0))), jaxmp.PolicyRules(BF16, [jaxmp.Rule("child", "float32")]))
  _, inter = _capture(local, jnp.ones((2, 3)))
  assert _first(inter, "model", "child", "x").dtype == jnp.float32
  assert _first(inter, "model", "child", "w").dtype == jnp.float32
  assert _first(inter, "model", "child_out").dtype == jnp.bfloat16  # the caller's dtype
  assert _first(inter, "model", "out", "w").dtype == jnp.bfloat16

  named = jaxmp.nnx.mixed_precision(
      build(lambda: Parent(nnx.Rngs(0))), jaxmp.PolicyRules(BF16, [jaxmp.Rule("child", "p=f32,c=f32,o=f32")]))
  _, inter = _capture(named, jnp.ones((2, 3)))
  assert _first(inter, "model", "child_out").dtype == jnp.float32
  assert _first(inter, "model", "out", "x").dtype == jnp.bfloat16


def test_class_rule():
  wrapped = jaxmp.nnx.mixed_precision(
      build(lambda: Parent(nnx.Rngs(0))), jaxmp.PolicyRules(BF16, [jaxmp.Rule(Probe, "f16")]))
  _, inter = _capture(wrapped, jnp.ones((2, 3)))
  assert _first(inter, "model", "child", "x").dtype == jnp.float16
  assert _first(inter, "model", "child_out").dtype == jnp.bfloat16


def test_normalization_in_float32_and_handed_back():

  class Net(nnx.Module):

    def __init__(self, rngs):
      self.dense = nnx.Linear(3, 4, rngs=rngs)
      self.ln = ProbeLayerNorm(4, rngs=rngs)
      self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
      h = self.ln(self.dense(x))
      self.sow(nnx.Intermediate, "ln_out", h)
      return self.head(h)

  wrapped = jaxmp.nnx.mixed_precision(Net(nnx.Rngs(0)), "bf16")
  _, inter = _capture(wrapped, jnp.ones((2, 3)))
  assert _first(inter, "model", "ln", "x").dtype == jnp.float32
  assert _first(inter, "model", "ln_out").dtype == jnp.bfloat16
  assert wrapped.model.ln.scale[...].dtype == jnp.bfloat16


def test_integer_inputs_and_rngs_are_not_cast_and_rng_state_advances():

  class Net(nnx.Module):

    def __init__(self, rngs):
      self.embed = nnx.Embed(11, 4, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)
      self.dense = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, ids, train=False):
      self.sow(nnx.Intermediate, "ids", ids)
      return self.dense(self.drop(self.embed(ids), deterministic=not train))

  model = Net(nnx.Rngs(0))
  wrapped = jaxmp.nnx.mixed_precision(model, BF16)
  ids = jnp.array([[1, 2, 3]], jnp.int32)
  out, inter = _capture(wrapped, ids, train=True)
  assert _first(inter, "model", "ids").dtype == jnp.int32
  assert out.dtype == jnp.float32
  assert int(model.drop.rngs.count[...]) == 1  # the model's own RNG stream advanced
  assert not np.array_equal(wrapped(ids, train=True), out)  # so the next mask differs
  np.testing.assert_array_equal(wrapped(ids), wrapped(ids))

  # An nnx.Rngs passed as an argument is the caller's, and advances too.
  drop = nnx.Dropout(0.5)
  rngs = nnx.Rngs(dropout=1)
  jaxmp.nnx.mixed_precision(drop, BF16)(jnp.ones((2, 8)), rngs=rngs)
  assert int(rngs.dropout.count[...]) == 1


@pytest.mark.filterwarnings("ignore:'.value' access is now deprecated")
def test_custom_module_reading_value_tied_weights_and_other_methods():

  class Tied(nnx.Module):

    def __init__(self, rngs):
      self.embed = nnx.Embed(10, 4, rngs=rngs)
      self.scale = nnx.Param(jnp.ones(4))

    def __call__(self, ids):
      h = self.embed(ids) * self.scale.value  # the old .value spelling
      self.sow(nnx.Intermediate, "seen_scale", self.scale.value)
      self.sow(nnx.Intermediate, "table", self.embed.embedding[...])  # a child's param
      return self.embed.attend(h)

    def encode(self, ids):
      return self.embed(ids)

  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule("embed", "f16")])
  wrapped = jaxmp.nnx.mixed_precision(Tied(nnx.Rngs(0)), rules)
  ids = jnp.array([[1, 2]])
  out, inter = _capture(wrapped, ids)
  assert out.dtype == jnp.float32 and out.shape == (1, 2, 10)
  assert _first(inter, "model", "seen_scale").dtype == jnp.bfloat16
  assert _first(inter, "model", "table").dtype == jnp.float16  # cast by its owner
  encoded = wrapped.encode(ids)
  assert encoded.dtype == jnp.float32 and encoded.shape == (1, 2, 4)
  rows = [(r.path, r.method) for r in jaxmp.tools.summary(wrapped, None, ids).rows]
  assert rows == [("<root>", "__call__"), ("embed", "__call__"), ("embed", "attend")]
  with pytest.raises(AttributeError, match=r"\.model\.scale"):
    wrapped.scale  # pylint: disable=pointless-statement


# ---- numerics against float32 and hand-written bf16 ------------------------------------------


def test_matches_hand_written_bf16_model_exactly():
  x = jax.random.normal(jax.random.key(1), (8, 5))
  model = build(lambda: MLP(nnx.Rngs(0)))
  by_hand = build(lambda: MLP(nnx.Rngs(0), dtype=jnp.bfloat16, norm_dtype=jnp.float32))
  expected = by_hand(x)
  assert expected.dtype == jnp.bfloat16
  np.testing.assert_array_equal(jaxmp.nnx.mixed_precision(model, BF16)(x),
                                expected.astype(jnp.float32))


def test_gradients_are_float32_and_match_float32_model():
  x = jax.random.normal(jax.random.key(1), (32, 5))
  y = jax.random.normal(jax.random.key(2), (32, 3))
  model = build(lambda: MLP(nnx.Rngs(0)))
  wrapped = jaxmp.nnx.mixed_precision(nnx.clone(model), BF16)
  grad = nnx.jit(nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2)))
  g_mixed = grad(wrapped)["model"]
  g_full = grad(model)
  assert set(jax.tree.leaves(_dtypes(g_mixed))) == {"float32"}
  for a, b in zip(jax.tree.leaves(g_mixed), jax.tree.leaves(g_full), strict=True):
    assert np.linalg.norm(a - b) <= 0.08 * np.linalg.norm(b)  # bfloat16 vs float32


def test_batch_stats_stay_float32_and_update_like_float32_model():

  class Net(nnx.Module):

    def __init__(self, rngs):
      self.dense = nnx.Linear(4, 8, rngs=rngs)
      self.bn = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)

    def __call__(self, x, train):
      return self.bn(self.dense(x), use_running_average=not train)

  x = 3.0 + jax.random.normal(jax.random.key(1), (16, 4))
  full = Net(nnx.Rngs(0))
  model = Net(nnx.Rngs(0))
  wrapped = jaxmp.nnx.mixed_precision(model, "bf16")
  assert model.bn.mean[...].dtype == jnp.float32 and model.dense.kernel[...].dtype == jnp.bfloat16
  full.dense.kernel[...] = model.dense.kernel[...].astype(jnp.float32)
  full(x, train=True)
  wrapped(x, train=True)
  assert model.bn.mean[...].dtype == jnp.float32
  np.testing.assert_allclose(model.bn.mean[...], full.bn.mean[...], rtol=0.02, atol=0.02)
  np.testing.assert_allclose(model.bn.var[...], full.bn.var[...], rtol=0.02, atol=0.02)
  assert not np.allclose(model.bn.mean[...], 0.0)
  before = model.bn.mean[...]
  wrapped(x, train=False)
  np.testing.assert_array_equal(model.bn.mean[...], before)


# ---- NNX transforms and graph functions ------------------------------------------------------


def _probe_block(seen):

  class Block(nnx.Module):

    def __init__(self, rngs):
      self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (4, 4)))
      self.ln = nnx.LayerNorm(4, rngs=rngs)

    def __call__(self, x):
      seen.append((x.dtype, self.kernel[...].dtype))
      return self.ln(x @ self.kernel[...]) + x

  return Block


def _scanned(block):

  class Scanned(nnx.Module):

    def __init__(self, rngs):
      @nnx.split_rngs(splits=3)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return block(rngs)
      self.blocks = make(rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def body(x, layer):
        return layer(x)
      return body(x, self.blocks)

  return Scanned


def _remat(block):

  class Remat(nnx.Module):

    def __init__(self, rngs):
      self.block = block(rngs)

    def __call__(self, x):
      return nnx.remat(lambda b, x: b(x))(self.block, x)

  return Remat


def _vmapped(block):

  class Vmapped(nnx.Module):

    def __init__(self, rngs):
      @nnx.split_rngs(splits=2)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return block(rngs)
      self.blocks = make(rngs)

    def __call__(self, x):
      return nnx.vmap(lambda b, x: b(x), in_axes=(0, None))(self.blocks, x).sum(0)

  return Vmapped


@pytest.mark.parametrize("make", [_scanned, _remat, _vmapped])
def test_scan_remat_and_vmap_stacks(make):
  seen = []
  model = build(lambda: make(_probe_block(seen))(nnx.Rngs(0)))
  x = jax.random.normal(jax.random.key(1), (2, 4))
  expected = nnx.clone(model)(x)
  wrapped = jaxmp.nnx.mixed_precision(model, jaxmp.PolicyRules(BF16, [jaxmp.Rule(r"block.*", "c=f16")]))
  seen.clear()
  out = wrapped(x)
  assert set(seen) == {(jnp.dtype(jnp.float16), jnp.dtype(jnp.float16))}
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, expected, rtol=0.05, atol=0.05)
  grads = nnx.grad(lambda m: m(x).sum())(wrapped)
  assert set(jax.tree.leaves(_dtypes(grads))) == {"float32"}


def test_jit_grad_split_merge_and_no_traced_values_left():
  model = build(lambda: MLP(nnx.Rngs(0)))
  wrapped = jaxmp.nnx.mixed_precision(model, BF16)
  x = jnp.ones((2, 5))
  traces = []

  @nnx.jit
  def f(m, x):
    traces.append(1)
    return m(x)

  out = f(wrapped, x)
  np.testing.assert_allclose(out, wrapped(x), rtol=0.02, atol=0.02)  # eager rounds apart
  f(wrapped, x + 1)
  graphdef, state = nnx.split(wrapped)
  np.testing.assert_array_equal(f(nnx.merge(graphdef, state), x), out)
  assert len(traces) == 1
  nnx.grad(lambda m: m(x).sum())(wrapped)
  # The model itself is as it was: its classes, attributes, concrete values.
  assert type(model.up) is nnx.Linear and "_jaxmp_call" not in vars(model.up)
  assert model.up.dot_general is jax.lax.dot_general
  for leaf in jax.tree.leaves(nnx.state(model)):
    assert isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)


def test_exception_inside_the_call_leaves_the_model_untouched():

  class Broken(nnx.Module):

    def __init__(self, rngs):
      self.bn = nnx.BatchNorm(3, rngs=rngs)

    def __call__(self, x):
      self.bn(x, use_running_average=False)
      raise RuntimeError("boom")

  model = Broken(nnx.Rngs(0))
  wrapped = jaxmp.nnx.mixed_precision(model, BF16)
  with pytest.raises(RuntimeError, match="boom"):
    wrapped(jnp.ones((2, 3)))
  np.testing.assert_array_equal(model.bn.mean[...], jnp.zeros(3))
  assert type(model) is Broken and type(model.bn) is nnx.BatchNorm


# ---- caches the caller owns ------------------------------------------------------------------


class _LayerCache(nnx.Module):
  """A per-layer KV cache the caller builds and passes in (as bonsai's decoders do)."""

  def __init__(self, dtype):
    self.k = nnx.Cache(jnp.full((3, 4), 1 / 3, dtype))


class _CachedLayer(nnx.Module):

  def __init__(self, rngs):
    self.proj = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x, cache, write=True):
    k = cache.k if isinstance(cache, _LayerCache) else cache
    if write:
      k[...] = jax.lax.dynamic_update_slice(k[...], self.proj(x), (0, 0))
    return x @ k[...].T


@pytest.mark.parametrize("handed", ["module", "variable"])
def test_a_cache_handed_in_is_read_in_the_compute_dtype_and_written_in_its_own(handed):
  model = _CachedLayer(nnx.Rngs(0))
  wrapped = jaxmp.nnx.mixed_precision(model, BF16)
  x = jax.random.normal(jax.random.key(1), (1, 4))
  cache = _LayerCache(jnp.float32)
  out = wrapped(x, cache if handed == "module" else cache.k)
  assert cache.k[...].dtype == jnp.float32
  # The update was the projection computed in bfloat16, written into the float32 cache.
  expected = _bf16_copy(model.proj)(x.astype(jnp.bfloat16))
  assert expected.dtype == jnp.bfloat16
  np.testing.assert_array_equal(cache.k[...][:1], expected.astype(jnp.float32))
  assert out.dtype == jnp.float32


def _bf16_copy(linear):
  copy = nnx.clone(linear)
  for _, variable in nnx.to_flat_state(nnx.state(copy, nnx.Param)):
    variable.set_raw_value(variable.get_raw_value().astype(jnp.bfloat16))
  return copy


def test_a_cache_handed_in_and_only_read_keeps_its_bits():
  wrapped = jaxmp.nnx.mixed_precision(_CachedLayer(nnx.Rngs(0)), BF16)
  cache = _LayerCache(jnp.float32)
  wrapped(jnp.ones((1, 4)), cache, write=False)
  # Read in bfloat16 for the call, never written: 1/3 is not rounded to bfloat16.
  np.testing.assert_array_equal(cache.k[...], jnp.full((3, 4), 1 / 3, jnp.float32))


def test_an_in_place_update_of_state_jaxmp_does_not_cast_names_the_state_and_the_fix():

  class Model(nnx.Module):

    def __init__(self, rngs):
      self.layer = _CachedLayer(rngs)
      self.bn = nnx.BatchNorm(4, rngs=rngs)  # float32 statistics: not a suspect

    def __call__(self, x, cache):
      return self.layer(self.bn(x), cache)

  wrapped = jaxmp.nnx.mixed_precision(Model(nnx.Rngs(0)), BF16)
  with pytest.raises(TypeError, match=r"dynamic_update_slice requires arguments to have the "
                     r"same dtypes.*'argument 0' \(Variable, float32\).*make it an "
                     r"nnx.Cache") as info:
    # A cache in a plain nnx.Variable, which jaxmp cannot tell from other state.
    wrapped(jnp.ones((1, 4)), nnx.Variable(jnp.zeros((3, 4), jnp.float32)))
  assert "'bn/" not in str(info.value)
  # As an nnx.Cache, the same buffer is read in bfloat16 and written back in float32.
  cache = _LayerCache(jnp.float32)
  wrapped(jnp.ones((1, 4)), cache)
  assert cache.k[...].dtype == jnp.float32


def _regression(n=64):
  x = jax.random.normal(jax.random.key(1), (n, 5))
  return x, x @ jax.random.normal(jax.random.key(2), (5, 3))


def test_optimizer_with_fp16_loss_scaling_trains_and_skips_a_poisoned_step():
  x, y = _regression()
  wrapped = jaxmp.nnx.mixed_precision(build(lambda: MLP(nnx.Rngs(0))),
                                      "params=float32,compute=float16,output=float32")
  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10))
  optimizer = nnx.Optimizer(wrapped, tx, wrt=nnx.Param)
  assert float(jaxmp.get_loss_scale(optimizer.opt_state).loss_scale) == 2.0**10

  @nnx.jit
  def step(model, optimizer, x, y):
    loss_fn = lambda m, x, y: jnp.mean((m(x) - y) ** 2)
    loss, grads = jaxmp.nnx.value_and_grad(loss_fn)(
        model, x, y, loss_scale=jaxmp.get_loss_scale(optimizer.opt_state))
    jaxmp.nnx.apply_gradients(optimizer, model, grads)
    return loss

  losses = [float(step(wrapped, optimizer, x, y)) for _ in range(30)]
  assert losses[-1] < 0.2 * losses[0]
  assert set(jax.tree.leaves(_dtypes(nnx.state(wrapped, nnx.Param)))) == {"float32"}

  params = nnx.clone(nnx.state(wrapped, nnx.Param))
  inner = nnx.clone(optimizer.opt_state).inner_state
  step(wrapped, optimizer, x.at[0, 0].set(jnp.inf), y)
  chex.assert_trees_all_equal(nnx.state(wrapped, nnx.Param), params)
  chex.assert_trees_all_equal(optimizer.opt_state.inner_state, inner)
  metrics = jaxmp.loss_scaling_metrics(optimizer.opt_state)
  assert int(metrics["skipped_steps"]) == 1
  assert float(metrics["loss_scale"]) == 2.0**9


def test_optimizer_step_counts_a_skipped_step_but_the_inner_state_does_not():
  # nnx.Optimizer.step advances on every update; loss scaling leaves the inner Optax
  # state (Adam's count, hence its bias correction and schedules) as it was.
  wrapped = jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), BF16)
  optimizer = nnx.Optimizer(wrapped, jaxmp.loss_scaling(optax.adam(1e-2)), wrt=nnx.Param)
  adam_count = lambda: int(optimizer.opt_state.inner_state[0].count[...])

  def step(x):
    loss_fn = lambda m, x: jnp.mean(m(x) ** 2)
    _, grads = jaxmp.nnx.value_and_grad(loss_fn)(
        wrapped, x, loss_scale=jaxmp.get_loss_scale(optimizer.opt_state))
    jaxmp.nnx.apply_gradients(optimizer, wrapped, grads)

  step(jnp.ones((4, 3)))
  assert (int(optimizer.step[...]), adam_count()) == (1, 1)
  params = [np.asarray(p).tobytes() for p in jax.tree.leaves(nnx.state(wrapped, nnx.Param))]
  step(jnp.ones((4, 3)).at[0, 0].set(jnp.nan))
  assert not bool(jaxmp.loss_scaling_metrics(optimizer.opt_state)["last_step_finite"])
  assert (int(optimizer.step[...]), adam_count()) == (2, 1)
  assert [np.asarray(p).tobytes()
          for p in jax.tree.leaves(nnx.state(wrapped, nnx.Param))] == params


def test_plain_nnx_grad_and_optimizer_update_work_too():
  x, y = _regression(16)
  wrapped = jaxmp.nnx.mixed_precision(build(lambda: MLP(nnx.Rngs(0))), BF16)
  optimizer = nnx.Optimizer(wrapped, optax.sgd(0.1), wrt=nnx.Param)
  loss_fn = nnx.jit(lambda m: jnp.mean((m(x) - y) ** 2))
  step = nnx.jit(lambda m, opt: opt.update(m, nnx.grad(loss_fn)(m)))
  before = float(loss_fn(wrapped))
  for _ in range(3):
    step(wrapped, optimizer)
  assert float(loss_fn(wrapped)) < before


# ---- the same model in linen and NNX -----------------------------------------------------------

V, D, F = 13, 8, 16


def _attention(q, k, v, **unused):
  # One attention function for both: nnx.dot_product_attention takes jax.nn's fused
  # path, which rounds differently from linen's in bfloat16 even without jaxmp.
  return nn.dot_product_attention(q, k, v)


class LinenBlock(nn.Module):

  @nn.compact
  def __call__(self, ids):
    h = nn.Embed(V, D, name="embed")(ids)
    h = h + nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=_attention,
                                            name="attn")(nn.LayerNorm(name="ln1")(h))
    m = nn.gelu(nn.Dense(F, name="up")(nn.LayerNorm(name="ln2")(h)))
    h = h + nn.Dense(D, name="down")(m)
    return nn.Einsum((D, V), "btd,dv->btv", name="head")(h)


class NnxBlock(nnx.Module):

  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.ln1 = nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False,
                                       attention_fn=_attention, rngs=rngs)
    self.ln2 = nnx.LayerNorm(D, rngs=rngs)
    self.up = nnx.Linear(D, F, rngs=rngs)
    self.down = nnx.Linear(F, D, rngs=rngs)
    self.head = nnx.Einsum("btd,dv->btv", (D, V), (V,), rngs=rngs)

  def __call__(self, ids):
    h = self.embed(ids)
    h = h + self.attn(self.ln1(h))
    m = nnx.gelu(self.up(self.ln2(h)))
    h = h + self.down(m)
    return self.head(h)


def _at(tree, path):
  for key in path:
    tree = tree[key]
  return tree


@functools.lru_cache(maxsize=None)
def _twin_params(seed):
  # Weights from numpy, shapes from an abstract init: nothing random is compiled.
  rng = np.random.default_rng(seed)
  ids = jnp.asarray(rng.permutation(V)[:10].reshape(2, 5))
  shapes = jax.eval_shape(LinenBlock().init, jax.random.key(0), ids)["params"]
  def weight(path, shape):
    offset = 1.0 if jax.tree_util.keystr(path).endswith("['scale']") else 0.0
    return jnp.asarray(offset + 0.3 * rng.standard_normal(shape.shape), jnp.float32)
  return jax.tree_util.tree_map_with_path(weight, shapes), ids


def twin_models(seed=0):
  """A linen and an NNX block with the same weights (nonzero biases), and token ids.

  The ids do not repeat: the embedding gradient of a repeated id is a sum whose order
  XLA may pick differently for two programs, in bfloat16.
  """
  params, ids = _twin_params(seed)
  model = build(lambda: NnxBlock(nnx.Rngs(seed)))
  for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    variable.set_raw_value(_at(params, path))
  return params, model, ids


@pytest.mark.parametrize("device", backends.DEVICES)
@pytest.mark.parametrize("rules", [
    BF16,
    jaxmp.PolicyRules("params=float32,compute=float16,output=float32", [
        jaxmp.Rule("head", "float32"), jaxmp.Rule(r"attn(/.*)?", "bf16")]),
])
def test_linen_and_nnx_give_identical_outputs_and_gradients(rules, device):
  # The two adapters trace the same operations (their jaxprs differ only in where the
  # parameters are cast), so XLA:CPU computes them bit for bit alike. On a GPU the two
  # programs are fused differently and keep float32 inside fusions where they round to
  # 16 bits: about 1e-3 relative apart on an H100 (tests/backends.py).
  with backends.on(device):
    _linen_and_nnx_agree(rules, backends.exact(device))


def _linen_and_nnx_agree(rules, exact):
  same = np.testing.assert_array_equal if exact else (
      lambda a, b, err_msg="": backends.assert_close_to_largest(a, b, backends.BF16_PROGRAMS_RTOL,
                                                                err_msg))
  params, model, ids = twin_models()
  linen = jaxmp.linen.mixed_precision(LinenBlock(), rules)
  wrapped = jaxmp.nnx.mixed_precision(model, rules)

  @jax.jit
  def linen_step(params):
    loss = lambda p: jnp.mean(linen.apply({"params": p}, ids) ** 2)
    return linen.apply({"params": params}, ids), jax.grad(loss)(params)

  @nnx.jit
  def nnx_step(wrapped):
    return wrapped(ids), nnx.grad(lambda m: jnp.mean(m(ids) ** 2))(wrapped)["model"]

  out_linen, g_linen = linen_step(params)
  out_nnx, g_nnx = nnx_step(wrapped)
  assert out_nnx.dtype == out_linen.dtype
  same(out_nnx, out_linen)
  flat = nnx.to_flat_state(g_nnx)
  assert len(flat) == len(jax.tree.leaves(g_linen)) == 19
  for path, grad in flat:
    same(grad[...], _at(g_linen, path), err_msg=str(path))


# ---- summary ---------------------------------------------------------------------------------


def test_summary_of_nnx_model_and_wrapper_changes_nothing():
  _, model, ids = twin_models()
  rules = jaxmp.PolicyRules("p=bf16,c=bf16,o=f32", [jaxmp.Rule("head", "p=f32,c=f32,o=f32")])
  rows = {r.path: r for r in jaxmp.tools.summary(model, rules, ids).rows}
  assert list(rows)[:3] == ["<root>", "embed", "ln1"]
  assert rows["attn/query"].compute_dtype == "bfloat16"
  assert rows["ln1"].compute_dtype == "float32" and rows["ln1"].rule == "norm"
  assert rows["ln1"].output_dtype == "bfloat16"
  assert rows["head"].param_dtype == "float32" and rows["head"].rule == "0: 'head'"
  assert rows["<root>"].output_dtype == "float32"
  # Nothing was cast or run: the model still stores float32.
  assert model.up.kernel[...].dtype == jnp.float32
  big = jax.ShapeDtypeStruct((4096, 4096), jnp.int32)
  assert len(jaxmp.tools.summary(model, rules, big).rows) == len(rows)
  wrapped = jaxmp.nnx.mixed_precision(model, BF16)
  assert {r.compute_dtype for r in jaxmp.tools.summary(wrapped, None, ids).rows} >= {"bfloat16"}
  text = str(jaxmp.tools.summary(wrapped.model, rules, ids))  # other rules: the model
  head = next(line for line in text.splitlines() if line.startswith("head"))
  assert head.split() == ["head", "Einsum", "float32", "float32", "float32", "-", "0:", "'head'",
                          "float32"]
  with pytest.raises(ValueError, match="needs rules"):
    jaxmp.tools.summary(model, None, ids)
  with pytest.raises(TypeError, match="variables="):
    jaxmp.tools.summary(model, rules, ids, variables={})


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [lambda x: x, "Linear", 3, None, nnx.Rngs(0)])
def test_wrapping_a_non_module(bad):
  with pytest.raises(TypeError, match="expects a flax.nnx.Module"):
    jaxmp.nnx.mixed_precision(bad, BF16)


@pytest.mark.parametrize("linen_model", [
    lambda: nn.Dense(2), lambda: jaxmp.linen.mixed_precision(nn.Dense(2), BF16)],
    ids=["module", "wrapper"])
def test_wrapping_a_linen_module_points_to_linen(linen_model):
  with pytest.raises(TypeError, match=re.escape("For flax.linen models use "
                                                "jaxmp.linen.mixed_precision.")):
    jaxmp.nnx.mixed_precision(linen_model(), BF16)


def test_wrapping_twice():
  wrapped = jaxmp.nnx.mixed_precision(build(lambda: MLP(nnx.Rngs(0))), BF16)
  with pytest.raises(TypeError, match="already wrapped"):
    jaxmp.nnx.mixed_precision(wrapped, BF16)
  outer = nnx.Sequential(wrapped)
  with pytest.raises(TypeError, match="contains a jaxmp wrapper at 'layers/0'"):
    jaxmp.nnx.mixed_precision(outer, BF16)


def test_bad_policy():
  with pytest.raises(ValueError, match="'f8'"):
    jaxmp.nnx.mixed_precision(build(lambda: MLP(nnx.Rngs(0))), "c=f8")
  with pytest.raises(TypeError, match="PolicyRules"):
    jaxmp.nnx.mixed_precision(build(lambda: MLP(nnx.Rngs(0))), [jaxmp.Rule(nnx.Linear, "f32")])


def test_rule_matching_nothing_warns_with_paths_once():
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule(r"decoder/.*", "f32")])
  with pytest.warns(UserWarning, match=r"(?s)rule 0 \('decoder/\.\*'\) matches no module.*"
                    r"down \(Linear\).*norm \(LayerNorm\).*up \(Linear\)"):
    wrapped = jaxmp.nnx.mixed_precision(build(lambda: MLP(nnx.Rngs(0))), rules)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    wrapped(jnp.ones((1, 5)))


def test_shadowed_rule_warns():
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule(nnx.Linear, "f32"), jaxmp.Rule("up", "f16")])
  with pytest.warns(UserWarning, match=r"rule 1 \('up'\) is shadowed"):
    jaxmp.nnx.mixed_precision(build(lambda: MLP(nnx.Rngs(0))), rules)


def test_training_helpers_bad_input():
  wrapped = jaxmp.nnx.mixed_precision(build(lambda: MLP(nnx.Rngs(0))), BF16)
  with pytest.raises(TypeError, match="loss_scale"):
    jaxmp.nnx.value_and_grad(lambda m: m(jnp.ones((1, 5))).sum())(wrapped, loss_scale=2.0)
  optimizer = nnx.Optimizer(wrapped, optax.sgd(0.1), wrt=nnx.Param)
  with pytest.raises(TypeError, match="jaxmp.nnx.Gradients"):
    jaxmp.nnx.apply_gradients(optimizer, wrapped, nnx.state(wrapped, nnx.Param))
  with pytest.raises(TypeError, match="nnx.Optimizer"):
    jaxmp.nnx.apply_gradients(optax.sgd(0.1), wrapped, None)


# ---- new rules for a wrapped model (jaxmp.tools.PrecisionController's mechanism) --------------


class _Net(nnx.Module):

  def __init__(self, rngs):
    self.body = nnx.Linear(3, 8, rngs=rngs)
    self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs)])
    self.head = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(self.blocks[0](nnx.relu(self.body(x))))


def test_with_rules_shares_every_variable_and_drops_only_the_fp8_state_it_removes():
  fp16 = "params=float32,compute=float16,output=float32"
  recipe = jaxmp.fp8.DelayedScaling(amax_history_length=4)
  model = jaxmp.nnx.mixed_precision(_Net(nnx.Rngs(0)), jaxmp.PolicyRules(
      fp16, [jaxmp.Rule(nnx.Linear, fp8=recipe)], trace_nonfinite=True))
  # The modules are known without a call; containers (nnx.List) are not modules.
  assert model.module_types() == {"": _Net, "body": nnx.Linear, "blocks/0": nnx.Linear,
                                  "head": nnx.Linear}
  x = jnp.ones((4, 3))
  _, grads = jaxmp.nnx.value_and_grad(lambda m: jnp.sum(m(x)))(model)  # some fp8 history
  optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(optax.sgd(0.1)), wrt=nnx.Param)
  jaxmp.nnx.apply_gradients(optimizer, model, grads)
  before = {path: v for path, v in nnx.to_flat_state(nnx.state(model))}
  rules = jaxmp.PolicyRules(fp16, [jaxmp.Rule("head", "float32"),
                                   jaxmp.Rule(nnx.Linear, fp8=recipe)], trace_nonfinite=True)
  wider = model.with_rules(rules)
  assert wider.rules == rules and wider.model is model.model
  assert wider.nonfinite is model.nonfinite
  assert sorted(wider.fp8) == ["blocks/0", "body"]  # head's recipe is gone, and its state
  assert all(wider.fp8[p] is model.fp8[p] for p in wider.fp8)
  after = {path: v for path, v in nnx.to_flat_state(nnx.state(wider))}
  assert set(after) == {p for p in before if p[:2] != ("fp8", "head")}
  assert all(after[p] is before[p] for p in after)  # the same variables, not copies
  assert model.rules != rules and sorted(model.fp8) == ["blocks/0", "body", "head"]
  # It runs the new rules: head in float32, without fp8; the optimizer still fits.
  ran = {r.path: r.ran for r in jaxmp.tools.summary(wider, None, x).rows}
  assert ran["head"] == "float32" and ran["body"] == "float8_e4m3fn", ran
  _, grads = jaxmp.nnx.value_and_grad(lambda m: jnp.sum(m(x)))(wider)
  jaxmp.nnx.apply_gradients(optimizer, wider, grads)


def test_with_rules_refuses_to_change_how_params_are_stored():
  model = jaxmp.nnx.mixed_precision(_Net(nnx.Rngs(0)), "params=float32,compute=float16")
  with pytest.raises(ValueError, match=r"'head/(bias|kernel)' is stored in float32.*bfloat16"):
    model.with_rules(jaxmp.PolicyRules("params=float32,compute=float16",
                                       [jaxmp.Rule("head", "bfloat16")]))
  with pytest.raises(TypeError, match="got 'float32'"):
    model.with_rules("float32")
