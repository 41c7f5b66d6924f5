"""Loss scales: exact trajectories (torch, Keras, jmp), bounds, pytree round trips, bad input."""

import copy
import math
import pickle
import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jaxmp

# REFERENCE.md: init 2**15, growth_interval 3, overflow flags -> scale after each step.
REF_OVERFLOWS = (1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0)
REF_SCALES = (16384, 8192, 8192, 8192, 16384, 16384, 16384, 32768, 16384, 16384, 16384,
              32768, 32768)


def _trajectory(ls, overflows):
  scales, counters = [], []
  for overflow in overflows:
    ls = ls.adjust(not overflow)
    scales.append(float(ls.loss_scale))
    counters.append(int(ls.counter))
  return scales, counters


def torch_grad_scaler(scale, overflows, growth_interval, growth_factor, backoff_factor):
  """torch.amp.GradScaler's update rule (REFERENCE.md), transcribed, in float32."""
  scale = np.float32(scale)
  growth, backoff = np.float32(growth_factor), np.float32(backoff_factor)
  tracker, out = 0, []
  with np.errstate(over="ignore"):
    for found_inf in overflows:
      if found_inf:
        scale = np.float32(scale * backoff)
        tracker = 0
      else:
        tracker += 1
        if tracker == growth_interval:
          grown = np.float32(scale * growth)
          if np.isfinite(grown):
            scale = grown
          tracker = 0
      out.append(float(scale))
  return out


def keras3_loss_scale_optimizer(scale, overflows, growth_steps):
  """Keras 3 LossScaleOptimizer: halve on overflow, double when counter == steps - 1."""
  scale, counter, out = np.float32(scale), 0, []
  for overflow in overflows:
    if overflow:
      scale, counter = np.float32(scale / 2), 0
    elif counter == growth_steps - 1:
      scale, counter = np.float32(scale * 2), 0
    else:
      counter += 1
    out.append(float(scale))
  return out


def tf_keras_dynamic_loss_scale(scale, overflows, growth_steps):
  """tf.keras DynamicLossScale: like Keras 3, but the scale never drops below 1."""
  scale, counter, out = np.float32(scale), 0, []
  for overflow in overflows:
    if overflow:
      scale, counter = np.float32(max(scale / 2, 1.0)), 0
    else:
      counter += 1
      if counter >= growth_steps:
        grown = np.float32(scale * 2)
        scale, counter = (grown if np.isfinite(grown) else scale), 0
    out.append(float(scale))
  return out


# --------------------------------------------------------------------------------------
# The dynamic rule.


def test_reference_trace_eager():
  ls = jaxmp.DynamicLossScale(scale=2**15, growth_interval=3)
  scales, counters = _trajectory(ls, REF_OVERFLOWS)
  assert scales == list(REF_SCALES)
  assert counters == [0, 0, 1, 2, 0, 1, 2, 0, 0, 1, 2, 0, 1]


def test_reference_trace_in_jitted_scan():
  def body(ls, overflow):
    ls = ls.adjust(jnp.logical_not(overflow))
    return ls, ls.loss_scale

  ls = jaxmp.DynamicLossScale(scale=2**15, growth_interval=3)
  final, scales = jax.jit(lambda ls, f: jax.lax.scan(body, ls, f))(
      ls, jnp.array(REF_OVERFLOWS, bool))
  np.testing.assert_array_equal(scales, np.array(REF_SCALES, np.float32))
  assert scales.dtype == jnp.float32
  assert final.growth_interval == 3 and final.min_scale == 1.0


def test_reference_trace_matches_torch_keras_and_jmp():
  n = len(REF_OVERFLOWS)
  assert torch_grad_scaler(2**15, REF_OVERFLOWS, 3, 2.0, 0.5) == list(REF_SCALES)
  assert keras3_loss_scale_optimizer(2**15, REF_OVERFLOWS, 3) == list(REF_SCALES)
  jmp_ls = jmp.DynamicLossScale(jnp.float32(2**15), period=3)
  jmp_scales = []
  for overflow in REF_OVERFLOWS:
    jmp_ls = jmp_ls.adjust(jnp.asarray(not overflow))
    jmp_scales.append(float(jmp_ls.loss_scale))
  assert jmp_scales == list(REF_SCALES) and len(jmp_scales) == n


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(
    overflows=st.lists(st.booleans(), min_size=1, max_size=40),
    growth_interval=st.integers(1, 5),
    log2_scale=st.integers(-20, 127),
    growth_factor=st.sampled_from([2.0, 1.5, 4.0, 1.25, 3.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.75, 0.125]),
)
def test_matches_torch_for_any_overflow_sequence(overflows, growth_interval, log2_scale,
                                                growth_factor, backoff_factor):
  # min_scale=0, max_scale=inf: torch's rule with no bounds. Scales start between
  # 2**-20 and 2**127 (growth past float32 is suppressed, as in torch) and stay normal
  # float32 numbers: XLA flushes subnormals to zero, numpy does not.
  ls = jaxmp.DynamicLossScale(scale=2.0**log2_scale, growth_interval=growth_interval,
                              growth_factor=growth_factor, backoff_factor=backoff_factor,
                              min_scale=0.0, max_scale=float("inf"))
  scales, _ = _trajectory(ls, overflows)
  assert scales == torch_grad_scaler(2.0**log2_scale, overflows, growth_interval,
                                     growth_factor, backoff_factor)


@hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
@hypothesis.given(overflows=st.lists(st.booleans(), min_size=1, max_size=40),
                  growth_interval=st.integers(1, 4), log2_scale=st.integers(0, 20))
def test_matches_keras3_tf_keras_and_jmp(overflows, growth_interval, log2_scale):
  scale = 2.0**log2_scale
  unbounded = jaxmp.DynamicLossScale(scale, growth_interval, min_scale=0.0,
                                     max_scale=float("inf"))
  assert _trajectory(unbounded, overflows)[0] == keras3_loss_scale_optimizer(
      scale, overflows, growth_interval)
  floored = jaxmp.DynamicLossScale(scale, growth_interval, max_scale=float("inf"))
  ours = _trajectory(floored, overflows)[0]
  assert ours == tf_keras_dynamic_loss_scale(scale, overflows, growth_interval)
  jmp_ls = jmp.DynamicLossScale(jnp.float32(scale), period=growth_interval)
  theirs = []
  for overflow in overflows:
    jmp_ls = jmp_ls.adjust(jnp.asarray(not overflow))
    theirs.append(float(jmp_ls.loss_scale))
  assert ours == theirs


def test_backoff_is_clamped_at_min_scale():
  ls = jaxmp.DynamicLossScale(scale=4.0, min_scale=1.0)
  assert _trajectory(ls, [1, 1, 1, 1])[0] == [2.0, 1.0, 1.0, 1.0]
  ls = jaxmp.DynamicLossScale(scale=6.0, min_scale=2.5)
  assert _trajectory(ls, [1, 1, 1])[0] == [3.0, 2.5, 2.5]


def test_growth_is_clamped_at_max_scale():
  ls = jaxmp.DynamicLossScale(scale=4.0, growth_interval=1, max_scale=16.0)
  assert _trajectory(ls, [0, 0, 0, 0]) == ([8.0, 16.0, 16.0, 16.0], [0, 0, 0, 0])
  ls = jaxmp.DynamicLossScale(scale=3.0, growth_interval=2, max_scale=10.0)
  assert _trajectory(ls, [0, 0, 0, 0, 0, 0])[0] == [3.0, 6.0, 6.0, 10.0, 10.0, 10.0]
  # At the bound the counter still resets every growth_interval steps.
  assert _trajectory(ls, [0] * 5)[1] == [1, 0, 1, 0, 1]


def _restored(target, scale, counter=0):
  """``target`` holding a checkpoint's leaves, rebuilt as Orbax and jit rebuild it (no
  constructor, so no bounds check): the hyperparameters are the target's."""
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target),
                                      [jnp.float32(scale), jnp.int32(counter)])


def test_an_overflow_never_raises_a_restored_scale_below_min_scale():
  # A 2**15 checkpoint restored into min_scale=2**20: overflows keep it (backing off
  # must not raise it to the floor), the first finite step lifts it into the bounds.
  restored = _restored(jaxmp.DynamicLossScale(2.0**21, growth_interval=3, min_scale=2.0**20),
                       2.0**15)
  assert _trajectory(restored, [1, 1, 0, 1, 0, 0, 0]) == (
      [2.0**15, 2.0**15, 2.0**20, 2.0**20, 2.0**20, 2.0**20, 2.0**21], [0, 0, 1, 0, 1, 2, 0])
  # jmp's rule (max(min_loss_scale, scale / 2)) raises it to the floor on the overflow.
  jmp_ls = jmp.DynamicLossScale(jnp.float32(2.0**15), min_loss_scale=jnp.float32(2.0**20))
  assert float(jmp_ls.adjust(jnp.asarray(False)).loss_scale) == 2.0**20


def test_a_restored_scale_above_max_scale_comes_down_at_the_next_step():
  target = jaxmp.DynamicLossScale(8.0, growth_interval=2, max_scale=16.0)
  assert _trajectory(_restored(target, 64.0), [1, 0, 0]) == ([16.0, 16.0, 16.0], [0, 1, 0])
  assert _trajectory(_restored(target, 64.0), [0, 0, 1]) == ([16.0, 16.0, 8.0], [1, 0, 0])
  # A restored counter at or past the target's interval grows at the next finite step.
  assert _trajectory(_restored(target, 4.0, counter=5), [0]) == ([8.0], [0])


def test_growth_that_would_overflow_float32_is_suppressed_and_counter_resets():
  ls = jaxmp.DynamicLossScale(scale=2.0**127, growth_interval=2, min_scale=0.0,
                              max_scale=float("inf"))
  scales, counters = _trajectory(ls, [0, 0, 0, 0])
  assert scales == [2.0**127] * 4
  assert counters == [1, 0, 1, 0]


def test_default_hyperparameters():
  ls = jaxmp.DynamicLossScale()
  assert float(ls.loss_scale) == 2.0**15 and int(ls.counter) == 0
  assert (ls.growth_interval, ls.growth_factor, ls.backoff_factor, ls.min_scale,
          ls.max_scale) == (2000, 2.0, 0.5, 1.0, 2.0**24)
  assert ls.loss_scale.dtype == jnp.float32 and ls.counter.dtype == jnp.int32


def test_grows_on_the_growth_interval_th_finite_step():
  ls = jaxmp.DynamicLossScale(scale=1.0, growth_interval=2000)
  step = jax.jit(lambda ls: ls.adjust(True))
  for _ in range(1999):
    ls = step(ls)
  assert float(ls.loss_scale) == 1.0 and int(ls.counter) == 1999
  ls = step(ls)
  assert float(ls.loss_scale) == 2.0 and int(ls.counter) == 0


@pytest.mark.parametrize("scale", [jnp.float16(1024), np.float16(1024), 1024.0, 1024,
                                   np.int32(1024), jnp.bfloat16(1024), jnp.array(1024.0)])
def test_any_real_scale_argument_works(scale):
  for ls in (jaxmp.DynamicLossScale(scale, growth_interval=1), jaxmp.StaticLossScale(scale)):
    assert ls.loss_scale.dtype == jnp.float32
    assert float(ls.loss_scale) == 1024.0
  ls = jaxmp.DynamicLossScale(scale, growth_interval=1)
  assert float(ls.adjust(False).loss_scale) == 512.0
  assert float(ls.adjust(True).loss_scale) == 2048.0


def test_traced_scale_and_counter_are_accepted_inside_jit():
  @jax.jit
  def make(scale, counter):
    return jaxmp.DynamicLossScale(scale, growth_interval=2, counter=counter).adjust(True)

  ls = make(jnp.float16(8.0), jnp.int32(1))
  assert float(ls.loss_scale) == 16.0 and int(ls.counter) == 0


@pytest.mark.parametrize("bad", [-8.0, 0.0, math.nan, math.inf, -math.inf, 1e-40])
def test_an_invalid_traced_scale_becomes_nan_where_a_concrete_one_is_refused(bad):
  # jit cannot raise on a value; a NaN scale makes every gradient it scales non-finite.
  make = jax.jit(lambda s: (jaxmp.StaticLossScale(s).loss_scale,
                            jaxmp.DynamicLossScale(s, min_scale=0.0).loss_scale))
  assert all(math.isnan(float(x)) for x in make(jnp.float32(bad)))
  assert [float(x) for x in make(jnp.float32(8.0))] == [8.0, 8.0]
  ls = jax.jit(jaxmp.StaticLossScale)(jnp.float32(bad))
  assert math.isnan(float(ls.unscale(jnp.float32(1.0))))
  assert math.isnan(float(ls.adjust(False).loss_scale))


def test_a_traced_scale_or_counter_out_of_its_bounds_becomes_nan():
  make = jax.jit(lambda s, c: jaxmp.DynamicLossScale(
      s, growth_interval=2, min_scale=2.0, max_scale=64.0, counter=c))
  assert float(make(8.0, 1).loss_scale) == 8.0 and int(make(8.0, 1).counter) == 1
  for scale, counter in [(1.0, 0), (128.0, 0), (8.0, 2), (8.0, -1)]:
    ls = make(scale, counter)
    assert math.isnan(float(ls.loss_scale)), (scale, counter)
    # It stays NaN: backing off or growing a NaN gives NaN.
    assert math.isnan(float(ls.adjust(False).loss_scale))
    assert math.isnan(float(ls.adjust(True).adjust(True).loss_scale))


def test_adjust_under_vmap_with_a_batched_flag():
  ls = jaxmp.DynamicLossScale(8.0, growth_interval=1)
  out = jax.vmap(lambda f: ls.adjust(f))(jnp.array([True, False]))
  np.testing.assert_array_equal(out.loss_scale, [16.0, 4.0])
  assert out.growth_interval == 1


def test_noop_and_static_never_change():
  for ls in (jaxmp.NoOpLossScale(), jaxmp.StaticLossScale(128.0)):
    for finite in (True, False, jnp.array(False)):
      assert ls.adjust(finite) is ls
    assert float(jax.jit(lambda ls: ls.adjust(False))(ls).loss_scale) == float(ls.loss_scale)
  assert float(jaxmp.NoOpLossScale().loss_scale) == 1.0


# --------------------------------------------------------------------------------------
# scale / unscale.


def _grads():
  return {
      "f32": jnp.array([1.0, -2.0], jnp.float32),
      "f16": jnp.array([0.5, 3.0], jnp.float16),
      "bf16": jnp.array([0.25], jnp.bfloat16),
      "int": jnp.arange(3),
      "none": None,
      "py": 1.5,
  }


@pytest.mark.parametrize("ls", [jaxmp.StaticLossScale(2.0**10), jaxmp.DynamicLossScale(2.0**10)])
def test_scale_and_unscale_touch_float_leaves_only_and_keep_dtypes(ls):
  grads = _grads()
  scaled = ls.scale(grads)
  for name in ("f32", "f16", "bf16"):
    assert scaled[name].dtype == grads[name].dtype
    np.testing.assert_array_equal(np.asarray(scaled[name], np.float32),
                                  np.asarray(grads[name], np.float32) * 1024)
  assert scaled["int"] is grads["int"] and scaled["none"] is None
  # A Python float is a gradient too (issue 13): scaled, as a float32 scalar.
  assert scaled["py"].dtype == jnp.float32 and float(scaled["py"]) == 1.5 * 1024
  back = ls.unscale(scaled)
  assert float(back["py"]) == 1.5
  for name in ("f32", "f16", "bf16"):
    assert back[name].dtype == grads[name].dtype
    np.testing.assert_array_equal(back[name], grads[name])


def test_unscale_of_float16_grads_with_a_scale_above_float16_max_is_exact():
  # 2**24 is not a float16 number (max 65504) and 1/2**24 is float16's smallest
  # subnormal: unscaling must multiply in float32.
  ls = jaxmp.DynamicLossScale(2.0**24)
  scaled = jnp.array([60000.0, 2048.0, -3.0], jnp.float16)
  out = ls.unscale(scaled)
  assert out.dtype == jnp.float16
  expected = (np.asarray(scaled, np.float32) / np.float32(2**24)).astype(np.float16)
  np.testing.assert_array_equal(out, expected)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert out[0] != 0


def test_noop_scale_and_unscale_return_the_tree_itself():
  grads = _grads()
  assert jaxmp.NoOpLossScale().scale(grads) is grads
  assert jaxmp.NoOpLossScale().unscale(grads) is grads


# --------------------------------------------------------------------------------------
# value_and_grad.


def _loss(w, x):
  return jnp.sum((w * x) ** 2)


@pytest.mark.parametrize("ls", [jaxmp.StaticLossScale(8.0), jaxmp.DynamicLossScale(8.0),
                                jaxmp.NoOpLossScale()])
def test_value_and_grad_returns_unscaled_loss_and_scaled_grads(ls):
  w, x = jnp.array([1.0, 2.0]), jnp.array([3.0, 1.0])
  loss, grads = ls.value_and_grad(_loss)(w, x)
  ref_loss, ref_grads = jax.value_and_grad(_loss)(w, x)
  assert loss == ref_loss
  np.testing.assert_array_equal(grads, ref_grads * float(ls.loss_scale))
  np.testing.assert_array_equal(ls.unscale(grads), ref_grads)


def test_value_and_grad_has_aux_argnums_and_jit():
  ls = jaxmp.DynamicLossScale(4.0)

  def fun(w, x):
    return _loss(w, x), {"pred": w * x}

  @jax.jit
  def step(ls, w, x):
    return ls.value_and_grad(fun, has_aux=True, argnums=(0, 1))(w, x)

  w, x = jnp.array([1.0, 2.0]), jnp.array([3.0, 1.0])
  (loss, aux), (gw, gx) = step(ls, w, x)
  (ref_loss, ref_aux), (rw, rx) = jax.value_and_grad(fun, has_aux=True, argnums=(0, 1))(w, x)
  assert loss == ref_loss
  np.testing.assert_array_equal(aux["pred"], ref_aux["pred"])
  np.testing.assert_array_equal(gw, 4 * rw)
  np.testing.assert_array_equal(gx, 4 * rx)


def test_value_and_grad_scales_a_half_precision_loss_in_float32():
  ls = jaxmp.StaticLossScale(2.0**15)
  w = jnp.array([1.0, 2.0], jnp.float32)

  def fun(w):  # computes (and returns its loss) in bfloat16
    return jnp.sum(w.astype(jnp.bfloat16) ** 2)

  loss, grads = ls.value_and_grad(fun)(w)
  assert loss.dtype == jnp.bfloat16 and float(loss) == 5.0
  np.testing.assert_array_equal(grads, np.array([2.0, 4.0]) * 2**15)


def test_value_and_grad_with_has_aux_needs_a_pair():
  with pytest.raises(TypeError, match="pair"):
    jaxmp.StaticLossScale(2.0).value_and_grad(lambda w: jnp.sum(w), has_aux=True)(jnp.ones(2))
  with pytest.raises(TypeError, match="callable"):
    jaxmp.StaticLossScale(2.0).value_and_grad(3.0)


# --------------------------------------------------------------------------------------
# Pytree: every field survives flatten/unflatten, jit, tree_map and checkpointing.


def _custom_dynamic():
  return jaxmp.DynamicLossScale(scale=512.0, growth_interval=7, growth_factor=3.0,
                                backoff_factor=0.25, min_scale=0.5, max_scale=1e6, counter=4)


# Field by field, not chex: checks the fields and their fixed dtypes without the class's own
# pytree registration, which is what the round trips below test.
def _assert_same_fields(a, b):
  assert type(a) is type(b)
  if isinstance(a, jaxmp.NoOpLossScale):
    return
  np.testing.assert_array_equal(np.asarray(a.loss_scale), np.asarray(b.loss_scale))
  assert np.asarray(b.loss_scale).dtype == np.float32
  if isinstance(a, jaxmp.DynamicLossScale):
    np.testing.assert_array_equal(np.asarray(a.counter), np.asarray(b.counter))
    assert np.asarray(b.counter).dtype == np.int32
    for name in ("growth_interval", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
      assert getattr(a, name) == getattr(b, name), name


ALL_SCALES = [jaxmp.NoOpLossScale, lambda: jaxmp.StaticLossScale(64.0), _custom_dynamic]


@pytest.mark.parametrize("make", ALL_SCALES)
def test_flatten_unflatten_round_trip(make):
  ls = make()
  leaves, treedef = jax.tree_util.tree_flatten(ls)
  _assert_same_fields(ls, jax.tree_util.tree_unflatten(treedef, leaves))
  _assert_same_fields(ls, jax.tree_util.tree_map(lambda x: x, ls))
  hash(treedef)  # static hyperparameters are hashable aux data


@pytest.mark.parametrize("make", ALL_SCALES[1:])
def test_unflatten_keeps_leaves_the_constructor_would_refuse(make):
  # JAX and Orbax unflatten a state with placeholders (None), abstract values (eval_shape,
  # restore targets) and shardings in place of arrays: unflatten must not run the
  # constructor's checks (a positive float32 scale), which is why the loss scales are not
  # register_dataclass classes (its unflatten calls the constructor).
  ls = make()
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  for leaf in (None, jax.ShapeDtypeStruct((), jnp.float32), sharding):
    out = jax.tree.map(lambda _, leaf=leaf: leaf, ls)
    assert type(out) is type(ls) and out.loss_scale is leaf
    if isinstance(ls, jaxmp.DynamicLossScale):
      assert out.counter is leaf and out.growth_interval == ls.growth_interval
  abstract = jax.eval_shape(lambda ls: ls, ls)
  assert abstract.loss_scale == jax.ShapeDtypeStruct((), jnp.float32)


def test_leaves_and_key_paths():
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(_custom_dynamic())[0]]
  assert paths == [".loss_scale", ".counter"]
  assert jax.tree_util.tree_leaves(jaxmp.StaticLossScale(2.0))[0].dtype == jnp.float32
  assert jax.tree_util.tree_leaves(jaxmp.NoOpLossScale()) == []


@pytest.mark.parametrize("make", ALL_SCALES)
def test_jit_round_trip(make):
  ls = make()
  _assert_same_fields(ls, jax.jit(lambda ls: ls)(ls))
  adjusted = jax.jit(lambda ls: ls.adjust(False))(ls)
  _assert_same_fields(ls.adjust(False), adjusted)


def test_min_scale_survives_jit_unlike_jmp():
  ls = jaxmp.DynamicLossScale(scale=4.0, min_scale=2.0)
  ls = jax.jit(lambda ls: ls.adjust(False))(ls)
  ls = jax.jit(lambda ls: ls.adjust(False))(ls)
  assert float(ls.loss_scale) == 2.0 and ls.min_scale == 2.0


@pytest.mark.parametrize("make", ALL_SCALES)
def test_checkpoint_round_trip_through_numpy(make):
  ls = make().adjust(True)
  leaves, treedef = jax.tree_util.tree_flatten(ls)
  saved = [np.asarray(x) for x in leaves]  # what a checkpointer writes
  restored = jax.tree_util.tree_unflatten(treedef, [np.array(x) for x in saved])
  _assert_same_fields(ls, restored)
  _assert_same_fields(ls.adjust(False), restored.adjust(False))


def test_immutable():
  ls = jaxmp.DynamicLossScale()
  with pytest.raises(AttributeError, match="immutable"):
    ls.min_scale = 0.0
  with pytest.raises(AttributeError, match="immutable"):
    jaxmp.StaticLossScale(2.0).scale_value = 3.0  # no new attributes either


def test_repr_names_every_field():
  text = repr(_custom_dynamic())
  for part in ("loss_scale=", "counter=", "growth_interval=7", "growth_factor=3.0",
               "backoff_factor=0.25", "min_scale=0.5", "max_scale=1000000.0"):
    assert part in text


# --------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("kwargs, error, pattern", [
    ({"growth_factor": 1.0}, ValueError, "growth_factor must be finite and > 1.*got 1.0"),
    ({"growth_factor": 0.5}, ValueError, "growth_factor.*got 0.5"),
    ({"growth_factor": float("inf")}, ValueError, "growth_factor"),
    ({"growth_factor": "2"}, TypeError, "growth_factor must be a real number"),
    ({"backoff_factor": 0.0}, ValueError, r"backoff_factor must be in the open interval \(0, 1\)"),
    ({"backoff_factor": 1.0}, ValueError, "backoff_factor.*got 1.0"),
    ({"backoff_factor": 1.5}, ValueError, "backoff_factor.*got 1.5"),
    ({"backoff_factor": -0.5}, ValueError, "backoff_factor.*got -0.5"),
    ({"scale": 0.0}, ValueError, "scale must be positive and finite.*got 0.0"),
    ({"scale": -4.0}, ValueError, "scale must be positive.*got -4.0"),
    ({"scale": float("nan")}, ValueError, "scale must be positive.*nan"),
    ({"scale": float("inf")}, ValueError, "scale must be positive.*inf"),
    ({"scale": 1e39}, ValueError, "scale must be positive and finite in float32"),
    ({"scale": np.float16(0)}, ValueError, "scale must be positive"),
    ({"scale": None}, TypeError, "scale must be a real number"),
    ({"scale": jnp.ones(2)}, ValueError, "scale must be a scalar"),
    ({"scale": True}, TypeError, "scale must be a real number"),
    ({"scale": 0.5}, ValueError, r"scale must be in \[min_scale, max_scale\]"),
    ({"scale": 2.0**25}, ValueError, r"scale must be in \[min_scale, max_scale\]"),
    ({"growth_interval": 0}, ValueError, r"growth_interval must be an integer in \[1, .*got 0"),
    ({"growth_interval": -3}, ValueError, "growth_interval.*got -3"),
    ({"growth_interval": 2.5}, TypeError, "growth_interval must be an integer >= 1, got 2.5"),
    ({"growth_interval": True}, TypeError, "growth_interval must be an integer"),
    ({"growth_interval": 2**31}, ValueError, "growth_interval"),
    ({"min_scale": 4.0, "max_scale": 2.0, "scale": 3.0}, ValueError,
     "min_scale must be <= max_scale, got min_scale=4.0 > max_scale=2.0"),
    ({"min_scale": -1.0}, ValueError, "min_scale must be >= 0.*got -1.0"),
    ({"min_scale": float("nan")}, ValueError, "min_scale"),
    ({"max_scale": 0.0}, ValueError, "max_scale must be > 0"),
    ({"max_scale": float("nan")}, ValueError, "max_scale must be > 0"),
    ({"counter": 2000}, ValueError, r"counter must be in \[0, growth_interval\) = \[0, 2000\)"),
    ({"counter": -1}, ValueError, "counter must be in"),
    ({"counter": 1.0}, TypeError, "counter must be an integer"),
])
def test_dynamic_bad_hyperparameters(kwargs, error, pattern):
  with pytest.raises(error, match=pattern) as info:
    jaxmp.DynamicLossScale(**kwargs)
  assert "DynamicLossScale" in str(info.value)


def test_traced_static_hyperparameter_is_refused():
  with pytest.raises(TypeError, match="growth_factor must be a concrete number"):
    jax.jit(lambda g: jaxmp.DynamicLossScale(growth_factor=g))(2.0)


@pytest.mark.parametrize("scale, error", [(0.0, ValueError), (-1.0, ValueError),
                                          (float("inf"), ValueError), ("8", TypeError)])
def test_static_bad_scale(scale, error):
  with pytest.raises(error, match="StaticLossScale: scale"):
    jaxmp.StaticLossScale(scale)


@pytest.mark.parametrize("ls", [jaxmp.NoOpLossScale(), jaxmp.StaticLossScale(2.0),
                                jaxmp.DynamicLossScale()])
def test_adjust_needs_a_scalar_bool(ls):
  with pytest.raises(TypeError, match=re.escape("grads_finite must be a scalar bool")):
    ls.adjust(1)
  with pytest.raises(TypeError, match="dtype float32"):
    ls.adjust(jnp.array(1.0))
  with pytest.raises(TypeError, match="dtype int32"):
    jax.jit(ls.adjust)(jnp.array(1))
  with pytest.raises(ValueError, match=r"shape \(2,\)"):
    ls.adjust(jnp.array([True, False]))
  with pytest.raises(TypeError, match="type NoneType"):
    ls.adjust(None)


# --------------------------------------------------------------------------------------
# Values: copy, deepcopy, pickle, equality by value.


@pytest.mark.parametrize("make", ALL_SCALES)
def test_copy_deepcopy_and_pickle_give_equal_loss_scales(make):
  ls = make().adjust(True)
  for clone in (copy.copy(ls), copy.deepcopy(ls), pickle.loads(pickle.dumps(ls))):
    _assert_same_fields(ls, clone)
    assert clone == ls and hash(clone) == hash(ls)
  # A copy is a live loss scale: its rule continues.
  assert copy.deepcopy(ls).adjust(False) == ls.adjust(False)


@pytest.mark.parametrize("make", ALL_SCALES)
def test_flatten_unflatten_and_jit_round_trips_compare_equal(make):
  ls = make()
  leaves, treedef = jax.tree_util.tree_flatten(ls)
  assert jax.tree_util.tree_unflatten(treedef, leaves) == ls
  assert jax.tree_util.tree_unflatten(treedef, [np.asarray(x) for x in leaves]) == ls
  assert jax.jit(lambda ls: ls)(ls) == ls
  assert len({ls, jax.tree_util.tree_unflatten(treedef, leaves)}) == 1


def test_equality_is_by_value_type_and_hyperparameters():
  assert jaxmp.StaticLossScale(8.0) == jaxmp.StaticLossScale(np.float16(8))
  assert jaxmp.StaticLossScale(8.0) != jaxmp.StaticLossScale(4.0)
  assert jaxmp.NoOpLossScale() == jaxmp.NoOpLossScale()
  assert jaxmp.NoOpLossScale() != jaxmp.StaticLossScale(1.0)
  ls = _custom_dynamic()
  assert ls == _custom_dynamic()
  assert ls != ls.adjust(True)  # the counter differs
  assert ls != jaxmp.DynamicLossScale(scale=512.0, growth_interval=7, growth_factor=3.0,
                                      backoff_factor=0.25, min_scale=0.5, max_scale=1e6,
                                      counter=3)
  assert ls != jaxmp.DynamicLossScale(scale=512.0, growth_interval=8, counter=4)
  assert ls != jaxmp.StaticLossScale(512.0)


def test_a_traced_loss_scale_equals_only_itself():
  def f(ls):
    assert ls == ls
    assert ls != jaxmp.StaticLossScale(2.0)
    return ls.loss_scale

  jax.jit(f)(jaxmp.StaticLossScale(2.0))


def test_loss_scaling_state_copies_and_pickles():
  import optax

  state = jaxmp.loss_scaling(optax.adam(1e-3), _custom_dynamic()).init({"w": jnp.ones(3)})
  for clone in (copy.copy(state), copy.deepcopy(state), pickle.loads(pickle.dumps(state))):
    leaves, treedef = jax.tree_util.tree_flatten(clone)
    assert treedef == jax.tree_util.tree_structure(state)
    for a, b in zip(leaves, jax.tree_util.tree_leaves(state), strict=True):
      np.testing.assert_array_equal(a, b)
    assert clone.loss_scale == state.loss_scale


def test_scale_and_unscale_treat_numpy_scalars_and_python_floats_like_arrays():
  ls = jaxmp.StaticLossScale(4.0)
  tree = {"py": 2.0, "f16": np.float16(3.0), "f32": np.float32(0.5), "int": 3, "i32": np.int32(2),
          "flag": True}
  scaled = ls.scale(tree)
  for name, value, dtype in (("py", 8.0, np.float32), ("f16", 12.0, np.float16),
                             ("f32", 2.0, np.float32)):
    assert scaled[name].shape == () and scaled[name].dtype == dtype, name
    assert float(scaled[name]) == value, name
    assert float(ls.unscale(scaled)[name]) == float(tree[name]), name
  for name in ("int", "i32", "flag"):
    assert scaled[name] is tree[name]


def test_loss_scaling_skips_a_nan_python_float_gradient():
  import optax

  tx = jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.NoOpLossScale())
  state = tx.init({"w": 1.0})
  updates, state = tx.update({"w": math.nan}, state)
  assert float(updates["w"]) == 0.0
  assert not bool(state.last_step_finite) and int(state.skipped_steps) == 1


# ---- None: one meaning everywhere ---------------------------------------------------------


def test_none_means_no_loss_scaling_at_every_entry_point():
  import optax  # pylint: disable=g-import-not-at-top
  params = {"w": jnp.array([1.0, -2.0])}
  noop = jaxmp.NoOpLossScale()
  # loss_scaling: left out, DynamicLossScale(); None, as everywhere, no scaling.
  assert isinstance(jaxmp.get_loss_scale(jaxmp.loss_scaling(optax.sgd(1.0)).init(params)),
                    jaxmp.DynamicLossScale)
  assert jaxmp.get_loss_scale(jaxmp.loss_scaling(optax.sgd(1.0), None).init(params)) == noop
  # value_and_grad: None is NoOpLossScale(), gradients unscaled.
  loss = lambda v: jnp.sum(v["params"]["w"] ** 2)
  _, grads = jaxmp.linen.value_and_grad(loss)({"params": params}, loss_scale=None)
  np.testing.assert_array_equal(grads.params["w"], [2.0, -4.0])
  # The tools: None is a scale of 1.
  tiny = {"w": jnp.array([1e-8, 3.0])}
  assert (jaxmp.tools.underflow_stats(tiny, "float16", loss_scale=None)
          == jaxmp.tools.underflow_stats(tiny, "float16", loss_scale=noop))
  metrics = [jaxmp.tools.training_metrics(params, loss_scale=s)["grad_norm"] for s in (None, noop)]
  np.testing.assert_array_equal(*metrics)
