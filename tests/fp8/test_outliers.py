"""Outlier stress: a few huge activations, per-tensor scaling against row, block and MX scaling.

"Massive activations" in LLMs reach about 10**4 times the typical magnitude (Sun et al.,
2024), in a few tokens and a few channels. One per-tensor scale then maps the
ordinary values far below E4M3's normal range (``2**-6`` after scaling): they turn
subnormal (fewer than 3 bits) or zero. A finer scale keeps every group that holds no
outlier exactly as it would be without the outliers: bit for bit, which is what these
tests assert, besides the error of the per-tensor product.

Which granularity isolates which outliers follows from where the groups run: outlier
*tokens* are isolated by every finer recipe (its groups lie within a token's row);
outlier *channels* by the tiles and blocks along the channels (``BlockScaling``,
``MXScaling``) in the forward GEMM, and by every finer recipe in the weight-gradient
GEMM (which contracts the tokens, so its groups lie within a channel). Per-token row
scales do not isolate outlier channels in the forward GEMM: every token holds them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp import fp8
from jaxmp._src.fp8 import per_gemm
from tests.fp8 import reference as ref

DIMS = (((1,), (0,)), ((), ()))
TOKENS, CHANNELS, FEATURES = 256, 384, 128
OUTLIERS = 2
RATIO = 1e4
FINER = {"rowwise": fp8.RowwiseScaling(power_of_two=False), "block": fp8.BlockScaling(),
         "mx": fp8.MXScaling()}
PER_TENSOR = fp8.CurrentScaling()


@pytest.fixture(scope="module")
def data():
  k = jax.random.split(jax.random.key(7), 3)
  x = jax.random.normal(k[0], (TOKENS, CHANNELS))
  w = jax.random.normal(k[1], (CHANNELS, FEATURES)) / np.sqrt(CHANNELS)
  g = jax.random.normal(k[2], (TOKENS, FEATURES))
  return x, w, g


@functools.cache
def _gemms_of(recipe):
  """The recipe's three GEMMs, jitted once per recipe (a recipe is hashable): every call
  of a module has the same shapes, so each recipe compiles once, not once per call."""
  @jax.jit
  def run(x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp8.fp8_dot_general(x, w, DIMS, recipe=recipe), x, w)
    return (y, *vjp(g))
  return run


def _gemms(recipe, x, w, g):
  return [np.asarray(a, np.float64) for a in _gemms_of(recipe)(x, w, g)]


def _relative_error(actual, expected):
  return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def test_outlier_tokens_ruin_per_tensor_scaling_and_leave_finer_scaling_untouched(data):
  x, w, g = data
  spiked = x.at[:OUTLIERS].multiply(RATIO)                  # two massive tokens
  exact = np.asarray(spiked, np.float64) @ np.asarray(w, np.float64)
  ordinary = slice(OUTLIERS, None)

  # Per tensor: most ordinary entries of the input land below E4M3's normal range.
  scale = ref.current_scale(np.max(np.abs(np.asarray(spiked))), "e4m3")
  scaled = np.abs(np.asarray(spiked)[ordinary]) / scale
  assert np.mean(scaled < 2.0**-6) > 0.6                    # subnormal or zero
  assert np.mean(scaled < 2.0**-10) > 0.05                  # rounds to zero

  clean_error = _relative_error(_gemms(PER_TENSOR, x, w, g)[0],
                                np.asarray(x, np.float64) @ np.asarray(w, np.float64))
  tensor_error = _relative_error(_gemms(PER_TENSOR, spiked, w, g)[0][ordinary],
                                 exact[ordinary])
  assert 0.03 < clean_error < 0.045 and tensor_error > 1.3 * clean_error

  for name, recipe in FINER.items():
    spiked_out = _gemms(recipe, spiked, w, g)[0]
    clean_out = _gemms(recipe, x, w, g)[0]
    # The ordinary tokens' outputs: the same bits as with no outlier at all.
    np.testing.assert_array_equal(spiked_out[ordinary], clean_out[ordinary], err_msg=name)
    assert _relative_error(spiked_out[ordinary], exact[ordinary]) < 0.045, name


def test_ten_times_larger_outliers_make_per_tensor_output_useless(data):
  x, w, _ = data
  spiked = x.at[:OUTLIERS].multiply(10 * RATIO)
  exact = (np.asarray(spiked, np.float64) @ np.asarray(w, np.float64))[OUTLIERS:]
  y = np.asarray(fp8.fp8_dot_general(spiked, w, DIMS, recipe=PER_TENSOR), np.float64)
  assert _relative_error(y[OUTLIERS:], exact) > 0.3
  y = np.asarray(fp8.fp8_dot_general(spiked, w, DIMS, recipe=FINER["rowwise"]), np.float64)
  assert _relative_error(y[OUTLIERS:], exact) < 0.045


def test_outlier_channels_in_the_weight_gradient(data):
  x, w, g = data
  spiked = x.at[:, :OUTLIERS].multiply(RATIO)               # two massive channels
  exact = np.asarray(spiked, np.float64).T @ np.asarray(g, np.float64)
  ordinary = slice(OUTLIERS, None)
  tensor_dw = _gemms(PER_TENSOR, spiked, w, g)[2]
  clean_dw = _gemms(PER_TENSOR, x, w, g)[2]
  clean_error = _relative_error(clean_dw, np.asarray(x, np.float64).T @ np.asarray(g, np.float64))
  # E5M2 output gradients dominate per-tensor's error (about 6%); the outliers add to it.
  assert _relative_error(tensor_dw[ordinary], exact[ordinary]) > 1.1 * clean_error
  for name, recipe in FINER.items():
    # The weight gradient contracts the tokens: every finer group lies within a channel.
    np.testing.assert_array_equal(_gemms(recipe, spiked, w, g)[2][ordinary],
                                  _gemms(recipe, x, w, g)[2][ordinary], err_msg=name)


def test_outlier_channels_in_the_forward_gemm_are_isolated_by_tiles_not_by_rows(data):
  x, _, _ = data
  spiked = x.at[:, :OUTLIERS].multiply(RATIO)
  tile = 128  # BlockScaling's tiles and MX's blocks hold the outliers in the first 128
  for name, recipe, isolated in (("rowwise", FINER["rowwise"], False),
                                 ("block", FINER["block"], True), ("mx", FINER["mx"], True),
                                 ("per tensor", PER_TENSOR, False)):
    q_spiked = per_gemm.quantize(spiked[None], recipe, per_gemm.INPUT)
    q_clean = per_gemm.quantize(x[None], recipe, per_gemm.INPUT)
    same = np.array_equal(np.asarray(q_spiked.data[0, :, tile:CHANNELS]).view(np.uint8),
                          np.asarray(q_clean.data[0, :, tile:CHANNELS]).view(np.uint8))
    assert same == isolated, name
