"""Recipes: defaults, hashability, and clear errors for every bad option."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxmp import fp8
from jaxmp._src.fp8 import recipes as recipes_lib


def test_defaults_match_transformer_engine_and_flax():
  r = fp8.DelayedScaling()
  assert (r.amax_history_length, r.margin, r.amax_compute) == (1024, 0, "max")
  assert fp8.CurrentScaling().margin == 0


def test_recipes_are_frozen_hashable_and_usable_as_static_jit_arguments():
  r = fp8.DelayedScaling(amax_history_length=np.int64(16), margin=np.int32(1))
  assert r == fp8.DelayedScaling(16, 1) and hash(r) == hash(fp8.DelayedScaling(16, 1))
  assert type(r.amax_history_length) is int and type(r.margin) is int
  with pytest.raises(dataclasses.FrozenInstanceError):
    r.margin = 2  # type: ignore[misc]

  f = jax.jit(lambda x, recipe: x * recipe.margin, static_argnums=1)
  assert float(f(2.0, r)) == 2.0
  assert len({fp8.CurrentScaling(), fp8.CurrentScaling(), r}) == 2


@pytest.mark.parametrize("kwargs, error, match", [
    ({"amax_history_length": 0}, ValueError, r"amax_history_length must be >= 1, got 0"),
    ({"amax_history_length": -3}, ValueError, r"got -3"),
    ({"amax_history_length": 2.5}, TypeError, r"must be an int >= 1, got 2.5 of type float"),
    ({"amax_history_length": True}, TypeError, r"got True of type bool"),
    ({"amax_history_length": "16"}, TypeError, r"got '16' of type str"),
    ({"margin": -1}, ValueError, r"margin must be >= 0, got -1"),
    ({"margin": 0.5}, TypeError, r"margin must be a non-negative int.*got 0.5"),
    ({"amax_compute": "mean"}, ValueError,
     r"unknown amax_compute 'mean'; accepted values are 'max', 'most_recent'"),
])
def test_delayed_scaling_rejects_bad_options(kwargs, error, match):
  with pytest.raises(error, match=match):
    fp8.DelayedScaling(**kwargs)


def test_unknown_recipe_option_is_a_clear_error():
  with pytest.raises(TypeError, match="amax_history"):
    fp8.DelayedScaling(amax_history=16)  # type: ignore[call-arg]
  with pytest.raises(TypeError, match="amax_history_length"):
    fp8.CurrentScaling(amax_history_length=16)  # type: ignore[call-arg]
  with pytest.raises(ValueError, match="margin must be >= 0, got -2"):
    fp8.CurrentScaling(margin=-2)


@pytest.mark.parametrize("bad, match", [
    (fp8.DelayedScaling, r"Pass an instance, e.g. DelayedScaling\(\)"),
    ("delayed", r"got 'delayed' of type str"),
    (None, r"got None of type NoneType"),
    ({"amax_history_length": 16}, r"of type dict"),
])
def test_check_recipe_names_the_bad_value(bad, match):
  with pytest.raises(TypeError, match=match):
    recipes_lib.check_recipe(bad)


@pytest.mark.parametrize("recipe", [fp8.DelayedScaling, fp8.CurrentScaling])
def test_margins_whose_scales_overflow_float32_are_refused(recipe):
  assert recipe(margin=recipes_lib.MAX_MARGIN).margin == 56
  for margin in (57, 128, 200):
    with pytest.raises(ValueError, match=rf"margin must be in \[0, 56\] .*got {margin}"):
      recipe(margin=margin)


def test_the_margin_bound_is_where_two_scales_of_a_float16_sized_amax_overflow():
  # The op dequantizes with the product of two scales (input x kernel) in float32; for
  # an amax of float16's max, margin 56 keeps that product a normal float32, 57 does not.
  import jax.numpy as jnp
  from jaxmp._src.fp8 import quantize as q

  amax = jnp.float32(65504.0)
  products = {m: q.scale_from_amax(amax, jnp.float32(1.0), q.E4M3, m) ** 2 for m in (56, 57)}
  assert np.isfinite(products[56]) and products[56] >= np.finfo(np.float32).tiny
  assert not np.isfinite(products[57])
