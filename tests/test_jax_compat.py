"""jax_compat's probes, and what jaxmp does on a JAX without each piece.

A missing piece is simulated as a newer or older JAX would present it: its module
hidden from the import system (``sys.modules[name] = None`` makes ``import name``
fail) or a name it needs removed. Each probe's cache is cleared before and after, so
the real answer comes back for the next test.
"""

import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp import fp8
from jaxmp._src import jax_compat
from jaxmp._src.fp8 import block_gemm
from jaxmp._src.fp8 import block_gemm_mosaic
from jaxmp._src.fp8 import fused_quantize
from jaxmp._src.fp8 import grouped
from jaxmp._src.fp8 import maxgrad
from jaxmp._src.fp8 import support

PROBES = (jax_compat.pallas_triton, jax_compat._layout_api, jax_compat._cuda_versions,
          jax_compat.extended_dtypes, jax_compat.pallas_mosaic_gpu, jax_compat.mosaic_gpu,
          jax_compat.mosaic_gpu_interpreter)
DIMS = (((1,), (0,)), ((), ()))


def _clear_probes():
  for probe in PROBES:
    probe.cache_clear()


@pytest.fixture
def fresh_probes():
  """Every probe asks again after the test (which may have hidden a piece)."""
  yield
  _clear_probes()


def _hide(monkeypatch, *modules):
  """``import`` of each of ``modules`` fails from now on; the probes ask again."""
  for name in modules:
    monkeypatch.setitem(sys.modules, name, None)
  _clear_probes()


def _trace(recipe, x, w) -> str:
  return jax.jit(lambda x, w: fp8.fp8_dot_general(x, w, DIMS, recipe=recipe)).trace(
      x, w).jaxpr.pretty_print()


def test_each_probe_finds_its_piece_on_the_installed_jax(fresh_probes):
  # The range make test and make test-min run has every piece; a probe that stopped
  # finding one would turn a feature off silently on every supported JAX.
  assert jax_compat.pallas_triton() is not None
  assert jax_compat.extended_dtypes() is not None
  assert jax_compat._layout_api() is not None
  assert jax_compat._cuda_versions()[0]
  assert block_gemm.available()
  assert jax_compat.pallas_mosaic_gpu() is not None and fused_quantize.available()
  assert jax_compat.mosaic_gpu() is not None and block_gemm_mosaic.available()
  assert jax_compat.mosaic_gpu_interpreter() is not None


@pytest.mark.parametrize("hidden", ["jax._src.pallas.triton", "jaxlib.triton",
                                    "jaxlib.mlir"])
def test_without_pallas_triton_block_scaling_runs_the_mosaic_kernel_on_hopper(
    monkeypatch, fresh_probes, hidden):
  x, w = jnp.ones((8, 128)), jnp.ones((128, 8))
  with fp8.compile_target("h100"):
    text = _trace(fp8.BlockScaling(), x, w)
  assert "jaxmp_block_fp8_gemm" in text and "jaxmp_block_fp8_gemm_mosaic" not in text
  _hide(monkeypatch, hidden)
  assert jax_compat.pallas_triton() is None and not block_gemm.available()
  with fp8.compile_target("h100"), warnings.catch_warnings():
    warnings.simplefilter("error", fp8.Fp8FallbackWarning)
    assert "jaxmp_block_fp8_gemm_mosaic" in _trace(fp8.BlockScaling(), x, w)


def test_without_either_kernel_s_pieces_block_scaling_runs_dequantized_on_hopper(
    monkeypatch, fresh_probes):
  from jax.experimental.pallas import mosaic_gpu  # pylint: disable=g-import-not-at-top

  x, w = jnp.ones((8, 128)), jnp.ones((128, 8))
  _hide(monkeypatch, "jax._src.pallas.triton")
  monkeypatch.delattr(mosaic_gpu, "emit_pipeline_warp_specialized")  # renamed, say
  _clear_probes()
  assert jax_compat.mosaic_gpu() is None and not block_gemm_mosaic.available()
  with fp8.compile_target("h100"), pytest.warns(
      fp8.Fp8FallbackWarning, match="needs Pallas Triton internals or Pallas Mosaic GPU"):
    text = _trace(fp8.BlockScaling(), x, w)
  assert "jaxmp_block_fp8_gemm" not in text and "dot_general" in text


def _dense_step_text(x, w) -> str:
  loss = lambda x, w: jnp.sum(fp8.fp8_dot_general(
      x, w, DIMS, recipe=fp8.CurrentScaling()).astype(jnp.float32) ** 2)
  with fp8.compile_target("h100", fused_quantize=True):
    return jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w).jaxpr.pretty_print()


@pytest.mark.parametrize("missing", ["module", "layout_cast", "WGMMA_TRANSPOSED"])
def test_without_mosaic_gpu_the_fused_quantization_falls_back_to_xla_and_warns(
    monkeypatch, fresh_probes, missing):
  x, w = jnp.ones((128, 256), jnp.bfloat16), jnp.ones((256, 128), jnp.bfloat16)
  assert "jaxmp_fused_fp8_quantize" in _dense_step_text(x, w)
  plgpu = jax_compat.pallas_mosaic_gpu()
  if missing == "module":  # imported already: hidden from the import system and its package
    monkeypatch.delattr(sys.modules["jax.experimental.pallas"], "mosaic_gpu")
    _hide(monkeypatch, "jax.experimental.pallas.mosaic_gpu")
  elif missing == "WGMMA_TRANSPOSED":  # an enum's member cannot be deleted: a Layout without it
    monkeypatch.setattr(plgpu, "Layout", types.SimpleNamespace(WGMMA=plgpu.Layout.WGMMA))
    _clear_probes()
  else:
    monkeypatch.delattr(plgpu, missing)
    _clear_probes()
  assert jax_compat.pallas_mosaic_gpu() is None and not fused_quantize.available()
  with pytest.warns(jax_compat.JaxVersionWarning, match="quantized by XLA's fusions"):
    text = _dense_step_text(x, w)
  assert "jaxmp_fused_fp8_quantize" not in text
  with pytest.raises(RuntimeError, match="no usable Pallas Mosaic GPU"):
    fused_quantize.quantize_2d(x, jnp.float8_e4m3fn, jnp.float32(1.0))


def test_without_the_mosaic_gpu_interpreter_the_kernel_refuses_to_interpret(
    monkeypatch, fresh_probes):
  from jax._src.pallas.mosaic_gpu.interpret import params  # pylint: disable=g-import-not-at-top

  monkeypatch.delattr(params, "InterpretGPUParams")
  _clear_probes()
  x = grouped.quantize(jnp.ones((1, 2, 128)), grouped.Grouping(1, 128), jnp.float8_e4m3fn,
                       jnp.ones((1, 2, 1)))
  with pytest.raises(NotImplementedError, match="has no Mosaic GPU interpreter"):
    block_gemm_mosaic.gemm(x, x, grouped.Grouping(1, 128), jnp.float32, interpret=True)


def test_a_triton_dot_without_max_num_imprecise_acc_is_not_used(monkeypatch, fresh_probes):
  from jaxlib.triton import dialect as tt  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(tt, "dot", lambda a, b, c: None)  # an older or newer signature
  _clear_probes()
  assert jax_compat.pallas_triton() is None


def test_without_layout_constraints_operands_keep_xlas_layout_and_it_warns_once(
    monkeypatch, fresh_probes):
  x = jnp.ones((2, 3))
  # A new function each time: JAX reuses the jaxpr of one it traced before.
  trace = lambda: jax.make_jaxpr(lambda x: jax_compat.row_major(x))(x)
  assert "layout_constraint" in str(trace())
  _hide(monkeypatch, "jax.experimental.layout")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")
    for _ in range(2):
      jaxpr = trace()
  assert "layout_constraint" not in str(jaxpr)
  assert [w.category for w in caught] == [jax_compat.JaxVersionWarning]
  message = str(caught[0].message)
  assert f"jax {jax.__version__}" in message and "layout constraints" in message
  assert "keep XLA's layout choice" in message


def test_an_fp8_step_for_hopper_traces_without_layout_constraints(monkeypatch, fresh_probes):
  k = jax.random.split(jax.random.key(0), 2)
  x, w = jax.random.normal(k[0], (16, 32)), jax.random.normal(k[1], (32, 16))
  with fp8.compile_target("h100"):
    constrained = _trace(fp8.CurrentScaling(), x, w)
  _hide(monkeypatch, "jax.experimental.layout")
  with fp8.compile_target("h100"), pytest.warns(jax_compat.JaxVersionWarning,
                                                 match="layout constraints"):
    unconstrained = _trace(fp8.CurrentScaling(), x, w)
  assert "layout_constraint" in constrained and "layout_constraint" not in unconstrained
  # The values are the layout's business only: this CPU runs the same product.
  f = jax.jit(lambda x, w: fp8.fp8_dot_general(x, w, DIMS, recipe=fp8.CurrentScaling()))
  np.testing.assert_array_equal(np.asarray(f(x, w)),
                                np.asarray(fp8.fp8_dot_general(x, w, DIMS,
                                                               recipe=fp8.CurrentScaling())))


def test_without_the_cudnn_version_query_mxfp8_is_assumed_on_blackwell_and_it_warns(
    monkeypatch, fresh_probes):
  b200 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA B200",
                               compute_capability="10.0")
  with warnings.catch_warnings():
    warnings.simplefilter("error", jax_compat.JaxVersionWarning)
    known = support.target_for_device(b200)  # no CUDA plugin here: nothing to warn of
  _hide(monkeypatch, "jax._src.lib")
  with pytest.warns(jax_compat.JaxVersionWarning, match=r"cuDNN version query .* assumed"):
    assumed = support.target_for_device(b200)
  assert assumed.mx and assumed == known


def test_without_the_extended_dtype_protocol_fp8_state_refuses_to_sum(
    monkeypatch, fresh_probes):
  from jax._src import ad_util  # pylint: disable=g-import-not-at-top

  monkeypatch.delattr(ad_util, "raw_jaxval_adders")
  monkeypatch.setattr(maxgrad, "_DTYPE", None)  # not built yet, as in a new process
  _clear_probes()
  assert jax_compat.extended_dtypes() is None
  with pytest.raises(ImportError, match=f"extended-dtype protocol.*jax {jax.__version__}"):
    maxgrad.to_max_float32(jnp.ones(2))
