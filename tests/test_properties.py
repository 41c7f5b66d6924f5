"""Property-based tests (hypothesis): the loss-scale state machine and tree casting.

tests/test_loss_scale.py already checks DynamicLossScale against torch, Keras and jmp
with no bounds (``min_scale=0, max_scale=inf``) or the default floor. Here the model is
the rule itself, transcribed in plain Python with float32 rounding, over random
hyperparameters *including* the clamping bounds and a restored counter; then the
invariants of every loss scale, and casting, finite checks and selection over random
nested pytrees of every kind of leaf.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxmp

F32 = np.float32
F32_MAX = float(np.finfo(np.float32).max)
SETTINGS = hypothesis.settings(max_examples=40, deadline=None, derandomize=True,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])


# --------------------------------------------------------------------------------------
# The loss-scale state machine.


def _f32_at_least(bound):
  """The smallest float32 >= ``bound``."""
  rounded = F32(bound)
  return np.nextafter(rounded, F32(np.inf)) if float(rounded) < bound else rounded


def _f32_at_most(bound):
  """The largest float32 <= ``bound``."""
  rounded = F32(bound)
  return np.nextafter(rounded, F32(-np.inf)) if float(rounded) > bound else rounded


class ReferenceDynamicLossScale:
  """DynamicLossScale's documented rule, in plain Python with float32 arithmetic.

  torch's GradScaler step, then the bounds: a finite step clamps into ``[min_scale,
  max_scale]``, an overflow clamps too but never raises the scale (one restored below
  ``min_scale`` stays there until a finite step).
  """

  def __init__(self, scale, growth_interval, growth_factor, backoff_factor, min_scale,
               max_scale, counter=0):
    self.scale, self.counter = F32(scale), counter
    self.growth_interval = growth_interval
    self.growth, self.backoff = F32(growth_factor), F32(backoff_factor)
    self.min, self.max = _f32_at_least(min_scale), _f32_at_most(min(max_scale, F32_MAX))

  def clamp(self, x):
    return min(max(x, self.min), self.max)

  def adjust(self, finite: bool) -> None:
    with np.errstate(over="ignore"):
      if not finite:
        self.scale = min(self.scale, self.clamp(F32(self.scale * self.backoff)))
        self.counter = 0
        return
      self.counter += 1
      if self.counter >= self.growth_interval:
        grown = F32(self.scale * self.growth)
        if np.isfinite(grown):
          self.scale = grown
        self.counter = 0
      self.scale = self.clamp(self.scale)


@st.composite
def dynamic_configs(draw):
  growth_interval = draw(st.integers(1, 6))
  min_scale = draw(st.sampled_from([0.0, 1.0]) | st.floats(1e-3, 1e3))
  max_scale = draw(st.sampled_from([float("inf"), F32_MAX]) |
                   st.floats(max(min_scale, 1e-3), 1e9))
  upper = min(max_scale, 1e12)
  scale = draw(st.floats(max(min_scale, 1e-3), upper) | st.sampled_from([upper]))
  hypothesis.assume(min_scale <= float(F32(scale)) <= max_scale)
  return dict(
      scale=scale, growth_interval=growth_interval,
      growth_factor=draw(st.sampled_from([2.0, 1.5, 4.0, 1.001]) | st.floats(1.01, 10.0)),
      backoff_factor=draw(st.sampled_from([0.5, 0.25, 0.999]) | st.floats(0.1, 0.99)),
      min_scale=min_scale, max_scale=max_scale,
      counter=draw(st.integers(0, growth_interval - 1)))


@SETTINGS
@hypothesis.given(config=dynamic_configs(), finite_flags=st.lists(st.booleans(), max_size=30))
def test_dynamic_loss_scale_follows_the_reference_rule_with_bounds(config, finite_flags):
  ls = jaxmp.DynamicLossScale(**config)
  ref = ReferenceDynamicLossScale(**config)
  assert float(ls.loss_scale) == float(ref.scale)
  hparams = (ls.growth_interval, ls.growth_factor, ls.backoff_factor, ls.min_scale,
             ls.max_scale)
  for i, finite in enumerate(finite_flags):
    ls = ls.adjust(finite)
    ref.adjust(finite)
    assert float(ls.loss_scale) == float(ref.scale), (i, finite, float(ls.loss_scale), ref.scale)
    assert int(ls.counter) == ref.counter, (i, int(ls.counter), ref.counter)
    # Invariants: within the bounds, counter below the interval, hyperparameters kept.
    assert F32(config["min_scale"]) <= F32(ls.loss_scale) <= F32(min(config["max_scale"],
                                                                         F32_MAX))
    assert 0 <= int(ls.counter) < config["growth_interval"]
    assert ls.loss_scale.dtype == jnp.float32 and ls.counter.dtype == jnp.int32
  assert (ls.growth_interval, ls.growth_factor, ls.backoff_factor, ls.min_scale,
          ls.max_scale) == hparams
  # A pytree round trip (what jit and checkpointing do) keeps every field.
  leaves, treedef = jax.tree_util.tree_flatten(ls)
  again = jax.tree_util.tree_unflatten(treedef, [np.asarray(x) for x in leaves])
  assert (float(again.loss_scale), int(again.counter)) == (float(ls.loss_scale), int(ls.counter))
  assert (again.growth_interval, again.growth_factor, again.backoff_factor, again.min_scale,
          again.max_scale) == hparams


@SETTINGS
@hypothesis.given(config=dynamic_configs(), finite_flags=st.lists(st.booleans(), max_size=30),
                  scale=st.floats(1e-3, 1e12), counter=st.integers(0, 12))
def test_a_restored_state_outside_its_bounds_is_clamped_and_no_overflow_raises_it(
    config, finite_flags, scale, counter):
  # A checkpoint restored into a loss scale with other bounds: Orbax rebuilds it from
  # the target's structure (its hyperparameters) and the checkpoint's leaves, with no
  # constructor to check them, so the scale may be outside the bounds and the counter
  # past the interval.
  target = jaxmp.DynamicLossScale(**config)
  ls = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target),
                                    [jnp.float32(scale), jnp.int32(counter)])
  ref = ReferenceDynamicLossScale(**{**config, "scale": scale, "counter": counter})
  for i, finite in enumerate(finite_flags):
    before = F32(ls.loss_scale)
    ls = ls.adjust(finite)
    ref.adjust(finite)
    after = F32(ls.loss_scale)
    assert (after, int(ls.counter)) == (ref.scale, ref.counter), (i, finite, after, ref.scale)
    if not finite:
      assert after <= before  # an overflow never raises the scale
    if finite or ref.min <= before:
      assert ref.min <= after <= ref.max  # in the bounds from then on


@SETTINGS
@hypothesis.given(growth_interval=st.integers(1, 4), runs=st.lists(st.integers(1, 9), max_size=8))
def test_alternating_runs_grow_only_after_a_full_interval(growth_interval, runs):
  # Runs of finite and overflowing steps, alternating: the scale grows exactly once per
  # growth_interval consecutive finite steps and halves once per overflow.
  ls = jaxmp.DynamicLossScale(2.0**20, growth_interval, min_scale=0.0, max_scale=float("inf"))
  expected = 20
  for k, length in enumerate(runs):
    finite = k % 2 == 0
    for _ in range(length):
      ls = ls.adjust(finite)
    expected += length // growth_interval if finite else -length
    assert float(ls.loss_scale) == 2.0**expected


# Normal numbers: XLA flushes float32 subnormals to zero, numpy does not.
finite_floats = st.just(0.0) | st.floats(2.0**-10, 1e3, width=32) | st.floats(-1e3, -2.0**-10, width=32)


@SETTINGS
@hypothesis.given(log2_scale=st.integers(-10, 20), values=st.lists(finite_floats, min_size=1,
                                                                   max_size=6),
                  flags=st.lists(st.booleans(), max_size=5),
                  dtype=st.sampled_from([np.float32, np.float16, ml_dtypes.bfloat16]))
def test_static_and_noop_loss_scales_never_change_and_scale_exactly(log2_scale, values, flags,
                                                                     dtype):
  tree = {"g": jnp.asarray(np.asarray(values, np.float32).astype(dtype)), "step": jnp.int32(3)}
  static = jaxmp.StaticLossScale(2.0**log2_scale)
  noop = jaxmp.NoOpLossScale()
  for finite in flags:
    assert static.adjust(finite) is static and noop.adjust(finite) is noop
  assert float(static.loss_scale) == 2.0**log2_scale and float(noop.loss_scale) == 1.0
  assert noop.scale(tree) is tree and noop.unscale(tree) is tree
  scaled = static.scale(tree)
  with np.errstate(over="ignore"):  # float16 overflows to inf, as in jax
    want = (np.asarray(tree["g"], np.float32) * F32(2.0**log2_scale)).astype(dtype)
  assert scaled["g"].dtype == dtype and scaled["step"] is tree["step"]
  np.testing.assert_array_equal(np.asarray(scaled["g"]), want)
  if dtype == np.float32:  # power-of-two scales are exact both ways in float32
    np.testing.assert_array_equal(static.unscale(scaled)["g"], tree["g"])


# --------------------------------------------------------------------------------------
# Random pytrees.

FLOAT_DTYPES = (np.float16, ml_dtypes.bfloat16, np.float32, ml_dtypes.float8_e4m3fn,
                ml_dtypes.float8_e5m2)
values = st.floats(allow_nan=True, allow_infinity=True, width=32)
shapes = st.sampled_from([(), (1,), (3,), (2, 2)])


@st.composite
def float_arrays(draw, dtypes=FLOAT_DTYPES, host=None):
  dtype = draw(st.sampled_from(dtypes + ((np.float64,) if host is not False else ())))
  shape = draw(shapes)
  data = np.asarray(draw(st.lists(values, min_size=int(np.prod(shape)),
                                  max_size=int(np.prod(shape)))), np.float32).reshape(shape)
  with np.errstate(over="ignore", invalid="ignore"):
    array = data.astype(dtype)
  # float64 only on the host: without jax_enable_x64 a jax array would be float32.
  on_host = dtype == np.float64 or (host if host is not None else draw(st.booleans()))
  return array if on_host else jnp.asarray(array)


other_leaves = st.one_of(
    st.builds(lambda n: jnp.arange(n, dtype=jnp.int32), st.integers(0, 3)),
    st.builds(lambda n: np.arange(n, dtype=np.uint8), st.integers(0, 3)),
    st.builds(lambda b: jnp.array([b, not b]), st.booleans()),
    st.builds(jax.random.key, st.integers(0, 2**31 - 1)),
    st.builds(jax.random.PRNGKey, st.integers(0, 2**31 - 1)),
    st.none(),
    st.floats(allow_nan=False, width=32),
    st.integers(-5, 5),
    st.booleans(),
    st.text(max_size=4),
)


def trees(leaves):
  return st.recursive(leaves, lambda children: st.one_of(
      st.lists(children, max_size=3),
      st.tuples(children, children),
      st.dictionaries(st.text("abc", min_size=1, max_size=2), children, max_size=3)),
                      max_leaves=8)


mixed_trees = trees(st.one_of(float_arrays(), other_leaves))


def _is_float_array(x):
  return isinstance(x, (jax.Array, np.ndarray)) and jaxmp._src.dtypes.is_float_dtype(x.dtype)


def _assert_cast(out, tree, dtype):
  dtype = np.dtype(dtype)
  out_leaves, out_def = jax.tree_util.tree_flatten(out)
  in_leaves, in_def = jax.tree_util.tree_flatten(tree)
  assert out_def == in_def
  for o, x in zip(out_leaves, in_leaves):
    if _is_float_array(x):
      assert o.dtype == dtype
      assert isinstance(o, jax.Array) == isinstance(x, jax.Array)  # numpy stays on the host
      if x.dtype == dtype:
        assert o is x
      with np.errstate(over="ignore", invalid="ignore"):
        want = np.asarray(x.astype(dtype)).astype(np.float32)
      np.testing.assert_array_equal(np.asarray(o).astype(np.float32), want)
    else:
      assert o is x


@SETTINGS
@hypothesis.given(tree=mixed_trees,
                  dtype=st.sampled_from(["float32", "bf16", "f16", "float8_e4m3fn"]))
def test_cast_tree_casts_float_arrays_only_and_keeps_everything_else(tree, dtype):
  with np.errstate(over="ignore", invalid="ignore"):  # numpy leaves overflow like jax's
    out = jaxmp.cast_tree(tree, dtype)
  _assert_cast(out, tree, jaxmp.tools.parse_dtype(dtype, allow_fp8=True))


policy_dtypes = st.sampled_from(["float32", "bfloat16", "float16"])


@SETTINGS
@hypothesis.given(tree=mixed_trees, param=policy_dtypes, compute=policy_dtypes,
                  output=policy_dtypes)
def test_policy_casts_follow_their_dtype(tree, param, compute, output):
  policy = jaxmp.Policy(param, compute, output)
  with np.errstate(over="ignore", invalid="ignore"):
    _assert_cast(policy.cast_to_param(tree), tree, param)
    _assert_cast(policy.cast_to_compute(tree), tree, compute)
    _assert_cast(policy.cast_to_output(tree), tree, output)
  assert jaxmp.get_policy(str(policy)) == policy


def _numpy_all_finite(tree) -> bool:
  return all(bool(np.all(np.isfinite(np.asarray(x).astype(np.float64))))
             for x in jax.tree_util.tree_leaves(tree) if _is_float_array(x))


@st.composite
def trees_with_poison(draw):
  tree = draw(mixed_trees)
  # Large finite values make the fast path's sum overflow: the exact check must decide.
  huge = draw(st.booleans())
  extra = [np.full((2,), 3e38, np.float32), jnp.full((2,), 3e38, jnp.float32)] if huge else []
  poison = draw(st.sampled_from([None, np.inf, -np.inf, np.nan]))
  if poison is not None:
    extra.append(jnp.asarray([1.0, poison, 2.0], draw(st.sampled_from(
        [jnp.float32, jnp.float16, jnp.bfloat16, jnp.float8_e5m2]))))
  return [tree, extra]


@SETTINGS
@hypothesis.given(tree=trees_with_poison())
def test_all_finite_equals_a_numpy_reference(tree):
  if any(isinstance(x, str) for x in jax.tree_util.tree_leaves(tree)):
    with pytest.raises(TypeError, match="all_finite: leaf .* of type str"):
      jaxmp.all_finite(tree)  # a string is not a number: refused, not taken as finite
    return
  result = jaxmp.all_finite(tree)
  assert result.shape == () and result.dtype == jnp.bool_
  assert bool(result) == _numpy_all_finite(tree)


array_trees = trees(float_arrays(host=False) | st.builds(
    lambda n: jnp.arange(n, dtype=jnp.int32), st.integers(0, 3)))


def _perturbed(tree, seed):
  rng = np.random.default_rng(seed)

  def other(x):
    with np.errstate(over="ignore", invalid="ignore"):
      return jnp.asarray(rng.normal(size=x.shape).astype(np.float32) * 100).astype(x.dtype)

  return jax.tree.map(other, tree)


@SETTINGS
@hypothesis.given(tree=array_trees, seed=st.integers(0, 100), pred=st.booleans())
def test_select_tree_picks_one_tree_bit_for_bit(tree, seed, pred):
  a, b = tree, _perturbed(tree, seed)
  out = jaxmp.select_tree(pred, a, b)
  want = a if pred else b
  out_leaves, out_def = jax.tree_util.tree_flatten(out)
  want_leaves, want_def = jax.tree_util.tree_flatten(want)
  assert out_def == want_def
  for o, w in zip(out_leaves, want_leaves):
    assert o.dtype == w.dtype and o.shape == w.shape
    assert np.asarray(o).tobytes() == np.asarray(w).tobytes()
  # Round trip: from the selection and its swap, each predicate gives one original back.
  swapped = jaxmp.select_tree(pred, b, a)
  for p, original in ((pred, a), (not pred, b)):
    again = jaxmp.select_tree(p, out, swapped)
    for o, w in zip(jax.tree.leaves(again), jax.tree.leaves(original)):
      assert np.asarray(o).tobytes() == np.asarray(w).tobytes()
