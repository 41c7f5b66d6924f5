"""The fused fp8 quantization kernel: its values (interpreted here), where it is used, what it
compiles to (deviceless, with the CUDA plugin)."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp import fp8
from jaxmp._src.fp8 import fused_quantize
from jaxmp._src.fp8 import quantize as q
from jaxmp._src.fp8 import support
from jaxmp._src.tools import targets as audit_targets

SHAPES = [(128, 128), (256, 384), (384, 128)]


def _values(shape, dtype, seed=0):
  """Normal values over a wide range, with the cases quantization treats specially."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * 2.0 ** rng.integers(-20, 18, shape)
  special = [np.inf, -np.inf, 1e30, -1e30, 0.0, -0.0, 448.0, 449.0, -57344.0, 60000.0,
             2.0 ** -140, -(2.0 ** -10)]
  x.flat[:len(special)] = special
  return jnp.asarray(x, dtype)


def _same_codes(a, b):
  """Equal fp8 codes, NaN for NaN (a NaN code's sign bit is the platform's)."""
  a, b = np.asarray(a), np.asarray(b)
  nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
  np.testing.assert_array_equal(nan_a, nan_b)
  np.testing.assert_array_equal(a.view(np.uint8)[~nan_a], b.view(np.uint8)[~nan_b])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fp8_dtype", [q.E4M3, q.E5M2])
def test_interpreted_kernel_equals_the_reference_formulas(shape, dtype, fp8_dtype):
  x = _values(shape, dtype)
  scale = jnp.float32(0.37)
  codes, transposed, amax = jax.jit(lambda x, s: fused_quantize.quantize_2d(
      x, fp8_dtype, s, interpret=True))(x, scale)
  expected = q.quantize(x, fp8_dtype, scale)
  assert codes.dtype == fp8_dtype and codes.shape == shape
  assert transposed.dtype == fp8_dtype and transposed.shape == shape[::-1]
  _same_codes(codes, expected)
  _same_codes(transposed, expected.T)
  # Saturation and overflow: +-1e30 saturate, inf stays non-finite (NaN in E4M3).
  as_f32 = np.asarray(codes.astype(jnp.float32)).ravel()
  largest = q.fp8_max(fp8_dtype)
  assert as_f32[2] == largest and as_f32[3] == -largest
  assert not np.isfinite(as_f32[0]) and not np.isfinite(as_f32[1])
  assert amax.dtype == jnp.float32 and amax.shape == ()
  np.testing.assert_array_equal(np.asarray(amax), np.asarray(q.amax(x)))  # inf here


def test_interpreted_amax_is_the_tensors_own_finite_nan_and_per_tile_max():
  x = jnp.asarray(np.arange(256 * 256, dtype=np.float32).reshape(256, 256) - 70000.0)
  for values in (x, x.at[200, 3].set(-1e6), x.at[5, 250].set(jnp.nan)):
    _, _, amax = fused_quantize.quantize_2d(values, q.E4M3, jnp.float32(1.0), interpret=True)
    np.testing.assert_array_equal(np.asarray(amax), np.asarray(q.amax(values)))
  # The largest magnitude in a tile other than the first: the tiles' maxima are reduced.
  assert float(fused_quantize.quantize_2d(x.at[200, 3].set(-1e6), q.E4M3, jnp.float32(1.0),
                                          interpret=True)[2]) == 1e6


def test_a_wider_tile_gives_the_same_codes():
  x = _values((256, 512), jnp.bfloat16, seed=1)
  narrow = fused_quantize.quantize_2d(x, q.E5M2, jnp.float32(3.0), interpret=True)
  wide = fused_quantize.quantize_2d(x, q.E5M2, jnp.float32(3.0), interpret=True,
                                    tile=(128, 256))
  _same_codes(narrow[0], wide[0])
  _same_codes(narrow[1], wide[1])
  np.testing.assert_array_equal(np.asarray(narrow[2]), np.asarray(wide[2]))


@pytest.mark.parametrize("shape, dtype", [((100, 128), jnp.float32), ((128, 200), jnp.float32),
                                          ((128, 128), jnp.float16), ((128,), jnp.float32)])
def test_shapes_and_dtypes_the_kernel_does_not_take_are_refused(shape, dtype):
  assert not fused_quantize.supports(shape, dtype)
  with pytest.raises(ValueError, match="multiples of the tile"):
    fused_quantize.quantize_2d(jnp.zeros(shape, dtype), q.E4M3, jnp.float32(1.0),
                               interpret=True)
  with pytest.raises(ValueError, match="not one the kernel takes"):
    fused_quantize.quantize(jnp.zeros(shape, dtype), q.E4M3, jnp.float32(1.0))


def test_leading_dimensions_are_flattened_into_rows():
  x = _values((2, 64, 256), jnp.bfloat16, seed=2)
  out = fused_quantize.quantize(x, q.E4M3, jnp.float32(0.5))
  expected = q.quantize(x, q.E4M3, jnp.float32(0.5))
  _same_codes(out.codes, expected)
  _same_codes(out.transposed, expected.reshape(128, 256).T)


DIMS = (((2,), (0,)), ((), ()))


def _step(recipe, x, w):
  state = fp8.init_state(recipe) if isinstance(recipe, fp8.DelayedScaling) else None

  def loss(x, w, state):
    y = fp8.fp8_dot_general(x, w, DIMS, state=state, recipe=recipe)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), (x, w, state)


@pytest.mark.parametrize("recipe", [fp8.DelayedScaling(amax_history_length=4),
                                    fp8.CurrentScaling()], ids=["delayed", "current"])
def test_with_the_table_entry_on_a_dense_step_uses_the_kernel_and_computes_the_same(recipe):
  # Small integers: every product and sum is exact, so any GEMM order gives these bits.
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.integers(-8, 9, (2, 64, 256)), jnp.bfloat16)
  w = jnp.asarray(rng.integers(-8, 9, (256, 128)), jnp.bfloat16)
  step, args = _step(recipe, x, w)
  results, texts = {}, {}
  for fused in (False, True):
    with fp8.compile_target("h100", fused_quantize=fused) as target:
      assert target.fused_quantize is fused
      texts[fused] = jax.jit(step).trace(*args).jaxpr.pretty_print()
      results[fused] = step(*args)
  # The input and the output gradient, one pallas_call each, in the CUDA branch of a
  # lax.platform_dependent (the kernel, the weight, stays XLA's).
  assert texts[True].count("name=jaxmp_fused_fp8_quantize") == 2
  assert "name=jaxmp_fused_fp8_quantize" not in texts[False]
  jax.tree.map(np.testing.assert_array_equal, results[False], results[True])
  assert np.count_nonzero(np.asarray(results[True][1][1])) > 0


def test_under_vmap_batched_tensors_take_xlas_path_and_the_step_computes_the_same():
  # Mosaic GPU lowers no batched pallas_call: under vmap the batched input and output
  # gradient are quantized by XLA (a batched kernel would be traced here otherwise).
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.integers(-8, 9, (3, 2, 64, 256)), jnp.bfloat16)
  w = jnp.asarray(rng.integers(-8, 9, (256, 128)), jnp.bfloat16)
  recipe = fp8.DelayedScaling(amax_history_length=4)
  state = fp8.init_state(recipe)

  def loss(x, w, state):
    y = fp8.fp8_dot_general(x, w, DIMS, state=state, recipe=recipe)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  batched = jax.jit(jax.grad(
      lambda x, w, s: jnp.sum(jax.vmap(loss, in_axes=(0, None, None))(x, w, s)),
      argnums=(0, 1, 2)))
  results = {}
  for fused in (False, True):
    with fp8.compile_target("h100", fused_quantize=fused):
      text = jax.jit(batched).trace(x, w, state).jaxpr.pretty_print()
      assert "name=jaxmp_fused_fp8_quantize" not in text
      results[fused] = batched(x, w, state)
  jax.tree.map(np.testing.assert_array_equal, results[False], results[True])
  # One amax over the whole batch, as the unbatched state records it.
  assert float(results[True][2].output_grad_amax_history[0]) > 0


def test_the_entry_is_off_for_every_chip_and_shapes_the_kernel_does_not_take_keep_xla():
  assert not any(t.fused_quantize for t in support.TARGETS.values())
  x, w = jnp.ones((2, 50, 256), jnp.bfloat16), jnp.ones((256, 128), jnp.bfloat16)
  step, args = _step(fp8.CurrentScaling(), x, w)
  with fp8.compile_target("h100", fused_quantize=True):
    assert "jaxmp_fused_fp8_quantize" not in jax.jit(step).trace(*args).jaxpr.pretty_print()


@pytest.mark.parametrize("out_dtype", [jnp.float16, jnp.float32])
def test_the_output_gradients_dtype_decides_too(out_dtype):
  # bfloat16 operands with a float16 output: the output gradient is float16, which the
  # kernel does not read, so neither tensor takes it; with float32 both do.
  x, w = jnp.ones((2, 64, 256), jnp.bfloat16), jnp.ones((256, 128), jnp.bfloat16)
  loss = lambda x, w: jnp.sum(fp8.fp8_dot_general(
      x, w, DIMS, preferred_element_type=out_dtype, recipe=fp8.CurrentScaling()).astype(
          jnp.float32) ** 2)
  step = jax.jit(jax.grad(loss, argnums=(0, 1)))
  with fp8.compile_target("h100", fused_quantize=True):
    text = jax.jit(step).trace(x, w).jaxpr.pretty_print()
    grads = step(x, w)
  assert text.count("name=jaxmp_fused_fp8_quantize") == (2 if out_dtype == jnp.float32 else 0)
  assert all(bool(jnp.isfinite(g).all()) for g in grads)


def test_compile_target_refuses_the_kernel_where_no_gemm_reads_transposed_codes():
  with pytest.raises(ValueError, match="k_major_fp8"):
    fp8.compile_target("b200", fused_quantize=True)
  with pytest.raises(TypeError, match="fused_quantize must be a bool"):
    fp8.compile_target("h100", fused_quantize=1)


def _need_hopper():
  device = jax.devices()[0]
  if device.platform != "gpu" or not support.target_for_device(device).k_major_fp8:
    pytest.skip(f"runs the kernel on a Hopper GPU (sm_90); here: {device.device_kind}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fp8_dtype", [q.E4M3, q.E5M2])
def test_on_a_hopper_gpu_the_kernel_computes_xlas_codes_and_amax(dtype, fp8_dtype):
  _need_hopper()
  x = _values((512, 384), dtype, seed=5)
  for scale in (jnp.float32(0.37), jnp.float32(3e-5), jnp.float32(1.0)):
    codes, transposed, amax = jax.jit(
        lambda x, s: fused_quantize.quantize_2d(x, fp8_dtype, s))(x, scale)
    expected = jax.jit(lambda x, s: q.quantize(x, fp8_dtype, s))(x, scale)
    _same_codes(codes, expected)
    _same_codes(transposed, expected.T)
    np.testing.assert_array_equal(np.asarray(amax), np.asarray(jax.jit(q.amax)(x)))


@pytest.mark.parametrize("recipe", [fp8.DelayedScaling(amax_history_length=4),
                                    fp8.CurrentScaling()], ids=["delayed", "current"])
def test_on_a_hopper_gpu_a_dense_step_with_the_kernel_computes_the_same(recipe):
  # Small integers: exact products and sums, so any GEMM algorithm gives these bits.
  _need_hopper()
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.integers(-8, 9, (2, 128, 256)), jnp.bfloat16)
  w = jnp.asarray(rng.integers(-8, 9, (256, 128)), jnp.bfloat16)
  step, args = _step(recipe, x, w)
  results = {}
  for fused in (False, True):
    with fp8.compile_target("h100", fused_quantize=fused):
      text = jax.jit(step).lower(*args).compile().as_text()
      assert text.count('custom_call_target="mosaic_gpu_v2"') == 2 * fused
      results[fused] = step(*args)
  jax.tree.map(np.testing.assert_array_equal, results[False], results[True])


# Compiled deviceless for an H100 (needs the CUDA plugin).
_PTX_CHECK = textwrap.dedent("""\
    import re, sys
    import jax, jax.numpy as jnp
    from jaxmp._src.fp8 import fused_quantize, quantize as q
    from jaxmp._src.tools import targets
    shard = jax.sharding.SingleDeviceSharding(targets.compile_device("h100"))
    for dtype, fp8_dtype in ((jnp.bfloat16, q.E4M3), (jnp.float32, q.E5M2)):
      args = (jax.ShapeDtypeStruct((256, 384), dtype, sharding=shard),
              jax.ShapeDtypeStruct((), jnp.float32, sharding=shard))
      text = jax.jit(lambda x, s: fused_quantize.quantize_2d(x, fp8_dtype, s)).trace(
          *args).lower().compile().as_text()
      print("HLO", text.count('custom_call_target="mosaic_gpu_v2"'))
    batched = (jax.ShapeDtypeStruct((3, 256, 384), jnp.bfloat16, sharding=shard),
               jax.ShapeDtypeStruct((), jnp.float32, sharding=shard))
    text = jax.jit(jax.vmap(lambda x, s: fused_quantize.quantize(x, q.E4M3, s),
                            in_axes=(0, None))).trace(*batched).lower().compile().as_text()
    print("VMAP", text.count('custom_call_target="mosaic_gpu_v2"'))
    """)

_STEP_CHECK = textwrap.dedent("""\
    import re, sys
    import jax, jax.numpy as jnp
    from jaxmp import fp8
    from jaxmp._src.tools import targets
    shard = jax.sharding.SingleDeviceSharding(targets.compile_device("h100"))
    S = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=shard)
    for name, recipe in (("delayed", fp8.DelayedScaling(amax_history_length=4)),
                         ("current", fp8.CurrentScaling())):
      state = (jax.tree.map(lambda a: S(a.shape, a.dtype), fp8.init_state(recipe))
               if name == "delayed" else None)
      def loss(x, w, state):
        y = fp8.fp8_dot_general(x, w, (((2,), (0,)), ((), ())), state=state, recipe=recipe)
        return jnp.sum(y.astype(jnp.float32) ** 2)
      for fused in (False, True):
        with fp8.compile_target("h100", fused_quantize=fused):
          text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
              S((4, 512, 1024), jnp.bfloat16), S((1024, 3072), jnp.bfloat16), state
          ).lower().compile().as_text()
        # fp8 arrays XLA's own kernels write (fusions, transposes, copies), by shape.
        written = re.findall(
            r"(f8e\\w+\\[[\\d,]*\\])\\{[\\d,]*\\}[^=]* (?:fusion|transpose|copy)\\(", text)
        print(name, int(fused), text.count('custom_call_target="mosaic_gpu_v2"'),
              " ".join(sorted(set(t.split("[")[1] for t in written))))
    """)


def _deviceless(script: str, **env: str) -> str:
  env = dict(os.environ, JAX_PLATFORMS="cpu", **env,
             PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  return out.stdout


def _need_cuda_plugin():
  if not audit_targets.cuda_plugin_installed():
    pytest.skip("needs the jax[cuda12] plugin (make gpu-report builds .venv-cuda)")


def test_the_kernel_compiles_for_sm_90a_with_tma_and_fp8_conversions():
  _need_cuda_plugin()
  out = _deviceless(_PTX_CHECK, MOSAIC_GPU_DUMP_PTX="1")
  assert [line for line in out.splitlines() if line.startswith("HLO")] == ["HLO 1", "HLO 1"]
  assert "VMAP 0" in out.splitlines()  # compiles under vmap: XLA's path, no kernel
  assert ".target sm_90a" in out
  # One TMA load and two TMA stores (the codes' tile and the transposed tile) per kernel.
  assert out.count("cp.async.bulk.tensor.4d.shared::cluster.global") == 2
  assert out.count("cp.async.bulk.tensor.4d.global.shared::cta") == 4
  assert "cvt.rn.satfinite.e4m3x2.f32" in out and "cvt.rn.satfinite.e5m2x2.f32" in out
  # XLA's own fusion divides with div.full.f32 too: the same quotient, bit for bit.
  assert "div.full.f32" in out and "div.rn.f32" not in out
  assert "shfl.sync.bfly" in out  # the register transpose


def test_with_the_entry_on_the_h100_step_quantizes_in_the_kernel_not_in_xla_fusions():
  _need_cuda_plugin()
  out = _deviceless(_STEP_CHECK, XLA_FLAGS="--xla_gpu_enable_triton_gemm=false")
  rows = {tuple(line.split()[:2]): (int(line.split()[2]), set(line.split()[3:]))
          for line in out.splitlines()}
  weight = {"1024,3072]", "3072,1024]"}  # w (1024, 3072) and its transpose: XLA's either way
  transposed = {"1024,2048]", "3072,2048]"}  # x.T and g.T, the weight gradient's operands
  for name in ("delayed", "current"):
    kernels_off, written_off = rows[(name, "0")]
    kernels_on, written_on = rows[(name, "1")]
    assert kernels_off == 0 and transposed <= written_off, out
    # On: the input and the output gradient come from the kernel, in both layouts.
    assert kernels_on == 2 and written_on <= weight, out
