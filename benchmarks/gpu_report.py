"""``make gpu-report``: estimated H100 step times and HBM traffic, from compiled HLO.

Each workload is compiled deviceless for an H100 SXM (``jaxmp.tools.audit(...,
target="h100")``) and read back from the optimized HLO: which GEMMs run in which
dtype on which backend, the HBM bytes of every other kernel, and a roofline estimate
(each kernel ``max(FLOPs / peak for its dtype, bytes / 3.35 TB/s)``, summed). These
are **estimates from compiled H100 HLO (deviceless)**, not measurements: no overlap,
no autotuning, and per-kernel overheads only where stated: the precision tables give
each variant's speed against the variant it differs from in one respect (precision or
attention, never both), count the kernels each step runs and give that ratio again
with 0, 1, 2 and 3 us added per kernel (cuBLAS mode; an assumed cost per kernel on the
GPU, not a host launch cost: see :data:`LAUNCH_US`). Two compile modes, because
without a GPU XLA cannot autotune GEMMs: ``cuBLAS`` (``xla_gpu_enable_triton_gemm=False``: every dot a
cuBLAS/cuBLASLt call, what a tuned H100 mostly runs) and ``Triton`` (XLA's default,
GEMM fusions with an untuned default tile). A train step (one that returns its
state) is compiled as a training loop runs it, its state donated, so that a new
parameter or fp8 state is written where the old one was (``gpu_measure.py`` times it
so too).

Workloads (``--workloads``):

* ``demo``: ``examples/train_lm.py --preset gpu`` (width 768, depth 8, context 512,
  batch 64, cuDNN fused attention where the dtype allows): the jitted train step with
  AdamW and global-norm clipping, run by ``jaxmp.linen.TrainState`` in float32,
  bfloat16, float16 + dynamic loss scaling and bfloat16 + jaxmp fp8 exactly as the
  demo runs them; then bfloat16 and fp8 with Flax's own attention, beside the same
  model written by hand in bfloat16 with Flax's ``nn.Fp8DirectDotGeneralOp`` in the
  blocks (whose attention is Flax's too).
* ``dense``: one ``nn.Dense`` 8192 x 8192 x 8192 forward + backward
  (``benchmarks/bench_fp8.py``'s step).
* ``block``: ``bench_fp8.py``'s pre-norm transformer block at its GPU preset.
* ``traffic``: jaxmp's fp8 against Flax's, non-GEMM HBM bytes at 4096^3 (Dense
  forward, forward + backward, jitted train steps with Adam: Flax's step code with
  either fp8 op, jaxmp's TrainState against it, and both skipping non-finite steps,
  jaxmp's through ``loss_scaling``, Flax's through ``optax.apply_if_finite``) and the
  block.
* ``llama``: a Llama-3-8B-shaped decoder layer (``benchmarks/llama_layer.py``: d_model
  4096, 32 query / 8 key-value heads, SwiGLU 14336, context 4096, batch 1), then a
  stack of two, each train step (SGD) in float32, bf16, bf16 with fused attention
  reading the mask tensor, bf16 with ``Rule(causal_attention=True)``, jaxmp fp8
  per-tensor (delayed) with and without causal attention, the same with causal
  attention and jaxmp's fused fp8 quantization kernel (``fp8.compile_target("h100",
  fused_quantize=True)``; its kernels are counted as the bytes of their operands and
  results), fp8 rowwise with causal attention, and Flax's own fp8.
* ``memory``: that layer (batch 1 x 512 tokens, so params and optimizer state
  dominate), a jitted train step with clipped AdamW and the state donated, for each of
  ``examples/train_memory.py``'s runs (float32; mixed; bf16 params + float32 master +
  bf16 moments; remainder masters; pure bf16 with round-to-nearest, stochastic
  rounding, Kahan summation; 8-bit moments without a master, with one, with remainders;
  ``--memory-runs`` picks): the compiled step's peak by XLA's accounting
  (``audit(...).memory``: arguments + outputs + temporaries - aliased).
* ``tpu``: 4096^3 matmuls in bf16, fp8 and int8, and jaxmp's fp8 and int8 Dense, compiled
  for TPU v5e, v5p, v6e and v7 (libtpu, deviceless): the operand dtypes in the HLO and
  the TPU cost model's estimated cycles per matmul; then the Llama-shaped layer's train
  step (context 1024) in bf16, fp8 rowwise and int8 per chip, GEMM and total cycles; then
  the demo's train step (``--preset gpu``) the same way, with the demo's per-tensor fp8.

On a machine with a GPU the same script also times each variant on it and prints
measured milliseconds and TFLOP/s beside the estimates.

Run: ``make gpu-report`` (builds ``.venv-cuda`` with ``jax[cuda12,tpu]`` on first use),
or ``.venv-cuda/bin/python benchmarks/gpu_report.py --workloads dense``. ``--preset
smoke`` compiles every workload at tiny sizes (the tests; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import sys
import time
import warnings
from typing import Any, Callable

if not (os.path.exists("/dev/nvidiactl") or os.environ.get("JAX_PLATFORMS")):
  # No GPU here: keep JAX off the CUDA backend, which would fail to start and then
  # offer no compile-only topology either.
  os.environ["JAX_PLATFORMS"] = "cpu"

import flax.linen as nn  # pylint: disable=g-import-not-at-top
from flax import nnx  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import optax  # pylint: disable=g-import-not-at-top

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "examples")]

import bench_fp8  # pylint: disable=g-import-not-at-top
import jaxmp  # pylint: disable=g-import-not-at-top
import llama_layer  # pylint: disable=g-import-not-at-top
import timing  # pylint: disable=g-import-not-at-top
import train_lm  # pylint: disable=g-import-not-at-top
import train_memory  # pylint: disable=g-import-not-at-top
import transformer  # pylint: disable=g-import-not-at-top
from jaxmp import fp8  # pylint: disable=g-import-not-at-top

OWG = fp8.OVERWRITE_WITH_GRADIENT
MODES = {"cuBLAS": {"xla_gpu_enable_triton_gemm": False}, "Triton": {}}
# --preset: bench_fp8's and the demo's preset of that name, and the edge of the
# traffic and TPU tables' square matmuls.
MATMUL_SIZE = {"gpu": 4096, "smoke": 128}
PRECISIONS = ("float32", "bf16", "fp16 + loss scaling", "bf16 + jaxmp fp8", "bf16 + Flax fp8")


@dataclasses.dataclass(frozen=True)
class Case:
  """A step to compile: ``fn(*make())``; ``make`` builds its arguments.

  ``against`` names the variant of the same table this one differs from in one respect
  only, ``differs`` which (``"precision"`` or ``"attention"``): the tables give each
  variant's speed against that one, so that a ratio measures one effect (bf16 with
  cuDNN's causal attention against float32 with Flax's would mix both).
  """
  fn: Callable[..., Any]
  make: Callable[[], tuple]
  against: str | None = None
  differs: str = ""


def compared(case: Case, **change: str) -> Case:
  """``case`` compared with another variant (``against=``, ``differs=``)."""
  return dataclasses.replace(case, **change)


def like_for_like(cases: dict[str, Case], seconds: dict[str, float | None], name: str) -> str:
  """``"1.51x vs bf16 (attention)"``: ``name``'s speed against the variant it differs
  from in one respect (its ``against``), from ``seconds`` per variant; ``-`` where it
  has none, or that variant is not in ``seconds``."""
  case = cases[name]
  if case.against is None or seconds.get(case.against) is None or seconds.get(name) is None:
    return "-"
  return f"{seconds[case.against] / seconds[name]:.2f}x vs {case.against} ({case.differs})"


# ---------------------------------------------------------------------------- workloads


def _layer_case(model, state_update, x_shape, g_shape, dtype, loss_scale=1.0) -> Case:
  """bench_fp8's forward + backward step of ``model`` on (x, g)."""

  def make():
    kx, kg, kp = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, x_shape, jnp.float32).astype(dtype)
    g = jax.random.normal(kg, g_shape, jnp.float32)
    variables = model.init(kp, x)
    return ({k: v for k, v in variables.items() if k in ("params", OWG)}, x, g)

  return Case(bench_fp8.make_step(model, state_update, loss_scale), make)


def layer_cases(workload: str, power_of_two: bool = False,
                preset_name: str = "gpu") -> dict[str, Case]:
  """The five precisions of bench_fp8's ``dense`` or ``block`` workload (GPU: 8192^3)."""
  preset = bench_fp8.PRESETS[preset_name]
  variants = bench_fp8.variants_of(1024, power_of_two)
  chosen = {"float32": variants["float32"], "bf16": variants["bf16"],
            "fp16 + loss scaling": (jnp.float16, None, None),
            "bf16 + jaxmp fp8": variants["jaxmp_fp8"], "bf16 + Flax fp8": variants["flax_fp8"]}
  cases = {}
  # Each against float32 (bf16, fp16) or bf16 (the fp8 variants): precision alone.
  against = {"bf16": "float32", "fp16 + loss scaling": "float32", "bf16 + jaxmp fp8": "bf16",
             "bf16 + Flax fp8": "bf16"}
  for name, (dtype, cls, update) in chosen.items():
    if workload == "dense":
      m, k, n = preset["dense"]
      model = nn.Dense(n, use_bias=False, dtype=dtype, dot_general_cls=cls)
      shapes = (m, k), (m, n)
    else:
      b = preset["block"]
      model = bench_fp8.Block(b["d_model"], b["heads"], b["d_ff"], dtype, cls)
      shapes = ((b["batch"], b["seq"], b["d_model"]),) * 2
    case = _layer_case(model, update, *shapes, dtype,
                       loss_scale=2.0**15 if dtype == jnp.float16 else 1.0)
    cases[name] = compared(case, against=against[name], differs="precision") \
        if name in against else case
  return cases


def _demo_tokens(preset_name: str) -> jax.Array:
  preset = train_lm.PRESETS[preset_name]
  config = preset["config"]
  return jax.random.randint(jax.random.key(1), (preset["batch"], config.context + 1), 0,
                            config.vocab)


def _demo_case(run: train_lm.Run, preset_name: str, fused_attention: bool) -> Case:
  """The demo's train step for ``run`` at its ``preset_name`` preset."""
  preset = train_lm.PRESETS[preset_name]

  def make():
    model = train_lm.make_model(run, preset["config"], fused_attention)
    t = _demo_tokens(preset_name)
    variables = model.init(jax.random.key(0), t[:, :-1])
    return (jaxmp.linen.TrainState.create(
        apply_fn=model.apply, variables=variables,
        tx=train_lm.make_optimizer(run, preset["lr"], preset["steps"])), t)
  return Case(train_lm.step, make)


def demo_cases(preset_name: str = "gpu") -> dict[str, Case]:
  """The demo's train step at its ``preset_name`` preset (``--preset gpu``), seven ways."""
  preset = train_lm.PRESETS[preset_name]
  config = preset["config"]
  runs = {r.name: r for r in train_lm.RUNS}
  jaxmp_case = lambda run, fused=preset.get("fused_attention", False): _demo_case(
      run, preset_name, fused)

  # Flax's own fp8: the model written in bfloat16 with Fp8DirectDotGeneralOp in the
  # blocks (the head stays out of fp8, as the demo's rule keeps it), its fp8 state
  # overwritten by its "gradient" as Flax's TrainState does.
  flax_model = transformer.TransformerLM(config, dtype=jnp.bfloat16,
                                         dot_general_cls=nn.Fp8DirectDotGeneralOp)
  flax_tx = train_lm.make_optimizer(dataclasses.replace(runs["bfloat16"], loss_scale=None),
                                    preset["lr"], preset["steps"])

  def flax_make():
    t = _demo_tokens(preset_name)
    variables = flax_model.init(jax.random.key(0), t[:, :-1])
    return (variables, flax_tx.init(variables["params"])), t

  def flax_step(state, t):
    variables, opt_state = state
    loss = lambda p, owg: train_lm.loss_fn(flax_model.apply, {"params": p, OWG: owg}, t)
    value, (grads, new_owg) = jax.value_and_grad(loss, argnums=(0, 1))(
        variables["params"], variables[OWG])
    updates, opt_state = flax_tx.update(grads, opt_state, variables["params"])
    params = optax.apply_updates(variables["params"], updates)
    return ({"params": params, OWG: new_owg}, opt_state), value

  # As the demo runs them at --preset gpu (fused attention), then bf16 and fp8 with
  # Flax's attention, beside Flax's own fp8 (a model written without fused attention).
  # float32 keeps Flax's attention (cuDNN's takes 16-bit inputs only): precision alone
  # is bf16 with Flax's attention against it, and the fused attention's gain is bf16
  # against that.
  precision = lambda of: dict(against=of, differs="precision")
  return {"float32": jaxmp_case(runs["float32"]),
          "bf16": compared(jaxmp_case(runs["bfloat16"]), against="bf16, unfused attention",
                           differs="attention"),
          "fp16 + loss scaling": compared(jaxmp_case(runs["float16 + loss scaling"]),
                                          **precision("bf16")),
          "bf16 + jaxmp fp8": compared(jaxmp_case(runs["bfloat16 + fp8"]), **precision("bf16")),
          "bf16, unfused attention": compared(jaxmp_case(runs["bfloat16"], False),
                                              **precision("float32")),
          "bf16 + jaxmp fp8, unfused attention": compared(
              jaxmp_case(runs["bfloat16 + fp8"], False), **precision("bf16, unfused attention")),
          "bf16 + Flax fp8 (unfused attention)": Case(flax_step, flax_make,
                                                      **precision("bf16, unfused attention"))}


# --preset: (batch, context) of the llama workload; its layer is Llama-3-8B's at "gpu".
LLAMA_TOKENS = {"gpu": (1, 4096), "smoke": (1, 16)}
LLAMA_STACK = 2  # layers in the stack variant


def _square_loss(y):
  return jnp.mean(jnp.square(y.astype(jnp.float32)))


def _llama(config, layers: int, dtype=None, dot_general_cls=None) -> nn.Module:
  """One decoder layer, or a stack of ``layers``."""
  if layers > 1:
    return llama_layer.Stack(config, layers, dtype, dot_general_cls)
  return llama_layer.DecoderLayer(config, dtype, dot_general_cls)


def _wrapped_train_case(model, rules, x_shape, tx, donate: bool = False) -> Case:
  """``model`` wrapped in ``rules``: a jaxmp TrainState step on a random input."""
  wrapped = jaxmp.linen.mixed_precision(model, rules)

  def make():
    x = jax.random.normal(jax.random.key(1), x_shape)
    return jaxmp.linen.TrainState.create(
        apply_fn=wrapped.apply, variables=wrapped.init(jax.random.key(0), x), tx=tx), x

  def step(state, x):
    loss, grads = state.value_and_grad(lambda v: _square_loss(state.apply_fn(v, x)))()
    return state.apply_gradients(grads), loss
  return Case(jax.jit(step, donate_argnums=0) if donate else step, make)


def with_block_kernel(case: Case, kernel: str) -> Case:
  """``case`` with ``BlockScaling``'s GEMMs traced as jaxmp's block kernel ``kernel``.

  The chip's table entry (``Target.block_fp8_kernels``) replaced by ``(kernel,)`` while
  the step traces, so that the table's choice and the other kernel run side by side
  (``"mosaic"``: the Mosaic GPU kernel; on a chip without block kernels nothing changes).
  """
  step = case.fn

  def traced(*args):
    target = dataclasses.replace(fp8.current_target(), block_fp8_kernels=(kernel,))
    with fp8.compile_target(target):
      return step(*args)
  return dataclasses.replace(case, fn=traced)


def llama_cases(preset_name: str = "gpu", layers: int = 1) -> dict[str, Case]:
  """A Llama-3-8B-shaped decoder layer (or stack), train step with SGD, ten ways.

  Each jaxmp variant wraps the same unchanged model (:mod:`llama_layer`) in rules;
  Flax's fp8 is the model written in bfloat16 with ``nn.Fp8DirectDotGeneralOp``.
  """
  config = llama_layer.LLAMA3_8B if preset_name == "gpu" else llama_layer.SMOKE
  batch, context = LLAMA_TOKENS[preset_name]
  x_shape = (batch, context, config.d_model)
  causal = jaxmp.Rule(llama_layer.Attention, causal_attention=True)
  fp8_rule = lambda recipe: jaxmp.Rule(nn.DenseGeneral, fp8=recipe)
  delayed, rowwise = fp8.DelayedScaling(), fp8.RowwiseScaling()
  bf16 = "params=float32,compute=bfloat16,output=float32"
  model = _llama(config, layers)
  jaxmp_case = lambda rules: _wrapped_train_case(model, rules, x_shape, optax.sgd(1e-3))
  flax_model = _llama(config, layers, jnp.bfloat16, nn.Fp8DirectDotGeneralOp)

  def flax_make():
    x = jax.random.normal(jax.random.key(1), x_shape)
    return flax_model.init(jax.random.key(0), x), x

  def flax_step(variables, x):
    loss = lambda p, owg: _square_loss(flax_model.apply({"params": p, OWG: owg}, x))
    value, (grads, new_owg) = jax.value_and_grad(loss, argnums=(0, 1))(
        variables["params"], variables[OWG])
    params = jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, variables["params"], grads)
    return {"params": params, OWG: new_owg}, value

  rules = lambda *r, **kw: jaxmp.PolicyRules(bf16, list(r), **kw)
  # Each row against the one it differs from in one respect. float32 keeps Flax's
  # attention (cuDNN's fused kernel takes 16-bit inputs only), so precision alone is
  # bf16 against float32, both with Flax's attention, and attention alone is each
  # fused variant against bf16.
  precision = lambda of: dict(against=of, differs="precision")
  attention = dict(against="bf16", differs="attention")
  causal_bf16 = "bf16 + causal attention"
  return {
      "float32": jaxmp_case(jaxmp.PolicyRules("float32")),
      "bf16": compared(jaxmp_case(rules()), **precision("float32")),
      "bf16 + fused attention (mask tensor)": compared(
          jaxmp_case(rules(fused_attention=True)), **attention),
      causal_bf16: compared(jaxmp_case(rules(causal)), **attention),
      "fp8 per-tensor": compared(jaxmp_case(rules(fp8_rule(delayed))), **precision("bf16")),
      "fp8 per-tensor + causal attention": compared(
          jaxmp_case(rules(causal, fp8_rule(delayed))), **precision(causal_bf16)),
      "fp8 rowwise + causal attention": compared(
          jaxmp_case(rules(causal, fp8_rule(rowwise))), **precision(causal_bf16)),
      "fp8 per-tensor, fused quantize + causal attention": compared(
          fused_quantize_case(jaxmp_case(rules(causal, fp8_rule(delayed)))),
          **precision(causal_bf16)),
      "fp8 block 1x128/128x128 + causal attention": compared(
          jaxmp_case(rules(causal, fp8_rule(fp8.BlockScaling()))), **precision(causal_bf16)),
      "fp8 block, Mosaic kernel + causal attention": compared(with_block_kernel(
          jaxmp_case(rules(causal, fp8_rule(fp8.BlockScaling()))), "mosaic"),
                                                              **precision(causal_bf16)),
      "Flax fp8": Case(flax_step, flax_make, **precision("bf16")),
  }


FUSED_QUANTIZE_CHIP = "h100"
"""The chip a fused-quantize variant is traced for: Hopper's table entry with
``fused_quantize`` on (an H200's entry is the H100's; on another platform the
``lax.platform_dependent`` branches take XLA's path)."""


def fused_quantize_case(case: Case) -> Case:
  """``case`` traced with the fused fp8 quantization kernel turned on
  (``fp8.compile_target(FUSED_QUANTIZE_CHIP, fused_quantize=True)``)."""
  def fn(*args):
    with fp8.compile_target(FUSED_QUANTIZE_CHIP, fused_quantize=True):
      return case.fn(*args)
  return dataclasses.replace(case, fn=fn)


def _nnx_train_case(make_model, rules, x_shape, lr: float = 1e-3) -> Case:
  """An NNX model wrapped in ``rules``: a jaxmp value_and_grad + apply_gradients step
  (SGD) on the split state, so that it compiles like the linen cases."""
  graphdefs = []

  def make():
    wrapped = jaxmp.nnx.mixed_precision(make_model(), rules)
    graphdef, state = nnx.split((wrapped, nnx.Optimizer(wrapped, optax.sgd(lr), wrt=nnx.Param)))
    graphdefs[:] = [graphdef]
    return state, jax.random.normal(jax.random.key(1), x_shape)

  def step(state, x):
    wrapped, optimizer = nnx.merge(graphdefs[0], state)
    loss, grads = jaxmp.nnx.value_and_grad(lambda m: _square_loss(m(x)))(wrapped)
    jaxmp.nnx.apply_gradients(optimizer, wrapped, grads)
    return nnx.state((wrapped, optimizer)), loss

  return Case(step, make)


def llama_scan_cases(preset_name: str = "gpu", layers: int = 2) -> dict[str, Case]:
  """``layers`` Llama-3-8B-shaped layers scanned (linen ``nn.scan``, NNX ``nnx.vmap`` +
  ``nnx.scan``), train step (SGD), bf16 and jaxmp fp8 per-tensor (delayed scaling: one
  amax history per layer, stacked on the layer axis) by rule on the unchanged model;
  the linen stack also with ``Rule(causal_attention=True)`` (cuDNN's fused attention,
  which saves no probability matrix for the backward pass; the NNX layer's attention
  is a function, which no rule matches). :func:`llama_cases` with ``layers`` gives the
  same layers unrolled."""
  config = llama_layer.LLAMA3_8B if preset_name == "gpu" else llama_layer.SMOKE
  batch, context = LLAMA_TOKENS[preset_name]
  x_shape = (batch, context, config.d_model)
  bf16 = "params=float32,compute=bfloat16,output=float32"
  delayed = fp8.DelayedScaling()
  rules = lambda *r: jaxmp.PolicyRules(bf16, list(r))
  linen = lambda r: _wrapped_train_case(llama_layer.ScannedStack(config, layers), r,
                                            x_shape, optax.sgd(1e-3))
  nnx_model = lambda: llama_layer.NnxScannedStack(config, layers, nnx.Rngs(0))
  fp8_against = lambda of: dict(against=of, differs="precision")
  fp8_rule = jaxmp.Rule(nn.DenseGeneral, fp8=delayed)
  causal = jaxmp.Rule(llama_layer.Attention, causal_attention=True)
  return {
      "bf16, nn.scan": linen(rules()),
      "fp8 per-tensor, nn.scan": compared(linen(rules(fp8_rule)), **fp8_against("bf16, nn.scan")),
      "bf16 + causal attention, nn.scan": linen(rules(causal)),
      "fp8 per-tensor + causal attention, nn.scan": compared(
          linen(rules(causal, fp8_rule)), **fp8_against("bf16 + causal attention, nn.scan")),
      "bf16, nnx.scan": _nnx_train_case(nnx_model, rules(), x_shape),
      "fp8 per-tensor, nnx.scan": compared(_nnx_train_case(
          nnx_model, rules(jaxmp.Rule(nnx.LinearGeneral, fp8=delayed)), x_shape),
          **fp8_against("bf16, nnx.scan")),
  }


def attention_cases(preset_name: str = "gpu") -> dict[str, Case]:
  """The llama layer's attention alone, forward + backward, three ways (measured only).

  ``jax.nn.dot_product_attention`` on the layer's shapes (batch x context, 32 query and
  8 key/value heads of 128 at ``"gpu"``), bfloat16: cuDNN reading a causal mask tensor
  (what ``PolicyRules(fused_attention=True)`` runs), cuDNN in its causal mode
  (``Rule(..., causal_attention=True)``), and XLA's unfused attention with the mask.
  Off a GPU, ``"cudnn"`` falls back to XLA's implementation (a smoke run only).
  """
  config = llama_layer.LLAMA3_8B if preset_name == "gpu" else llama_layer.SMOKE
  batch, context = LLAMA_TOKENS[preset_name]
  fused = "cudnn" if jax.default_backend() == "gpu" else "xla"
  mask = jnp.tril(jnp.ones((1, 1, context, context), bool))

  def make():
    shape = lambda heads: (batch, context, heads, config.head_dim)
    q, k, v, g = (jax.random.normal(jax.random.key(i), shape(h), jnp.bfloat16) for i, h in
                  enumerate((config.heads, config.kv_heads, config.kv_heads, config.heads)))
    return q, k, v, g

  def case(implementation, causal):
    def attention(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, mask=None if causal else mask,
                                          is_causal=causal, implementation=implementation)

    def step(q, k, v, g):
      out, backward = jax.vjp(attention, q, k, v)
      return out, backward(g)
    return Case(step, make)
  return {"cuDNN, causal mask tensor": case(fused, False),
          "cuDNN, causal mode": case(fused, True),
          "XLA, causal mask tensor": case("xla", False)}


MEMORY_TOKENS = {"gpu": (1, 512), "smoke": (1, 16)}
"""(batch, context) of the memory workload: few tokens, so params and state dominate."""

LEAN_MEMORY = {"xla_disable_hlo_passes": "dot-merger"}
"""XLA options for a step whose peak memory matters more than its last percent of speed.

XLA's dot merger joins GEMMs that share an operand into one (the q, k and v
projections' weight gradients share the layer's input) and copies each result out of
the joined one; at the end of the backward pass, when every gradient is live, those
copies sat on the Llama layer's peak (16 MiB at 512 tokens, deviceless H100 compile).
``jax.jit(step, compiler_options=LEAN_MEMORY)`` compiles without it
(docs/guides/memory.md)."""


def memory_cases(preset_name: str = "gpu", config: Any = None,
                 runs: Any = None) -> dict[str, Case]:
  """``examples/train_memory.py``'s ways to store params and AdamW's state (or
  ``runs``), on one Llama-3-8B-shaped layer (218M params at ``gpu``; or ``config``'s);
  steps donate their state."""
  config = config or (llama_layer.LLAMA3_8B if preset_name == "gpu" else llama_layer.SMOKE)
  batch, context = MEMORY_TOKENS[preset_name]
  model = llama_layer.DecoderLayer(config)
  return {run.name: _wrapped_train_case(model, run.policy, (batch, context, config.d_model),
                                        train_lm.make_optimizer(run, 1e-4, 1000), donate=True)
          for run in (runs or train_memory.RUNS)}


def memory_table(preset_name: str = "gpu", names: Any = None) -> None:
  """Peak memory of the compiled H100 train step, by XLA's accounting, per way (the runs
  of ``examples/train_memory.py`` named in ``names``, always with float32; default all)."""
  runs = [run for run in train_memory.RUNS
          if not names or run.name == "float32" or run.name in names]
  cases = memory_cases(preset_name, runs=runs)
  reports = {name: audit(case, "cuBLAS", f"memory: {name}") for name, case in cases.items()}
  lean = {name: audit(case, "cuBLAS", f"memory: {name}, dot merger off", options=LEAN_MEMORY)
          for name, case in cases.items()}
  params = sum(x.size for x in jax.tree_util.tree_leaves(
      jax.eval_shape(lambda: next(iter(cases.values())).make()[0].params)))
  batch, context = MEMORY_TOKENS[preset_name]
  print(f"\n### memory: one {'Llama-3-8B' if preset_name == 'gpu' else 'smoke'} layer "
        f"({params / 1e6:.0f}M params), batch {batch} x context {context}, train step "
        "(clipped AdamW, state donated)\n")
  print("| run | peak GiB | vs float32 | arguments GiB | temporaries GiB | "
        "temporaries bytes/param | peak GiB, dot merger off | vs float32 |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|")
  base = reports["float32"].memory.peak_bytes
  lean_base = lean["float32"].memory.peak_bytes
  for name, r in reports.items():
    m, lean_peak = r.memory, lean[name].memory.peak_bytes
    print(f"| {name} | {m.peak_bytes / 2**30:.3f} | {m.peak_bytes / base:.3f}x | "
          f"{m.argument_bytes / 2**30:.3f} | {m.temp_bytes / 2**30:.3f} | "
          f"{m.temp_bytes / params:.2f} | {lean_peak / 2**30:.3f} | "
          f"{lean_peak / lean_base:.3f}x |")


def traffic_cases(power_of_two: bool = False,
                  preset_name: str = "gpu") -> dict[str, dict[str, Case]]:
  """jaxmp's fp8 and Flax's, side by side: {case: {"jaxmp": Case, "Flax": Case}}."""
  size = MATMUL_SIZE[preset_name]
  dims = (((1,), (0,)), ((), ()))
  recipe = fp8.DelayedScaling(power_of_two=power_of_two)
  flax_op = nn.Fp8DirectDotGeneralOp()
  bf = lambda shape, seed: jax.random.normal(jax.random.key(seed), shape).astype(jnp.bfloat16)
  operands = lambda: (bf((size, size), 0), bf((size, size), 1))

  def jaxmp_fwd(x, w, state):
    return fp8.fp8_dot_general(x, w, dims, state=state, recipe=recipe)

  def flax_fwd(x, w, state):
    return flax_op.apply({OWG: state}, x, w, dims)

  def with_backward(forward):
    def fwd_bwd(x, w, state, g):  # an explicit cotangent XLA cannot fold
      out, vjp = jax.vjp(forward, x, w, state)
      return out, vjp(g)
    return fwd_bwd

  jaxmp_state = lambda: fp8.init_state(recipe)
  flax_state = lambda: flax_op.init(jax.random.key(0), jnp.ones((2, 2), jnp.bfloat16),
                                    jnp.ones((2, 2), jnp.bfloat16), dims)[OWG]
  cases = {
      f"Dense {size}^3 forward": {
          "jaxmp": Case(jaxmp_fwd, lambda: (*operands(), jaxmp_state())),
          "Flax": Case(flax_fwd, lambda: (*operands(), flax_state()))},
      f"Dense {size}^3 forward + backward": {
          "jaxmp": Case(with_backward(jaxmp_fwd),
                        lambda: (*operands(), jaxmp_state(), bf((size, size), 2))),
          "Flax": Case(with_backward(flax_fwd),
                       lambda: (*operands(), flax_state(), bf((size, size), 2)))},
      f"Dense {size}^3 train step, Flax's step code (Adam)": flax_step_cases(
          size, power_of_two),
      f"Dense {size}^3 train step, jaxmp TrainState (Adam)": dense_step_cases(
          size, power_of_two, loss_scaling=False),
      f"Dense {size}^3 train step, jaxmp TrainState + loss_scaling (Adam)": dense_step_cases(
          size, power_of_two, loss_scaling=True),
      f"Dense {size}^3 train step skipping non-finite steps: jaxmp TrainState + "
      "loss_scaling, Flax + optax.apply_if_finite (Adam)": dense_step_cases(
          size, power_of_two, loss_scaling=True, flax_skips=True),
  }
  block = layer_cases("block", power_of_two, preset_name)
  cases["block forward + backward"] = {"jaxmp": block["bf16 + jaxmp fp8"],
                                       "Flax": block["bf16 + Flax fp8"]}
  return cases


def _dense_data(size: int) -> tuple[jax.Array, jax.Array]:
  """The inputs and targets every Dense train step is compiled for."""
  return tuple(jax.random.normal(jax.random.key(i), (size, size)) for i in (0, 1))


def _flax_dense_step(dense: nn.Module, size: int,
                     tx: optax.GradientTransformation | None = None) -> Case:
  """Flax's way of training an fp8 Dense: a jitted step with ``tx`` (Adam by default),
  its fp8 state overwritten by its "gradient" as Flax's TrainState does."""
  tx = optax.adam(1e-3) if tx is None else tx

  def make():
    x, y = _dense_data(size)
    variables = dense.init(jax.random.key(0), x[:2])
    return variables, tx.init(variables["params"]), x, y

  def step(variables, opt_state, x, y):
    def loss(params, owg):
      out = dense.apply({"params": params, OWG: owg}, x)
      return jnp.mean((out.astype(jnp.float32) - y) ** 2)
    value, (grads, new_owg) = jax.value_and_grad(loss, argnums=(0, 1))(
        variables["params"], variables[OWG])
    updates, opt_state = tx.update(grads, opt_state, variables["params"])
    params = optax.apply_updates(variables["params"], updates)
    return {"params": params, OWG: new_owg}, opt_state, value

  return Case(step, make)


def flax_step_cases(size: int, power_of_two: bool = False) -> dict[str, Case]:
  """Flax's Dense train step, with jaxmp's fp8 dot_general and with Flax's: the same
  step code, so that only the fp8 op differs."""
  recipe = fp8.DelayedScaling(power_of_two=power_of_two)
  jaxmp_op = functools.partial(jaxmp.linen.Fp8DotGeneral, recipe=recipe)
  dense = lambda op: nn.Dense(size, dtype=jnp.bfloat16, dot_general_cls=op)
  return {"jaxmp": _flax_dense_step(dense(jaxmp_op), size),
          "Flax": _flax_dense_step(dense(nn.Fp8DirectDotGeneralOp), size)}


def dense_step_cases(size: int, power_of_two: bool = False, loss_scaling: bool = True,
                     flax_skips: bool = False) -> dict[str, Case]:
  """A jitted Dense train step with Adam: jaxmp by rule, through its TrainState (and
  ``loss_scaling`` with ``NoOpLossScale``, which skips non-finite steps), and Flax's
  fp8 Dense (with ``flax_skips``, its Adam inside ``optax.apply_if_finite``, which
  skips them too)."""
  rules = jaxmp.PolicyRules("params=float32,compute=bfloat16,output=float32",
                            [jaxmp.Rule(nn.Dense, fp8=fp8.DelayedScaling(
                                power_of_two=power_of_two))])
  model = jaxmp.linen.mixed_precision(nn.Dense(size), rules)

  def jaxmp_make():
    x, y = _dense_data(size)
    return (jaxmp.linen.TrainState.create(
        apply_fn=model.apply, variables=model.init(jax.random.key(0), x[:2]),
        tx=(jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.NoOpLossScale()) if loss_scaling
            else optax.adam(1e-3))), x, y)

  def jaxmp_step(state, x, y):
    loss, grads = state.value_and_grad(lambda v: jnp.mean((state.apply_fn(v, x) - y) ** 2))()
    return state.apply_gradients(grads), loss

  flax = nn.Dense(size, dtype=jnp.bfloat16, dot_general_cls=nn.Fp8DirectDotGeneralOp)
  flax_tx = optax.apply_if_finite(optax.adam(1e-3), 1000) if flax_skips else None
  return {"jaxmp": Case(jaxmp_step, jaxmp_make), "Flax": _flax_dense_step(flax, size, flax_tx)}


# ---------------------------------------------------------------------------- report


def progress(message: str) -> None:
  """One line on stderr while compiling (stdout stays the Markdown report)."""
  print(f"[gpu-report {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def returns_its_state(fn: Any, args: tuple) -> bool:
  """Whether ``fn(*args)`` returns a tuple whose first element has ``args[0]``'s
  structure, shapes and dtypes (a train step: its state comes back, to be fed to the
  next call). ``args`` may be shapes (``jax.ShapeDtypeStruct``)."""
  out = jax.eval_shape(fn, *args)
  shapes = lambda tree: jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), tree)
  return (isinstance(out, tuple) and len(out) > 1
          and jax.tree_util.tree_structure(out[0]) == jax.tree_util.tree_structure(args[0])
          and shapes(out[0]) == shapes(args[0]))


def audit(case: Case, mode: str, name: str = "", donate: bool | None = None,
          options: dict | None = None) -> jaxmp.tools.AuditReport:
  """``case`` compiled deviceless for an H100 in GEMM ``mode``.

  ``donate``: whether its first argument (a train step's state) is donated. By default a
  train step (:func:`returns_its_state`) is compiled as a training loop (and
  ``gpu_measure.py``) runs it, its state donated; a case already jitted keeps its own
  options. ``options``: more XLA options (e.g. :data:`LEAN_MEMORY`).
  """
  start = time.perf_counter()
  args = jax.eval_shape(case.make)
  if donate is None:
    donate = not hasattr(case.fn, "trace") and returns_its_state(case.fn, args)
  fn = jax.jit(case.fn, donate_argnums=0) if donate else case.fn
  report = jaxmp.tools.audit(fn, *args, target="h100",
                             compiler_options={**MODES[mode], **(options or {})})
  progress(f"compiled {name or 'a case'} ({mode}{', state donated' if donate else ''}) in "
           f"{time.perf_counter() - start:.0f} s")
  return report


def measure(cases: dict[str, Case]) -> dict[str, timing.Timing]:
  """Times every case on the local GPU (interleaved rounds, medians)."""
  runs = {}
  for name, case in cases.items():
    args = case.make()
    fn = jax.jit(case.fn)
    runs[name] = functools.partial(lambda f, a: jax.block_until_ready(f(*a)), fn, args)
  return timing.interleaved(runs, baseline=next(iter(runs)), rounds=5, calls=5)


LAUNCH_US = (0, 1, 2, 3)
"""Per-kernel overheads (microseconds) the like-for-like ratios are shown again at.

The roofline has no cost per kernel; these add a stated one for every kernel the step
runs. It is not the host's cost of launching each kernel: XLA puts runs of a train
step's kernels into CUDA-graph command buffers, which the host launches as one graph
each (the Llama-3-8B-shaped layer's fp8 step: 90 of its 143 kernels in 9 buffers;
benchmarks/RESULTS.md). It stands for what each kernel costs beyond its roofline time
on the GPU itself (its ramp-up and tail, the gap before the next), as the 4 us that
``jaxmp.tools.recommend_precision`` adds was fitted to steps measured on an H200."""


def like_for_like_with_launches(cases: dict[str, Case], reports: dict, name: str) -> str:
  """``name``'s speed against its ``against`` variant, cuBLAS mode, at each of
  :data:`LAUNCH_US` per kernel."""
  against = cases[name].against
  if against is None:
    return "-"
  at = lambda who, us: reports[who]["cuBLAS"].estimated_seconds_with_launches(us * 1e-6)
  return "/".join(f"{at(against, us) / at(name, us):.2f}" for us in LAUNCH_US)


def precision_table(title: str, cases: dict[str, Case], on_gpu: bool) -> None:
  reports = {name: {mode: audit(case, mode, f"{title}: {name}") for mode in MODES}
             for name, case in cases.items()}
  measured = measure(cases) if on_gpu else {}
  est = lambda name, mode: reports[name][mode].estimated_seconds * 1e3
  header = ["variant", "est. ms (cuBLAS)", "like for like (cuBLAS)", "est. ms (Triton)",
            "non-GEMM MiB", "GEMMs fp8/all", "GEMM ms", "other ms", "kernels",
            "like for like at " + "/".join(f"{us:g}" for us in LAUNCH_US) + " us/kernel"]
  if on_gpu:
    header += ["measured ms", "measured like for like", "measured TFLOP/s"]
  print(f"\n### {title}\n")
  print("Each variant against the one it differs from in one respect (precision or "
        "attention), never across both.\n")
  print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
  cublas = {name: reports[name]["cuBLAS"].estimated_seconds for name in cases}
  for name in cases:
    r = reports[name]["cuBLAS"]
    row = [name, f"{est(name, 'cuBLAS'):.3f}", like_for_like(cases, cublas, name),
           f"{est(name, 'Triton'):.3f}", f"{r.non_gemm_bytes / 2**20:.0f}",
           f"{sum(g.fp8 * g.count for g in r.gemms)}/{sum(g.count for g in r.gemms)}",
           f"{r.gemm_seconds * 1e3:.3f}", f"{r.non_gemm_seconds * 1e3:.3f}", str(r.launches),
           like_for_like_with_launches(cases, reports, name)]
    if on_gpu:
      ms = measured[name].ms
      row += [f"{ms:.3f}",
              like_for_like(cases, {n: m.ms for n, m in measured.items()}, name),
              f"{r.gemm_flops / (ms * 1e-3) / 1e12:.0f}"]
    print("| " + " | ".join(row) + " |")
  flops = reports[next(iter(cases))]["cuBLAS"].gemm_flops
  print(f"\nGEMM work per step: {flops / 1e12:.3f} TFLOP (from the HLO).")


def traffic_table(power_of_two: bool = False, preset_name: str = "gpu") -> None:
  print("\n### fp8: non-GEMM HBM traffic, jaxmp vs Flax (MiB per call)"
        + (", jaxmp with power-of-two scales" if power_of_two else "") + "\n")
  print("| case | mode | jaxmp | Flax | jaxmp GEMMs fp8/all | Flax GEMMs fp8/all |\n"
        "|---|---|---:|---:|---|---|")
  for case, pair in traffic_cases(power_of_two, preset_name).items():
    for mode in MODES:
      r = {who: audit(c, mode, f"traffic {case}: {who}") for who, c in pair.items()}
      count = lambda rep: f"{sum(g.fp8 for g in rep.gemms)}/{len(rep.gemms)}"
      print(f"| {case} | {mode} | {r['jaxmp'].non_gemm_bytes / 2**20:.0f} | "
            f"{r['Flax'].non_gemm_bytes / 2**20:.0f} | {count(r['jaxmp'])} | {count(r['Flax'])} |")


def tpu_table(generations=("v5e", "v5p", "v6e", "v7"), size: int = 4096) -> None:
  """fp8 and int8 matmuls on TPUs, by the TPU compiler's cost model (deviceless)."""
  dims = (((1,), (0,)), ((), ()))
  S = jax.ShapeDtypeStruct
  mat = lambda dtype: S((size, size), dtype)
  dot = lambda out: (lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=out))
  recipe = fp8.DelayedScaling(amax_history_length=16)
  state = jax.eval_shape(lambda: fp8.init_state(recipe))

  def jaxmp_fwd_bwd(x, w, state, g):
    f = lambda x, w, s: fp8.fp8_dot_general(x, w, dims, state=s, recipe=recipe)
    out, vjp = jax.vjp(f, x, w, state)
    return out, vjp(g)

  def jaxmp_int8_fwd_bwd(x, w, g):
    f = lambda x, w: fp8.fp8_dot_general(x, w, dims, recipe=fp8.Int8Scaling())
    out, vjp = jax.vjp(f, x, w)
    return out, vjp(g)

  cases = {
      "bf16 x bf16 -> f32": (dot(jnp.float32), (mat(jnp.bfloat16),) * 2),
      "e4m3 x e4m3 -> f32": (dot(jnp.float32), (mat(jnp.float8_e4m3fn),) * 2),
      "e5m2 x e4m3 -> f32": (dot(jnp.float32), (mat(jnp.float8_e5m2), mat(jnp.float8_e4m3fn))),
      "int8 x int8 -> s32": (dot(jnp.int32), (mat(jnp.int8),) * 2),
      "jaxmp fp8 Dense fwd+bwd (3 GEMMs)": (
          jaxmp_fwd_bwd, (mat(jnp.bfloat16), mat(jnp.bfloat16), state, mat(jnp.bfloat16))),
      "jaxmp int8 Dense fwd+bwd (3 GEMMs)": (jaxmp_int8_fwd_bwd, (mat(jnp.bfloat16),) * 3),
  }
  print(f"\n### TPU: {size}^3 matmuls by the TPU cost model (deviceless)\n")
  print("| TPU | case | GEMM operands (in the HLO) | est. cycles per GEMM | vs bf16 |\n"
        "|---|---|---|---|---:|")
  for gen in generations:
    base = None
    for name, (fn, args) in cases.items():
      r = jaxmp.tools.audit(fn, *args, target=gen)
      progress(f"compiled TPU {gen}: {name}")
      cycles = [g.cycles for g in r.gemms]
      base = base or cycles[0]
      operands = "; ".join(" x ".join(d.replace("float8_", "") for d in g.compute_dtypes)
                           for g in r.gemms)
      print(f"| {gen} ({r.device_kind}) | {name} | {operands} | "
            f"{', '.join(map(str, cycles))} | "
            f"{', '.join(f'{c / base:.2f}' for c in cycles)} |")


def _tpu_cycles(report: jaxmp.tools.AuditReport) -> tuple[int, int]:
  """(GEMM cycles, all cycles) of a TPU compile, by the cost model, per call."""
  gemms = sum((g.cycles or 0) * g.count for g in report.gemms)
  return gemms, gemms + sum((k.cycles or 0) * k.count for k in report.kernels)


TPU_LLAMA_TOKENS = {"gpu": (1, 1024), "smoke": (1, 16)}
"""(batch, context) of the TPU llama table: context 1024 keeps its compiles short."""


def tpu_llama_table(generations=("v5e", "v5p", "v6e", "v7"), preset_name: str = "gpu") -> None:
  """The Llama-3-8B-shaped layer's train step in bf16, fp8 and int8 per TPU (cost model)."""
  config = llama_layer.LLAMA3_8B if preset_name == "gpu" else llama_layer.SMOKE
  batch, context = TPU_LLAMA_TOKENS[preset_name]
  x_shape = (batch, context, config.d_model)
  bf16 = "params=float32,compute=bfloat16,output=float32"
  # Flax's attention in every variant: libtpu (jax 0.10.2) crashed compiling the
  # layer with causal_attention=True for v7.
  rules = lambda *r: jaxmp.PolicyRules(bf16, list(r))
  dense = lambda recipe: jaxmp.Rule(nn.DenseGeneral, fp8=recipe)
  variants = {
      "bf16": rules(),
      "fp8 rowwise": rules(dense(fp8.RowwiseScaling())),
      "int8": rules(dense(fp8.Int8Scaling())),
      "int8, weight grad bf16": rules(dense(fp8.GemmRecipes(fp8.Int8Scaling(),
                                                            fp8.Int8Scaling(), None))),
  }
  model = _llama(config, 1)
  print(f"\n### TPU: one {config.d_model}-wide Llama-shaped decoder layer, batch {batch} x "
        f"context {context}, train step (SGD), by the TPU cost model (deviceless)\n")
  _tpu_step_rows(generations, "llama layer", {
      name: _wrapped_train_case(model, rule_set, x_shape, optax.sgd(1e-3))
      for name, rule_set in variants.items()})


def _tpu_step_rows(generations, what: str, cases: dict[str, Case]) -> None:
  """A table of ``cases`` (train steps) compiled per TPU: GEMM and all cycles, vs the first."""
  print("| TPU | variant | GEMM operands | GEMM cycles | all cycles | step vs bf16 |\n"
        "|---|---|---|---:|---:|---:|")
  for gen in generations:
    base = None
    for name, case in cases.items():
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.Fp8FallbackWarning)  # the table shows it
        try:
          r = jaxmp.tools.audit(case.fn, *jax.eval_shape(case.make), target=gen)
        except jaxmp.tools.CompileCrashError as e:  # libtpu died (in audit's child process)
          progress(f"TPU {gen}: {what}, {name}: {e}")
          print(f"| {gen} | {name} | compile crashed: {str(e).split(' compiling ')[0]} "
                "| - | - | - |")
          continue
      progress(f"compiled TPU {gen}: {what}, {name}")
      gemm_cycles, total = _tpu_cycles(r)
      base = base or total
      operands = ", ".join(sorted({"x".join(d.replace("float8_", "") for d in g.compute_dtypes)
                                   for g in r.gemms}))
      print(f"| {gen} | {name} | {operands} | {gemm_cycles:,} | {total:,} | "
            f"{base / total:.2f}x |")


def tpu_demo_table(generations=("v5e", "v5p", "v6e", "v7"), preset_name: str = "gpu") -> None:
  """The demo's train step in bf16, fp8 and int8 per TPU (cost model).

  ``examples/train_lm.py --preset gpu``'s model, batch and AdamW with Flax's attention
  (cuDNN's fused attention is a GPU kernel), the state donated; the rules keep the
  output projection out of fp8 and int8, as the demo's do.
  """
  config, batch = (train_lm.PRESETS[preset_name][k] for k in ("config", "batch"))
  bf16 = {r.name: r for r in train_lm.RUNS}["bfloat16"]
  variants = {
      "bf16": bf16.policy,
      "fp8 per-tensor (the demo's)": train_lm.fp8_rules(),
      "fp8 rowwise": train_lm.fp8_rules(fp8.RowwiseScaling()),
      "int8": train_lm.fp8_rules(fp8.Int8Scaling()),
      "int8, weight grad bf16": train_lm.fp8_rules(
          fp8.GemmRecipes(fp8.Int8Scaling(), fp8.Int8Scaling(), None)),
  }
  print(f"\n### TPU: the demo's train step (width {config.width}, depth {config.depth}, "
        f"batch {batch} x context {config.context}, AdamW), by the TPU cost model "
        "(deviceless)\n")
  cases = {name: _demo_case(dataclasses.replace(bf16, policy=policy), preset_name, False)
           for name, policy in variants.items()}
  _tpu_step_rows(generations, "demo step", {
      name: Case(jax.jit(case.fn, donate_argnums=0), case.make) for name, case in cases.items()})


WORKLOADS = ("traffic", "dense", "block", "demo", "llama", "memory", "tpu")
"""What ``--workloads`` accepts, in the default order (the module docstring says what each is)."""


def parse_workloads(text: str) -> list[str]:
  """``--workloads``' comma-separated list, checked before anything compiles."""
  chosen = [w.strip() for w in text.split(",") if w.strip()]
  unknown = [w for w in chosen if w not in WORKLOADS]
  if unknown or not chosen:
    raise argparse.ArgumentTypeError(
        f"unknown workload(s) {unknown or text!r}; accepted: {', '.join(WORKLOADS)}")
  return chosen


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
      "--workloads", type=parse_workloads, default=list(WORKLOADS),
      help=f"comma-separated, from: {', '.join(WORKLOADS)} (default: all). demo: the "
           "demo's train step in five precisions; dense: one 8192^3 Dense fwd+bwd; block: a "
           "transformer block; llama: a Llama-3-8B-shaped decoder layer and a stack of "
           "two at context 4096, ten ways; memory: that layer's train step's peak "
           "memory with ten ways to store params and AdamW's state; traffic: jaxmp's fp8 against Flax's, non-GEMM bytes; tpu: "
           "matmuls, the Llama-shaped layer and the demo step compiled for TPU v5e-v7. All of them compile for about half an hour on "
           "2 cores; progress goes to stderr.")
  parser.add_argument("--power-of-two", action="store_true",
                      help="jaxmp's delayed scaling with power_of_two=True (traffic table)")
  parser.add_argument("--memory-runs", nargs="*", metavar="RUN",
                      choices=[run.name for run in train_memory.RUNS],
                      help="the memory workload's runs besides float32 (default: all)")
  parser.add_argument("--preset", choices=sorted(MATMUL_SIZE), default="gpu",
                      help="the workloads' sizes (smoke: tiny, to check the script runs)")
  args = parser.parse_args(argv)
  on_gpu = jax.devices()[0].platform == "gpu"
  print(f"jax {jax.__version__}; estimates from compiled H100 HLO (deviceless)"
        + (f"; measured on {jax.devices()[0].device_kind}" if on_gpu else ""))
  for number, workload in enumerate(args.workloads, 1):
    progress(f"workload {number}/{len(args.workloads)}: {workload}")
    if workload == "traffic":
      traffic_table(args.power_of_two, args.preset)
    elif workload == "tpu":
      tpu_table(size=MATMUL_SIZE[args.preset])
      tpu_llama_table(preset_name=args.preset)
      tpu_demo_table(preset_name=args.preset)
    elif workload == "demo":
      precision_table(f"demo train step, examples/train_lm.py --preset {args.preset} (AdamW)",
                      demo_cases(args.preset), on_gpu)
    elif workload == "memory":
      memory_table(args.preset, args.memory_runs)
    elif workload == "llama":
      batch, context = LLAMA_TOKENS[args.preset]
      shape = "Llama-3-8B" if args.preset == "gpu" else "smoke-sized"
      precision_table(f"llama: one {shape} decoder layer, batch {batch} x context {context}, "
                      "train step (SGD)", llama_cases(args.preset), on_gpu)
      precision_table(f"llama: {LLAMA_STACK} {shape} decoder layers, batch {batch} x context "
                      f"{context}, train step (SGD)", llama_cases(args.preset, LLAMA_STACK), on_gpu)
      precision_table(f"llama: the same {LLAMA_STACK} layers scanned (linen nn.scan; NNX "
                      f"nnx.vmap + nnx.scan), batch {batch} x context {context}, train step "
                      "(SGD)", llama_scan_cases(args.preset, LLAMA_STACK), on_gpu)
    else:  # dense, block
      preset = bench_fp8.PRESETS[args.preset]
      size = ("x".join(map(str, preset["dense"])) if workload == "dense" else
              ", ".join(f"{k} {v}" for k, v in preset["block"].items()))
      precision_table(f"{workload} forward + backward ({size})",
                      layer_cases(workload, preset_name=args.preset), on_gpu)


if __name__ == "__main__":
  main()
