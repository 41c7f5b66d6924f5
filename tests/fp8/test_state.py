"""State primitives: init, for_grad, merge, accumulate, empty_like."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp._src.fp8 import maxgrad
from jaxmp import fp8

DENSE = (((1,), (0,)), ((), ()))
RECIPE = fp8.DelayedScaling(amax_history_length=3)


def _used_state():
  return fp8.DelayedScalingState(
      input_scale=jnp.array([0.5]), input_amax_history=jnp.array([4.0, 1.0, 2.0]),
      kernel_scale=jnp.array([0.25]), kernel_amax_history=jnp.array([0.5, 0.5, 0.5]),
      output_grad_scale=jnp.array([2.0]), output_grad_amax_history=jnp.array([9.0, 0.0, 3.0]))


def test_init_state_layout_is_flax_s():
  s = fp8.init_state(RECIPE)
  assert s._fields == ("input_scale", "input_amax_history", "kernel_scale",
                       "kernel_amax_history", "output_grad_scale", "output_grad_amax_history")
  for name, leaf in s._asdict().items():
    assert leaf.dtype == jnp.float32
    assert leaf.shape == ((1,) if name.endswith("scale") else (3,))
    np.testing.assert_array_equal(leaf, 1.0 if name.endswith("scale") else 0.0)
  assert fp8.init_state(fp8.CurrentScaling()) is None
  with pytest.raises(TypeError, match="init_state: recipe must be"):
    fp8.init_state("delayed")
  assert fp8.DelayedScalingState.from_variables(s._asdict()) == s
  with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
    fp8.DelayedScalingState.from_variables({**s._asdict(), "extra": 1})


class TestMerge:

  @pytest.mark.parametrize("fill", [0.0, -np.inf, np.nan, -1.0])
  def test_uninformative_cotangents_keep_the_old_state(self, fill):
    old = _used_state()
    ct = jax.tree_util.tree_map(lambda x: jnp.full_like(x, fill), old)
    chex.assert_trees_all_equal(fp8.state.merge(old, ct, jnp.array(True)), old)

  def test_informative_cotangents_replace_it_leaf_by_leaf(self):
    old = _used_state()
    ct = jax.tree_util.tree_map(jnp.zeros_like, old)._replace(
        input_scale=jnp.array([0.125]), input_amax_history=jnp.array([5.0, 1.0, 2.0]))
    new = fp8.state.merge(old, ct, True)
    chex.assert_trees_all_equal(new, old._replace(input_scale=ct.input_scale,
                                         input_amax_history=ct.input_amax_history))

  def test_a_skipped_step_keeps_everything(self):
    old, ct = _used_state(), fp8.init_state(RECIPE)._replace(input_scale=jnp.array([3.0]))
    chex.assert_trees_all_equal(fp8.state.merge(old, ct, jnp.array(False)), old)
    chex.assert_trees_all_equal(jax.jit(fp8.state.merge)(old, ct, jnp.array(False)), old)
    np.testing.assert_array_equal(
        jax.jit(fp8.state.merge)(old, ct, jnp.array(True)).input_scale, [3.0])

  def test_works_on_a_whole_collection_and_keeps_dtypes(self):
    old = {"a": {"Fp8DotGeneral_0": _used_state()._asdict()},
           "b": {"Fp8DotGeneral_0": fp8.init_state(RECIPE)._asdict()}}
    ct = jax.tree_util.tree_map(jnp.zeros_like, old)
    ct["b"]["Fp8DotGeneral_0"]["kernel_scale"] = jnp.array([7.0])
    new = fp8.state.merge(old, ct, jnp.array(True))
    assert float(new["b"]["Fp8DotGeneral_0"]["kernel_scale"][0]) == 7.0
    chex.assert_trees_all_equal(new["a"], old["a"])
    bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), old)
    assert fp8.state.merge(bf16, ct)["a"]["Fp8DotGeneral_0"]["input_scale"].dtype == jnp.bfloat16

  def test_many_leaves_of_several_shapes_and_dtypes_merge_as_each_would_alone(self):
    # merge decides stacked leaves and selects them in chunks; each leaf must come
    # out as merging it on its own gives, whatever its neighbours (more leaves than
    # one chunk holds, two dtypes, a scalar, an empty leaf).
    rng = np.random.default_rng(0)
    shapes = [(1,), (3,), (), (0,), (2, 2)]
    fills = [None, 0.0, -np.inf, np.nan, -1.0]
    old, ct = {}, {}
    for i in range(41):
      shape, dtype = shapes[i % 5], (jnp.float32, jnp.bfloat16)[i % 2]
      old[f"leaf{i:02d}"] = jnp.asarray(rng.uniform(0.5, 2.0, shape), dtype)
      fill = fills[(i // 5) % 5]
      value = rng.uniform(0.5, 2.0, shape) if fill is None else np.full(shape, fill)
      ct[f"leaf{i:02d}"] = jnp.asarray(value, jnp.float32)
    ct["leaf01"] = ct["leaf01"].at[1].set(np.inf)  # one bad entry spoils a history
    for finite in (True, False):
      merged = jax.jit(fp8.state.merge)(old, ct, jnp.array(finite))
      alone = {k: fp8.state.merge({k: old[k]}, {k: ct[k]}, jnp.array(finite))[k] for k in old}
      chex.assert_trees_all_equal(merged, alone)
      taken = [k for k in old if not np.array_equal(merged[k], old[k])]
      # Informative cotangents replace (those of leaves 0-4 and 25-29, but not the
      # empty leaf03 and leaf28, nor leaf01 with its inf); the rest keep the old state.
      assert taken == (["leaf00", "leaf02", "leaf04", "leaf25", "leaf26", "leaf27",
                        "leaf29"] if finite else []), taken
      for k in taken:  # the cotangent itself, in the old leaf's shape and dtype
        chex.assert_trees_all_equal(merged[k], ct[k].astype(old[k].dtype))

  def test_errors(self):
    old = _used_state()
    with pytest.raises(ValueError, match=r"has 6 leaves, the state 6: the gradients lack "
                                         r"\.input_scale.*they hold \['input_amax_history'\]"):
      fp8.state.merge(old, old._asdict())
    with pytest.raises(ValueError, match=r"leaf .*input_amax_history.* has shape \(3,\) in the "
                                         r"state and \(4,\) in the cotangent"):
      fp8.state.merge(old, old._replace(input_amax_history=jnp.zeros(4)))
    with pytest.raises(TypeError, match="boolean grads_finite, got dtype float32"):
      fp8.state.merge(old, old, jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"scalar grads_finite, got one of shape \(2,\)"):
      fp8.state.merge(old, old, jnp.array([True, False]))


def _state_cotangent(state, x, g, kernel):
  def loss(s):
    return jnp.sum(fp8.fp8_dot_general(x, kernel, DENSE, state=s, recipe=RECIPE) * g)
  return jax.jit(jax.grad(loss))(state)


def test_accumulating_micro_batches_equals_one_step_over_the_whole_batch():
  rng = np.random.default_rng(0)
  kernel = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((6, 8)) * np.array([[1], [1], [1], [7], [7], [7]]),
                  jnp.float32)
  g = jnp.asarray(rng.standard_normal((6, 4)) * np.array([[5], [5], [5], [1], [1], [1]]),
                  jnp.float32)
  state = _used_state()  # scales and histories already in use
  whole = _state_cotangent(state, x, g, kernel)
  a = _state_cotangent(state, x[:3], g[:3], kernel)
  b = _state_cotangent(state, x[3:], g[3:], kernel)
  acc = fp8.state.accumulate(fp8.state.accumulate(fp8.state.empty_like(state), a), b)
  chex.assert_trees_all_equal(acc, whole)
  # The per-micro-batch amaxes differ (x peaks in b, g in a), and their sum would not do.
  assert float(a.input_amax_history[0]) < float(b.input_amax_history[0])
  assert float(a.output_grad_amax_history[0]) > float(b.output_grad_amax_history[0])
  summed = jax.tree_util.tree_map(jnp.add, a, b)
  assert float(summed.input_scale[0]) != float(whole.input_scale[0])
  chex.assert_trees_all_equal(fp8.state.merge(state, acc, jnp.array(True)), whole)


def test_accumulate_ignores_empty_and_nan_micro_batches():
  a = _used_state()
  chex.assert_trees_all_equal(fp8.state.accumulate(fp8.state.empty_like(a), a), a)
  chex.assert_trees_all_equal(fp8.state.accumulate(a, jax.tree_util.tree_map(jnp.zeros_like, a)), a)
  nan = jax.tree_util.tree_map(lambda x: jnp.full_like(x, np.nan), a)
  chex.assert_trees_all_equal(fp8.state.accumulate(nan, a), a)
  chex.assert_trees_all_equal(fp8.state.merge(a, fp8.state.empty_like(a)), a)


def test_a_step_with_non_finite_gradients_leaves_the_state_untouched():
  state = _used_state()
  kernel = jnp.ones((2, 2))

  def loss(kernel, s):
    s = fp8.state.for_grad(s)
    y = fp8.fp8_dot_general(jnp.array([[1.0, 2.0]]), kernel, DENSE, state=s, recipe=RECIPE)
    # A float16 head whose loss-scaled backward pass overflows: the output gradient
    # reaching the fp8 layer is inf. fp8 quantization must not saturate it away.
    y16 = y.astype(jnp.float16)
    return jnp.sum((y16 * jnp.float16(1000.0)).astype(jnp.float32) * 2.0**15)

  kernel_grad, state_ct = jax.jit(jax.grad(loss, argnums=(0, 1)))(kernel, state)
  finite = jaxmp.all_finite(kernel_grad)
  assert not bool(finite)
  chex.assert_trees_all_equal(fp8.state.merge(state, state_ct, finite), state)
  assert bool(jaxmp.all_finite(state_ct))  # and even raw, no inf/NaN was recorded


def test_for_grad_and_from_grad():
  s = _used_state()
  m = fp8.state.for_grad(s)
  assert all(maxgrad.is_max_float32(x) for x in m)
  chex.assert_trees_all_equal(fp8.state.from_grad(m), s)
  chex.assert_trees_all_equal(fp8.state.from_grad(s), s)
  with pytest.raises(TypeError, match="must be float32 to accumulate by max, got .* float16"):
    fp8.state.for_grad(s._replace(input_scale=jnp.ones(1, jnp.float16)))


def test_all_reduce_takes_the_max_over_replicas():
  a, b = _used_state(), _used_state()._replace(input_amax_history=jnp.array([6.0, 1.0, 2.0]))
  stacked = jax.tree_util.tree_map(lambda x, y: jnp.stack([x, y]), a, b)
  out = jax.vmap(lambda c: fp8.state.all_reduce(c, "r"), axis_name="r")(stacked)
  expected = fp8.state.accumulate(a, b)
  for i in range(2):
    chex.assert_trees_all_equal(jax.tree_util.tree_map(lambda x: x[i], out), expected)
