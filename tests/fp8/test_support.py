"""What runs where: targets, the fallback warning, and the support table compiled deviceless."""

import gc
import os
import re
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
from jaxmp._src import jax_compat
from jaxmp._src.fp8 import support
from jaxmp._src.tools import targets as audit_targets

DIMS = (((1,), (0,)), ((), ()))
X = jnp.ones((4, 64))
W = jnp.ones((64, 8))


def _fallback_warnings(recipe, target=None):
  """The Fp8FallbackWarning messages of tracing one fp8 matmul (with ``target`` named)."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fn = lambda x, w: fp8.fp8_dot_general(x, w, DIMS, state=fp8.init_state(recipe),
                                          recipe=recipe)
    if target is None:
      jax.eval_shape(fn, X, W)
    else:
      with fp8.compile_target(target):
        jax.eval_shape(fn, X, W)
  return [str(w.message) for w in caught if issubclass(w.category, fp8.Fp8FallbackWarning)]


ALL = [fp8.DelayedScaling(4), fp8.CurrentScaling(), fp8.RowwiseScaling(), fp8.BlockScaling(),
       fp8.MXScaling(), fp8.GemmRecipes(fp8.MXScaling(), None, fp8.BlockScaling())]


@pytest.mark.on_cpu  # checks the target traced for on this CPU (fp8.current_target)
def test_the_cpu_emulates_every_recipe_without_warning():
  assert fp8.current_target().name == "cpu"
  for recipe in ALL:
    assert _fallback_warnings(recipe) == []


@pytest.mark.parametrize("target, warns", [
    ("h100", ["MXScaling", "GemmRecipes"]),
    ("b200", ["BlockScaling", "GemmRecipes"]),
    ("v7", ["BlockScaling", "MXScaling", "GemmRecipes"]),
    ("a100", [type(r).__name__ for r in ALL]),
    ("v5e", [type(r).__name__ for r in ALL]),
])
def test_recipes_that_fall_back_warn_naming_the_target(target, warns):
  warned = []
  for recipe in ALL:
    messages = _fallback_warnings(recipe, target)
    assert all(f"on {target} (" in m for m in messages)
    if messages:
      warned.append(type(recipe).__name__)
  assert warned == warns


def test_the_warning_names_the_gemms_that_fall_back_and_what_runs():
  recipe = fp8.GemmRecipes(fp8.RowwiseScaling(), fp8.BlockScaling(power_of_two=True), None)
  (message,) = _fallback_warnings(recipe, "h100")
  assert ("its input-gradient GEMM runs as a bfloat16 GEMM on dequantized operands (exact "
          "with power-of-two scales, and faster than jaxmp's block-scaled fp8 GEMM, which "
          "runs the other scales)") in message
  assert "forward" not in message.split("its ")[1] and "weight" not in message.split("its ")[1]
  (message,) = _fallback_warnings(fp8.BlockScaling(), "b200")
  assert ("GEMMs run as a float32 GEMM on dequantized operands (jaxmp's block-scaled fp8 "
          "GEMM runs on Hopper GPUs, sm_90, with block_size 128)") in message
  (message,) = _fallback_warnings(fp8.MXScaling(), "h100")
  assert ("its forward, input-gradient, weight-gradient GEMMs run as a bfloat16 GEMM on "
          "dequantized operands (MXFP8 GEMMs need a Blackwell GPU with cuDNN >= 9.10)") in message


def test_fp8_ops_are_traced_for_the_device_jax_computes_on_by_default(monkeypatch):
  # On a machine with a GPU, a step run under `with jax.default_device(cpu):` runs on the
  # CPU: traced for the GPU it would carry the GPU's kernels and layouts to the CPU.
  real = jax.devices
  h100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                               compute_capability="9.0")
  monkeypatch.setattr(jax, "devices", lambda backend=None: [h100] if backend is None
                      else real(backend))
  assert fp8.current_target().block_fp8
  with jax.default_device(real("cpu")[0]):
    assert fp8.current_target().name == "cpu"


@pytest.mark.on_cpu  # checks the target traced for on this CPU (fp8.current_target)
def test_compile_target_overrides_and_restores():
  with fp8.compile_target("B200") as target:
    assert fp8.current_target() is target and target.mx
    with fp8.compile_target("h100"):
      assert fp8.current_target().name == "h100"
    assert fp8.current_target().name == "b200"
  assert fp8.current_target().name == "cpu"


@pytest.mark.on_cpu  # checks the target traced for on this CPU (fp8.current_target)
def test_compile_target_called_without_with_warns_that_it_changed_nothing():
  # Called as a function, it would name no target, silently: fp8 ops still trace for
  # the local device. Like a coroutine never awaited, it says so when dropped.
  with pytest.warns(RuntimeWarning, match=re.escape(
      "jaxmp.fp8.compile_target('b200') was never entered, so it changed nothing: it names "
      "the chip only inside `with jaxmp.fp8.compile_target('b200'):`.")):
    fp8.compile_target("b200")
    gc.collect()
  assert fp8.current_target().name == "cpu"
  # Entered once, it warns nothing; the same object may be entered again, nested too.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    named = fp8.compile_target("h100")
    with named as target:
      assert target.name == "h100"
      with named:
        assert fp8.current_target().name == "h100"
      assert fp8.current_target().name == "h100"
    assert fp8.current_target().name == "cpu"
    del named
    gc.collect()
  # A bad name is refused at the call, entered or not.
  with pytest.raises(ValueError, match="unknown target 'h300'"):
    fp8.compile_target("h300")


@pytest.mark.on_cpu  # checks the target traced for on this CPU (fp8.current_target)
def test_a_function_traced_before_is_traced_again_for_the_named_target_and_after_it():
  # JAX caches a function's trace by the function and its argument types; the target is
  # not among them. Traced here first, the block-scaled GEMM came back as this CPU's
  # dequantized dot under compile_target("h100"), so audit(..., target="h100")
  # reported float32 GEMMs for a step the H100 runs as jaxmp's fp8 kernel.
  step = jax.jit(lambda x, w: fp8.fp8_dot_general(x, w, DIMS, recipe=fp8.BlockScaling()))
  x, w = jnp.ones((128, 256), jnp.bfloat16), jnp.ones((256, 128), jnp.bfloat16)
  kernel = lambda: "pallas_call" in step.trace(x, w).jaxpr.pretty_print()
  assert not kernel()  # this CPU: the dequantized GEMM only
  with fp8.compile_target("h100"):
    assert kernel()  # the kernel, under lax.platform_dependent
  assert not kernel()


def test_an_mx_function_traced_for_blackwell_still_runs_here_with_the_same_numbers():
  # On a b200 target the MX GEMM is jax.nn.scaled_matmul under lax.platform_dependent;
  # on this CPU the same program takes the dequantizing branch.
  k = jax.random.split(jax.random.key(0), 2)
  x, w = jax.random.normal(k[0], (16, 96)), jax.random.normal(k[1], (96, 24))
  run = lambda: jax.jit(lambda x, w: fp8.fp8_dot_general(x, w, DIMS, recipe=fp8.MXScaling()))
  with fp8.compile_target("b200"):
    on_b200 = run()(x, w)
    text = jax.jit(lambda x, w: fp8.fp8_dot_general(
        x, w, DIMS, recipe=fp8.MXScaling())).trace(x, w).jaxpr.pretty_print()
  assert "platform_index" in text and "scaled_matmul" in text
  np.testing.assert_array_equal(np.asarray(on_b200), np.asarray(run()(x, w)))


@pytest.mark.parametrize("device, name, fp8_gemm, mx_gemm", [
    (types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                           compute_capability="9.0"), "NVIDIA H100 80GB HBM3", True, False),
    (types.SimpleNamespace(platform="gpu", device_kind="NVIDIA B200", compute_capability="10.0"),
     "NVIDIA B200", True, jax_compat.cudnn_version() in (None,) or jax_compat.cudnn_version() >= 91000),
    (types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100", compute_capability="8.0"),
     "NVIDIA A100", False, False),
    (types.SimpleNamespace(platform="tpu", device_kind="TPU7x"), "v7", True, False),
    (types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite"), "v5e", False, False),
    (types.SimpleNamespace(platform="gpu", device_kind="AMD Instinct MI300X"),
     "AMD Instinct MI300X", None, False),
    (types.SimpleNamespace(platform="gpu", device_kind="NVIDIA L4", compute_capability="8.9"),
     "NVIDIA L4", True, False),
])
def test_devices_are_read_as_targets(device, name, fp8_gemm, mx_gemm):
  target = support.target_for_device(device)
  assert (target.name, target.fp8, target.mx) == (name, fp8_gemm, mx_gemm)
  # Only Hopper's (and Ada's) cuBLASLt reads fp8 operands K-major only.
  assert target.k_major_fp8 == (name in ("NVIDIA H100 80GB HBM3", "NVIDIA L4"))
  # No claim about a GPU this module does not describe: no warning either.
  if fp8_gemm is None:
    assert support.lowering(fp8.MXScaling(), target).kind == "unknown"


# The support table of docs/guides/fp8.md, compiled deviceless (needs the CUDA plugin; TPU rows
# need libtpu): every GEMM of a forward + backward, read back from the optimized HLO.
_TABLE_CHECK = textwrap.dedent("""\
    from jaxmp import fp8
    from jaxmp._src.tools import audit
    from jaxmp._src.tools import targets
    recipes = {"tensor": fp8.DelayedScaling(4), "row": fp8.RowwiseScaling(),
               "block": fp8.BlockScaling(), "block2": fp8.BlockScaling(power_of_two=True),
               "mx": fp8.MXScaling(), "mx_ceil": fp8.MXScaling(scale_rounding="ceil"),
               "mx_rceil": fp8.MXScaling(gradient_format="e5m2", scale_rounding="rceil"),
               "gw_hp": fp8.GemmRecipes.rowwise_with_gw_hp()}
    for target in ("h100", "b200", "v7"):
      if target == "v7" and not targets.installed("libtpu"):
        continue
      for name, recipe in recipes.items():
        kinds, warned = audit.compiled_gemms(recipe, target)
        print(target, name, len(kinds), ",".join(sorted(set(kinds))), warned)
    """)

def _deviceless(script: str) -> subprocess.CompletedProcess:
  """``script`` run in a process that compiles deviceless (JAX_PLATFORMS=cpu), checked."""
  # This pytest process may hold libtpu's single-process lock (it ran TPU audits).
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
             ALLOW_MULTIPLE_LIBTPU_LOAD="1",
             PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                       text=True, timeout=1200)
  assert out.returncode == 0, out.stderr[-4000:]
  return out


_EXPECTED_TABLE = {
    ("h100", "tensor"): "3 fp8 False", ("h100", "row"): "3 fp8 False",
    ("h100", "block"): "3 fp8 False", ("h100", "block2"): "3 bfloat16 True",
    ("h100", "mx"): "3 bfloat16 True",
    ("b200", "tensor"): "3 fp8 False", ("b200", "row"): "3 fp8 False",
    ("b200", "block"): "3 float32 True", ("b200", "block2"): "3 bfloat16 True",
    ("b200", "mx"): "3 mx False",
    ("v7", "tensor"): "3 fp8 False", ("v7", "row"): "3 fp8 False",
    ("v7", "block"): "3 float32 True", ("v7", "block2"): "3 bfloat16 True",
    ("v7", "mx"): "3 bfloat16 True",
    **{(chip, mx): "3 mx False" if chip == "b200" else "3 bfloat16 True"
       for chip in ("h100", "b200", "v7") for mx in ("mx_ceil", "mx_rceil")},
    # torchao's rowwise_with_gw_hp: fp8 forward, fp8 rowwise x tensorwise input gradient.
    **{(chip, "gw_hp"): "3 bfloat16,fp8 False" for chip in ("h100", "b200", "v7")},
}


@pytest.mark.slow
def test_the_support_table_holds_in_deviceless_compiles():
  if not audit_targets.cuda_plugin_installed():
    pytest.skip("needs the jax[cuda12] plugin (make gpu-report builds .venv-cuda)")
  out = _deviceless(_TABLE_CHECK)
  rows = {tuple(line.split()[:2]): " ".join(line.split()[2:])
          for line in out.stdout.splitlines() if line.split()[:1] in (["h100"], ["b200"], ["v7"])}
  assert rows, out.stdout
  for key, found in rows.items():
    assert found == _EXPECTED_TABLE[key], (key, found)


_MX_ROUNDINGS_CHECK = textwrap.dedent("""\
    import re
    import jax, jax.numpy as jnp
    import jaxmp
    from jaxmp import fp8
    S = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    for rounding in ("floor", "ceil", "rceil", "even"):
      recipe = fp8.MXScaling(gradient_format="e5m2", scale_rounding=rounding)
      def step(x, w, g, recipe=recipe):
        y, vjp = jax.vjp(lambda x, w: fp8.fp8_dot_general(x, w, dims, recipe=recipe), x, w)
        return y, vjp(g)
      r = jaxmp.tools.audit(step, S, S, S, target="b200")
      calls = sorted(set(re.findall(r'custom_call_target="(__cudnn[^"]*)"', r.hlo)))
      print(rounding, "|".join(sorted(f"{g.backend}:{','.join(g.operand_dtypes)}"
                                      for g in r.gemms)), ",".join(calls))
    """)


def test_every_mx_scale_rounding_reaches_cudnn_s_block_scaled_gemm_on_a_b200():
  # Every rounding gives E8M0 scales, which is all cuDNN's block-scaled GEMM reads: the
  # three GEMMs of a forward + backward (E4M3 operands, E5M2 gradients) lower to it.
  if not audit_targets.cuda_plugin_installed():
    pytest.skip("needs the jax[cuda12] plugin (make gpu-report builds .venv-cuda)")
  lines = dict(line.split(" ", 1) for line in _deviceless(_MX_ROUNDINGS_CHECK).stdout.splitlines()
               if line.split(" ", 1)[0] in ("floor", "ceil", "rceil", "even"))
  mx = "MX cuDNN block-scaled GEMM"
  expected = (f"{mx}:float8_e4m3fn,float8_e4m3fn|{mx}:float8_e5m2,float8_e4m3fn|"
              f"{mx}:float8_e5m2,float8_e4m3fn __cudnn$blockScaledDot")  # sorted
  assert lines == dict.fromkeys(("floor", "ceil", "rceil", "even"), expected), lines


_ROWWISE_LAYOUT_CHECK = textwrap.dedent("""\
    import jax, jax.numpy as jnp
    import jaxmp
    from jaxmp import fp8
    dims = (((1,), (0,)), ((), ()))
    def step(w, x, g):
      f = lambda w, x: fp8.fp8_dot_general(x, w.astype(jnp.bfloat16), dims,
                                           recipe=fp8.RowwiseScaling())
      y, vjp = jax.vjp(f, w, x)
      dw, dx = vjp(g)
      return w - 1e-3 * dw, dx, y
    args = (jax.ShapeDtypeStruct((1024, 4096), jnp.float32),
            jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16),
            jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16))
    r = jaxmp.tools.audit(jax.jit(step, donate_argnums=0), *args, target="h100",
                          compiler_options={"xla_gpu_enable_triton_gemm": False})
    print("launches", r.launches)
    for k in r.kernels:
      print("kernel", k.output)
    """)


def test_rowwise_reads_its_float32_kernel_without_a_transposed_int16_copy_on_an_h100():
  # Left to choose the layouts, XLA wrote the forward pass's quantizations of the
  # kernel in another layout than the GEMMs read, and its two amaxes (per row, per
  # column) read a transposed int16 copy of the kernel's magnitudes: 26 kernels for
  # this step, one an s16[4096,1024]. The quantized operands pinned to the canonical
  # layout (per_gemm._canonical_on_gpus): 22, and no 2-D int16 array.
  if not audit_targets.cuda_plugin_installed():
    pytest.skip("needs the jax[cuda12] plugin (make gpu-report builds .venv-cuda)")
  lines = _deviceless(_ROWWISE_LAYOUT_CHECK).stdout.splitlines()
  outputs = [line.split(" ", 1)[1] for line in lines if line.startswith("kernel ")]
  assert outputs, lines
  assert not [o for o in outputs if o.startswith("s16[") and "," in o.split("]")[0]], outputs
  launches = int(next(line.split()[1] for line in lines if line.startswith("launches ")))
  assert launches <= 22, launches


_SCALE_CHECK = textwrap.dedent("""\
    import re
    import jax, jax.numpy as jnp
    import jaxmp
    from jaxmp._src.fp8 import scaled_gemm
    def product(a, b, scale):
      return scaled_gemm.rescaled_dot(a, b, scaled_gemm.CANONICAL, scale, jnp.bfloat16)
    fp8 = jax.ShapeDtypeStruct((1, 256, 256), jnp.float8_e4m3fn)
    scale = jax.ShapeDtypeStruct((), jnp.float32)
    for mode, options in (("cuBLAS", {"xla_gpu_enable_triton_gemm": False}), ("Triton", {})):
      r = jaxmp.tools.audit(jax.jit(product), fp8, fp8, scale, target="h100",
                            compiler_options=options)
      calls = re.findall(r'custom-call\\(([^)]*)\\), custom_call_target="__cublas', r.hlo)
      # The entry computation's float32 scalar parameter (the scale), by name.
      entry = r.hlo[r.hlo.index("\\nENTRY"):]
      (param,) = re.findall(r"(%\\S+) = f32\\[\\]\\S* parameter\\(", entry)
      rounded = bool(re.search(r"= bf16\\[\\] convert\\(", r.hlo))
      print(mode, [g.backend for g in r.gemms],
            ["the scale" if c.split(", ")[2] == param else c for c in calls], rounded)
    """)


def test_h100_bfloat16_gemm_scale_reaches_cublaslt_in_float32():
  # rescaled_dot's CUDA form multiplies a bfloat16-output GEMM by its scale converted to
  # bfloat16 (fuses_output_on_gpus). XLA's cuBLASLt call drops the conversion and is
  # given the float32 scale (the scalar parameter itself); its Triton GEMM keeps the
  # bfloat16 rounding. What the docstring and the fp8 guide say.
  if not audit_targets.cuda_plugin_installed():
    pytest.skip("needs the jax[cuda12] plugin (make gpu-report builds .venv-cuda)")
  lines = [line for line in _deviceless(_SCALE_CHECK).stdout.splitlines()
           if line.split(" ", 1)[0] in ("cuBLAS", "Triton")]
  assert lines == ["cuBLAS ['fp8 cuBLASLt'] ['the scale'] False",
                   "Triton ['Triton GEMM fusion'] [] True"], lines


@pytest.mark.parametrize("target, warns", [
    ("cpu", False), ("v5e", False), ("v5p", False), ("v6e", False), ("v7", True),
    ("h100", False), ("b200", False), ("a100", False),
])
def test_int8_warns_where_it_runs_at_the_bfloat16_rate_naming_the_chip(target, warns):
  messages = _fallback_warnings(fp8.Int8Scaling(), None if target == "cpu" else target)
  if not warns:
    assert messages == []
    return
  (message,) = messages
  # The recipe as the user wrote it, not the per-GEMM form jaxmp runs it in.
  assert message.startswith("jaxmp fp8: Int8Scaling() does not run in int8 on v7 ")
  assert ("does not run in int8 on v7 (TPU v7: int8 at the bfloat16 rate): its forward, "
          "input-gradient, weight-gradient GEMMs run as int8 GEMMs at the bfloat16 rate") in message
  # Only the int8 GEMMs are named; an fp8 GEMM beside them runs in fp8 on v7.
  (message,) = _fallback_warnings(fp8.GemmRecipes(fp8.Int8Scaling(), fp8.RowwiseScaling()), "v7")
  assert "its forward GEMM runs as int8 GEMMs" in message


def test_int8_lowers_to_int8_gemms_where_jaxmp_claims_so():
  int8 = fp8.Int8Scaling()
  assert [support.lowering(int8, support.TARGETS[t]).kind
          for t in ("v5e", "v5p", "v6e", "v7", "h100", "cpu")] == [
              "int8", "int8", "int8", "fallback", "unknown", "emulated"]


_TPU_INT8_CHECK = textwrap.dedent("""\
    import jax, jax.numpy as jnp
    from jaxmp import fp8
    from jaxmp._src.tools import audit
    dims = (((1,), (0,)), ((), ()))
    operand = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)
    int8 = lambda x, w: fp8.fp8_dot_general(x, w, dims, recipe=fp8.Int8Scaling())
    bf16 = lambda x, w: jax.lax.dot_general(x, w, dims)
    for target in ("v5e", "v5p", "v6e", "v7"):
      kinds, warned = audit.compiled_gemms(fp8.Int8Scaling(), target)
      (q,), (b,) = (audit.audit(f, operand, operand, target=target).gemms for f in (int8, bf16))
      print(target, ",".join(sorted(set(kinds))), len(kinds), warned,
            ",".join(q.compute_dtypes), round(q.cycles / b.cycles, 2))
    """)


@pytest.mark.slow
def test_int8_gemms_are_int8_matrix_unit_gemms_on_tpus_by_the_cost_model():
  if not audit_targets.installed("libtpu"):
    pytest.skip("needs libtpu (jax[tpu]; make gpu-report builds .venv-cuda with it)")
  out = _deviceless(_TPU_INT8_CHECK)
  rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()
          if line.split()[:1] in (["v5e"], ["v5p"], ["v6e"], ["v7"])}
  assert set(rows) == {"v5e", "v5p", "v6e", "v7"}, out.stdout
  for target, (kinds, count, warned, operands, ratio) in rows.items():
    # Forward and both gradient GEMMs multiply int8 operands (the int32 product is
    # rescaled inside the GEMM's fusion, which writes bfloat16).
    assert (kinds, count, operands) == ("int8", "3", "int8,int8"), (target, rows)
    assert warned == str(target == "v7"), (target, rows)
    # The forward GEMM's cycles against bfloat16's (libtpu's cost model): about half on
    # v5e and v5p, less on v6e, the same on v7 (hence the warning there).
    bound = {"v5e": (0, 0.6), "v5p": (0, 0.6), "v6e": (0, 0.95), "v7": (0.9, 1.1)}[target]
    assert bound[0] <= float(ratio) <= bound[1], (target, rows)
