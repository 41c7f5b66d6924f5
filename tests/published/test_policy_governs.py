"""The policy governs published models, and the summary reports what actually ran.

Every test runs on the models of :mod:`tests.published.models`: Flax's own published
code, copied verbatim, with their published configs (several set ``dtype=float32``),
shrunk to tiny sizes. What is checked is the traced computation (the jaxpr), not what
the rules say should run.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
from jaxmp._src.tools import summary as summary_lib
from tests.published import matmuls
from tests.published import models as registry

BF16 = "params=float32,compute=bfloat16,output=float32"
F16 = "params=float32,compute=float16,output=float32"
ENTRIES = registry.MODELS
IDS = [e.name for e in ENTRIES]
FP8_LAYERS = {"linen": (nn.Dense, nn.DenseGeneral, nn.Einsum),
              "nnx": (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)}


def _wrap(entry, model, rules):
  if rules is None:
    return model
  if entry.framework == "linen":
    return jaxmp.linen.mixed_precision(model, rules)
  return jaxmp.nnx.mixed_precision(model, rules)


def _batch(entry):
  return entry.batch(jax.random.key(1))


def _init(entry, model, key, batch):
  return entry.init(model, key, batch)


def _abstract_init(entry, model, key, batch):
  # Shapes only: what tracing a forward needs, at no cost.
  return jax.eval_shape(lambda key: entry.init(model, key, batch), key)


def _forward_fn(entry, rules, mode):
  """(f(arg) -> logits, arg) for the model's forward in ``mode``, wrapped by ``rules``."""
  key, batch = jax.random.key(0), _batch(entry)
  if entry.framework == "linen":
    model = _wrap(entry, entry.module("train" if mode == "train" else "eval"), rules)
    variables = _abstract_init(entry, model, key, batch)
    return (lambda v: entry.forward(model, v, batch, mode, key)[0]), variables
  model = _wrap(entry, entry.module(nnx.Rngs(0)), rules)
  graphdef, state = nnx.split(model)
  return (lambda s: entry.forward(nnx.merge(graphdef, s), batch, mode, key)), state


def _jaxpr(entry, rules, mode="train"):
  fn, arg = _forward_fn(entry, rules, mode)
  return jax.make_jaxpr(fn)(arg)


@functools.cache
def _total_matmuls(name):
  return sum(matmuls.count_matmuls(_jaxpr(registry.BY_NAME[name], None)).values())


# ---- every matmul in the compute dtype ------------------------------------------------


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
@pytest.mark.parametrize("policy, dtype", [(BF16, "bfloat16"), (F16, "float16")])
def test_every_matmul_runs_in_the_compute_dtype(entry, policy, dtype):
  counts = matmuls.count_matmuls(_jaxpr(entry, policy))
  assert counts == {dtype: _total_matmuls(entry.name)}, matmuls.describe_matmuls(
      _jaxpr(entry, policy))


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.config_dtype == "float32"],
                         ids=[e.name for e in ENTRIES if e.config_dtype == "float32"])
def test_model_dtypes_switch_lets_the_config_win(entry):
  # The opt-in switch: the model's own dtype fields decide, so a float32 config runs
  # its layers in float32 again (the behaviour before the policy governed).
  rules = jaxmp.PolicyRules(BF16, module_dtypes="model")
  counts = matmuls.count_matmuls(_jaxpr(entry, rules))
  assert counts["float32"] >= _total_matmuls(entry.name) // 2


def _summary(entry, rules):
  """The precision summary of the model's eval forward, and that forward's jaxpr."""
  key, batch = jax.random.key(0), _batch(entry)
  if entry.framework == "linen":
    model = _wrap(entry, entry.module("eval"), rules)
    variables = _abstract_init(entry, model, key, batch)
    kwargs = {"train": False} if entry.name == "imagenet_resnet18" else {}
    summary = jaxmp.tools.summary(model, None, *batch.inputs, variables=variables, **kwargs)
    return summary, _jaxpr(entry, rules, "eval")
  model = _wrap(entry, entry.module(nnx.Rngs(0)), rules)
  model.eval()
  args = batch.inputs
  if entry.name == "gemma3_transformer":
    from tests.published.flax_gemma import transformer  # pylint: disable=g-import-not-at-top
    tokens = batch.inputs[0]
    mask = tokens != 0
    args = (tokens, transformer.build_positions_from_mask(mask), None,
            transformer.make_causal_attn_mask(mask))
  elif entry.name == "mnist_cnn":
    args = (batch.inputs[0], None)
  return jaxmp.tools.summary(model, None, *args), _jaxpr(entry, rules, "eval")


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_summary_reports_what_the_jaxpr_ran(entry):
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no module computes off-policy: no warning
    summary, jaxpr = _summary(entry, BF16)
  assert not summary.mismatches
  # Every matmul of the traced forward is attributed to exactly one module call.
  assert sum(r.matmuls for r in summary.rows) == sum(matmuls.count_matmuls(jaxpr).values())
  for row in summary.rows:
    if row.matmuls:
      assert row.ran == row.compute_dtype == "bfloat16", row


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_a_rule_keeps_one_layer_wider(entry):
  summary, _ = _summary(entry, BF16)
  # The last module with matmuls of its own (the output layer in every model here).
  target = [r for r in summary.rows if r.matmuls][-1]
  path = "" if target.path == "<root>" else target.path
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule(path, "float32")])
  summary, jaxpr = _summary(entry, rules)
  counts = matmuls.count_matmuls(jaxpr)
  wide = [r for r in summary.rows if r.path == target.path]  # every method of that module
  assert all(r.compute_dtype == "float32" and r.ran in ("float32", "-") for r in wide)
  assert counts["float32"] == sum(r.matmuls for r in wide)
  assert counts["float32"] + counts["bfloat16"] == sum(counts.values())
  assert not summary.mismatches


def test_summary_flags_a_module_whose_code_fixes_its_dtype():
  # A module with no dtype field that computes in float32 whatever it is given: the
  # wrapper cannot change it, and the summary says so (and warns with the path).

  class Fixed(nn.Module):

    @nn.compact
    def __call__(self, x):
      kernel = self.param("kernel", nn.initializers.ones, (x.shape[-1], 2))
      return x.astype(jnp.float32) @ kernel.astype(jnp.float32)

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return Fixed(name="fixed")(nn.Dense(3, name="dense")(x))

  with pytest.warns(UserWarning, match=r"fixed \(Fixed\): ran float32, resolved compute "
                                       r"bfloat16"):
    summary = jaxmp.tools.summary(Net(), BF16, jnp.ones((1, 4)))
  rows = {r.path: r for r in summary.rows}
  assert rows["fixed"].mismatch and rows["fixed"].ran == "float32"
  assert not rows["dense"].mismatch and rows["dense"].ran == "bfloat16"
  assert "float32 !" in str(summary)
  # Saying so with a rule makes the summary agree.
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule("fixed", "float32")])
  assert not jaxmp.tools.summary(Net(), rules, jnp.ones((1, 4))).mismatches


# ---- the float32 op list ---------------------------------------------------------------


def _exp_dtypes(jaxpr):
  found = collections.Counter()

  def walk(jaxpr):
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
      if eqn.primitive.name == "exp":
        found[np.dtype(eqn.invars[0].aval.dtype).name] += 1
      for sub in summary_lib.sub_jaxprs_that_run(eqn, summary_lib.lowering_platform()):
        walk(sub)

  walk(jaxpr)
  return found


ATTENTION = [registry.BY_NAME[n] for n in ("lm1b_transformer_lm", "wmt_transformer",
                                            "gemma3_transformer")]


@pytest.mark.parametrize("entry", ATTENTION, ids=[e.name for e in ATTENTION])
def test_attention_softmax_computes_in_float32(entry):
  exps = _exp_dtypes(_jaxpr(entry, F16))
  assert exps and set(exps) == {"float32"}, exps
  # A rule turns the list off for the whole model: the softmax runs in float16.
  off = jaxmp.PolicyRules(F16, float32_ops=())
  assert set(_exp_dtypes(_jaxpr(entry, off))) == {"float16"}


def test_a_rule_turns_the_list_off_for_its_modules():
  entry = registry.BY_NAME["lm1b_transformer_lm"]
  rules = jaxmp.PolicyRules(F16, [jaxmp.Rule(nn.MultiHeadDotProductAttention,
                                             float32_ops=())])
  assert set(_exp_dtypes(_jaxpr(entry, rules))) == {"float16"}
  # ... and adds it back where the model-wide list is off.
  rules = jaxmp.PolicyRules(F16, [jaxmp.Rule(nn.MultiHeadDotProductAttention,
                                             float32_ops=("softmax",))], float32_ops=())
  assert set(_exp_dtypes(_jaxpr(entry, rules))) == {"float32"}


# ---- gradients and training ---------------------------------------------------------------


def _grads(entry, rules):
  """The gradient leaves of the loss w.r.t. the params, eval mode, jitted."""
  key, batch = jax.random.key(0), _batch(entry)
  if entry.framework == "linen":
    model = _wrap(entry, entry.module("eval"), rules)
    variables = _init(entry, model, key, batch)

    def loss(params):
      logits, _ = entry.forward(model, {**variables, "params": params}, batch, "eval", key)
      return entry.loss(logits, batch.targets)

    return jax.tree.leaves(jax.jit(jax.grad(loss))(variables["params"]))
  model = _wrap(entry, entry.module(nnx.Rngs(0)), rules)
  loss = lambda model: entry.loss(entry.forward(model, batch, "eval", key), batch.targets)
  # NNX's own transforms: the scanned model's layers must be split at its trace level.
  return jax.tree.leaves(nnx.jit(nnx.grad(loss))(model))


# Slow: compiles each published model's forward and backward twice (float32, bfloat16); the
# jaxpr checks above cover the policy in `make test-fast`.
@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_gradients_are_float32_and_match_float32s(entry):
  reference = _grads(entry, None)
  mixed = _grads(entry, BF16)
  assert {x.dtype for x in mixed} == {jnp.dtype(jnp.float32)}
  a = jnp.concatenate([x.ravel() for x in reference])
  b = jnp.concatenate([x.ravel() for x in mixed])
  cosine = float(a @ b / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))
  assert cosine > 0.99


STEPS = 30
LR = 5e-4


def _linen_losses(entry, rules, loss_scale, steps):
  key, batch = jax.random.key(0), _batch(entry)
  model = _wrap(entry, entry.module("train"), rules)
  tx = jaxmp.loss_scaling(optax.adam(LR), loss_scale)
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                        variables=_init(entry, model, key, batch), tx=tx)

  @jax.jit
  def step(state, key):
    def loss_fn(variables):
      logits, updates = entry.forward(model, variables, batch, "train", key)
      return entry.loss(logits, batch.targets), updates

    (loss, updates), grads = state.value_and_grad(loss_fn, has_aux=True)()
    state = state.apply_gradients(grads, collections={**state.collections, **updates})
    return state, loss, jaxmp.loss_scaling_metrics(state.opt_state)["last_step_finite"]

  current = [state]

  def advance(i):
    out = step(current[0], jax.random.key(100 + i))
    current[0] = out[0]
    return out

  return _applied_losses(advance, steps, lambda out: out[0])


def _nnx_losses(entry, rules, loss_scale, steps):
  batch = _batch(entry)
  model = _wrap(entry, entry.module(nnx.Rngs(0)), rules)
  optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(optax.adam(LR), loss_scale),
                            wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, key):
    loss_fn = lambda model: entry.loss(entry.forward(model, batch, "train", key), batch.targets)
    loss, grads = jaxmp.nnx.value_and_grad(loss_fn)(
        model, loss_scale=jaxmp.get_loss_scale(optimizer.opt_state))
    jaxmp.nnx.apply_gradients(optimizer, model, grads)
    return model, loss, jaxmp.loss_scaling_metrics(optimizer.opt_state)["last_step_finite"]

  return _applied_losses(lambda i: step(model, optimizer, jax.random.key(100 + i)), steps,
                         lambda out: model)


def _applied_losses(step, steps, state_of):
  """Runs ``step(i)`` until ``steps`` steps were applied; their losses and the state.

  A dynamic loss scale starts high (2**15) and skips the steps whose scaled
  gradients overflow float16 until it has backed off; those steps change nothing, so
  runs are compared after the same number of applied steps.
  """
  losses, calls, state = [], 0, None
  while len(losses) < steps and calls < 2 * steps:
    out = step(calls)
    state, calls = state_of(out), calls + 1
    if bool(out[2]):
      losses.append(float(out[1]))
  return losses, state


def _train(entry, rules, loss_scale=None, steps=STEPS):
  """Per-step training losses and the trained state (linen TrainState / NNX model)."""
  loss_scale = jaxmp.NoOpLossScale() if loss_scale is None else loss_scale
  if entry.framework == "linen":
    return _linen_losses(entry, rules, loss_scale, steps)
  return _nnx_losses(entry, rules, loss_scale, steps)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_training_tracks_float32(entry):
  """30 applied steps in each precision end within 5% of float32's loss.

  The final loss is the mean of the last 5 steps. Where float32 drives the loss of
  these tiny batches near zero (the CNN memorizes its two images), 5% of a near-zero
  number says nothing, so the bar is 5% of the larger of float32's final loss and
  the loss float32 removed.
  """
  fp8 = jaxmp.PolicyRules(BF16, [jaxmp.Rule(FP8_LAYERS[entry.framework],
                                            fp8=jaxmp.fp8.DelayedScaling(16))])
  reference, _ = _train(entry, None)
  final = np.mean(reference[-5:])
  assert final < 0.9 * reference[0]  # it learns
  bar = 0.05 * max(final, reference[0] - final)
  runs = {"bfloat16": (BF16, None), "float16 + loss scaling": (F16, jaxmp.DynamicLossScale()),
          "bfloat16 + fp8": (fp8, None)}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # fp8 rule matching no layer (ResNet)
    for name, (rules, loss_scale) in runs.items():
      losses, _ = _train(entry, rules, loss_scale)
      assert len(losses) == STEPS, name
      assert abs(np.mean(losses[-5:]) - final) < bar, (name, losses[-5:], reference[-5:])


# ---- the models' own surfaces -------------------------------------------------------------


DROPOUT = [e for e in ENTRIES if registry.DROPOUT in e.surfaces and e.name != "scan_mlp"]


@pytest.mark.parametrize("entry", DROPOUT, ids=[e.name for e in DROPOUT])
def test_dropout_flag(entry):
  batch = _batch(entry)
  if entry.framework == "linen":
    model = jaxmp.linen.mixed_precision(entry.module("train"), BF16)
    variables = _init(entry, model, jax.random.key(0), batch)
    out = lambda key: entry.forward(model, variables, batch, "train", key)[0]
    evaluate = jaxmp.linen.mixed_precision(entry.module("eval"), BF16)
    det = lambda key: entry.forward(evaluate, variables, batch, "eval", key)[0]
  else:
    model = jaxmp.nnx.mixed_precision(entry.module(nnx.Rngs(0)), BF16)
    out = lambda key: entry.forward(model, batch, "train", key)
    det = lambda key: entry.forward(model, batch, "eval", key)
  assert not np.array_equal(out(jax.random.key(1)), out(jax.random.key(2)))
  np.testing.assert_array_equal(det(jax.random.key(1)), det(jax.random.key(2)))


STATS = [e for e in ENTRIES if registry.BATCH_STATS in e.surfaces]


@pytest.mark.slow  # compiles and runs a published model's train step
@pytest.mark.parametrize("entry", STATS, ids=[e.name for e in STATS])
def test_batch_statistics_update_in_float32(entry):
  def stats(obj):
    if entry.framework == "linen":
      return jax.tree.leaves(obj.collections["batch_stats"])
    return jax.tree.leaves(nnx.state(obj, nnx.BatchStat))

  _, trained = _train(entry, BF16, steps=2)
  leaves = stats(trained)
  assert leaves and {x.dtype for x in leaves} == {jnp.dtype(jnp.float32)}
  if entry.framework == "linen":
    variables = _init(entry, entry.module("train"), jax.random.key(0), _batch(entry))
    initial = jax.tree.leaves(variables["batch_stats"])
  else:
    initial = stats(entry.module(nnx.Rngs(0)))
  assert any(not np.array_equal(a, b) for a, b in zip(leaves, initial))


def test_linen_decode_cache_and_method():
  for name in ("lm1b_transformer_lm", "wmt_transformer"):
    entry = registry.BY_NAME[name]
    key, batch = jax.random.key(0), _batch(entry)
    plain = entry.module("decode")
    wrapped = jaxmp.linen.mixed_precision(plain, BF16)
    variables = _init(entry, wrapped, key, batch)
    cache = entry.decode.init_cache(wrapped, key, batch)
    # The cache is created by layers computing in bfloat16, so it holds bfloat16.
    assert {x.dtype for x in jax.tree.leaves(cache) if jnp.issubdtype(x.dtype, jnp.floating)
            } == {jnp.dtype(jnp.bfloat16)}
    step = jax.jit(lambda v, c: entry.decode.step(wrapped, v, c, batch))
    reference = jax.jit(lambda v, c: entry.decode.step(plain, v, c, batch))
    ref_cache = entry.decode.init_cache(plain, key, batch)
    for _ in range(3):
      logits, cache = step(variables, cache)
      ref_logits, ref_cache = reference(variables, ref_cache)
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
    a, b = logits.ravel(), ref_logits.ravel()
    assert float(a @ b / (jnp.linalg.norm(a) * jnp.linalg.norm(b))) > 0.99


@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float32])
def test_nnx_kv_cache_comes_back_in_its_own_dtype_through_a_scan(cache_dtype):
  entry = registry.BY_NAME["gemma3_transformer"]
  batch = _batch(entry)
  model = jaxmp.nnx.mixed_precision(entry.module(nnx.Rngs(0)), BF16)
  cache = jax.tree.map(
      lambda x: x.astype(cache_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
      entry.decode.init_cache(model.model, batch))
  graphdef, state = nnx.split(model)

  def decode(state, cache):
    def body(cache, _):
      logits, cache = entry.decode.step(nnx.merge(graphdef, state), cache, batch)
      return cache, logits

    return jax.lax.scan(body, cache, None, length=3)

  cache, logits = jax.jit(decode)(state, cache)
  assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
  for leaf, reference in zip(jax.tree.leaves(cache),
                             jax.tree.leaves(entry.decode.init_cache(model.model, batch))):
    expected = cache_dtype if jnp.issubdtype(reference.dtype, jnp.floating) else reference.dtype
    assert leaf.dtype == expected


# ---- caches written in place ------------------------------------------------------------
# A decoder that writes its KV cache in place (linen: `cached_key.value = ...` in the
# `cache` collection; NNX: `self.cached_key[...] = ...` on nnx.Cache variables) updates
# it with `lax.dynamic_update_slice(cache, key, ...)`, which needs one dtype. A cache
# built float32 by the model's own code (the unwrapped model's init, NNX init_cache's
# default) is read in the module's compute dtype and written back in its own dtype.


def _floats(tree):
  return {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


@pytest.mark.parametrize("name", ["lm1b_transformer_lm", "wmt_transformer"])
def test_linen_decoder_writing_a_float32_cache_in_place(name):
  entry = registry.BY_NAME[name]
  key, batch = jax.random.key(0), _batch(entry)
  plain = entry.module("decode")
  wrapped = jaxmp.linen.mixed_precision(plain, BF16)
  variables = _init(entry, wrapped, key, batch)
  cache = entry.decode.init_cache(plain, key, batch)  # built by the unwrapped model
  assert _floats(cache) == {jnp.dtype(jnp.float32)}
  # The same published model configured for bfloat16 (its own cache is bfloat16).
  bf16 = type(plain)(dataclasses.replace(plain.config, dtype=jnp.bfloat16))
  ref_cache = entry.decode.init_cache(bf16, key, batch)
  step = jax.jit(lambda v, c: entry.decode.step(wrapped, v, c, batch))
  reference = jax.jit(lambda v, c: entry.decode.step(bf16, v, c, batch))
  for _ in range(3):
    logits, cache = step(variables, cache)
    ref_logits, ref_cache = reference(variables, ref_cache)
  assert _floats(cache) == {jnp.dtype(jnp.float32)}
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, ref_logits.astype(jnp.float32), rtol=0.05, atol=0.05)
  for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache)):
    np.testing.assert_allclose(a, b.astype(a.dtype), rtol=0.05, atol=0.05)
  jaxpr = jax.make_jaxpr(lambda v, c: entry.decode.step(wrapped, v, c, batch))(variables, cache)
  assert set(matmuls.count_matmuls(jaxpr)) == {"bfloat16"}, matmuls.describe_matmuls(jaxpr)


def _attention(**kwargs):
  # Flax's own nnx.MultiHeadAttention in decode mode, as its init_cache docstring uses it.
  return nnx.MultiHeadAttention(num_heads=registry.HEADS, in_features=registry.WIDTH,
                                decode=True, rngs=nnx.Rngs(0), **kwargs)


def test_nnx_attention_writing_its_float32_cache_in_place():
  shape = (registry.BATCH, registry.SEQ, registry.WIDTH)
  tokens = jax.random.normal(jax.random.key(1), shape)
  model = _attention()
  model.init_cache(shape)  # float32: init_cache's default dtype
  wrapped = jaxmp.nnx.mixed_precision(model, BF16)
  reference = _attention(dtype=jnp.bfloat16)  # the same params, computing in bfloat16
  reference.init_cache(shape, dtype=jnp.bfloat16)
  step = nnx.jit(lambda m, x: m(x))
  for t in range(3):
    out = step(wrapped, tokens[:, t:t + 1])
    ref = step(reference, tokens[:, t:t + 1])
  for name in ("cached_key", "cached_value"):
    assert getattr(model, name)[...].dtype == jnp.float32
    # The projections ran in bfloat16 exactly as the reference's: the float32 cache
    # holds the reference's bfloat16 cache exactly.
    np.testing.assert_array_equal(getattr(model, name)[...],
                                  getattr(reference, name)[...].astype(jnp.float32))
  assert int(model.cache_index[...]) == 3
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref.astype(jnp.float32), rtol=0.02, atol=0.02)
  graphdef, state = nnx.split(wrapped)
  jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens[:, :1]))(state)
  assert matmuls.count_matmuls(jaxpr) == {"bfloat16": 6}, matmuls.describe_matmuls(jaxpr)


def test_nnx_bfloat16_cache_stays_bfloat16_under_a_float32_policy():
  shape = (registry.BATCH, registry.SEQ, registry.WIDTH)
  model = _attention()
  model.init_cache(shape, dtype=jnp.bfloat16)
  wrapped = jaxmp.nnx.mixed_precision(model, "float32")
  x = jax.random.normal(jax.random.key(1), shape)[:, :1]
  wrapped(x)
  assert model.cached_key[...].dtype == model.cached_value[...].dtype == jnp.bfloat16
  # What was written is the float32 key projection, rounded once to the cache's dtype.
  np.testing.assert_array_equal(model.cached_key[...][:, :1],
                                model.key(x).astype(jnp.bfloat16))


def test_keras_mixed_names_hand_back_float32_logits():
  entry = registry.BY_NAME["lm1b_transformer_lm"]
  for name, dtype in (("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")):
    jaxpr = _jaxpr(entry, name, "eval")
    assert jaxpr.out_avals[0].dtype == jnp.float32
    assert matmuls.count_matmuls(jaxpr) == {dtype: _total_matmuls(entry.name)}
