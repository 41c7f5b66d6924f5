"""Int8Scaling (AQT's symmetric int8) against the NumPy reference, and by rule on published models.

Exact values where int8 arithmetic is exact: the codes and scales, and the GEMMs, whose
int32 accumulation leaves one float32 conversion and one float32 rescale, both
reproduced by :func:`tests.fp8.reference.int8_matmul`.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp import fp8
from jaxmp._src.fp8 import int8
from tests import backends
from tests.fp8 import reference
from tests.published import models as registry

DIMS = (((1,), (0,)), ((), ()))
INT8 = fp8.Int8Scaling()
BF16 = "params=float32,compute=bfloat16,output=float32"


def _random(key, shape, dtype=jnp.float32):
  return (jax.random.normal(jax.random.key(key), shape) * 3).astype(dtype)


def _int8_dots(jaxpr) -> list:
  """The dot_generals with int8 operands anywhere in ``jaxpr``: their preferred types."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general" and all(
        v.aval.dtype == jnp.int8 for v in eqn.invars):
      found.append(np.dtype(eqn.params["preferred_element_type"]))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          found += _int8_dots(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          found += _int8_dots(sub)
  return found


def test_quantization_is_the_reference_bit_for_bit_ties_to_even():
  ties = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -127.0]], np.float32)
  rows = np.concatenate([ties, np.asarray(_random(0, (5, 8))), np.zeros((1, 8), np.float32)])
  got = int8.quantize(jnp.asarray(rows)[None])
  codes, scale = reference.int8_quantize_rows(rows)
  assert got.data.dtype == jnp.int8
  np.testing.assert_array_equal(np.asarray(got.data[0]), codes)
  np.testing.assert_array_equal(np.asarray(got.scale[0, :, 0]), scale)
  np.testing.assert_array_equal(codes[0], [127, 0, 2, 2, 0, -2, 126, -127])
  assert scale[-1] == 1                                       # an all-zero row


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_row_amax_is_the_largest_magnitude_and_inf_for_any_nan(dtype):
  # int8's amax reduces the bits (int8.row_amax); it must read every value as NumPy's
  # max|row| does, NaN of either sign and any payload as inf.
  x = np.array(_random(11, (8, 9)), np.float32)
  x[1, 2] = np.nan
  x[2, 4] = -np.inf
  x[3] = 0.0
  x[4] = -0.0
  x[5, :] = -np.abs(x[5, :])                    # an all-negative row
  x[6, 0] = np.finfo(np.float32).smallest_subnormal if dtype == jnp.float32 else 0
  x[6, 1:] = 0
  x = np.asarray(jnp.asarray(x, dtype))
  bits = x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).copy()
  bits[7, 3] = bits[1, 2] | (1 << (8 * x.itemsize - 1)) | 1  # -NaN with another payload
  x = bits.view(x.dtype)
  got = np.asarray(int8.row_amax(jnp.asarray(x)[None]))[0, :, 0]
  want = np.max(np.abs(x.astype(np.float32)), axis=1)
  want = np.where(np.isnan(want), np.inf, want).astype(np.float32)
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, want)
  assert np.isinf(got[[1, 2, 7]]).all() and (got[[3, 4]] == 0).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("device", backends.DEVICES)
def test_quantizing_swapped_is_swapping_then_quantizing_bit_for_bit(dtype, device):
  # The backward GEMMs' operands are quantized in their forward layout and the codes
  # swapped (int8.quantize_swapped): codes and scales must be those of the reference
  # applied to the swapped operand, non-finite columns included. On a GPU the scales
  # divide within an ulp of IEEE, and a few codes land one away (tests/backends.py).
  x = np.array(_random(12, (2, 6, 40)), np.float32)
  x[0, 1, 3] = np.nan
  x[1, 4, 7] = np.inf
  x[0, :, 9] = 0.0
  x = np.asarray(jnp.asarray(x, dtype))
  with backends.on(device):
    got = int8.quantize_swapped(jnp.asarray(x))
  assert got.data.shape == (2, 40, 6) and got.scale.shape == (2, 40, 1)
  for b in range(2):
    finite = np.isfinite(x[b].astype(np.float32)).all(axis=0)  # the reference's columns
    codes, scale = reference.int8_quantize_rows(x[b].astype(np.float32).T[finite])
    got_codes, got_scale = np.asarray(got.data[b])[finite], np.asarray(got.scale[b, :, 0])[finite]
    if backends.exact(device):
      np.testing.assert_array_equal(got_codes, codes)
      np.testing.assert_array_equal(got_scale, scale)
      continue
    assert backends.max_ulps(got_scale, scale) <= backends.DIVISION_ULPS
    off = np.abs(got_codes.astype(np.int32) - codes)
    assert off.max(initial=0) <= 1 and np.mean(off > 0) <= backends.CODES_OFF_BY_ONE_STEP
  # A column holding inf or NaN: scale inf, every code 0 (its products are NaN).
  assert (np.asarray(got.data[0, 3]) == 0).all() and (np.asarray(got.data[1, 7]) == 0).all()
  assert np.isinf(np.asarray(got.scale[[0, 1], [3, 7], 0])).all()


# The int8 GEMM's exact formula, under IEEE division; on a GPU its scales are an ulp off
# (the quantization test above checks them there).
@pytest.mark.on_cpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_is_the_int32_gemm_rescaled_exactly(dtype):
  x, w = _random(1, (6, 40), dtype), _random(2, (40, 5), dtype)
  got = fp8.fp8_dot_general(x, w, DIMS, recipe=INT8, preferred_element_type=jnp.float32)
  want = reference.int8_matmul(np.asarray(x, np.float32), np.asarray(w, np.float32).T)
  np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.on_cpu  # exact under IEEE division, as the test above
def test_each_gradient_gemm_is_an_int8_gemm_per_channel_exactly():
  x, w, g = _random(3, (6, 40)), _random(4, (40, 5)), _random(5, (6, 5))
  _, vjp = jax.vjp(lambda x, w: fp8.fp8_dot_general(x, w, DIMS, recipe=INT8), x, w)
  dx, dw = vjp(g)
  x, w, g = np.asarray(x), np.asarray(w), np.asarray(g)
  # dx = g @ w.T: g per token, the kernel per input channel (rows of w along N).
  np.testing.assert_array_equal(np.asarray(dx), reference.int8_matmul(g, w))
  # dw = x.T @ g: both per channel along the tokens.
  np.testing.assert_array_equal(np.asarray(dw), reference.int8_matmul(x.T, g.T))


def test_the_gradient_is_straight_through_where_the_backward_gemms_keep_the_compute_dtype():
  # Integer-valued operands: every float32 sum is exact, so the order of summation
  # cannot differ between the two programs.
  x = jnp.round(_random(6, (6, 40)))
  w = jnp.round(_random(7, (40, 5)))
  g = jnp.round(_random(8, (6, 5)))
  recipe = fp8.GemmRecipes(INT8, None, None)
  _, int8_vjp = jax.vjp(lambda x, w: fp8.fp8_dot_general(x, w, DIMS, recipe=recipe), x, w)
  _, plain_vjp = jax.vjp(lambda x, w: jax.lax.dot_general(x, w, DIMS), x, w)
  for got, want in zip(int8_vjp(g), plain_vjp(g)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_non_finite_row_makes_its_products_non_finite_and_leaves_the_others():
  x, w = np.array(_random(9, (4, 16))), np.array(_random(10, (16, 3)))
  x[0, 3] = np.nan
  x[2, 0] = np.inf
  out = np.asarray(fp8.fp8_dot_general(jnp.asarray(x), jnp.asarray(w), DIMS, recipe=INT8))
  assert np.isnan(out[[0, 2]]).all()
  np.testing.assert_array_equal(out[[1, 3]], reference.int8_matmul(x[[1, 3]], w.T))
  # An overflowed output gradient reaches both parameter and input gradients.
  g = np.ones((4, 3), np.float32)
  g[1, 1] = np.inf
  _, vjp = jax.vjp(lambda x, w: fp8.fp8_dot_general(x, w, DIMS, recipe=INT8),
                   jnp.asarray(x[[1, 3, 1, 3]]), jnp.asarray(w))
  dx, dw = vjp(jnp.asarray(g))
  assert not np.isfinite(np.asarray(dx)[1]).any() and np.isfinite(np.asarray(dx)[[0, 2, 3]]).all()
  assert not np.isfinite(np.asarray(dw)).all()


@pytest.mark.parametrize("recipe, count", [
    (INT8, 3),
    (fp8.GemmRecipes(INT8, None, None), 1),
    (fp8.GemmRecipes(INT8, fp8.RowwiseScaling(), INT8), 2),
])
def test_the_int8_gemms_are_int8_dot_generals_with_int32_accumulation(recipe, count):
  x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.bfloat16)

  def loss(x, w):
    return fp8.fp8_dot_general(x, w, DIMS, recipe=recipe).astype(jnp.float32).sum()

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
  assert _int8_dots(jaxpr.jaxpr) == [np.dtype(np.int32)] * count


def test_int8_keeps_no_state_and_composes_with_gemm_recipes():
  assert fp8.init_state(INT8) is None
  assert jaxmp._src.fp8.recipes.per_gemm(INT8) == fp8.GemmRecipes(INT8, INT8, INT8)
  assert hash(fp8.Int8Scaling()) == hash(INT8) and fp8.Int8Scaling() == INT8
  with pytest.raises(TypeError, match=r"Pass an instance, e.g. Int8Scaling\(\)"):
    fp8.GemmRecipes(forward=fp8.Int8Scaling)


def _lm1b_in_int8(mode: str):
  """Flax's published lm1b LM with int8 on every Dense but the logit head: the entry,
  a batch, the wrapped model and its variables."""
  entry = registry.BY_NAME["lm1b_transformer_lm"]
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule("decoder/logitdense"),
                                   jaxmp.Rule((nn.Dense, nn.DenseGeneral), fp8=INT8)])
  batch = entry.batch(jax.random.key(1))
  model = jaxmp.linen.mixed_precision(entry.module(mode), rules)
  return entry, batch, model, entry.init(model, jax.random.key(0), batch)


@pytest.mark.slow
def test_linen_lm1b_runs_its_dense_gemms_in_int8_by_rule():
  entry, batch, model, variables = _lm1b_in_int8("train")
  assert set(variables) == {"params"}                          # int8 keeps no state

  def loss(params):
    logits, _ = entry.forward(model, {"params": params}, batch, "train", jax.random.key(2))
    return registry.cross_entropy(logits, batch.targets)

  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(variables["params"])
  dots = _int8_dots(jaxpr.jaxpr)
  # Per decoder block: query, key, value, out (DenseGeneral) and the MLP's two Dense
  # layers, three GEMMs each; the logit head stays out.
  assert dots == [np.dtype(np.int32)] * (3 * 6 * registry.LAYERS)
  value, grads = jax.jit(jax.value_and_grad(loss))(variables["params"])
  assert np.isfinite(value) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_int8_by_rule_on_a_chip_where_it_does_not_pay_warns_one_text_naming_it_and_the_chip():
  # Each of lm1b's twelve int8 layers traces the check; every message is the same text,
  # so Python's warning filter shows it once, not once per layer.
  entry, batch, model, variables = _lm1b_in_int8("eval")
  forward = lambda v: entry.forward(model, v, batch, "eval", jax.random.key(2))
  messages = {}
  for target in ("v5e", "v7"):
    with warnings.catch_warnings(record=True) as caught, fp8.compile_target(target):
      warnings.simplefilter("always")
      jax.eval_shape(forward, variables)
    messages[target] = [str(w.message) for w in caught
                        if issubclass(w.category, fp8.Fp8FallbackWarning)]
  assert messages["v5e"] == []                      # int8 pays there: no warning
  assert len(messages["v7"]) == 6 * registry.LAYERS  # one per int8 layer, all one text:
  assert set(messages["v7"]) == {
      "jaxmp fp8: Int8Scaling() does not run in int8 on v7 (TPU v7: int8 at the bfloat16 "
      "rate): its forward, input-gradient, weight-gradient GEMMs run as int8 GEMMs at the "
      "bfloat16 rate (libtpu's cost model): only the quantization's cost is added. Name "
      "another target with jaxmp.fp8.compile_target if this is not the chip."}


@pytest.mark.slow
def test_nnx_mnist_cnn_runs_its_linear_gemms_in_int8_by_rule():
  entry = registry.BY_NAME["mnist_cnn"]
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule(nnx.Linear, fp8=INT8)])
  model = jaxmp.nnx.mixed_precision(entry.module(nnx.Rngs(0)), rules)
  batch = entry.batch(jax.random.key(1))
  assert not nnx.state(model, jaxmp.nnx.Fp8State)

  def loss(model):
    return registry.cross_entropy(entry.forward(model, batch, "train", jax.random.key(2)),
                                  batch.targets)

  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(
      lambda state: nnx.grad(loss)(nnx.merge(graphdef, state)))(state)
  assert _int8_dots(jaxpr.jaxpr) == [np.dtype(np.int32)] * 6  # linear1, linear2: 3 GEMMs each
  value = loss(model)
  assert np.isfinite(value)


def test_int8_on_a_layer_with_no_gemm_is_reported_naming_the_rule_and_the_recipe_type():
  # As for fp8: the recipe is dropped where the class has no GEMM, and the rule that
  # reached no GEMM is named in a warning (a rule may match by path, GEMM or not).
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(nn.LayerNorm()(x))

  model = jaxmp.linen.mixed_precision(Block(), jaxmp.PolicyRules(BF16, [
      jaxmp.Rule(nn.LayerNorm, fp8=INT8)]))
  with pytest.warns(UserWarning, match=r"rule 0 \(LayerNorm\) has an int8 recipe but matches "
                    r"no layer fp8 applies to"):
    model.init(jax.random.key(0), jnp.ones((2, 4)))
