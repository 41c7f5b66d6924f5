"""A recipe per GEMM: each of the forward, input-gradient and weight-gradient GEMMs runs its own.

Each GEMM of ``GemmRecipes(a, b, c)`` is checked bit for bit against the same GEMM of
the single recipe it names, and a ``None`` GEMM against a plain ``lax.dot_general`` in
the compute dtype.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp import fp8
from jaxmp._src.fp8 import recipes as recipes_lib

DIMS = (((1,), (0,)), ((), ()))


@pytest.fixture(scope="module")
def operands():
  k = jax.random.split(jax.random.key(0), 3)
  return tuple(jax.random.normal(key, shape).astype(jnp.bfloat16)
               for key, shape in zip(k, ((48, 200), (200, 64), (48, 64))))


def _run_vjp(op, x, w, g):
  """(y, dx, dw) of ``op(x, w)`` for the cotangent ``g``."""
  y, vjp = jax.vjp(op, x, w)
  return (y, *vjp(g))


def _run(op, operands):
  """:func:`_run_vjp`, jitted, as float32 NumPy arrays."""
  run = jax.jit(lambda x, w, g: _run_vjp(op, x, w, g))
  return [np.asarray(a.astype(jnp.float32)) for a in run(*operands)]


_FP8_RUNS = {}


def _fp8(recipe):
  return lambda x, w: fp8.fp8_dot_general(x, w, DIMS, recipe=recipe)


def _fp8_run(recipe, operands):
  """``_run(_fp8(recipe))``, computed once per recipe for the module's operands."""
  if recipe not in _FP8_RUNS:
    _FP8_RUNS[recipe] = _run(_fp8(recipe), operands)
  return _FP8_RUNS[recipe]


def test_each_gemm_runs_the_recipe_it_is_given(operands):
  rows, blocks, mx = fp8.RowwiseScaling(), fp8.BlockScaling(block_size=32), fp8.MXScaling()
  y, dx, dw = _fp8_run(fp8.GemmRecipes(rows, blocks, mx), operands)
  np.testing.assert_array_equal(y, _fp8_run(rows, operands)[0])
  np.testing.assert_array_equal(dx, _fp8_run(blocks, operands)[1])
  np.testing.assert_array_equal(dw, _fp8_run(mx, operands)[2])
  # ... and the three single recipes differ from one another here, so this is a check.
  assert not np.array_equal(dx, _fp8_run(rows, operands)[1])
  assert not np.array_equal(dw, _fp8_run(blocks, operands)[2])


def test_a_product_without_a_gradient_quantizes_only_the_forward_gemms_operands(operands):
  # Differentiated, the op quantizes all four operand layouts in the forward pass
  # behind one optimization barrier (so that a donated train step updates its kernels
  # in place); a barrier keeps every operand alive, so the product alone must not pass
  # through it: it would quantize the backward GEMMs' operands for nothing (and on a
  # TPU v5e its int8 GEMM was then priced at the bfloat16 rate).
  x, w, g = operands
  op = _fp8(fp8.RowwiseScaling())
  count = lambda text: (text.count("optimization_barrier"), text.count("reduce_max"))
  alone = count(jax.make_jaxpr(op)(x, w).pretty_print())
  trained = count(jax.make_jaxpr(lambda x, w: _run_vjp(op, x, w, g))(x, w).pretty_print())
  assert alone[1] == 2, alone  # one row-amax for each of the forward GEMM's operands
  assert trained[1] == 6, trained  # + the two swapped layouts, + g's two
  assert trained[0] == alone[0] + 1, (alone, trained)  # the forward pass's barrier


def test_a_none_gemm_is_the_plain_gemm_in_the_compute_dtype(operands):
  plain = _run(lambda x, w: jax.lax.dot_general(x, w, DIMS), operands)
  rows = fp8.RowwiseScaling()
  # A weight gradient in the compute dtype, as torchao's rowwise_with_gw_hp (which
  # differs in the input-gradient GEMM: the next test).
  y, dx, dw = _fp8_run(fp8.GemmRecipes(rows, rows, None), operands)
  np.testing.assert_array_equal(dw, plain[2])
  np.testing.assert_array_equal(y, _fp8_run(rows, operands)[0])
  assert not np.array_equal(y, plain[0])
  y, _, dw = _fp8_run(fp8.GemmRecipes(None, rows, rows), operands)
  np.testing.assert_array_equal(y, plain[0])
  np.testing.assert_array_equal(dw, _fp8_run(rows, operands)[2])


def test_rowwise_input_gradient_scales_the_kernel_per_input_channel_not_per_tensor(operands):
  # One recipe serves both operands of a GEMM, so GemmRecipes(rows, rows, None) scales
  # the kernel of dx = g @ w.T per row of w (per input channel), where torchao's
  # rowwise_with_gw_hp scales it per tensor: one input channel 2**12 times larger
  # leaves the other channels' input gradients bit for bit as they were.
  x, w, g = operands
  loud = (x, w.at[0].multiply(2**12), g)
  rows = fp8.RowwiseScaling()
  dx = _fp8_run(fp8.GemmRecipes(rows, rows, None), operands)[1]
  np.testing.assert_array_equal(_run(_fp8(fp8.GemmRecipes(rows, rows, None)), loud)[1][:, 1:],
                                dx[:, 1:])
  # A per-tensor kernel scale in that GEMM would move them.
  tensor = fp8.GemmRecipes(rows, fp8.CurrentScaling(), None)
  assert not np.array_equal(_run(_fp8(tensor), loud)[1][:, 1:],
                            _fp8_run(tensor, operands)[1][:, 1:])


def test_one_current_scaling_for_every_gemm_is_current_scaling_bit_for_bit(operands):
  current = fp8.CurrentScaling(margin=1)
  assert recipes_lib.per_gemm(fp8.GemmRecipes(current, current, current)) is current
  same = _fp8_run(fp8.GemmRecipes(current, current, current), operands)
  for a, b in zip(same, _fp8_run(current, operands)):
    np.testing.assert_array_equal(a, b)


def test_per_gemm_current_scaling_scales_each_gemm_operand_per_tensor(operands):
  # Mixed with None, CurrentScaling runs through the per-GEMM op: the same E4M3 x E4M3
  # forward and E5M2 gradients as the whole-layer recipe, to float32 accumulation order.
  current = fp8.CurrentScaling()
  y, dx, _ = _fp8_run(fp8.GemmRecipes(current, current, None), operands)
  whole = _fp8_run(current, operands)
  np.testing.assert_allclose(y, whole[0], rtol=2**-7)
  np.testing.assert_allclose(dx, whole[1], rtol=2**-7)


def test_finer_recipes_keep_no_state_and_refuse_some():
  x = jnp.ones((4, 8))
  w = jnp.ones((8, 2))
  for recipe in (fp8.RowwiseScaling(), fp8.BlockScaling(), fp8.MXScaling(),
                 fp8.GemmRecipes(forward=fp8.MXScaling())):
    assert fp8.init_state(recipe) is None
    with pytest.raises(ValueError, match="keeps no state, but state= was given"):
      fp8.fp8_dot_general(x, w, DIMS, state=fp8.init_state(fp8.DelayedScaling(4)),
                          recipe=recipe)


def test_gemm_recipes_are_hashable_static_arguments_and_compare_by_value():
  a = fp8.GemmRecipes(fp8.RowwiseScaling(), None, fp8.MXScaling())
  assert a == fp8.GemmRecipes(fp8.RowwiseScaling(), None, fp8.MXScaling())
  assert len({a, dataclasses.replace(a, input_grad=fp8.BlockScaling())}) == 2
  assert a.gemms == (fp8.RowwiseScaling(), None, fp8.MXScaling())
  f = jax.jit(lambda x, recipe: fp8.fp8_dot_general(x, x.T, DIMS, recipe=recipe),
              static_argnums=1)
  assert f(jnp.ones((2, 64)), a).shape == (2, 2)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"forward": fp8.DelayedScaling()}, TypeError, "DelayedScaling keeps one state per tensor"),
    ({"input_grad": "rowwise"}, TypeError, "input_grad must be None"),
    ({"weight_grad": fp8.RowwiseScaling}, TypeError, "got <class"),
    ({}, ValueError, "every GEMM is None"),
])
def test_gemm_recipes_refuse_bad_fields(kwargs, error, match):
  with pytest.raises(error, match=match):
    fp8.GemmRecipes(**kwargs)


def test_a_recipe_per_operand_with_one_recipe_for_both_is_that_gemm_bit_for_bit(operands):
  rows = fp8.RowwiseScaling()
  both = fp8.GemmRecipes(rows, fp8.OperandRecipes(output_grad=rows, kernel=rows),
                         fp8.OperandRecipes(output_grad=rows, input=rows))
  for got, expected in zip(_fp8_run(both, operands), _fp8_run(rows, operands)):
    np.testing.assert_array_equal(got, expected)


def test_torchao_rowwise_with_gw_hp_is_spelled_out_and_runs_its_gemms_as_named(operands):
  recipe = fp8.GemmRecipes.rowwise_with_gw_hp()
  rows = fp8.RowwiseScaling(power_of_two=True, gradient_format="e4m3")
  assert recipe == fp8.GemmRecipes(
      rows, fp8.OperandRecipes(kernel=fp8.CurrentScaling(power_of_two=True), output_grad=rows),
      None)
  assert hash(recipe) == hash(fp8.GemmRecipes.rowwise_with_gw_hp())
  # What runs (the lowered program): the forward and input-gradient GEMMs multiply two
  # E4M3 operands, the weight-gradient GEMM the bfloat16 operands themselves.
  x, w, g = operands
  text = jax.jit(lambda x, w, g: _run_vjp(_fp8(recipe), x, w, g)).lower(x, w, g).as_text()
  dots = re.findall(r"stablehlo.dot_general %\S+, %\S+, .*: \(tensor<([^>]*)>, tensor<([^>]*)>\)",
                    text)
  assert [(a.split("x")[-1], b.split("x")[-1]) for a, b in dots] == [
      ("f8E4M3FN", "f8E4M3FN"), ("f8E4M3FN", "f8E4M3FN"), ("bf16", "bf16")], dots
