"""The block-scaled fp8 kernel: its sums (interpreted here) and what it compiles to (deviceless)."""

import functools
import os
import subprocess
import sys
import textwrap
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp import fp8
from jaxmp._src.fp8 import block_gemm
from jaxmp._src.fp8 import block_gemm_mosaic
from jaxmp._src.fp8 import grouped
from jaxmp._src.fp8 import quantize as q
from jaxmp._src.fp8 import block
from jaxmp._src.fp8 import support
from jaxmp._src.tools import targets as audit_targets
from tests.fp8 import reference

TILE = grouped.Grouping(1, 128)
BLOCK = grouped.Grouping(128, 128)


def _operand(values, grouping, power_of_two=True):
  x = jnp.asarray(values, jnp.float32)
  scale = grouped.scales(x, grouping, q.E4M3, power_of_two=power_of_two)
  return grouped.quantize(x, grouping, q.E4M3, scale)


# The three GEMMs of BlockScaling (per_gemm.py): forward and input gradient multiply a
# 1x128-tiled operand by a 128x128-blocked one, the weight gradient two 1x128-tiled ones.
# Rows that are not a multiple of the kernel's tile (64 x 128) or of a block are padded.
ROLES = [("forward", (1, 70, 384), (1, 200, 384), BLOCK),
         ("input gradient", (2, 64, 256), (2, 130, 256), BLOCK),
         ("weight gradient", (1, 96, 200), (1, 150, 200), TILE)]


@pytest.mark.parametrize("role, a_shape, b_shape, grouping_b", ROLES)
def test_the_kernel_sums_the_same_products_as_the_dequantized_gemm(role, a_shape, b_shape,
                                                                   grouping_b):
  # Small integers are exact in E4M3 and power-of-two scales exact in float32: every
  # partial sum is an integer below 2**24 times a power of two, so any order of the
  # same sums gives the same bits, and the kernel must equal the dequantized GEMM.
  del role
  rng = np.random.default_rng(0)
  a = _operand(rng.integers(-16, 17, a_shape) * 2.0 ** rng.integers(-3, 4, a_shape[:2] + (1,)),
               TILE)
  b = _operand(rng.integers(-16, 17, b_shape), grouping_b)
  out = block_gemm.gemm(a, b, grouping_b, jnp.float32, interpret=True)
  expected = block.dequantized_dot(a, b, TILE, grouping_b, jnp.float32, True)
  assert out.shape == expected.shape and out.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
  assert np.count_nonzero(np.asarray(out)) > out.size // 2  # not a product of zeros


def test_the_kernel_matches_deepseek_v3_s_block_scaled_product_by_the_reference_formulas():
  # DeepSeek-V3's formulas in NumPy (tests/fp8/reference.py): amax / 448 scales per
  # 1x128 tile and 128x128 block, E4M3 codes; the product of the dequantized operands
  # in float64. The kernel gets the operands quantized by those formulas.
  rng = np.random.default_rng(4)
  x, w = rng.standard_normal((1, 70, 300)), rng.standard_normal((1, 200, 300))  # partial
  (xc, xs), (wc, ws), exact = reference.block_scaled_operands(x, w)
  exact = exact[:, :70, :200]  # the rows of x and w
  fp8_data = lambda codes: jax.lax.bitcast_convert_type(jnp.asarray(codes, jnp.uint8),
                                                        jnp.float8_e4m3fn)
  a = grouped.Quantized(fp8_data(xc), jnp.asarray(xs))
  b = grouped.Quantized(fp8_data(wc), jnp.asarray(ws))
  out = np.asarray(block_gemm.gemm(a, b, BLOCK, jnp.float32, interpret=True))[:, :70, :200]
  np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-6 * np.abs(exact).max())
  # ... and jaxmp's own quantization gives those operands.
  jx = _operand(x, TILE, power_of_two=False)
  np.testing.assert_array_equal(np.asarray(jx.data).view(np.uint8), xc)


def test_every_schedule_of_the_kernel_gives_the_same_bits():
  # Where the weight's scales are loaded (per tile or per row), whether the next
  # block's are loaded early, the order programs run in and the tile change how the
  # kernel is scheduled, never its sums: the same bits for non-power-of-two scales.
  k = jax.random.split(jax.random.key(3), 2)
  a = _operand(jax.random.normal(k[0], (1, 70, 384)), TILE, power_of_two=False)
  b = _operand(jax.random.normal(k[1], (1, 390, 384)), BLOCK, power_of_two=False)
  gemm = functools.partial(block_gemm.gemm, out_dtype=jnp.float32, interpret=True)
  for b_, grouping in ((b, BLOCK), (a, TILE)):
    expected = np.asarray(gemm(a, b_, grouping, one_b_scale_per_tile=False, prefetch=False,
                               group_columns=1))
    for schedule in ({}, {"group_columns": 3}, {"prefetch": False},
                     {"one_b_scale_per_tile": False}, {"tile": (64, 256)}):
      np.testing.assert_array_equal(np.asarray(gemm(a, b_, grouping, **schedule)), expected,
                                    err_msg=str(schedule))


def test_the_kernel_rounds_once_to_the_output_dtype_for_any_scales():
  # DeepSeek-V3's scales (amax / 448) are not powers of two: the kernel scales each
  # block's exact float32 sum, the dequantized GEMM multiplies rounded float32
  # operands; both are within float32 rounding of the exact block-scaled sum.
  k = jax.random.split(jax.random.key(1), 2)
  a = _operand(jax.random.normal(k[0], (1, 64, 512)), TILE, power_of_two=False)
  b = _operand(jax.random.normal(k[1], (1, 128, 512)), BLOCK, power_of_two=False)
  exact = np.einsum("pc,qc->pq", *(np.asarray(grouped.dequantize(x, g)[0], np.float64)
                                   for x, g in ((a, TILE), (b, BLOCK))))
  out32 = np.asarray(block_gemm.gemm(a, b, BLOCK, jnp.float32, interpret=True)[0])
  np.testing.assert_allclose(out32, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())
  out16 = block_gemm.gemm(a, b, BLOCK, jnp.bfloat16, interpret=True)
  assert out16.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out16[0]), out32.astype(jnp.bfloat16))


def test_hopper_targets_run_block_scaling_in_fp8_where_the_kernel_is_the_faster_gemm():
  for name in ("h100", "h200"):
    assert support.lowering(fp8.BlockScaling(), support.TARGETS[name]).kind == "fp8"
    # Power-of-two scales: the exact bfloat16 GEMM beats the kernel (measured).
    found = support.lowering(fp8.BlockScaling(power_of_two=True), support.TARGETS[name])
    assert found.kind == "fallback" and found.detail.startswith("a bfloat16 GEMM")
    assert "faster than jaxmp's block-scaled fp8 GEMM" in found.detail
  for name in ("b200", "a100", "v7"):
    assert support.lowering(fp8.BlockScaling(), support.TARGETS[name]).kind == "fallback"
  found = support.lowering(fp8.BlockScaling(block_size=64), support.TARGETS["h100"])
  assert found.kind == "fallback" and "block_size 128" in found.detail
  # A local GPU: sm_90 only (the kernel's PTX is checked for Hopper's wgmma).
  gpus = {cc: support.target_for_device(types.SimpleNamespace(
      platform="gpu", device_kind="NVIDIA GPU", compute_capability=cc)).block_fp8
          for cc in ("8.9", "9.0", "10.0")}
  assert gpus == {"8.9": False, "9.0": True, "10.0": False}


def test_without_the_pallas_internals_it_needs_block_scaling_runs_the_mosaic_kernel(
    monkeypatch):
  # The chip table's next kernel: Mosaic GPU, the Triton back end's successor.
  monkeypatch.setattr(block_gemm, "available", lambda: False)
  found = support.lowering(fp8.BlockScaling(), support.TARGETS["h100"])
  assert (found.kind, found.detail) == ("fp8", "jaxmp's block-scaled fp8 GEMM (a Pallas "
                                        "Mosaic GPU kernel: TMA, wgmma, warp-specialised)")
  x, w = jnp.ones((8, 128)), jnp.ones((128, 8))
  with fp8.compile_target("h100"), warnings.catch_warnings():
    warnings.simplefilter("error", fp8.Fp8FallbackWarning)
    text = jax.jit(lambda x, w: fp8.fp8_dot_general(
        x, w, (((1,), (0,)), ((), ())), recipe=fp8.BlockScaling())).trace(x, w).jaxpr
  assert "jaxmp_block_fp8_gemm_mosaic" in text.pretty_print()


def test_without_either_kernel_s_pieces_block_scaling_falls_back_and_says_why(monkeypatch):
  monkeypatch.setattr(block_gemm, "available", lambda: False)
  monkeypatch.setattr(block_gemm_mosaic, "available", lambda: False)
  found = support.lowering(fp8.BlockScaling(), support.TARGETS["h100"])
  assert (found.kind, found.detail) == ("fallback", "a float32 GEMM on dequantized operands "
                                        "(jaxmp's block-scaled fp8 GEMM needs Pallas Triton "
                                        "internals or Pallas Mosaic GPU, which this JAX lacks)")
  x, w = jnp.ones((8, 128)), jnp.ones((128, 8))
  with fp8.compile_target("h100"), pytest.warns(fp8.Fp8FallbackWarning,
                                                 match="needs Pallas Triton internals"):
    text = jax.jit(lambda x, w: fp8.fp8_dot_general(
        x, w, (((1,), (0,)), ((), ())), recipe=fp8.BlockScaling())).trace(x, w).jaxpr
  assert "jaxmp_block_fp8_gemm" not in text.pretty_print()


def test_a_function_traced_for_hopper_still_runs_here_with_the_same_numbers():
  # On an h100 target the GEMMs are the kernel under lax.platform_dependent; on this
  # CPU the same program takes the dequantizing branch.
  k = jax.random.split(jax.random.key(2), 2)
  x, w = jax.random.normal(k[0], (64, 256)), jax.random.normal(k[1], (256, 128))
  dims = (((1,), (0,)), ((), ()))
  f = lambda x, w: fp8.fp8_dot_general(x, w, dims, recipe=fp8.BlockScaling())
  grad = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1)))
  with fp8.compile_target("h100"):
    text = jax.jit(grad).trace(x, w).jaxpr.pretty_print()
    on_h100 = grad(x, w)
  assert text.count("jaxmp_block_fp8_gemm") == 3 and "platform_index" in text
  jax.tree.map(np.testing.assert_array_equal, on_h100, grad(x, w))


# Compiled deviceless for an H100 (needs the CUDA plugin): the kernel's PTX holds
# Hopper's fp8 tensor-core instruction, and a BlockScaling forward + backward's three
# GEMMs are the kernel on fp8 operands, with no fallback warning.
_PTX_CHECK = textwrap.dedent("""\
    import glob, os, re, sys
    import jax, jax.numpy as jnp
    from jaxmp._src.fp8 import block_gemm, grouped
    from jaxmp._src.tools import audit
    P = Q = C = 512
    a = grouped.Quantized(jax.ShapeDtypeStruct((1, P, C), jnp.float8_e4m3fn),
                          jax.ShapeDtypeStruct((1, P, C // 128), jnp.float32))
    b = grouped.Quantized(jax.ShapeDtypeStruct((1, Q, C), jnp.float8_e4m3fn),
                          jax.ShapeDtypeStruct((1, Q // 128, C // 128), jnp.float32))
    for per_tile in (False, True):
      report = audit.audit(lambda a, b: block_gemm.gemm(
          a, b, grouped.Grouping(128, 128), jnp.bfloat16, one_b_scale_per_tile=per_tile),
                           a, b, target="h100")
      print(f"gemms{int(per_tile)}", [(g.backend, g.fp8, g.shape, g.rate)
                                      for g in report.gemms])
    ptx = "".join(open(f).read() for f in glob.glob(os.path.join(sys.argv[1], "*.ptx")))
    for pattern in (r"wgmma\\.mma_async[\\w.]*e4m3\\.e4m3", r"mma\\.sync[\\w.]*",
                    r"cvt[\\w.]*e4m3x2"):
      print(pattern, sorted(set(re.findall(pattern, ptx))))
    kernels = [open(f).read() for f in glob.glob(os.path.join(sys.argv[1], "*.ptx"))]
    kernels = [k for k in kernels if "jaxmp_block_fp8_gemm" in k]
    print("global_loads", sorted(k.count("ld.global") for k in kernels))
    kinds, warned = audit.compiled_gemms(__import__("jaxmp").fp8.BlockScaling(), "h100")
    print("block", kinds, warned)
    """)


def _deviceless(script: str, dump: str) -> str:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_dump_to={dump}",
             PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run([sys.executable, "-c", script, dump], env=env, capture_output=True,
                       text=True, timeout=1200)
  assert out.returncode == 0, out.stderr[-4000:]
  return out.stdout


@pytest.mark.slow
def test_the_kernel_compiles_to_fp8_wgmma_for_an_h100(tmp_path):
  if not audit_targets.cuda_plugin_installed():
    pytest.skip("needs the jax[cuda12] plugin (make gpu-report builds .venv-cuda)")
  lines = dict(line.split(" ", 1) for line in _deviceless(_PTX_CHECK, str(tmp_path)).splitlines())
  for per_tile in "01":
    # An fp8 GEMM, priced at the bf16 peak: the speed it was measured at on an H200.
    assert lines["gemms" + per_tile] == \
        "[('jaxmp block-scaled fp8 (Triton wgmma)', True, '1*512x512x512', 'bf16')]"
  assert lines[r"wgmma\.mma_async[\w.]*e4m3\.e4m3"] == \
      "['wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3']"
  # Not Ampere's MMA on operands widened to float16 (what Pallas' own dot gives).
  assert lines[r"mma\.sync[\w.]*"] == "[]" and lines[r"cvt[\w.]*e4m3x2"] == "[]"
  assert lines["block"] == "('fp8', 'fp8', 'fp8') False"
  # The scales are loaded as vectors: a few loads per thread and block (read as a
  # (64, 1) column and a (1, 128) row, each thread loaded one per accumulator element,
  # 128), so prefetching the next block's carries a few registers across the loop.
  loads = [int(n) for n in lines["global_loads"].strip("[]").split(",")]
  assert len(loads) == 2 and all(n <= 12 for n in loads), loads
