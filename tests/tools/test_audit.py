"""jaxmp.tools.audit: what a compiled step runs, from the optimized HLO."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp import fp8
from jaxmp._src.tools import audit as audit_lib
from jaxmp._src.tools import targets

DENSE = (((1,), (0,)), ((), ()))


@pytest.mark.on_cpu  # checks what XLA:CPU compiles (audit of the local device)
def test_bf16_matmul_reports_bf16_operands_and_exact_flops():
  x = jnp.ones((64, 128), jnp.bfloat16)
  w = jnp.ones((128, 32), jnp.bfloat16)
  report = jaxmp.tools.audit(lambda x, w: x @ w, x, w)
  (gemm,) = report.gemms
  assert gemm.operand_dtypes == ("bfloat16", "bfloat16")
  assert gemm.flops == 2 * 64 * 128 * 32
  assert gemm.shape == "64x32x128"
  assert gemm.backend.startswith("CPU")
  assert not gemm.fp8
  # A CPU has no bfloat16 GEMM: it reads the operands as float32, converted by kernels
  # of their own, which the report lists.
  assert gemm.compute_dtypes == ("float32", "float32")
  assert {k.unfused for k in report.unfused} >= {"convert bf16->f32"}
  assert report.target == "cpu" and report.estimated_seconds is None
  assert report.non_gemm_bytes == sum(k.bytes * k.count for k in report.kernels)
  assert "GEMM backend" in str(report) and "bfloat16 x bfloat16" in str(report)


def test_fp8_dot_general_reports_fp8_operands_forward_and_backward():
  recipe = fp8.DelayedScaling(amax_history_length=4)
  state = fp8.init_state(recipe)
  x = jnp.ones((32, 64), jnp.bfloat16)
  w = jnp.ones((64, 16), jnp.bfloat16)

  def forward(x, w, state):
    return fp8.fp8_dot_general(x, w, DENSE, state=state, recipe=recipe)

  (gemm,) = jaxmp.tools.audit(forward, x, w, state).gemms
  assert gemm.operand_dtypes == ("float8_e4m3fn", "float8_e4m3fn")
  assert gemm.flops == 2 * 32 * 64 * 16

  def forward_backward(x, w, state, g):
    _, vjp = jax.vjp(forward, x, w, state)
    return vjp(g)

  report = jaxmp.tools.audit(forward_backward, x, w, state, jnp.ones((32, 16), jnp.bfloat16))
  # dx = g w^T and dw = x^T g: the output gradient in E5M2 against E4M3 operands.
  assert sorted(tuple(sorted(g.operand_dtypes)) for g in report.gemms) == [
      ("float8_e4m3fn", "float8_e5m2")] * 2
  # dw = x^T g in w's own layout: a 64x16 product over the batch of 32, no transpose.
  assert sorted(g.shape for g in report.gemms) == ["32x64x16", "64x16x32"]


def _vjp_gemms(recipe):
  state = fp8.init_state(recipe)
  x, w = jnp.ones((32, 64), jnp.bfloat16), jnp.ones((64, 16), jnp.bfloat16)

  def backward(x, w, state, g):
    _, vjp = jax.vjp(lambda x, w, s: fp8.fp8_dot_general(x, w, DENSE, state=s, recipe=recipe),
                     x, w, state)
    return vjp(g)

  return jaxmp.tools.audit(backward, x, w, state, jnp.ones((32, 16), jnp.bfloat16))


def _count_line(report):
  return next(line for line in str(report).splitlines() if " GEMMs (" in line)


def test_the_count_under_the_table_is_of_the_operands_its_rows_show():
  # A CPU widens fp8 operands to float32 for the product: the rows say "operands hold
  # float8", and so must the count, with how the product reads them.
  report = _vjp_gemms(fp8.DelayedScaling(amax_history_length=4))
  assert all(g.operand_dtypes[0].startswith("float8") and not g.fp8 for g in report.gemms)
  assert _count_line(report).startswith(
      "2 GEMMs (2 on fp8 operands, read as float32 by the product), ")
  # int8 operands are named as int8, not counted as "0 on fp8".
  report = _vjp_gemms(fp8.Int8Scaling())
  assert [g.operand_dtypes for g in report.gemms] == [("int8", "int8")] * 2
  assert _count_line(report).startswith("2 GEMMs (0 on fp8 operands; 2 on int8 operands")
  # Operands the product reads as they are held add nothing.
  report = jaxmp.tools.audit(lambda x: x @ x, jnp.ones((4, 4)))
  assert _count_line(report).startswith("1 GEMMs (0 on fp8 operands), ")


def test_batched_einsum_shape_and_flops():
  a = jnp.ones((3, 8, 16), jnp.float32)
  b = jnp.ones((3, 16, 4), jnp.float32)
  (gemm,) = jaxmp.tools.audit(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), a, b).gemms
  assert gemm.shape == "3*8x4x16"
  assert gemm.flops == 2 * 3 * 8 * 16 * 4
  assert gemm.operand_dtypes == ("float32", "float32")


# XLA:CPU left this GEMM unfused in the entry computation (as it compiled a small train
# step with tests/xla_flags.py's flags): its bfloat16 argument widened by a convert of
# its own, the argument's number unrelated to the dot's operand order.
UNFUSED_CPU_HLO = """\
HloModule jit_step

ENTRY %main.3 (g: f32[64,16], n: s32[], x: bf16[64,32]) -> f32[32,16] {
  %g = f32[64,16]{1,0} parameter(0)
  %n = s32[] parameter(1)
  %x = bf16[64,32]{1,0} parameter(PARAMETER)
  %widened = f32[64,32]{1,0} convert(%x)
  ROOT %dot = f32[32,16]{1,0} dot(%widened, %g), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}
"""


@pytest.mark.parametrize("parameter", [2, 1])  # before: IndexError; float32 (g's dtype)
def test_an_unfused_dot_reads_its_operands_back_through_widening_converts(parameter):
  hlo = UNFUSED_CPU_HLO.replace("PARAMETER", str(parameter))
  if parameter == 1:
    hlo = hlo.replace("%n = s32[] parameter(1)", "%n = s32[] parameter(2)")
  (gemm,) = audit_lib.analyze(hlo, "cpu").gemms
  assert (gemm.backend, gemm.operand_dtypes, gemm.compute_dtypes) == (
      "CPU dot", ("bfloat16", "float32"), ("float32", "float32"))
  assert (gemm.shape, gemm.flops) == ("32x16x64", 2 * 32 * 16 * 64)


def test_jitted_function_keeps_its_static_arguments():
  f = jax.jit(lambda x, n: x @ x.T * n, static_argnums=1)
  report = jaxmp.tools.audit(f, jnp.ones((8, 4)), 3)
  assert [g.flops for g in report.gemms] == [2 * 8 * 8 * 4]


# A hand-written GPU module: an fp8 cuBLASLt call inside a loop of 3 iterations, and
# a kernel that only narrows float32 to bfloat16. The parser and the roofline are
# checked here without the CUDA plugin.
GPU_HLO = textwrap.dedent("""\
    HloModule m

    %convert_computation (p: f32[1024,512]) -> bf16[1024,512] {
      %wide = f32[1024,512]{1,0} parameter(0)
      ROOT %c = bf16[1024,512]{1,0} convert(%wide)
    }

    %body (t: (f8e4m3fn[1024,256], f8e4m3fn[512,256])) -> (f8e4m3fn[1024,256], f8e4m3fn[512,256]) {
      %t = (f8e4m3fn[1024,256]{1,0}, f8e4m3fn[512,256]{1,0}) parameter(0)
      %a = f8e4m3fn[1024,256]{1,0} get-tuple-element(%t), index=0
      %b = f8e4m3fn[512,256]{1,0} get-tuple-element(%t), index=1
      %one = f32[] constant(1)
      %gemm = (f32[1024,512]{1,0}, s8[4194304]{0}) custom-call(%a, %b, %one, %one), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"precision_config":{"operand_precision":["DEFAULT","DEFAULT"]}}}
      %out = f32[1024,512]{1,0} get-tuple-element(%gemm), index=0
      %narrow = bf16[1024,512]{1,0} fusion(%out), kind=kLoop, calls=%convert_computation
      ROOT %r = (f8e4m3fn[1024,256]{1,0}, f8e4m3fn[512,256]{1,0}) tuple(%a, %b)
    }

    %cond (t: (f8e4m3fn[1024,256], f8e4m3fn[512,256])) -> pred[] {
      %tc = (f8e4m3fn[1024,256]{1,0}, f8e4m3fn[512,256]{1,0}) parameter(0)
      ROOT %go = pred[] constant(true)
    }

    ENTRY %main (a: f8e4m3fn[1024,256], b: f8e4m3fn[512,256]) -> (f8e4m3fn[1024,256], f8e4m3fn[512,256]) {
      %a0 = f8e4m3fn[1024,256]{1,0} parameter(0)
      %b0 = f8e4m3fn[512,256]{1,0} parameter(1)
      %t0 = (f8e4m3fn[1024,256]{1,0}, f8e4m3fn[512,256]{1,0}) tuple(%a0, %b0)
      ROOT %w = (f8e4m3fn[1024,256]{1,0}, f8e4m3fn[512,256]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
    }
    """)


def test_gpu_module_roofline_and_loop_count():
  spec = targets.GPU_TARGETS["h100"]
  report = audit_lib.analyze(GPU_HLO, "gpu", spec, "h100", spec.device_kind)
  (gemm,) = report.gemms
  assert (gemm.backend, gemm.operand_dtypes, gemm.output_dtype) == (
      "fp8 cuBLASLt", ("float8_e4m3fn", "float8_e4m3fn"), "float32")
  assert (gemm.shape, gemm.count, gemm.rate) == ("1024x512x256", 3, "fp8")
  flops = 2 * 1024 * 512 * 256
  gemm_bytes = 1024 * 256 + 512 * 256 + 4 * 1024 * 512
  assert (gemm.flops, gemm.bytes) == (flops, gemm_bytes)
  assert gemm.seconds == max(flops / 1978.9e12, gemm_bytes / 3.35232e12)
  (narrow,) = report.kernels
  assert narrow.unfused == "convert f32->bf16" and narrow.count == 3
  assert narrow.bytes == (4 + 2) * 1024 * 512
  assert report.non_gemm_bytes == 3 * narrow.bytes
  assert report.estimated_seconds == pytest.approx(3 * (gemm.seconds + narrow.bytes / 3.35232e12))
  assert "roofline estimate" in str(report)
  # Launches: the GEMM and the convert, each 3 times (the loop's trip count).
  assert report.launches == 6
  assert report.estimated_seconds_with_launches(0) == report.estimated_seconds
  assert report.estimated_seconds_with_launches(2e-6) == report.estimated_seconds + 6 * 2e-6


def test_audit_reports_the_compiled_steps_memory():
  x = jnp.ones((64, 32), jnp.float32)
  memory = jaxmp.tools.audit(lambda x: x.T @ x, x).memory
  assert (memory.argument_bytes, memory.output_bytes) == (64 * 32 * 4, 32 * 32 * 4)
  assert memory.peak_bytes == (memory.argument_bytes + memory.output_bytes
                               + memory.temp_bytes - memory.alias_bytes)
  donated = jaxmp.tools.audit(jax.jit(lambda x: x * 2, donate_argnums=0), x).memory
  assert donated.alias_bytes == 64 * 32 * 4 and donated.peak_bytes == 64 * 32 * 4


def test_launch_overhead_bad_input():
  spec = targets.GPU_TARGETS["h100"]
  report = audit_lib.analyze(GPU_HLO, "gpu", spec, "h100", spec.device_kind)
  with pytest.raises(TypeError, match=r"per_launch must be a number of seconds.*got '2us'"):
    report.estimated_seconds_with_launches("2us")
  with pytest.raises(ValueError, match=r"finite and 0 or more seconds, got -1e-06"):
    report.estimated_seconds_with_launches(-1e-6)


# cuDNN's fused attention as XLA lowers jax.nn.dot_product_attention(..., is_causal=True,
# implementation="cudnn") for an H100 (backend config cut to the fields audit reads).
ATTENTION_HLO = textwrap.dedent("""\
    HloModule m

    ENTRY %main (q: bf16[2,128,4,64], k: bf16[2,128,4,64], v: bf16[2,128,4,64]) -> bf16[2,4,128,64] {
      %q = bf16[2,128,4,64]{3,2,1,0} parameter(0)
      %k = bf16[2,128,4,64]{3,2,1,0} parameter(1)
      %v = bf16[2,128,4,64]{3,2,1,0} parameter(2)
      %fa = (bf16[2,4,128,64]{3,1,2,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": {"fmha_scale": 0.125, "is_flash_attention": true, "mask_type": "MASK_TYPE"}}
      ROOT %out = bf16[2,4,128,64]{3,1,2,0} get-tuple-element(%fa), index=0
    }
    """)


@pytest.mark.parametrize("mask_type, pairs, label", [
    ("NO_MASK", 128 * 128, "attention 2*4*128x128x64"),
    ("CAUSAL", 128 * 129 // 2, "attention 2*4*128x128x64 causal"),
])
def test_cudnn_attention_counts_the_pairs_its_mask_mode_keeps(mask_type, pairs, label):
  spec = targets.GPU_TARGETS["h100"]
  hlo = ATTENTION_HLO.replace("MASK_TYPE", mask_type)
  (gemm,) = audit_lib.analyze(hlo, "gpu", spec, "h100", spec.device_kind).gemms
  assert gemm.backend == "cuDNN fused attention"
  assert (gemm.shape, gemm.flops) == (label, 4 * 2 * 4 * pairs * 64)


# cuDNN's MXFP8 block-scaled GEMM, as XLA lowers jax.nn.scaled_matmul for a Blackwell
# GPU (cuDNN >= 9.10): fp8 operands and E8M0 scales, inside a called computation.
MX_HLO = textwrap.dedent("""\
    HloModule m

    %mm (lhs: f8e4m3fn[1,256,512], rhs: f8e4m3fn[1,128,512], ls: f8e8m0fnu[1,256,16], rs: f8e8m0fnu[1,128,16]) -> bf16[1,256,128] {
      %lhs = f8e4m3fn[1,256,512]{2,1,0} parameter(0)
      %rhs = f8e4m3fn[1,128,512]{2,1,0} parameter(1)
      %ls = f8e8m0fnu[1,256,16]{2,1,0} parameter(2)
      %rs = f8e8m0fnu[1,128,16]{2,1,0} parameter(3)
      %cc = (bf16[1,256,128]{2,1,0}, u8[0]{0}) custom-call(%lhs, %rhs, %ls, %rs), custom_call_target="__cudnn$blockScaledDot"
      ROOT %out = bf16[1,256,128]{2,1,0} get-tuple-element(%cc), index=0
    }

    ENTRY %main (a: f8e4m3fn[1,256,512], b: f8e4m3fn[1,128,512], c: f8e8m0fnu[1,256,16], d: f8e8m0fnu[1,128,16]) -> bf16[1,256,128] {
      %a = f8e4m3fn[1,256,512]{2,1,0} parameter(0)
      %b = f8e4m3fn[1,128,512]{2,1,0} parameter(1)
      %c = f8e8m0fnu[1,256,16]{2,1,0} parameter(2)
      %d = f8e8m0fnu[1,128,16]{2,1,0} parameter(3)
      ROOT %call = bf16[1,256,128]{2,1,0} call(%a, %b, %c, %d), to_apply=%mm
    }
    """)


def test_cudnn_block_scaled_gemm_is_an_mx_gemm():
  spec = targets.GPU_TARGETS["b200"]
  report = audit_lib.analyze(MX_HLO, "gpu", spec, "b200", spec.device_kind)
  (gemm,) = report.gemms
  assert (gemm.backend, gemm.operand_dtypes, gemm.output_dtype, gemm.shape) == (
      "MX cuDNN block-scaled GEMM", ("float8_e4m3fn", "float8_e4m3fn"), "bfloat16",
      "1*256x128x512")
  assert (gemm.flops, gemm.rate, gemm.fp8) == (2 * 256 * 128 * 512, "fp8", True)
  assert gemm.bytes == 256 * 512 + 128 * 512 + 256 * 16 + 128 * 16 + 2 * 256 * 128


@pytest.mark.parametrize("target,error,match", [
    (3, TypeError, "target must be a string"),
    ("h200", ValueError, "unknown target 'h200'; accepted targets are 'h100', 'a100', 'b200', "
                         "'v5e', 'v5p', 'v6e', 'v7'"),
])
def test_bad_target(target, error, match):
  with pytest.raises(error, match=match):
    jaxmp.tools.audit(lambda x: x, jnp.ones(2), target=target)


@pytest.mark.parametrize("target, says", [
    # TPU targets need libtpu alone: a small environment, not the 6.5 GB .venv-cuda.
    ("v5e", f'jax[tpu] at this JAX\'s version in its own environment: for TPU targets alone '
            f'`pip install "jax[tpu]=={jax.__version__}" -e .` in a virtual environment is '
            'enough'),
    ("h100", "jax[cuda12] at this JAX's version in its own environment: `make gpu-report` "
             "builds one (.venv-cuda, which also holds libtpu)"),
])
def test_a_missing_plugin_says_what_to_install(monkeypatch, target, says):
  monkeypatch.setattr(targets, "installed", lambda module: False)
  with pytest.raises(ImportError, match="plugin, which is not installed here") as e:
    targets.compile_device.__wrapped__(target)  # uncached: a built device would be kept
  assert says in str(e.value), str(e.value)


def test_bad_fn_and_options():
  with pytest.raises(TypeError, match="fn must be callable"):
    jaxmp.tools.audit("not a function")
  with pytest.raises(TypeError, match="compiler_options must be a mapping"):
    jaxmp.tools.audit(lambda x: x, jnp.ones(2), compiler_options=["xla_gpu_enable_triton_gemm"])


_H100_CHECK = textwrap.dedent("""\
    import jax, jax.numpy as jnp, jaxmp
    from jaxmp import fp8
    S = jax.ShapeDtypeStruct
    recipe = fp8.DelayedScaling(amax_history_length=16)
    state = jax.eval_shape(lambda: fp8.init_state(recipe))
    dims = (((1,), (0,)), ((), ()))
    def step(x, w, state, g):
      f = lambda x, w, s: fp8.fp8_dot_general(x, w, dims, state=s, recipe=recipe)
      out, vjp = jax.vjp(f, x, w, state)
      return out, vjp(g)
    args = (S((512, 256), jnp.bfloat16), S((256, 384), jnp.bfloat16), state,
            S((512, 384), jnp.bfloat16))
    for options in ({"xla_gpu_enable_triton_gemm": False}, {}):
      r = jaxmp.tools.audit(step, *args, target="h100", compiler_options=options)
      assert r.device_kind == "NVIDIA H100 80GB HBM3", r.device_kind
      assert len(r.gemms) == 3 and all(g.fp8 for g in r.gemms), str(r)
      if options:
        assert {g.backend for g in r.gemms} == {"fp8 cuBLASLt"}, str(r)
        # Every GEMM writes bfloat16 itself, with the default (not power-of-two)
        # scales: no float32 product in memory, no kernel narrowing it. (Triton
        # splits these small GEMMs along K, into float32 partial sums.)
        assert [g.output_dtype for g in r.gemms] == ["bfloat16"] * 3, str(r)
        assert not [k for k in r.kernels if k.unfused == "convert f32->bf16"
                    and k.bytes >= 512 * 256], str(r)
        # Both gradients come out of their GEMMs in their operands' layouts: no
        # kernel writes a bfloat16 matrix (a transpose, or a scale left unfolded
        # after one).
        assert not [k for k in r.kernels if k.output.startswith("bf16[")
                    and k.output.count(",") == 1], str(r)
      # Quantization fuses: no float32 or bool tensor of an operand's size in memory.
      big = [k for k in r.kernels if k.bytes >= 512 * 256 and
             (k.output.startswith("f32[") or k.output.startswith("pred[")) and
             k.output.count(",") == 1 and not k.unfused]
      assert not big, [(k.name, k.output) for k in big]
      assert r.estimated_seconds > 0
    bf = jaxmp.tools.audit(lambda a, b: a @ b, S((256, 256), jnp.bfloat16), S((256, 256), jnp.bfloat16),
                           target="h100", compiler_options={"xla_gpu_enable_triton_gemm": False})
    (g,) = bf.gemms
    assert (g.backend, g.operand_dtypes, g.output_dtype, g.rate) == (
        "cuBLASLt", ("bfloat16", "bfloat16"), "bfloat16", "bf16"), str(bf)
    # cuDNN fused attention (the score matrix never reaches memory) is one kernel.
    qkv = (S((2, 128, 4, 64), jnp.bfloat16),) * 3
    att = jaxmp.tools.audit(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"), *qkv,
        target="h100")
    (g,) = att.gemms
    assert (g.backend, g.flops, g.operand_dtypes) == (
        "cuDNN fused attention", 4 * 2 * 4 * 128 * 128 * 64, ("bfloat16", "bfloat16")), str(att)
    # The finite check of a gradient tree compiles to reductions with no conditional
    # (a conditional would make XLA write the gradients it takes to memory).
    finite = jaxmp.tools.audit(jaxmp.all_finite, {"w": S((512, 512), jnp.float32)},
                               target="h100")
    assert "conditional(" not in finite.hlo, finite.hlo
    # Kahan's compensation is the rounding error of p + y: XLA's GPU compiler deletes
    # a bare float32 -> bfloat16 -> float32 round trip, but keeps this one.
    v = lambda dtype: S((4096,), dtype)
    kahan = jaxmp.tools.audit(jaxmp.optim.kahan_add, v(jnp.bfloat16), v(jnp.float32),
                              v(jnp.bfloat16), target="h100")
    assert "reduce-precision(" in kahan.hlo, kahan.hlo
    # fp8 GEMMs that XLA cannot run as fp8 (block and MX recipes on an H100, a short
    # contraction widened to bfloat16) still quantize both operands: without a barrier
    # XLA deleted the float32 -> fp8 -> wider round trip (no fp8 type was left).
    import re
    for recipe, shapes in [(fp8.BlockScaling(), ((256, 512), (512, 384))),
                           (fp8.MXScaling(), ((256, 512), (512, 384))),
                           (fp8.CurrentScaling(), ((64, 8), (8, 32)))]:
      fwd = lambda x, w, recipe=recipe: fp8.fp8_dot_general(x, w, dims, recipe=recipe)
      r = jaxmp.tools.audit(fwd, *(S(s, jnp.bfloat16) for s in shapes), target="h100")
      quantized = set(re.findall(r"f8e4m3fn\\[([0-9,]+)\\]", r.hlo))
      if isinstance(recipe, fp8.CurrentScaling):
        assert {"64,8", "8,32"} <= quantized, (recipe, quantized)
      else:  # both canonical operands, (batch, rows, contracted)
        assert {"1,256,512", "1,384,512"} <= quantized, (recipe, quantized)
    print("ok")
    """)


def test_h100_deviceless():
  if not targets.cuda_plugin_installed():
    pytest.skip("needs JAX's CUDA plugin, jax[cuda12] (make gpu-report builds it)")
  # A fresh process: compiling for a GPU that is not there needs JAX_PLATFORMS=cpu
  # before JAX starts.
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run([sys.executable, "-c", _H100_CHECK], env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-4000:]


STACK_HLO = textwrap.dedent("""\
    HloModule stack

    %read_one (p0: f32[8,256,256], p1: s32[], p2: f32[256,256]) -> f32[256,256] {
      %p0 = f32[8,256,256]{2,1,0} parameter(0)
      %p1 = s32[] parameter(1)
      %zero = s32[] constant(0)
      %slice = f32[1,256,256]{2,1,0} dynamic-slice(%p0, %p1, %zero, %zero), dynamic_slice_sizes={1,256,256}
      %layer = f32[256,256]{1,0} bitcast(%slice)
      %p2 = f32[256,256]{1,0} parameter(2)
      ROOT %product = f32[256,256]{1,0} multiply(%layer, %p2)
    }

    %write_one (q0: f32[8,256,256], q1: bf16[256,256], q2: s32[]) -> f32[8,256,256] {
      %q0 = f32[8,256,256]{2,1,0} parameter(0)
      %q1 = bf16[256,256]{1,0} parameter(1)
      %wide = f32[256,256]{1,0} convert(%q1)
      %update = f32[1,256,256]{2,1,0} bitcast(%wide)
      %q2 = s32[] parameter(2)
      %zero = s32[] constant(0)
      ROOT %dus = f32[8,256,256]{2,1,0} dynamic-update-slice(%q0, %update, %q2, %zero, %zero)
    }

    %write_and_read (r0: f32[8,256,256], r1: f32[1,256,256], r2: s32[]) -> (f32[8,256,256], f32[8,256,256]) {
      %r0 = f32[8,256,256]{2,1,0} parameter(0)
      %r1 = f32[1,256,256]{2,1,0} parameter(1)
      %r2 = s32[] parameter(2)
      %zero = s32[] constant(0)
      %dus = f32[8,256,256]{2,1,0} dynamic-update-slice(%r0, %r1, %r2, %zero, %zero)
      %negated = f32[8,256,256]{2,1,0} negate(%r0)
      ROOT %both = (f32[8,256,256]{2,1,0}, f32[8,256,256]{2,1,0}) tuple(%dus, %negated)
    }

    ENTRY %main (w: f32[8,256,256], i: s32[], x: f32[256,256], g: bf16[256,256], u: f32[1,256,256]) -> f32[256,256] {
      %w = f32[8,256,256]{2,1,0} parameter(0)
      %i = s32[] parameter(1)
      %x = f32[256,256]{1,0} parameter(2)
      %g = bf16[256,256]{1,0} parameter(3)
      %u = f32[1,256,256]{2,1,0} parameter(4)
      %read = f32[256,256]{1,0} fusion(%w, %i, %x), kind=kLoop, calls=%read_one
      %written = f32[8,256,256]{2,1,0} fusion(%w, %g, %i), kind=kLoop, calls=%write_one
      %both = (f32[8,256,256]{2,1,0}, f32[8,256,256]{2,1,0}) fusion(%w, %u, %i), kind=kLoop, calls=%write_and_read
      ROOT %r = f32[256,256]{1,0} add(%read, %x)
    }
    """)


def test_a_kernel_is_charged_the_slices_it_reads_and_the_update_it_writes_in_place():
  layer, stack = 256 * 256 * 4, 8 * 256 * 256 * 4
  report = audit_lib.analyze(STACK_HLO, "gpu")
  moved = {k.name: k.bytes for k in report.kernels}
  # One layer of the stack read (the slice), x read, the product written.
  assert moved["read"] == layer + 4 + layer + layer
  # The bf16 update read and written into the stack in place; the stack's other
  # layers are neither read nor written.
  assert moved["written"] == layer // 2 + 4 + layer
  # A stack that is also read in full (negated) is read in full; the update written.
  assert moved["both"] == stack + layer + 4 + layer + stack
  # A kernel with no fused body: every operand and its result.
  assert moved["r"] == 3 * layer


def test_a_scan_over_stacked_layers_costs_each_trip_one_layer():
  def apply_layers(stack, x):
    def layer(carry, w):
      y = jnp.tanh(carry * w)
      return y, y
    return jax.lax.scan(layer, x, stack)

  def per_trip_bytes(layers):
    stack = jnp.ones((layers, 256, 256))
    report = jaxmp.tools.audit(apply_layers, stack, jnp.ones((256, 256)))
    return sorted(k.bytes for k in report.kernels if k.count == layers)

  # Before in-place updates and slices were told apart, each trip was charged the
  # whole stack, so a loop over L layers cost L^2 layers' bytes.
  assert per_trip_bytes(4) == per_trip_bytes(16)
  assert max(per_trip_bytes(16)) <= 3 * 256 * 256 * 4 + 64
