"""fp8_dot_general and fp8_einsum: numerics, goldens, transforms, signatures, errors."""

import functools
import subprocess
import sys
import textwrap

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmp import fp8
from tests import xla_flags

DENSE = (((1,), (0,)), ((), ()))


def _representable(seed, shape, dtype=jnp.float8_e4m3fn, scale=1.0):
  """Random values that fp8 represents exactly at scale 1 (so fp8 math is exact)."""
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale
  return jnp.asarray(x.astype(dtype).astype(np.float32))


def _normal(seed, shape, scale=1.0, dtype=np.float32):
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale
  return jnp.asarray(x.astype(dtype))


def _state(length=4):
  recipe = fp8.DelayedScaling(amax_history_length=length)
  return recipe, fp8.init_state(recipe)


# Dimension numbers beyond a plain dense layer: batch dims, several contracting
# dims, contracting dims that are not last, kernels contracted on their last axis.
CASES = [
    ((4, 8), (8, 3), DENSE),
    ((2, 5, 8), (8, 3), (((2,), (0,)), ((), ()))),
    ((8, 4), (3, 8), (((0,), (1,)), ((), ()))),
    ((2, 4, 3, 6), (3, 6, 5), (((2, 3), (0, 1)), ((), ()))),
    ((3, 4, 8), (3, 8, 5), (((2,), (1,)), ((0,), (0,)))),
    ((4, 3, 8, 2), (2, 8, 5, 3), (((2,), (1,)), ((3, 1), (0, 3)))),
]


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", CASES)
def test_exact_for_representable_operands_forward_and_backward(lhs_shape, rhs_shape, dims):
  """At scale 1, fp8-representable operands make the fp8 product exact."""
  k1, k2, k3 = 0, 1, 2
  x, w = _representable(k1, lhs_shape), _representable(k2, rhs_shape)
  recipe, state = _state()
  fp8_fn = lambda x, w: fp8.fp8_dot_general(x, w, dims, state=state, recipe=recipe)
  ref_fn = lambda x, w: jax.lax.dot_general(x, w, dims, precision="highest")
  g = _representable(k3, jax.eval_shape(ref_fn, x, w).shape, jnp.float8_e5m2)

  @jax.jit
  def outputs_and_grads(x, w):
    return [(f(x, w), jax.grad(lambda x, w: jnp.sum(f(x, w) * g), (0, 1))(x, w))
            for f in (fp8_fn, ref_fn)]

  (y, grads), (ref, ref_grads) = outputs_and_grads(x, w)
  np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
  for a, b in zip(grads, ref_grads):
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recipe", [fp8.DelayedScaling(4), fp8.CurrentScaling()])
def test_close_to_float32_for_ordinary_values(recipe):
  x, w = _normal(3, (16, 64), 30), _normal(4, (64, 32), 0.02)
  dot = jax.jit(lambda s: fp8.fp8_dot_general(x, w, DENSE, state=s, recipe=recipe))
  state = fp8.init_state(recipe)
  if state is not None:  # one step so that delayed scaling has seen the amaxes
    state = jax.grad(lambda s: jnp.sum(dot(s)))(state)
  y = dot(state)
  ref = x @ w
  assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.05


class TestDtypes:

  def test_output_dtype_follows_operands_like_lax(self):
    x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 4), jnp.bfloat16)
    recipe = fp8.CurrentScaling()
    assert fp8.fp8_dot_general(x, w, DENSE, recipe=recipe).dtype == jnp.bfloat16
    assert fp8.fp8_dot_general(x, w.astype(jnp.float32), DENSE, recipe=recipe).dtype == jnp.float32
    assert fp8.fp8_dot_general(x, w, DENSE, preferred_element_type=jnp.float32,
                               recipe=recipe).dtype == jnp.float32
    assert fp8.fp8_dot_general(x.astype(jnp.float16), w.astype(jnp.float16), DENSE,
                               recipe=recipe).dtype == jnp.float16

  def test_gradients_have_the_operands_dtypes(self):
    x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 4), jnp.float32)
    recipe, state = _state()
    gx, gw, gs = jax.grad(lambda x, w, s: jnp.sum(fp8.fp8_dot_general(
        x, w, DENSE, state=s, recipe=recipe)), (0, 1, 2))(x, w, state)
    assert (gx.dtype, gw.dtype) == (jnp.bfloat16, jnp.float32)
    assert all(leaf.dtype == jnp.float32 for leaf in gs)

  def test_bfloat16_result_is_the_float32_scaled_product_rounded_once(self):
    x = _normal(5, (32, 64), 7, jnp.bfloat16)
    w = _normal(6, (64, 16), 0.1, jnp.bfloat16)
    recipe = fp8.CurrentScaling()

    @jax.jit
    def ours_and_reference(x, w):
      sx = 1 / ((448 / jnp.max(jnp.abs(x)).astype(jnp.float32)))
      sw = 1 / ((448 / jnp.max(jnp.abs(w)).astype(jnp.float32)))
      qx = jnp.clip(x.astype(jnp.float32) / sx, -448, 448).astype(jnp.float8_e4m3fn)
      qw = jnp.clip(w.astype(jnp.float32) / sw, -448, 448).astype(jnp.float8_e4m3fn)
      ref = (jnp.dot(qx.astype(jnp.float32), qw.astype(jnp.float32),
                     precision="highest") * (sx * sw)).astype(jnp.bfloat16)
      return fp8.fp8_dot_general(x, w, DENSE, recipe=recipe), ref

    y, ref = ours_and_reference(x, w)
    # Bit-equal here; a CPU whose GEMM sums in another order may differ in a last bit.
    np.testing.assert_allclose(y.astype(np.float32), ref.astype(np.float32), rtol=2**-7)
    assert np.mean(np.asarray(y) != np.asarray(ref)) <= 0.01


class TestGoldens:
  """REFERENCE.md's golden sequences (Flax's and TransformerEngine's values)."""

  def test_layer_used_three_times_per_step_takes_the_max(self):
    # Flax's fm32 test: a 1x1 layer applied three times in a scan to its own output.
    # Step 1 input 2 (scale 1 keeps it 2); step 2 input 3, but the scale 2/448 from
    # history [2, 0, 0] saturates it to 2 for the next two uses; step 3 likewise.
    recipe = fp8.DelayedScaling(amax_history_length=3)

    @jax.jit
    def state_grad(x, state):
      def loss(state):
        state = fp8.state.for_grad(state)

        def body(c, _):
          return fp8.fp8_dot_general(c, jnp.ones((1, 1)), DENSE, state=state, recipe=recipe), None

        return jax.lax.scan(body, jnp.full((1, 1), x), None, length=3)[0][0, 0]
      return jax.grad(loss)(state)

    state = fp8.init_state(recipe)
    expected = [([2, 0, 0], 1.0), ([3, 0, 2], 2 / 448), ([4, 2, 3], 3 / 448)]
    for x, (history, scale) in zip([2.0, 3.0, 4.0], expected):
      state = fp8.state.merge(state, state_grad(x, state))
      np.testing.assert_array_equal(state.input_amax_history, history)
      np.testing.assert_allclose(state.input_scale, [scale], rtol=1e-6)

  def test_the_same_loop_without_for_grad_sums_like_flax_float32(self):
    recipe = fp8.DelayedScaling(amax_history_length=3)

    def loss(state):
      def body(c, _):
        return fp8.fp8_dot_general(c, jnp.ones((1, 1)), DENSE, state=state, recipe=recipe), None
      return jax.lax.scan(body, jnp.full((1, 1), 2.0), None, length=3)[0][0, 0]

    ct = jax.grad(loss)(fp8.init_state(recipe))
    np.testing.assert_array_equal(ct.input_amax_history, [6, 0, 0])  # why for_grad exists

  @pytest.mark.parametrize("amax_compute, expected", [
      ("max", [1.0, 1 / 448, 10 / 448, 10 / 448]),
      ("most_recent", [1.0, 1 / 448, 10 / 448, 3 / 448]),
  ])
  def test_dense_input_amax_1_10_3(self, amax_compute, expected):
    recipe = fp8.DelayedScaling(amax_history_length=4, amax_compute=amax_compute)
    w = jnp.ones((2, 3))
    step = jax.jit(jax.grad(lambda s, x: jnp.sum(
        fp8.fp8_dot_general(x, w, DENSE, state=s, recipe=recipe))))
    state, scales = fp8.init_state(recipe), []
    for amax in [1.0, 10.0, 3.0, 1.0]:
      state = fp8.state.merge(state, step(state, jnp.array([[amax, -0.5]])))
      scales.append(float(state.input_scale[0]))
    np.testing.assert_allclose(scales, expected, rtol=1e-6)
    # Bit-identical to Flax/TE's formula 1 / (448 / amax).
    assert np.float32(scales[2]) == np.float32(1) / (np.float32(448) / np.float32(10))

  def test_margin_leaves_headroom(self):
    recipe = fp8.DelayedScaling(amax_history_length=2, margin=2)
    state = fp8.init_state(recipe)._replace(input_amax_history=jnp.array([7.0, 0.0]))
    ct = jax.grad(lambda s: jnp.sum(fp8.fp8_dot_general(
        jnp.ones((1, 1)), jnp.ones((1, 1)), DENSE, state=s, recipe=recipe)))(state)
    np.testing.assert_allclose(ct.input_scale, [7 * 4 / 448], rtol=1e-6)


class TestSoundness:

  def test_zero_cotangent_from_stop_gradient_or_unused_output_keeps_the_state(self):
    recipe = fp8.DelayedScaling(amax_history_length=2)
    state = fp8.init_state(recipe)._replace(
        input_scale=jnp.array([0.5]), input_amax_history=jnp.array([3.0, 1.0]))
    x, w = jnp.ones((2, 2)), jnp.ones((2, 2))
    dot = lambda s: fp8.fp8_dot_general(x, w, DENSE, state=s, recipe=recipe)
    losses = (lambda s: jnp.sum(jax.lax.stop_gradient(dot(s))),
              lambda s: (dot(s), 0.0)[1],
              lambda s: jnp.sum(jax.lax.stop_gradient(dot(fp8.state.for_grad(s)))))

    @jax.jit
    def raw_and_merged(state):
      raws = [jax.grad(loss)(state) for loss in losses]
      return raws, [fp8.state.merge(state, raw) for raw in raws]

    raws, merged = raw_and_merged(state)
    for raw, new in zip(raws, merged):
      assert float(raw.input_scale[0]) == 0.0  # what Flax's trainer would write
      chex.assert_trees_all_equal(new, state)

  def test_a_zeroed_state_recovers_instead_of_poisoning_the_layer(self):
    """What Flax's TrainState writes after a zero cotangent: the op reads it as fresh."""
    recipe = fp8.DelayedScaling(amax_history_length=2)
    zeroed = jax.tree_util.tree_map(jnp.zeros_like, fp8.init_state(recipe))
    x, w = jnp.array([[1.0, 2.0]]), jnp.array([[1.0], [1.0]])
    y, vjp = jax.vjp(lambda s: fp8.fp8_dot_general(x, w, DENSE, state=s, recipe=recipe), zeroed)
    np.testing.assert_array_equal(y, [[3.0]])
    (ct,) = vjp(jnp.ones_like(y))
    assert float(ct.input_scale[0]) == 1.0
    np.testing.assert_array_equal(ct.input_amax_history, [2.0, 0.0])

  def test_inf_and_nan_never_enter_the_history(self):
    recipe = fp8.DelayedScaling(amax_history_length=2)
    state = fp8.init_state(recipe)._replace(input_amax_history=jnp.array([3.0, 0.0]),
                                            output_grad_amax_history=jnp.array([5.0, 0.0]))
    x = jnp.array([[np.inf, 1.0]])
    ct = jax.grad(lambda s: jnp.sum(fp8.fp8_dot_general(
        x, jnp.ones((2, 2)), DENSE, state=s, recipe=recipe) * jnp.array([np.nan, 1.0])))(state)
    np.testing.assert_array_equal(ct.input_amax_history, [0.0, 3.0])
    np.testing.assert_array_equal(ct.output_grad_amax_history, [0.0, 5.0])
    chex.assert_tree_all_finite(ct)
    # And a loss-scaling trainer that sees the non-finite gradients keeps the old state.
    kept = fp8.state.merge(state, ct, grads_finite=jnp.array(False))
    chex.assert_trees_all_equal(kept, state)


class TestVmap:
  recipe = fp8.DelayedScaling(amax_history_length=2)
  xs = jnp.array([[[1.0]], [[2.0]], [[3.0]]])

  def _loss(self, state, shared=True, use_for_grad=False):
    if use_for_grad:
      state = fp8.state.for_grad(state)
    f = lambda x, s: fp8.fp8_dot_general(x, jnp.ones((1, 1)), DENSE, state=s, recipe=self.recipe)
    in_axes = (0, None) if shared else (0, 0)
    return jnp.sum(jax.vmap(f, in_axes=in_axes)(self.xs, state))

  @pytest.mark.parametrize("use_for_grad", [False, True])
  def test_shared_state_gets_the_max_over_the_batch(self, use_for_grad):
    ct = jax.jit(jax.grad(functools.partial(self._loss, use_for_grad=use_for_grad)))(
        fp8.init_state(self.recipe))
    np.testing.assert_array_equal(ct.input_amax_history, [3.0, 0.0])  # not 1 + 2 + 3
    np.testing.assert_array_equal(ct.kernel_amax_history, [1.0, 0.0])  # not 3
    np.testing.assert_array_equal(ct.input_scale, [1.0])

  def test_per_member_state_gets_per_member_amaxes(self):
    states = jax.tree_util.tree_map(lambda a: jnp.stack([a] * 3), fp8.init_state(self.recipe))
    ct = jax.jit(jax.grad(functools.partial(self._loss, shared=False)))(states)
    np.testing.assert_array_equal(ct.input_amax_history, [[1, 0], [2, 0], [3, 0]])

  def test_per_example_gradients(self):
    f = lambda x, s: jnp.sum(fp8.fp8_dot_general(x, jnp.ones((1, 1)), DENSE, state=s,
                                                 recipe=self.recipe))
    cts = jax.jit(jax.vmap(jax.grad(f, argnums=1), in_axes=(0, None)))(
        self.xs, fp8.init_state(self.recipe))
    assert cts.input_amax_history.shape == (3, 2)


class TestSignature:

  def test_partial_is_a_dot_general_for_flax_dense(self):
    recipe, state = _state()
    dg = functools.partial(fp8.fp8_dot_general, state=state, recipe=recipe)
    layer = nn.Dense(3, dot_general=dg, precision=jax.lax.Precision.HIGHEST)
    x = jnp.ones((2, 4))
    v = layer.init(jax.random.key(0), x)
    assert layer.apply(v, x).shape == (2, 3)

  def test_nnx_linear_passes_out_sharding(self):
    dg = functools.partial(fp8.fp8_dot_general, recipe=fp8.CurrentScaling())
    layer = nnx.Linear(4, 3, dot_general=dg, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 4))
    np.testing.assert_allclose(layer(x), x @ layer.kernel[...] + layer.bias[...], rtol=0.1)

  def test_keywords_flax_and_nnx_pass(self):
    recipe, state = _state()
    y = fp8.fp8_dot_general(jnp.ones((2, 4)), jnp.ones((4, 3)), DENSE,
                            precision=jax.lax.Precision.HIGHEST, preferred_element_type=None,
                            out_sharding=None, state=state, recipe=recipe)
    np.testing.assert_array_equal(y, np.full((2, 3), 4.0))

  def test_mapping_state_is_accepted(self):
    recipe, state = _state()
    y = fp8.fp8_dot_general(jnp.ones((1, 2)), jnp.ones((2, 1)), DENSE, state=state._asdict(),
                            recipe=recipe)
    assert float(y[0, 0]) == 2.0

  @pytest.mark.slow
  def test_out_sharding_under_an_explicit_mesh(self):
    code = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np
      from jax.sharding import PartitionSpec as P, AxisType
      from jaxmp import fp8
      mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
      recipe = fp8.DelayedScaling(4)
      dims = (((1,), (0,)), ((), ()))
      with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((4, 8)), P("x", None))
        w = jax.device_put(jnp.full((8, 6), 0.5), P(None, None))
        def loss(x, w, s):
          y = fp8.fp8_dot_general(x, w, dims, out_sharding=P("x", None), state=s, recipe=recipe)
          return jnp.sum(y), y
        (_, y), (gx, gw, gs) = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
            x, w, fp8.init_state(recipe))
        assert y.sharding.spec == P("x", None), y.sharding
        assert gx.sharding.spec == P("x", None) and gw.sharding.spec == P(None, None)
        np.testing.assert_array_equal(y, np.full((4, 6), 4.0))
        np.testing.assert_array_equal(gw, np.full((8, 6), 4.0))
        np.testing.assert_array_equal(gs.input_amax_history, [1, 0, 0, 0])
      print("ok")
    """)
    env = xla_flags.environ("--xla_force_host_platform_device_count=2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


class TestErrors:

  @pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_, jnp.complex64])
  def test_non_float_operands(self, dtype):
    x = jnp.ones((2, 2), dtype)
    with pytest.raises(TypeError, match=f"lhs must be a floating-point array, got dtype "
                                        f"{np.dtype(dtype).name}"):
      fp8.fp8_dot_general(x, jnp.ones((2, 2)), DENSE, recipe=fp8.CurrentScaling())
    with pytest.raises(TypeError, match=f"rhs must be .* got dtype {np.dtype(dtype).name}"):
      fp8.fp8_dot_general(jnp.ones((2, 2)), x, DENSE, recipe=fp8.CurrentScaling())

  def test_bad_preferred_element_type(self):
    with pytest.raises(TypeError, match="preferred_element_type must be a floating-point "
                                        "dtype, got int32"):
      fp8.fp8_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), DENSE,
                          preferred_element_type=jnp.int32, recipe=fp8.CurrentScaling())

  def test_state_errors(self):
    x = jnp.ones((2, 2))
    with pytest.raises(ValueError, match=r"DelayedScaling needs state=.*init_state"):
      fp8.fp8_dot_general(x, x, DENSE, recipe=fp8.DelayedScaling(4))
    with pytest.raises(ValueError, match="keeps no state, but state= was given"):
      fp8.fp8_dot_general(x, x, DENSE, state=_state()[1], recipe=fp8.CurrentScaling())
    with pytest.raises(ValueError, match=r"input_amax_history has shape \(4,\), but the recipe "
                                         "has amax_history_length=8"):
      fp8.fp8_dot_general(x, x, DENSE, state=_state(4)[1], recipe=fp8.DelayedScaling(8))
    with pytest.raises(ValueError, match=r"missing \['output_grad_scale'\]"):
      fp8.fp8_dot_general(x, x, DENSE, recipe=fp8.DelayedScaling(4), state={
          k: v for k, v in _state()[1]._asdict().items() if k != "output_grad_scale"})
    with pytest.raises(TypeError, match="state must be a jaxmp.fp8.DelayedScalingState"):
      fp8.fp8_dot_general(x, x, DENSE, state=[1.0], recipe=fp8.DelayedScaling(4))

  def test_bad_recipe_and_dimension_numbers(self):
    x = jnp.ones((2, 2))
    with pytest.raises(TypeError, match="recipe must be a jaxmp.fp8.DelayedScaling or .* got "
                                        "'current' of type str"):
      fp8.fp8_dot_general(x, x, DENSE, recipe="current")
    with pytest.raises(ValueError, match="dimension_numbers must be"):
      fp8.fp8_dot_general(x, x, (1, 0), recipe=fp8.CurrentScaling())


EINSUMS = [
    ("btd,dh->bth", (2, 3, 4), (4, 5)),
    ("btd,dnh->btnh", (2, 3, 4), (4, 2, 5)),
    ("btnh,nhd->btd", (2, 3, 2, 4), (2, 4, 5)),
    ("...d,hd->...h", (2, 3, 4), (5, 4)),
    ("bd,bdh->bh", (3, 4), (3, 4, 5)),
    ("mk,nk->nm", (3, 4), (5, 4)),  # jnp.einsum would call dot_general(rhs, lhs)
    ("bxd,dh->bh", (2, 3, 4), (4, 5)),  # x summed out of the input first
    ("bd,dh", (3, 4), (4, 5)),  # implicit output
]


@pytest.mark.parametrize("eqn, lhs_shape, rhs_shape", EINSUMS)
def test_fp8_einsum_matches_jnp_einsum(eqn, lhs_shape, rhs_shape):
  x, w = _representable(7, lhs_shape, scale=0.5), _representable(8, rhs_shape)
  recipe, state = _state()
  fn = lambda x, w, s: fp8.fp8_einsum(eqn, x, w, state=s, recipe=recipe)
  ref_fn = lambda x, w, s: jnp.einsum(eqn, x, w, precision="highest")
  g = _representable(9, jax.eval_shape(ref_fn, x, w, None).shape, jnp.float8_e5m2)

  @jax.jit
  def outputs_and_grads(x, w, s):
    return [(f(x, w, s), jax.grad(lambda x, w, s: jnp.sum(f(x, w, s) * g), (0, 1, 2))(x, w, s))
            for f in (fn, ref_fn)]

  (y, (gx, gw, gs)), (ref, (rx, rw, _)) = outputs_and_grads(x, w, state)
  if "x" in eqn:  # summing x out before quantizing is not exact in fp8
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.05
  else:
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gx, rx, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gw, rw, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gs.input_amax_history[0], jnp.max(jnp.abs(x)))
  # The kernel's amax goes to the kernel's history, whatever order einsum prefers.
  np.testing.assert_allclose(gs.kernel_amax_history[0], jnp.max(jnp.abs(w)))


@pytest.mark.parametrize("eqn, match", [
    ("ab,bc,cd->ad", "exactly two operands"),
    ("aa,ab->b", "repeated subscripts within the lhs"),
    ("ab,bc->az", r"output subscripts \['z'\]"),
    ("ab,b1->a", "subscripts must be letters"),
    ("abc,bc->a", "lhs has 2 dimensions but its subscripts 'abc' name 3"),
])
def test_fp8_einsum_errors(eqn, match):
  with pytest.raises(ValueError, match=match):
    fp8.fp8_einsum(eqn, jnp.ones((2, 3)), jnp.ones((3, 3)), recipe=fp8.CurrentScaling())
  with pytest.raises(ValueError, match="subscript 'b' of 'ab,bc->ac' has size 3 in lhs and 4"):
    fp8.fp8_einsum("ab,bc->ac", jnp.ones((2, 3)), jnp.ones((4, 3)), recipe=fp8.CurrentScaling())
