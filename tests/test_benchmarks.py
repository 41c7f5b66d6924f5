"""Every script in benchmarks/ runs at tiny sizes and prints what it measures.

Smoke tests: the figures of a tiny model mean nothing, so these check that each script
runs end to end and reports every variant it claims to, with the few facts that hold
at any size (fp8 GEMMs in the compiled HLO, bytes per parameter, no skipped steps).
They run in-process through each script's ``main(argv)``, except those that compile
for a GPU or TPU without one: those need JAX's CUDA plugin (``make gpu-report`` builds
``.venv-cuda``), run in a subprocess with ``JAX_PLATFORMS=cpu``, and are skipped
without it.
"""

import json
import math
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from jaxmp._src.tools import targets

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
sys.path.insert(0, str(ROOT / "examples"))

NEEDS_CUDA_PLUGIN = pytest.mark.skipif(
    not targets.cuda_plugin_installed(),
    reason="compiles for GPUs without one through JAX's CUDA plugin (jax[cuda12]), not "
           "installed here; `make gpu-report` builds .venv-cuda with it")


def _table_rows(out: str, names) -> dict[str, list[str]]:
  """The cells after the name of each table line that starts with one of ``names``."""
  rows = {}
  for line in out.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")] if line.startswith("|") else None
    for name in names:
      if cells is not None and cells[0] == name:
        rows[name] = cells[1:]
      elif cells is None and re.match(re.escape(name) + r" {2,}\S", line):
        rows[name] = line[len(name):].split()
  return rows


def _run_deviceless(script: str, *args: str) -> str:
  """``script`` in a subprocess that compiles for chips that are not here."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
             ALLOW_MULTIPLE_LIBTPU_LOAD="1",
             PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  result = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], env=env,
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
  assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
  return result.stdout


@pytest.mark.slow
def test_bench_recipes_quality_trains_the_demo_with_fp8_recipes(capsys):
  # A few recipes (each is a few seconds of compiling): delayed scaling's state, a
  # recipe per GEMM, one per operand, and MX's rounded-up scales; tests/fp8 runs every
  # recipe.
  import bench_recipes  # pylint: disable=g-import-not-at-top
  recipes = ["per-tensor delayed", "rowwise, bf16 weight gradient",
             "torchao rowwise_with_gw_hp", "MXFP8, rceil scales"]
  bench_recipes.main(["--parts", "quality", "--preset", "smoke", "--steps", "2",
                      "--recipes", *recipes])
  names = ["bfloat16", *recipes]
  rows = _table_rows(capsys.readouterr().out, names)
  assert list(rows) == names, rows
  for name, (train, val, delta) in rows.items():
    assert 0 < float(train) < 10 and 0 < float(val) < 10, (name, rows[name])
  assert rows["bfloat16"][2] == "+0.00%"


@pytest.mark.slow
@NEEDS_CUDA_PLUGIN
def test_bench_recipes_support_compiles_every_recipe_for_each_chip():
  import bench_recipes  # pylint: disable=g-import-not-at-top
  rows = _table_rows(_run_deviceless("bench_recipes.py", "--parts", "support"),
                     bench_recipes.RECIPES)
  assert list(rows) == list(bench_recipes.RECIPES), rows
  assert rows["per-tensor delayed"][:2] == ["fp8, fp8, fp8"] * 2  # h100, b200


@pytest.mark.slow
def test_bench_fp8_times_every_variant_of_both_workloads():
  import bench_fp8  # pylint: disable=g-import-not-at-top
  results = bench_fp8.main(["--preset", "smoke"])
  assert list(results) == ["dense", "block"]
  for timings in results.values():
    assert list(timings) == list(bench_fp8.variants_of(16)), timings
    assert all(t.ms > 0 and t.ratio > 0 for t in timings.values()), timings


@pytest.mark.slow
def test_bench_block_gemm_times_the_kernels_beside_bf16_and_checks_their_products():
  import bench_block_gemm  # pylint: disable=g-import-not-at-top
  results = bench_block_gemm.main(["--preset", "smoke", "--rounds", "1", "--calls", "1"])
  (shape, rows), = results.items()
  assert shape == (64, 128, 256)
  assert list(rows) == ["bf16", "fp8 per-tensor", "block defaults", "block no prefetch",
                        "mosaic defaults", "mosaic 3 stages", "block 1x128 x 1x128",
                        "mosaic 1x128 x 1x128"]
  for name, (t, error) in rows.items():
    assert t.ms > 0
    # The kernels' products, rounded once to bfloat16: within 2^-9 of each value.
    kernel = name.startswith(("block", "mosaic"))
    assert (error is None) == (not kernel) and (error or 0) <= 2 ** -8, rows


def test_bench_block_gemm_times_only_the_schedules_named_and_refuses_unknown_ones(capsys):
  import bench_block_gemm  # pylint: disable=g-import-not-at-top
  results = bench_block_gemm.main(["--preset", "smoke", "--rounds", "1", "--calls", "1",
                                   "--variants", "mosaic defaults"])
  assert list(results[(64, 128, 256)]) == ["bf16", "fp8 per-tensor", "mosaic defaults",
                                           "block 1x128 x 1x128", "mosaic 1x128 x 1x128"]
  assert "64x128x256 fastest: mosaic defaults " in capsys.readouterr().out
  with pytest.raises(SystemExit):
    bench_block_gemm.main(["--preset", "smoke", "--variants", "mosaic 7 stages"])
  assert "unknown variant(s) ['mosaic 7 stages']" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_linen_times_the_wrapper_beside_the_hand_written_model():
  import bench_linen  # pylint: disable=g-import-not-at-top
  timings, converts = bench_linen.main(["--preset", "smoke", "--rounds", "1", "--calls", "1"])
  assert list(timings) == ["hand_bf16", "jaxmp_bf16", "float32"]
  assert timings["hand_bf16"].ratio == 1.0
  # The wrapper adds no casts beyond those of the model written in bfloat16 by hand.
  assert converts["jaxmp_bf16"]["converts"] <= converts["hand_bf16"]["converts"], converts


@pytest.mark.slow
def test_bench_loss_scaling_times_every_formulation_of_the_skip(capsys):
  import bench_loss_scaling  # pylint: disable=g-import-not-at-top
  times = bench_loss_scaling.main(["--width", "8", "--batch", "4", "--blocks", "2",
                                   "--steps", "1", "--warmup", "1", "--max-other-load", "inf"])
  names = [v.name for v in bench_loss_scaling.variants(1e-4)]
  assert list(times) == names
  rows = _table_rows(capsys.readouterr().out, names)
  assert list(rows) == names and rows["plain"][2:4] == ["1.000", "1.000"], rows


@pytest.mark.slow
def test_bench_memory_reports_bytes_per_param_and_loss_of_each_run(capsys):
  import bench_memory  # pylint: disable=g-import-not-at-top
  import train_memory  # pylint: disable=g-import-not-at-top
  picked = ["(b) remainders", train_memory.NEAREST]
  rows, vals = bench_memory.main(["--preset", "smoke", "--steps", "2", "--settings", "demo",
                                  "--runs", *picked])
  assert list(rows) == ["float32", "(a) mixed", *picked]
  assert all(math.isfinite(v) for v in vals["demo"].values()), vals
  per_param = {name: row.bytes_per_param for name, row in rows.items()}
  assert (per_param["(a) mixed"]["params"], per_param["(a) mixed"]["master"]) == (4.0, 0.0)
  assert (per_param[train_memory.NEAREST]["params"],
          per_param[train_memory.NEAREST]["master"]) == (2.0, 0.0)
  assert (per_param["(b) remainders"]["params"], per_param["(b) remainders"]["master"]) == (
      2.0, 2.0)
  assert "round-to-nearest drops" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_nonfinite_times_the_step_with_tracing_off_and_on(capsys):
  import bench_nonfinite  # pylint: disable=g-import-not-at-top
  timings = bench_nonfinite.main(["--preset", "smoke", "--blocks", "2", "--steps", "1",
                                  "--max-other-load", "inf"])
  assert list(timings) == ["off", "on"]
  rows = _table_rows(capsys.readouterr().out, ["off", "on"])
  # HLO instructions: tracing adds some; no step was skipped.
  assert int(rows["on"][6]) > int(rows["off"][6]), rows
  assert rows["off"][8] == rows["on"][8] == "0", rows


@pytest.mark.slow
def test_bench_precisions_times_every_configuration_of_the_demo():
  import bench_precisions  # pylint: disable=g-import-not-at-top
  import train_lm  # pylint: disable=g-import-not-at-top
  timings = bench_precisions.main(["--preset", "smoke", "--rounds", "1", "--calls", "1"])
  assert list(timings) == [run.name for run in train_lm.RUNS if not run.note]
  assert timings["float32"].ratio == 1.0


def test_gpu_report_lists_its_workloads_and_refuses_an_unknown_one_before_compiling():
  # No CUDA plugin needed: the arguments are checked before anything compiles.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = lambda *args: subprocess.run([sys.executable, str(BENCHMARKS / "gpu_report.py"), *args],
                                     env=env, capture_output=True, text=True, timeout=300,
                                     cwd=ROOT)
  help_text = " ".join(run("--help").stdout.split())
  assert "from: traffic, dense, block, demo, llama, memory, tpu (default: all)" in help_text, help_text
  bad = run("--workloads", "dense,gemma")
  assert bad.returncode == 2 and bad.stdout == "", (bad.stdout, bad.stderr)
  assert ("unknown workload(s) ['gemma']; accepted: traffic, dense, block, demo, llama, memory, tpu"
          in bad.stderr), bad.stderr


@pytest.mark.slow
def test_gpu_report_s_scanned_llama_stacks_train_with_every_projection_in_fp8():
  import jax  # pylint: disable=g-import-not-at-top
  import gpu_report  # pylint: disable=g-import-not-at-top
  from tests.published import matmuls  # pylint: disable=g-import-not-at-top

  cases = gpu_report.llama_scan_cases("smoke")
  counts = {}
  for name, case in cases.items():
    args = case.make()
    counts[name] = dict(matmuls.count_matmuls(jax.make_jaxpr(case.fn)(*args)))
    _, loss = jax.jit(case.fn)(*args)
    assert math.isfinite(float(loss)), (name, loss)
  # The scan body holds one layer: its 7 projections' 21 GEMMs (forward e4m3 x e4m3, the
  # two gradients with the e5m2 output gradient) are fp8 by the rule, on the unchanged
  # stack; attention's score and weighted-sum GEMMs stay in the compute dtype.
  fp8_gemms = {"float8_e4m3fn": 7, "mixed:float8_e4m3fn,float8_e5m2": 14}
  assert counts["bf16, nn.scan"] == {"bfloat16": 27}, counts
  assert counts["fp8 per-tensor, nn.scan"] == {**fp8_gemms, "bfloat16": 6}, counts
  # With the causal rule the projections stay fp8; attention is jax.nn's (XLA's on a
  # CPU, whose probabilities' GEMMs mix in float32; cuDNN's fused kernel on a GPU).
  causal_attention = {"bfloat16": 4, "mixed:bfloat16,float32": 2}
  assert counts["bf16 + causal attention, nn.scan"] == {
      "bfloat16": 21 + 4, "mixed:bfloat16,float32": 2}, counts
  assert counts["fp8 per-tensor + causal attention, nn.scan"] == {
      **fp8_gemms, **causal_attention}, counts
  # NNX's attention multiplies two of its GEMMs' bfloat16 operands with a float32 one.
  nnx_attention = {"mixed:bfloat16,float32": 2}
  assert counts["bf16, nnx.scan"] == {"bfloat16": 25, **nnx_attention}, counts
  assert counts["fp8 per-tensor, nnx.scan"] == {**fp8_gemms, "bfloat16": 4, **nnx_attention}, counts
  assert cases["fp8 per-tensor, nn.scan"].against == "bf16, nn.scan"
  assert cases["fp8 per-tensor, nnx.scan"].against == "bf16, nnx.scan"


@pytest.mark.slow
@NEEDS_CUDA_PLUGIN
def test_gpu_report_compiles_every_workload_for_an_h100():
  workloads = ["traffic", "dense", "block", "demo", "llama", "memory"] + (
      ["tpu"] if targets.installed("libtpu") else [])
  out = _run_deviceless("gpu_report.py", "--preset", "smoke", "--workloads", ",".join(workloads))
  for title in ("### fp8: non-GEMM HBM traffic", "### dense forward + backward",
                "### block forward + backward", "### demo train step",
                "### llama: one smoke-sized decoder layer", "### llama: 2 smoke-sized",
                "### memory: one smoke layer"):
    assert title in out, out
  # Declared causal, the layer's attention runs as cuDNN's two calls (forward,
  # backward) in place of the six score and weighted-sum GEMMs of Flax's attention.
  llama = out[out.index("### llama: one"):out.index("### llama: 2")]
  rows = _table_rows(llama, ["bf16", "bf16 + causal attention"])
  assert (rows["bf16"][4], rows["bf16 + causal attention"][4]) == ("0/21", "0/17"), llama
  # Each ratio measures one effect: attention against bf16, precision against float32.
  assert rows["bf16"][1].endswith("x vs float32 (precision)"), llama
  assert rows["bf16 + causal attention"][1].endswith("x vs bf16 (attention)"), llama
  # jaxmp's fp8 Dense runs its three GEMMs in fp8 on an H100, at any size.
  dense = out[out.index("### dense"):out.index("### block")]
  assert _table_rows(dense, ["bf16 + jaxmp fp8"])["bf16 + jaxmp fp8"][4] == "3/3", dense
  if "tpu" in workloads:
    assert "### TPU:" in out and "| v7 (" in out, out
    assert "jaxmp int8 Dense fwd+bwd" in out and "| v5e | int8 | " in out, out
    demo = out[out.index("### TPU: the demo's train step"):]
    rows = [line for line in demo.splitlines() if line.startswith("| v5e | ")]
    assert [row.split(" | ")[1] for row in rows] == [
        "bf16", "fp8 per-tensor (the demo's)", "fp8 rowwise", "int8",
        "int8, weight grad bf16"], demo
    assert "int8xint8" in rows[3], rows  # int8 GEMMs on a TPU by rule


def _check_deviceless(code: str, timeout: int) -> str:
  """What ``code`` prints (stripped), run with the benchmarks importable and no GPU."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([str(ROOT), str(BENCHMARKS), str(ROOT / "examples")]))
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-4000:]
  return out.stdout.strip()


_FP8_KERNELS = textwrap.dedent("""\
    import re, sys
    sys.argv = ["gpu_report"]
    import gpu_report
    cases = gpu_report.llama_cases("smoke")
    for donate in (False, True):
      for name in ("bf16", "fp8 per-tensor"):
        r = gpu_report.audit(cases[name], "cuBLAS", donate=donate)
        # Copies of a float32 vector: of the fp8 state's leaves (histories, scales).
        copies = sum(bool(re.search(r"= f32\\[\\d+\\]\\S* copy\\(", line))
                     for line in r.hlo.splitlines())
        print(f"{name}{' donated' if donate else ''}|{r.launches}|"
              f"{sum(g.fp8 for g in r.gemms)}|{copies}")
    """)


@NEEDS_CUDA_PLUGIN
def test_h100_fp8_train_step_launches_at_most_twice_bf16_s_kernels():
  # Delayed scaling's per-tensor state updates run as a few reductions over every
  # layer's state at once (fp8.state.merge) and each op's three scales as one
  # reduction: a small Llama layer's fp8 step compiled for an H100 launched 187
  # kernels against bf16's 60 (3.1x) when each op updated its own state. With the
  # state donated (as training loops run a step), the selects go leaf by leaf (a
  # select over leaves laid end to end copied each leaf: 158 kernels, 2.6x); the
  # amaxes behind a barrier cost a few kernels (109 -> 119 undonated) and won 0.6
  # ms of 8.7 on an H200 (RESULTS.md). Each Dense's output gradient is written before
  # its transpose, by a kernel of its own (the Llama layer's step 2.7% faster on an
  # H200; test_h100_delayed_scaling_transposes_each_output_gradient_as_fp8_values):
  # donated 138 -> 140 kernels here, and 155 until the scales went behind the
  # forward pass's barrier (XLA had recomputed them in merge's select and copied all
  # 21 into the donated state). Each new amax history (its old one rolled) was
  # computed inside merge's select and then copied into the donated state, 21 copies
  # (140 kernels, 2.3x); computed behind a barrier into a buffer of their own, the
  # selects write every history in place: 120 kernels, as many as undonated.
  rows = {name: tuple(map(int, counts)) for name, *counts in
          (line.split("|") for line in _check_deviceless(_FP8_KERNELS, 600).splitlines())}
  assert rows["fp8 per-tensor"][1] == 21, rows  # the 7 Dense layers' 3 GEMMs, in fp8
  assert rows["fp8 per-tensor"][0] <= 2.0 * rows["bf16"][0], rows
  assert rows["fp8 per-tensor donated"][0] <= 2.0 * rows["bf16 donated"][0], rows
  assert rows["fp8 per-tensor donated"][2] == 0, rows  # no state leaf copied


_DONATED_COPIES = textwrap.dedent("""\
    import re, sys
    sys.argv = ["gpu_report"]
    import gpu_report
    cases = gpu_report.llama_cases("smoke")
    for name in ("fp8 per-tensor", "fp8 rowwise + causal attention",
                 "fp8 block 1x128/128x128 + causal attention"):
      report = gpu_report.audit(cases[name], "cuBLAS", donate=True)
      for line in report.hlo.splitlines():
        # A float32 matrix: a parameter (the fp8 state's leaves are vectors).
        match = re.search(r"= (f32\\[\\d+,[\\d,]+\\])\\S* copy(-start)?\\(", line)
        if match:
          print(name, match.group(1))
    """)


@NEEDS_CUDA_PLUGIN
def test_h100_fp8_train_step_with_a_donated_state_copies_no_parameter():
  # A training loop donates its state (examples/train_lm.py does), so each step writes
  # its parameters into the buffers of the old ones. Delayed scaling's amax of each
  # fp8 kernel was fused by XLA into the optimizer's update of that kernel, which then
  # could not be written in place: the step copied every fp8 kernel (f32[4096,14336]
  # three times on a Llama-3-8B layer, 0.43 ms a step measured on an H200). The
  # per-GEMM recipes (rowwise here) copied every kernel too until their quantizations
  # went behind a barrier in the forward pass (fp8/per_gemm.py); the block recipe's
  # FFN kernels until its kernel wrote the weight gradient as (in, out)
  # (block.gemm).
  assert _check_deviceless(_DONATED_COPIES, 600) == ""


_KERNEL_READERS = textwrap.dedent("""\
    import re, sys
    sys.argv = ["gpu_report"]
    import gpu_report
    report = gpu_report.audit(gpu_report.llama_cases("smoke")["fp8 per-tensor"], "cuBLAS",
                              donate=True)
    entry = report.hlo[report.hlo.index("\\nENTRY"):]
    for param in re.findall(r"(state_params__\\w+?kernel__\\S*?): f32", entry):
      readers = [line.split(" = ")[0].strip() for line in entry.splitlines()[1:]
                 if re.search(f"[(,] ?%{re.escape(param)}[,)]", line)]
      print(param, len(readers), *readers)
    """)


@NEEDS_CUDA_PLUGIN
def test_h100_delayed_scaling_reads_each_float32_kernel_once_for_its_amax_and_quantization():
  # cuBLASLt's fp8 GEMMs read both operands K-major, so XLA had the kernel that
  # quantizes a Dense kernel (in, out) write it transposed; such a kernel cannot also
  # take the amax, and each FFN kernel was read three times a step (amax,
  # quantization, update: 224 MiB each on a Llama-3-8B layer). Quantized in its own
  # layout (scaled_gemm.in_own_layout_on_gpus), the quantization and the amax are one
  # kernel and the optimizer's update is the only other reader. Fails without it:
  # the gate, up and down kernels have three readers.
  rows = [line.split() for line in _check_deviceless(_KERNEL_READERS, 600).splitlines()]
  assert len(rows) == 7, rows  # q, k, v, o, gate, up, down
  assert all(int(row[1]) == 2 for row in rows), rows


_GRADIENT_TRANSPOSES = textwrap.dedent("""\
    import sys
    sys.argv = ["gpu_report"]
    import gpu_report
    report = gpu_report.audit(gpu_report.llama_cases("smoke")["fp8 per-tensor"], "cuBLAS",
                              donate=True)
    print(sum(k.count for k in report.kernels
              if k.unfused == "transpose" and k.output.startswith("f8e5m2")))
    """)


@NEEDS_CUDA_PLUGIN
def test_h100_delayed_scaling_transposes_each_output_gradient_as_fp8_values():
  # The weight-gradient GEMM reads the output gradient transposed. XLA cast g to fp8
  # and transposed it in one kernel (two outputs, or the transposed one beside the
  # producer's), and on an H200 those kernels moved 0.3-1.7 TB/s where most others
  # moved 3-4.4. Written first (scaled_gemm.in_own_layout_on_gpus, own_kernel=True), each
  # Dense's g is copied by a plain fp8 transpose: one per Dense (q, k, v, o, gate, up,
  # down). Fails without it: none.
  assert _check_deviceless(_GRADIENT_TRANSPOSES, 600).strip() == "7"


_MEMORY_CHECK = textwrap.dedent("""\
    import dataclasses, sys
    sys.argv = ["gpu_report"]
    import jax, jaxmp, gpu_report, llama_layer, train_memory
    runs = {r.name: r for r in train_memory.RUNS}
    # The order docs/guides/memory.md advises against: stochastic rounding inside loss scaling.
    inside = lambda schedule: jaxmp.optim.stochastic_rounding(
        train_memory.bf16_adamw(schedule), jax.random.key(0))
    runs["inside"] = dataclasses.replace(runs["(d) pure bf16, stochastic"], name="inside",
                                         optimizer=inside, loss_scale=jaxmp.NoOpLossScale)
    config = llama_layer.Config(d_model=512, heads=8, kv_heads=2, head_dim=64, ffn=2048)
    cases = gpu_report.memory_cases("smoke", config, list(runs.values()))
    state = jax.eval_shape(lambda: cases["float32"].make()[0])
    print(sum(x.size for x in jax.tree_util.tree_leaves(state.params)))
    for name, case in cases.items():
      m = gpu_report.audit(case, "cuBLAS").memory
      print(f"{name}|{m.peak_bytes}|{m.temp_bytes}")
    """)


@pytest.mark.slow
@NEEDS_CUDA_PLUGIN
def test_h100_train_step_memory_orders_as_the_memory_transforms_promise():
  first, *lines = _check_deviceless(_MEMORY_CHECK, 1200).splitlines()
  params = int(first)
  rows = {}
  for line in lines:
    name, peak, temp = line.rsplit("|", 2)
    rows[name] = (int(peak), int(temp))
  peak = lambda name: rows[name][0]
  # Less state, lower peak: float32 Adam > mixed > master + bf16 moments > remainders
  # > pure bfloat16.
  assert (peak("float32") > peak("(a) mixed") > peak("(b) master + bf16 Adam")
          > peak("(b) remainders") > peak("(c) pure bf16, nearest")), rows
  # 8-bit moments hold 2.03 bytes per param where bfloat16 ones hold 4, float32 ones 8;
  # the 8-bit update's computed map leaves loss scaling's skip a select (a table lookup
  # kept it a conditional writing float32 buffers: each 8-bit peak was above these).
  assert peak("(a) mixed, 8-bit Adam") < peak("(a) mixed"), rows
  assert peak("(b) master + 8-bit Adam") < peak("(b) master + bf16 Adam"), rows
  assert peak("(b) remainders, 8-bit Adam") < peak("(b) remainders"), rows
  # Stochastic rounding outside loss scaling: its random bits cost at most 2 bytes of
  # temporaries per param over round-to-nearest; inside, more (why docs/guides/memory.md says so).
  extra = lambda name: (rows[name][1] - rows["(c) pure bf16, nearest"][1]) / params
  assert extra("(d) pure bf16, stochastic") <= 2, rows
  assert extra("inside") > 2, rows


_LEAN_MEMORY_CHECK = textwrap.dedent("""\
    import sys
    sys.argv = ["gpu_report"]
    import gpu_report
    cases = gpu_report.memory_cases("gpu")
    for name in ("float32", "(b) master + bf16 Adam"):
      for lean in (False, True):
        options = gpu_report.LEAN_MEMORY if lean else None
        print(f"{name}|{lean}|{gpu_report.audit(cases[name], 'cuBLAS', options=options).memory.peak_bytes}")
    """)


@pytest.mark.slow
@NEEDS_CUDA_PLUGIN
def test_h100_bf16_master_step_peaks_under_three_quarters_of_float32_adam_without_dot_merger():
  # The Llama-3-8B-shaped layer (218M params, 512 tokens): bf16 params, float32 masters
  # and bf16 moments hold 10 + 2 bytes per param against float32 Adam's 12 + 4. With
  # XLA's dot merger the q, k, v weight gradients become one GEMM whose k and v parts are
  # copied out while every gradient is live: 0.753x. Without it (gpu_report.LEAN_MEMORY,
  # docs/guides/memory.md): 0.748x, and float32's peak moves by bytes.
  peaks = {}
  for line in _check_deviceless(_LEAN_MEMORY_CHECK, 1200).splitlines():
    name, lean, peak = line.rsplit("|", 2)
    peaks[name, lean == "True"] = int(peak)
  master = "(b) master + bf16 Adam"
  assert peaks[master, True] <= 0.75 * peaks["float32", True], peaks
  assert peaks[master, False] > peaks[master, True], peaks
  assert abs(peaks["float32", False] - peaks["float32", True]) < 2**20, peaks  # a few bytes


@pytest.mark.slow
def test_gpu_measure_times_counts_and_weighs_every_variant_it_names(tmp_path, capsys):
  # On the CPU: a check that the GPU-measuring script runs end to end (the figures of
  # a tiny model on a CPU mean nothing; the kernel counts and XLA's peaks are real).
  import gpu_measure  # pylint: disable=g-import-not-at-top
  import gpu_report  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  gpu_measure.main(["--preset", "smoke", "--workloads", "llama,attention", "--json",
                    str(tmp_path / "m.json"), "--profile", str(tmp_path / "traces")])
  out = capsys.readouterr().out
  # Every variant traced and summarised (a CPU trace has no GPU kernels: busy 0).
  traced = {f.parents[3] for f in (tmp_path / "traces").glob("*/*/plugins/profile/*/*.trace.json.gz")}
  variants = len(gpu_report.llama_cases("smoke")) + len(gpu_report.attention_cases("smoke"))
  assert len(traced) == variants, traced  # one folder per variant
  # ... and each trace copied beside its folder, two levels down (a device run's
  # output keeps no deeper files).
  assert {f.parent / f.name.removesuffix(".trace.json.gz") for f in (tmp_path / "traces").glob(
      "*/*.trace.json.gz")} == traced
  # llama's table | its profile, attention's table | attention's profile
  llama_out, profiled_out, _ = re.split(r"\nprofiled \(jax\.profiler.*\n", out)
  names = list(gpu_report.llama_cases("smoke"))
  rows = _table_rows(llama_out, names)
  assert list(rows) == names, out
  profiled = _table_rows(profiled_out, names)
  assert list(profiled) == names and all(cells[1] == "0.000" for cells in profiled.values()), out
  attention = gpu_report.attention_cases("smoke")
  assert list(_table_rows(profiled_out, list(attention))) == list(attention), out
  # The attention table's three ways compute one attention (and its gradients): a
  # causal mask tensor and the causal mode mask the same pairs.
  results = [jax.jit(case.fn)(*case.make()) for case in attention.values()]
  for other in results[1:]:
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2),
        results[0], other)
  kernels = {name: int(cells[5]) for name, cells in rows.items()}
  assert kernels["fp8 per-tensor"] > kernels["bf16"] > 0, out
  # Each row against the row it differs from in one respect.
  assert rows["float32"][1] == "-", out
  assert rows["bf16 + causal attention"][1].endswith("x vs bf16 (attention)"), out
  assert rows["fp8 per-tensor + causal attention"][1].endswith(
      "x vs bf16 + causal attention (precision)"), out
  figures = json.loads((tmp_path / "m.json").read_text())
  table, = [v for k, v in figures.items() if k.startswith("llama") and "profiled" not in k]
  assert list(table) == names and all(r["ms"] > 0 and r["ms_one_at_a_time"] > 0
                                     for r in table.values())
  # A memory run's state is zeros built leaf by leaf (a PRNG key included, which the
  # stochastic-rounding run keeps in its optimizer state); XLA's peak is the step's.
  row = gpu_measure.memory_run("(d) pure bf16, stochastic", "smoke")
  assert row["xla_peak_bytes"] > 0 and row["peak_bytes_in_use"] is None  # no stats on XLA:CPU
  # The lean compile (no dot merger) takes its options on any backend.
  assert gpu_measure.memory_run("(b) master + bf16 Adam", "smoke", lean=True)["xla_peak_bytes"] > 0


def test_every_gpu_table_row_is_compared_with_a_row_differing_in_one_respect():
  # A ratio across precision and attention at once (bf16 with cuDNN's causal attention
  # against float32 with Flax's) measured neither: each row names its one difference.
  import gpu_report  # pylint: disable=g-import-not-at-top
  tables = {"llama": gpu_report.llama_cases("smoke"), "demo": gpu_report.demo_cases("smoke"),
            "dense": gpu_report.layer_cases("dense", preset_name="smoke")}
  for title, cases in tables.items():
    baselines = [name for name, case in cases.items() if case.against is None]
    assert baselines == ["float32"], (title, baselines)
    for name, case in cases.items():
      if case.against is not None:
        assert case.against in cases and case.against != name, (title, name)
        assert case.differs in ("precision", "attention"), (title, name)
  llama, demo = tables["llama"], tables["demo"]
  assert (llama["bf16"].against, llama["bf16"].differs) == ("float32", "precision")
  assert (llama["bf16 + causal attention"].against,
          llama["bf16 + causal attention"].differs) == ("bf16", "attention")
  assert (demo["bf16, unfused attention"].against, demo["bf16"].against) == (
      "float32", "bf16, unfused attention")
  seconds = {"bf16": 11.648, "bf16 + causal attention": 7.724}
  assert gpu_report.like_for_like(llama, seconds, "bf16 + causal attention") == (
      "1.51x vs bf16 (attention)")
  assert gpu_report.like_for_like(llama, seconds, "bf16") == "-"  # float32 not given


def test_gpu_measure_runs_the_variants_asked_for_and_refuses_names_it_does_not_have():
  import gpu_measure  # pylint: disable=g-import-not-at-top
  import gpu_report  # pylint: disable=g-import-not-at-top
  llama = {"llama": gpu_report.llama_cases("smoke")}
  both = {**llama, "attention": gpu_report.attention_cases("smoke")}
  assert gpu_measure.check_variants(None, llama) is None
  # In the order asked (the first is the table's baseline); names may hold commas.
  assert gpu_measure.check_variants("fp8 per-tensor; bf16", llama) == ["fp8 per-tensor", "bf16"]
  assert gpu_measure.check_variants("cuDNN, causal mode", both) == ["cuDNN, causal mode"]
  with pytest.raises(ValueError, match=r"unknown variant\(s\) \['bf17'\].*'bf16'"):
    gpu_measure.check_variants("bf16;bf17", llama)
  with pytest.raises(ValueError, match=r"\['cuDNN, causal mode'\]"):  # attention not chosen
    gpu_measure.check_variants("cuDNN, causal mode", llama)


def test_gpu_measure_donates_a_train_step_s_state_and_feeds_each_step_the_last_one():
  # As a training loop runs a step (and examples/train_lm.py does): the old state's
  # buffers are given to the new one. Undonated, an H200 ran the fp8 demo step 0.82x
  # bf16's speed, donated 1.08x (the state's copies differ).
  import gpu_measure  # pylint: disable=g-import-not-at-top
  import gpu_report  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  compiled, args, feeds_back = gpu_measure._compile(gpu_report.llama_cases("smoke")["bf16"])
  assert feeds_back
  gpu_measure._runner(compiled, args, feeds_back)(2)
  assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(args[0]))
  # Not a train step: nothing donated.
  case = gpu_report.Case(lambda x, y: (x.sum(), y), lambda: (jax.numpy.ones((2, 3)),
                                                           jax.numpy.ones((3, 3))))
  compiled, args, feeds_back = gpu_measure._compile(case)
  assert not feeds_back
  gpu_measure._runner(compiled, args, feeds_back)(2)
  assert not any(leaf.is_deleted() for leaf in args)


def test_gpu_measure_reads_where_the_gpu_time_went_from_a_profiler_trace():
  # A trace as jax.profiler writes it on a GPU: host events, device events on the
  # stream thread and the same time again on the device's "XLA Ops" line.
  import gpu_measure  # pylint: disable=g-import-not-at-top
  trace = {"traceEvents": [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
      {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
      {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
      {"ph": "X", "pid": 1, "tid": 3, "ts": 0, "dur": 900.0, "name": "PjitFunction(step)"},
      {"ph": "X", "pid": 2, "tid": 7, "ts": 1, "dur": 300.0,
       "name": "sm90_xmma_gemm_e4m3f32_e4m3f32", "args": {"hlo_op": "cublas-gemm.3"}},
      {"ph": "X", "pid": 2, "tid": 7, "ts": 2, "dur": 100.0, "name": "cudnn_generated_fmha"},
      {"ph": "X", "pid": 2, "tid": 7, "ts": 3, "dur": 50.0, "name": "loop_convert_fusion",
       "args": {"hlo_op": "convert.7"}},
      {"ph": "X", "pid": 2, "tid": 7, "ts": 4, "dur": 50.0, "name": "loop_convert_fusion",
       "args": {"hlo_op": "convert.7"}},
      {"ph": "X", "pid": 2, "tid": 7, "ts": 5, "dur": 40.0,
       "name": "input_convert_transpose_fusion_4", "args": {"hlo_op": "command_buffer_1"}},
      {"ph": "X", "pid": 2, "tid": 8, "ts": 1, "dur": 300.0, "name": "cublas-gemm.3"},
  ]}
  kernels = gpu_measure.device_kernels(trace)
  assert kernels == [("sm90_xmma_gemm_e4m3f32_e4m3f32 [cublas-gemm.3]", 300.0),
                     ("cudnn_generated_fmha", 100.0), ("loop_convert_fusion [convert.7]", 50.0),
                     ("loop_convert_fusion [convert.7]", 50.0),
                     ("input_convert_transpose_fusion_4 [command_buffer_1]", 40.0)]
  # Bytes per execution by HLO instruction (the trace writes XLA's ".4" as "_4").
  bytes_of = {"loop_convert_fusion": 200_000_000, "input_convert_transpose_fusion.4": 40_000_000}
  summary = gpu_measure.profile_summary(kernels, steps=2, wall_ms=1.0, top=2, bytes_of=bytes_of)
  assert summary["kernels"] == 2.5
  assert (summary["GEMM_ms"], summary["attention_ms"], summary["transposing_ms"],
          summary["other_ms"]) == (0.15, 0.05, 0.02, 0.05)
  assert summary["busy_ms"] == pytest.approx(0.27) and summary["idle_ms"] == pytest.approx(0.73)
  # Two convert runs, 400 MB in 100 us; the transposing one, 40 MB in 40 us.
  assert summary["other_tbps"] == pytest.approx(4.0)
  assert summary["transposing_tbps"] == pytest.approx(1.0)
  assert summary["GEMM_tbps"] is None  # no bytes given for it
  assert "other_tbps" not in gpu_measure.profile_summary(kernels, steps=2, wall_ms=1.0)
  assert summary["top"] == [("sm90_xmma_gemm_e4m3f32_e4m3f32 [cublas-gemm.3]", 0.15, 0.5),
                            ("cudnn_generated_fmha", 0.05, 0.5)]
