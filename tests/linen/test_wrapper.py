"""jaxmp.linen.mixed_precision: casting semantics, lifted transforms, training, bad input."""

import re
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jaxmp

BF16 = "params=float32,compute=bfloat16,output=float32"


def _dtypes(tree):
  return jax.tree.map(lambda x: np.dtype(x.dtype).name, tree)


def _sown(intermediates, *path):
  node = intermediates
  for key in path:
    node = node[key]
  return node


class Probe(nn.Module):
  """A Dense-like layer that records the dtypes it sees."""
  features: int = 4

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
    self.sow("intermediates", "x", x)
    self.sow("intermediates", "kernel", kernel)
    return x @ kernel


class Parent(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = Probe(name="child")(x)
    self.sow("intermediates", "child_out", h)
    return Probe(name="out")(h)


class ProbeLayerNorm(nn.LayerNorm):

  @nn.compact
  def __call__(self, x, *args, **kwargs):
    self.sow("intermediates", "x", x)
    return super().__call__(x, *args, **kwargs)


def _apply_intermediates(model, variables, *args, **kwargs):
  _, state = model.apply(variables, *args, mutable=["intermediates"], **kwargs)
  return state["intermediates"]


# ---- storage, compute and output dtypes ------------------------------------------------------


def test_init_stores_params_in_param_dtype():
  x = jnp.ones((2, 3))
  pure = jaxmp.linen.mixed_precision(Parent(), "p=bf16,c=bf16,o=f32")
  assert set(jax.tree.leaves(_dtypes(pure.init(jax.random.key(0), x)["params"]))) == {"bfloat16"}
  rules = jaxmp.PolicyRules("p=bf16,c=bf16,o=f32", [jaxmp.Rule("out", "p=f32,c=f32")])
  mixed = jaxmp.linen.mixed_precision(Parent(), rules)
  params = mixed.init(jax.random.key(0), x)["params"]
  assert params["child"]["kernel"].dtype == jnp.bfloat16
  assert params["out"]["kernel"].dtype == jnp.float32


def test_init_with_output():
  model = jaxmp.linen.mixed_precision(Parent(), "p=bf16,c=bf16,o=f16")
  out, variables = model.init_with_output(jax.random.key(0), jnp.ones((2, 3)))
  assert out.dtype == jnp.float16
  assert variables["params"]["child"]["kernel"].dtype == jnp.bfloat16


def test_module_sees_inputs_and_params_in_compute_dtype():
  model = jaxmp.linen.mixed_precision(Parent(), BF16)
  variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
  assert variables["params"]["child"]["kernel"].dtype == jnp.float32
  inter = _apply_intermediates(model, variables, jnp.ones((2, 3)))
  for name in ("child", "out"):
    assert inter[name]["x"][0].dtype == jnp.bfloat16
    assert inter[name]["kernel"][0].dtype == jnp.bfloat16


def test_model_output_has_default_output_dtype():
  for spec, expected in [(BF16, jnp.float32), ("p=f32,c=bf16,o=f16", jnp.float16),
                         ("bf16", jnp.bfloat16)]:
    model = jaxmp.linen.mixed_precision(Parent(), spec)
    variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
    assert model.apply(variables, jnp.ones((2, 3))).dtype == expected


def test_override_is_local():
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule("child", "float32")])
  model = jaxmp.linen.mixed_precision(Parent(), rules)
  variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
  inter = _apply_intermediates(model, variables, jnp.ones((2, 3)))
  assert inter["child"]["x"][0].dtype == jnp.float32
  assert inter["child"]["kernel"][0].dtype == jnp.float32
  # The child computed in float32 and handed its output back in its caller's bf16.
  assert inter["child_out"][0].dtype == jnp.bfloat16
  assert inter["out"]["kernel"][0].dtype == jnp.bfloat16


def test_rule_with_named_output_dtype():
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule("child", "p=f32,c=f32,o=f32")])
  model = jaxmp.linen.mixed_precision(Parent(), rules)
  variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
  inter = _apply_intermediates(model, variables, jnp.ones((2, 3)))
  assert inter["child_out"][0].dtype == jnp.float32
  # The next module still computes in its own dtype.
  assert inter["out"]["x"][0].dtype == jnp.bfloat16


def test_class_rule():
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule(Probe, "f16")])
  model = jaxmp.linen.mixed_precision(Parent(), rules)
  variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
  inter = _apply_intermediates(model, variables, jnp.ones((2, 3)))
  assert inter["child"]["x"][0].dtype == jnp.float16
  assert inter["child_out"][0].dtype == jnp.bfloat16


def test_normalization_in_float32_and_handed_back():

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      h = ProbeLayerNorm(name="ln")(nn.Dense(4)(x))
      self.sow("intermediates", "ln_out", h)
      return nn.Dense(2)(h)

  model = jaxmp.linen.mixed_precision(Net(), "bf16")
  variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
  inter = _apply_intermediates(model, variables, jnp.ones((2, 3)))
  assert inter["ln"]["x"][0].dtype == jnp.float32
  assert inter["ln_out"][0].dtype == jnp.bfloat16
  assert variables["params"]["ln"]["scale"].dtype == jnp.bfloat16


def test_integer_inputs_and_rngs_are_not_cast():

  class Net(nn.Module):

    @nn.compact
    def __call__(self, ids, train: bool):
      self.sow("intermediates", "ids", ids)
      h = nn.Embed(11, 4)(ids)
      h = nn.Dropout(0.5, deterministic=not train)(h)
      return nn.Dense(3)(h)

  model = jaxmp.linen.mixed_precision(Net(), BF16)
  ids = jnp.array([[1, 2, 3]], jnp.int32)
  variables = model.init(jax.random.key(0), ids, train=False)
  out, state = model.apply(variables, ids, train=True, rngs={"dropout": jax.random.key(1)},
                           mutable=["intermediates"])
  assert state["intermediates"]["ids"][0].dtype == jnp.int32
  assert out.dtype == jnp.float32
  out2 = model.apply(variables, ids, train=True, rngs={"dropout": jax.random.key(1)})
  np.testing.assert_array_equal(out, out2)


# ---- numerics against float32 and hand-written bf16 ------------------------------------------


class MLP(nn.Module):
  dtype: object = None
  norm_dtype: object = None

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16, dtype=self.dtype)(x))
    x = nn.LayerNorm(dtype=self.norm_dtype)(x)
    return nn.Dense(3, dtype=self.dtype)(x)


def test_matches_hand_written_bf16_model_exactly():
  x = jax.random.normal(jax.random.key(1), (8, 5))
  variables = MLP().init(jax.random.key(0), x)
  wrapped = jaxmp.linen.mixed_precision(MLP(), BF16).apply(variables, x)
  by_hand = MLP(dtype=jnp.bfloat16, norm_dtype=jnp.float32).apply(variables, x)
  assert by_hand.dtype == jnp.bfloat16
  np.testing.assert_array_equal(wrapped, by_hand.astype(jnp.float32))


# Tolerances scale with the compute dtype's eps: bfloat16 keeps 7 mantissa bits,
# float16 10, so float16 gradients are about 8x closer to the float32 ones.
@pytest.mark.parametrize("compute,rtol,atol", [("bfloat16", 0.05, 0.02),
                                               ("float16", 6e-3, 2.5e-3)])
def test_gradients_are_float32_and_match_float32_model(compute, rtol, atol):
  x = jax.random.normal(jax.random.key(1), (32, 5))
  y = jax.random.normal(jax.random.key(2), (32, 3))
  variables = MLP().init(jax.random.key(0), x)
  wrapped = jaxmp.linen.mixed_precision(
      MLP(), f"params=float32,compute={compute},output=float32")

  def loss(apply, params):
    return jnp.mean((apply({"params": params}, x) - y) ** 2)

  g_mixed = jax.grad(lambda p: loss(wrapped.apply, p))(variables["params"])
  g_full = jax.grad(lambda p: loss(MLP().apply, p))(variables["params"])
  assert set(jax.tree.leaves(_dtypes(g_mixed))) == {"float32"}
  chex.assert_trees_all_close(g_mixed, g_full, rtol=rtol, atol=atol)
  # It did compute in the half type: the gradients are close, not equal.
  assert not all(np.array_equal(a, b)
                 for a, b in zip(jax.tree.leaves(g_mixed), jax.tree.leaves(g_full)))


def test_batch_stats_stay_float32_and_update_like_float32_model():

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x, train: bool):
      x = nn.Dense(8)(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
      return nn.Dense(2)(x)

  x = 3.0 + jax.random.normal(jax.random.key(1), (16, 4))
  variables = Net().init(jax.random.key(0), x, train=False)
  wrapped = jaxmp.linen.mixed_precision(Net(), "bf16")
  stored = wrapped.init(jax.random.key(0), x, train=False)
  assert stored["batch_stats"]["BatchNorm_0"]["mean"].dtype == jnp.float32
  _, mixed = wrapped.apply(variables, x, train=True, mutable=["batch_stats"])
  _, full = Net().apply(variables, x, train=True, mutable=["batch_stats"])
  assert _dtypes(mixed) == _dtypes(full)
  chex.assert_trees_all_close(mixed, full, rtol=0.02, atol=0.02)
  assert not np.allclose(mixed["batch_stats"]["BatchNorm_0"]["mean"],
                         variables["batch_stats"]["BatchNorm_0"]["mean"])


# ---- lifted transforms and setup-style modules -----------------------------------------------


class Block(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    h = Probe(x.shape[-1], name="probe")(x)
    return nn.LayerNorm()(h) + x, None


class Scanned(nn.Module):

  @nn.compact
  def __call__(self, x):
    x, _ = nn.scan(Block, variable_axes={"params": 0, "intermediates": 0},
                   split_rngs={"params": True},
                   length=3)(name="layers")(x, None)
    return x


class Remat(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.remat(Block)(name="block")(x, None)[0]


class Vmapped(nn.Module):

  @nn.compact
  def __call__(self, x):
    stacked = jnp.stack([x, 2 * x])
    out = nn.vmap(Probe, variable_axes={"params": 0, "intermediates": 0},
                  split_rngs={"params": True}, in_axes=0)(x.shape[-1], name="probe")(stacked)
    return out.sum(0)


class SetupStyle(nn.Module):

  def setup(self):
    self.probe = Probe(4)
    self.scale = self.param("scale", nn.initializers.ones, (4,))

  def __call__(self, x):
    self.sow("intermediates", "scale", self.scale)
    return self.probe(x) * self.scale


@pytest.mark.parametrize("model,probe_path", [
    (Scanned(), ("layers", "probe")),
    (Remat(), ("block", "probe")),
    (Vmapped(), ("probe",)),
    (SetupStyle(), ("probe",)),
])
def test_lifted_and_setup_modules(model, probe_path):
  x = jax.random.normal(jax.random.key(1), (2, 4))
  variables = model.init(jax.random.key(0), x)
  # The probe inside the lifted transform (or setup) stores its params in bfloat16;
  # every other param keeps the default policy's float32.
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule("/".join(probe_path), "p=bf16,c=bf16")])
  wrapped = jaxmp.linen.mixed_precision(model, rules)
  stored = wrapped.init(jax.random.key(0), x)
  expected = jax.tree_util.tree_map_with_path(
      lambda path, _: "bfloat16" if tuple(k.key for k in path[:len(probe_path)]) == probe_path
      else "float32", variables["params"])
  assert "bfloat16" in jax.tree.leaves(expected)
  assert _dtypes(stored["params"]) == expected
  for a, b in zip(jax.tree.leaves(stored["params"]), jax.tree.leaves(variables["params"]),
                  strict=True):
    np.testing.assert_array_equal(a, b.astype(a.dtype))  # the same init, cast

  out, state = wrapped.apply(stored, x, mutable=["intermediates"])
  probe = _sown(state["intermediates"], *probe_path)
  assert probe["x"][0].dtype == jnp.bfloat16
  assert probe["kernel"][0].dtype == jnp.bfloat16
  assert out.dtype == jnp.float32
  assert wrapped.apply(variables, x).dtype == jnp.float32
  np.testing.assert_allclose(out, model.apply(variables, x), rtol=0.05, atol=0.05)
  grads = jax.grad(lambda p: wrapped.apply({"params": p}, x).sum())(stored["params"])
  assert _dtypes(grads) == expected


def test_setup_params_are_cast():
  wrapped = jaxmp.linen.mixed_precision(SetupStyle(), BF16)
  variables = wrapped.init(jax.random.key(0), jnp.ones((1, 4)))
  inter = _apply_intermediates(wrapped, variables, jnp.ones((1, 4)))
  assert inter["scale"][0].dtype == jnp.bfloat16


# ---- the linen Module's init/apply signature ---------------------------------------------------


def test_method_and_capture_intermediates_and_extra_kwargs():

  class Net(nn.Module):

    def setup(self):
      self.embed = nn.Embed(10, 4)
      self.dense = nn.Dense(4)

    def __call__(self, ids, scale=1.0):
      return self.embed.attend(self.dense(self.embed(ids))) * scale

    def encode(self, ids):
      return self.dense(self.embed(ids))

  model = jaxmp.linen.mixed_precision(Net(), BF16)
  ids = jnp.array([[1, 2]])
  variables = model.init({"params": jax.random.key(0)}, ids)
  encoded = model.apply(variables, ids, method=Net.encode)
  assert encoded.dtype == jnp.float32 and encoded.shape == (1, 2, 4)
  assert model.apply(variables, ids, method="encode").shape == (1, 2, 4)
  out, state = model.apply(variables, ids, scale=2.0, capture_intermediates=True)
  assert out.dtype == jnp.float32
  assert state["intermediates"]["dense"]["__call__"][0].dtype == jnp.bfloat16
  np.testing.assert_allclose(out, 2 * model.apply(variables, ids), rtol=1e-6)


def test_flax_train_state_trains():
  x = jax.random.normal(jax.random.key(1), (64, 5))
  y = x @ jax.random.normal(jax.random.key(2), (5, 3))
  model = jaxmp.linen.mixed_precision(MLP(), BF16)
  variables = model.init(jax.random.key(0), x)
  state = train_state.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                        tx=optax.adam(1e-2))

  @jax.jit
  def step(state):
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2))(state.params)
    return state.apply_gradients(grads=grads), loss

  losses = []
  for _ in range(40):
    state, loss = step(state)
    losses.append(float(loss))
  assert losses[-1] < 0.2 * losses[0]
  assert set(jax.tree.leaves(_dtypes(state.params))) == {"float32"}


def test_jit_static_wrapper_and_no_retrace():
  model = jaxmp.linen.mixed_precision(MLP(), BF16)
  x = jnp.ones((2, 5))
  variables = model.init(jax.random.key(0), x)
  traces = []

  @jax.jit
  def f(v, x):
    traces.append(1)
    return model.apply(v, x)

  f(variables, x)
  f(variables, x + 1)
  assert len(traces) == 1


# ---- cost: no converts beyond the casts themselves ---------------------------------------------


def _convert_count(fn, *args):
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  return len(re.findall(r"\bconvert\(", hlo))


def test_train_step_converts_match_hand_written_model():
  x = jax.random.normal(jax.random.key(1), (32, 5))
  y = jax.random.normal(jax.random.key(2), (32, 3))
  params = MLP().init(jax.random.key(0), x)["params"]
  wrapped = jaxmp.linen.mixed_precision(MLP(), BF16)
  tx = optax.adam(1e-3)
  opt_state = tx.init(params)

  def make_step(apply):
    def step(params, opt_state):
      grads = jax.grad(
          lambda p: jnp.mean((apply({"params": p}, x).astype(jnp.float32) - y) ** 2))(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state
    return step

  ours = _convert_count(make_step(wrapped.apply), params, opt_state)
  # By hand: dtype=bfloat16 on every layer, the norm included (it upcasts internally).
  by_hand = MLP(dtype=jnp.bfloat16, norm_dtype=jnp.bfloat16)
  hand = _convert_count(make_step(by_hand.apply), params, opt_state)
  assert ours <= hand + 2, (ours, hand)


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [lambda x: x, "Dense", 3, None])
def test_wrapping_a_non_module(bad):
  with pytest.raises(TypeError, match="expects a flax.linen.Module"):
    jaxmp.linen.mixed_precision(bad, BF16)


def test_wrapping_an_nnx_module_points_to_nnx():
  from flax import nnx
  with pytest.raises(TypeError, match="jaxmp.nnx.mixed_precision"):
    jaxmp.linen.mixed_precision(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), BF16)


def test_wrapping_twice_or_bound():
  wrapped = jaxmp.linen.mixed_precision(MLP(), BF16)
  with pytest.raises(TypeError, match="already wrapped"):
    jaxmp.linen.mixed_precision(wrapped, BF16)
  variables = MLP().init(jax.random.key(0), jnp.ones((1, 5)))
  with pytest.raises(TypeError, match="unbound"):
    jaxmp.linen.mixed_precision(MLP().bind(variables), BF16)


def test_bad_policy():
  with pytest.raises(ValueError, match="'f8'"):
    jaxmp.linen.mixed_precision(MLP(), "c=f8")
  with pytest.raises(TypeError, match="PolicyRules"):
    jaxmp.linen.mixed_precision(MLP(), [jaxmp.Rule(nn.Dense, "f32")])


def test_rule_matching_nothing_warns_with_paths_once():
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule(r"decoder/.*", "f32")])
  model = jaxmp.linen.mixed_precision(MLP(), rules)
  with pytest.warns(UserWarning, match=r"(?s)rule 0 \('decoder/\.\*'\) matches no module.*"
                    r"Dense_0 \(Dense\).*LayerNorm_0 \(LayerNorm\)"):
    variables = model.init(jax.random.key(0), jnp.ones((1, 5)))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    model.apply(variables, jnp.ones((1, 5)))


def test_shadowed_rule_warns():
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule(nn.Dense, "f32"), jaxmp.Rule("Dense_0", "f16")])
  model = jaxmp.linen.mixed_precision(MLP(), rules)
  with pytest.warns(UserWarning, match=r"rule 1 \('Dense_0'\) is shadowed"):
    model.init(jax.random.key(0), jnp.ones((1, 5)))


# ---- new rules for a wrapped model (jaxmp.tools.PrecisionController's mechanism) --------------


def test_with_rules_rewraps_the_same_model_and_knows_its_modules():
  fp16 = "params=float32,compute=float16,output=float32"
  model = jaxmp.linen.mixed_precision(nn.Sequential([nn.Dense(4), nn.Dense(2)]), fp16)
  assert model.module_types() == {}  # nothing has run yet
  x = jnp.ones((1, 3))
  variables = model.init(jax.random.key(0), x)
  assert model.module_types() == {"": nn.Sequential, "layers_0": nn.Dense,
                                  "layers_1": nn.Dense}
  rules = jaxmp.PolicyRules(fp16, [jaxmp.Rule("layers_1", "float32")])
  wider = model.with_rules(rules)
  assert wider.model is model.model and wider.rules == rules
  assert model.rules == jaxmp.PolicyRules(fp16)  # the old wrapper is unchanged
  assert wider.module_types() == model.module_types()  # known before it runs
  # The same variables, the new rules: layers_1 now runs its matmul in float32.
  ran = lambda m: {r.path: r.ran for r in jaxmp.tools.summary(m, None, x,
                                                              variables=variables).rows}
  assert ran(model) == {"<root>": "-", "layers_0": "float16", "layers_1": "float16"}
  assert ran(wider) == {"<root>": "-", "layers_0": "float16", "layers_1": "float32"}
  np.testing.assert_array_equal(
      wider.apply(variables, x),
      jaxmp.linen.mixed_precision(model.model, rules).apply(variables, x))
  with pytest.raises(TypeError, match=r"got Rule\(match='layers_1'"):
    model.with_rules(jaxmp.Rule("layers_1", "float32"))


class _Mlp(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name="head")(nn.relu(nn.Dense(4, name="hidden")(x)))


def test_with_rules_refuses_to_change_how_params_are_stored():
  # As NNX's with_rules: the params stay as init stored them, so rules that store one
  # in another dtype are refused, naming it, rather than ignored.
  model = jaxmp.linen.mixed_precision(_Mlp(), BF16)
  x = jnp.ones((4, 3))
  model.with_rules(jaxmp.PolicyRules("bfloat16"))  # nothing stored yet: nothing to keep
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"'head/(bias|kernel)' is stored in float32, but the "
                     r"new rules store it in bfloat16.*init a wrapper with these rules"):
    model.with_rules(jaxmp.PolicyRules("bfloat16"))
  with pytest.raises(ValueError, match=r"'hidden/(bias|kernel)' is stored in float32"):
    model.with_rules(jaxmp.PolicyRules(BF16, [jaxmp.Rule("hidden", "bfloat16")]))
  # Another compute dtype, or a param-free module's param dtype, stores nothing anew.
  wider = model.with_rules(jaxmp.PolicyRules(BF16, [jaxmp.Rule("head", "float32"),
                                                   jaxmp.Rule("", "bfloat16")]))
  assert wider.apply(variables, x).dtype == jnp.float32
  # The wrapper with_rules made knows what init stored, too.
  with pytest.raises(ValueError, match="'head/(bias|kernel)' is stored in float32"):
    wider.with_rules(jaxmp.PolicyRules("bfloat16"))


def test_a_wrapper_that_does_not_trace_refuses_the_probe_naming_the_fix():
  tracing = jaxmp.linen.mixed_precision(_Mlp(), jaxmp.PolicyRules(BF16, trace_nonfinite=True))
  x = jnp.ones((4, 3))
  variables = tracing.init(jax.random.key(0), x)
  plain = tracing.with_rules(jaxmp.PolicyRules(BF16))
  with pytest.raises(ValueError, match=r"does not trace non-finite values.*'jaxmp_nonfinite' "
                     r"collection.*Drop it.*trace_nonfinite=True"):
    plain.apply(variables, x)
  without = {k: v for k, v in variables.items() if k != jaxmp.linen.NONFINITE_COLLECTION}
  np.testing.assert_array_equal(plain.apply(without, x), tracing.apply(variables, x))


class _OwnCacheDecoder(nn.Module):
  """A decoder step that keeps its key cache in a collection of its own ('kv')."""

  @nn.compact
  def __call__(self, x):
    k = nn.Dense(4, name="key")(x)
    initialized = self.has_variable("kv", "k")  # as Flax's decoders: no update in init
    cached = self.variable("kv", "k", jnp.zeros, (2, 3, 4), jnp.float32)
    if initialized:
      cached.value = jax.lax.dynamic_update_slice(cached.value, k[:, None], (0, 0, 0))
    return k


def test_an_in_place_update_of_state_jaxmp_does_not_cast_names_the_state_and_the_fix():
  model = jaxmp.linen.mixed_precision(_OwnCacheDecoder(), BF16)
  x = jnp.ones((2, 4))
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(TypeError, match=r"dynamic_update_slice requires arguments to have the "
                     r"same dtypes.*'kv/k' \(float32\).*'cache' collection") as info:
    model.apply(variables, x, mutable=["kv"])
  assert "batch_stats" not in str(info.value) and "params" not in str(info.value)
  assert "same dtypes" in str(info.value.__cause__)
