"""jaxmp.tools.recommend_precision: the candidate the compiler estimates fastest, if faster."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxmp
from jaxmp._src.tools import audit as audit_lib
from jaxmp._src.tools import isolated_compile
from jaxmp._src.tools import recommend
from jaxmp._src.tools import targets

BF16 = "params=float32,compute=bfloat16,output=float32"
CANDIDATES = {
    "bf16": jaxmp.PolicyRules(BF16),
    "fp8": jaxmp.PolicyRules(BF16, [jaxmp.Rule(nn.Dense, fp8=jaxmp.fp8.DelayedScaling())]),
    "int8": jaxmp.PolicyRules(BF16, [jaxmp.Rule(nn.Dense, fp8=jaxmp.fp8.Int8Scaling())]),
}


def _build(rules):
  model = jaxmp.linen.mixed_precision(nn.Dense(8), rules)
  x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  return jax.grad(lambda v, x: model.apply(v, x).sum()), (variables, x)


def _kernel(cycles, count=1):
  return audit_lib.Kernel("fusion", "kLoop", "bf16[8]", 16, cycles=cycles, count=count)


def _report(target, estimated_seconds=None, kernels=(), spec=None):
  return audit_lib.AuditReport(target, target, {}, (), tuple(kernels), spec, estimated_seconds,
                               "")


# ---- the choice, from given numbers ------------------------------------------------------


@pytest.mark.parametrize("estimates, chosen", [
    ({"bf16": 10.0, "fp8": 12.0, "int8": 9.0}, "int8"),  # the fastest, faster than bf16
    ({"bf16": 10.0, "fp8": 8.0, "int8": 9.0}, "fp8"),
    ({"bf16": 10.0, "fp8": 12.0, "int8": 11.0}, "bf16"),  # every narrow type slower
    ({"bf16": 10.0, "fp8": 10.0, "int8": 10.5}, "bf16"),  # a tie keeps the baseline
    ({"int8": 10.0, "bf16": 10.0, "fp8": 11.0}, "bf16"),  # wherever it is in the order
    ({"fp8": 7.0, "int8": 7.0, "bf16": 8.0}, "fp8"),     # tied others: the first given
    ({"bf16": 10.0}, "bf16"),
])
def test_choose_takes_the_fastest_only_if_faster_than_the_baseline(estimates, chosen):
  assert recommend.choose(estimates, "bf16") == chosen


def test_gpu_estimates_are_the_roofline_plus_the_stated_overhead_per_launch():
  spec = targets.GPU_TARGETS["h100"]
  reports = {"bf16": _report("h100", 1e-3, [_kernel(None, count=3)], spec),
             "fp8": _report("h100", 0.9e-3, [_kernel(None, count=53)], spec)}
  estimates, unit, source = recommend.step_estimates(reports, per_launch=2e-6)
  # fp8's roofline is lower, but its 50 extra launches cost 100 us: it is slower.
  assert estimates == pytest.approx({"bf16": 1e-3 + 3 * 2e-6, "fp8": 0.9e-3 + 53 * 2e-6},
                                    rel=1e-12)
  assert unit == "seconds" and source == "GPU roofline estimate + 2 us per kernel launch"
  assert recommend.step_estimates(reports, per_launch=0)[0] == {"bf16": 1e-3, "fp8": 0.9e-3}


def test_tpu_estimates_are_always_the_summed_kernel_cycles_never_optimal_seconds():
  # libtpu's optimal_seconds prices an int8 and an fp8 4096^3 matmul alike on every TPU
  # (v5e: 0.789 ms each, bf16 0.880 ms), where the kernels' cycles give each chip's
  # matrix rate (v5e: int8 542,476, fp8 1,088,142, bf16 1,082,356): a precision is
  # chosen by the cycles, even where every compile has the seconds. A kernel without
  # cycles counts 0, a loop's kernel its trip count times.
  with_seconds = {"bf16": _report("v5e", 0.880e-3, [_kernel(1_082_356)]),
                  "int8": _report("v5e", 0.789e-3, [_kernel(542_476)]),
                  "fp8": _report("v5e", 0.789e-3, [_kernel(1_088_142)])}
  estimates, unit, source = recommend.step_estimates(with_seconds)
  assert (estimates, unit) == ({"bf16": 1_082_356.0, "int8": 542_476.0, "fp8": 1_088_142.0},
                               "cycles")
  assert source == "TPU cost model (sum of kernels' estimated_cycles)"
  mixed = {"bf16": _report("v5e", 2e-3, [_kernel(100), _kernel(None, count=4)]),
           "int8": _report("v5e", None, [_kernel(50, count=3), _kernel(7)])}
  assert recommend.step_estimates(mixed)[:2] == ({"bf16": 100.0, "int8": 157.0}, "cycles")


@pytest.mark.parametrize("reports", [
    {"bf16": _report("cpu"), "int8": _report("cpu")},
    {"bf16": _report("v5e", None, [_kernel(10)]), "int8": _report("v5e", None, [_kernel(None)])},
], ids=["cpu", "tpu without cycles"])
def test_a_compile_without_an_estimate_is_refused_naming_it(reports):
  with pytest.raises(ValueError, match="'int8' for 'v5e'" if "v5e" in str(reports) else
                     "'bf16' for 'cpu'") as e:
    recommend.step_estimates(reports)
  assert "gives no time estimate" in str(e.value)


# ---- the tool, with given estimates --------------------------------------------------------


def test_the_result_holds_every_estimate_the_speedups_and_the_chosen_rules(monkeypatch):
  seconds = {id(CANDIDATES["bf16"]): 4e-3, id(CANDIDATES["fp8"]): 5e-3,
             id(CANDIDATES["int8"]): 2e-3}
  built = []

  def build(rules):
    built.append(rules)
    return (lambda: None), (id(rules),)

  def fake_audit(fn, key, *, target, compiler_options):
    assert (target, compiler_options) == ("h100", None)
    return _report("h100", seconds[key], [_kernel(None, count=10)], targets.GPU_TARGETS["h100"])

  monkeypatch.setattr(audit_lib, "audit", fake_audit)
  # Through the _src module, not the face: jaxmp.tools loads on first touch, and loaded
  # here it would bind the fake audit for every later test.
  result = recommend.recommend_precision(build, CANDIDATES, target="h100", per_launch=1e-4)
  assert built == list(CANDIDATES.values())
  assert [(c.name, c.estimate, c.launches) for c in result.candidates] == [
      ("bf16", pytest.approx(5e-3), 10), ("fp8", pytest.approx(6e-3), 10),
      ("int8", pytest.approx(3e-3), 10)]
  assert [c.speedup for c in result.candidates] == pytest.approx([1.0, 5 / 6, 5 / 3])
  assert (result.chosen, result.rules, result.baseline) == ("int8", CANDIDATES["int8"], "bf16")
  assert (result.target, result.unit) == ("h100", "seconds")
  text = str(result)
  assert "int8" in text.splitlines()[-2] and "<- chosen" in text.splitlines()[-2]
  assert "1.67x" in text and "0.83x" in text
  assert "estimates, not measurements" in text
  with pytest.raises(dataclasses.FrozenInstanceError):
    setattr(result, "chosen", "fp8")  # noqa: B010 (the frozen dataclass refuses it)
  # With bf16 at 2 ms nothing is faster, and the baseline stays.
  seconds[id(CANDIDATES["bf16"])] = 2e-3
  assert recommend.recommend_precision(build, CANDIDATES, target="h100",
                                      per_launch=1e-4).chosen == "bf16"


def test_a_candidate_whose_compile_crashes_is_left_out_by_name_the_baseline_is_not(
    monkeypatch):
  # libtpu 0.0.42.1 dies compiling a Llama-3-8B-shaped layer's int8 and fp8 steps for
  # v7 at 2 x 4096 tokens; audit compiles TPU steps in a child and raises instead.
  crashed = isolated_compile.CompileCrashError(
      "audit(target='v7'): the compiler crashed with SIGSEGV (a stack overflow) compiling "
      "step for TPU7x (v7), whose arguments are 11 arrays, the largest f32[14336,4096]")
  seconds = {id(CANDIDATES["bf16"]): 4e-3, id(CANDIDATES["fp8"]): 3e-3}

  def fake_audit(fn, key, *, target, compiler_options):
    if key not in seconds:
      raise crashed
    return _report("v7", None, [_kernel(int(seconds[key] * 1e9))])

  monkeypatch.setattr(audit_lib, "audit", fake_audit)
  build = lambda rules: ((lambda: None), (id(rules),))
  with pytest.warns(RuntimeWarning, match="left out candidate 'int8'.*SIGSEGV"):
    result = recommend.recommend_precision(build, CANDIDATES, target="v7")
  assert [c.name for c in result.candidates] == ["bf16", "fp8"] and result.chosen == "fp8"
  assert result.failed == (("int8", str(crashed)),)
  assert "int8: not compiled: audit(target='v7'): the compiler crashed" in str(result)
  del seconds[id(CANDIDATES["bf16"])]  # without the baseline there is nothing to compare
  with pytest.raises(isolated_compile.CompileCrashError, match="SIGSEGV"):
    recommend.recommend_precision(build, CANDIDATES, target="v7")


def test_on_a_cpu_there_is_no_estimate_to_recommend_from():
  with pytest.raises(ValueError, match="no time estimate"):
    jaxmp.tools.recommend_precision(_build, CANDIDATES, target=None)


# ---- deviceless compiles (need libtpu / the CUDA plugin) -----------------------------------

# flax/examples/lm1b's TransformerLM (tests/published/flax_lm1b, verbatim) at its
# published configs/default.py sizes (emb_dim 512, 8 heads, qkv_dim 512, mlp_dim 2048,
# max_target_length 128), 2 of its 6 layers and batch 8 to keep the compiles short; an
# SGD train step. Every Dense but the logits computes in bf16, fp8 or int8.
_LM1B_CHECK = textwrap.dedent("""\
    import sys
    import flax.linen as nn, jax, jax.numpy as jnp, optax
    import jaxmp
    from tests.published.flax_lm1b import models
    config = models.TransformerConfig(
        vocab_size=30000, output_vocab_size=30000, emb_dim=512, num_heads=8, num_layers=2,
        qkv_dim=512, mlp_dim=2048, max_len=128, deterministic=True)
    bf16 = "params=float32,compute=bfloat16,output=float32"
    dense = (nn.Dense, nn.DenseGeneral)
    candidates = {"bf16": jaxmp.PolicyRules(bf16)}
    for name, recipe in (("fp8", jaxmp.fp8.DelayedScaling()), ("int8", jaxmp.fp8.Int8Scaling())):
      candidates[name] = jaxmp.PolicyRules(
          bf16, [jaxmp.Rule("logitdense"), jaxmp.Rule(dense, fp8=recipe)])
    tokens = jax.ShapeDtypeStruct((8, 128), jnp.int32)

    def build(rules):
      model = jaxmp.linen.mixed_precision(models.TransformerLM(config), rules)
      init = lambda: model.init(jax.random.key(0), jnp.ones((8, 128), jnp.int32))
      state = jax.eval_shape(lambda: jaxmp.linen.TrainState.create(
          apply_fn=model.apply, variables=init(), tx=optax.sgd(1e-3)))

      def step(state, tokens):
        def loss_fn(variables):
          logits = model.apply(variables, tokens)
          return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()
        loss, grads = state.value_and_grad(loss_fn)()
        return state.apply_gradients(grads), loss

      return step, (state, tokens)
    """)

# flax docs_nnx/mnist_tutorial.md's CNN (tests/published/flax_mnist_cnn, verbatim) at its
# published sizes and batch 32, the tutorial's train step with SGD (jaxmp's NNX
# value_and_grad / apply_gradients); both nnx.Linear but the last in bf16, fp8 or int8
# (the convolutions stay bf16: fp8 rules cover Linear, LinearGeneral and Einsum).
_MNIST_CNN_CHECK = textwrap.dedent("""\
    import sys
    import jax, jax.numpy as jnp, optax
    from flax import nnx
    import jaxmp
    from tests.published.flax_mnist_cnn import cnn
    bf16 = "params=float32,compute=bfloat16,output=float32"
    candidates = {"bf16": jaxmp.PolicyRules(bf16)}
    for name, recipe in (("fp8", jaxmp.fp8.DelayedScaling()), ("int8", jaxmp.fp8.Int8Scaling())):
      candidates[name] = jaxmp.PolicyRules(
          bf16, [jaxmp.Rule("linear2"), jaxmp.Rule(nnx.Linear, fp8=recipe)])
    images = jax.ShapeDtypeStruct((32, 28, 28, 1), jnp.float32)
    labels = jax.ShapeDtypeStruct((32,), jnp.int32)

    def build(rules):
      def create():
        model = jaxmp.nnx.mixed_precision(cnn.CNN(rngs=nnx.Rngs(0)), rules)
        return model, nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
      graphdef, state = nnx.split(nnx.eval_shape(create))

      def step(state, images, labels):
        model, optimizer = nnx.merge(graphdef, state)
        def loss_fn(model):
          logits = model(images, nnx.Rngs(dropout=0))
          return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        loss, grads = jaxmp.nnx.value_and_grad(loss_fn)(model)
        jaxmp.nnx.apply_gradients(optimizer, model, grads)
        return nnx.state((model, optimizer)), loss

      return step, (state, images, labels)
    """)

_PRINT_RESULTS = textwrap.dedent("""\
    for target in sys.argv[1:]:
      result = jaxmp.tools.recommend_precision(build, candidates, target=target)
      print(result)
      print("RESULT", target, result.unit, result.chosen,
            *(f"{c.name}={c.estimate!r}" for c in result.candidates))
    """)


def _recommend(script, *targets_):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
             ALLOW_MULTIPLE_LIBTPU_LOAD="1",
             PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run([sys.executable, "-W", "ignore", "-c", script + _PRINT_RESULTS, *targets_],
                       env=env, capture_output=True, text=True, timeout=1200)
  assert out.returncode == 0, out.stderr[-4000:]
  rows = {}
  for line in out.stdout.splitlines():
    if line.startswith("RESULT "):
      _, target, unit, chosen, *pairs = line.split()
      rows[target] = unit, chosen, {k: float(v) for k, v in (p.split("=") for p in pairs)}
  assert set(rows) == set(targets_), out.stdout
  return rows, out.stdout


def _assert_never_slower_than_bf16(chosen, estimates):
  # The narrow types change the compiled step (the rules reached the model).
  assert len(set(estimates.values())) == 3, estimates
  best = min(estimates.values())
  assert estimates[chosen] <= estimates["bf16"]
  assert chosen == ("bf16" if best >= estimates["bf16"] else
                    next(n for n, e in estimates.items() if e == best))
  for narrow in ("fp8", "int8"):
    if estimates[narrow] >= estimates["bf16"]:
      assert chosen != narrow


@pytest.mark.slow
@pytest.mark.parametrize("script, target, unit", [
    (_LM1B_CHECK, "v5e", "cycles"),  # libtpu gives no optimal_seconds for this train step
    (_MNIST_CNN_CHECK, "v5e", "cycles"),
    (_LM1B_CHECK, "h100", "seconds"),  # the roofline + 4 us per kernel
], ids=["lm1b-v5e", "nnx_mnist_cnn-v5e", "lm1b-h100"])
def test_a_published_step_gets_no_narrow_type_its_target_is_estimated_slower_in(
    script, target, unit):
  if targets.is_tpu(target) and not targets.installed("libtpu"):
    pytest.skip("needs libtpu (jax[tpu]; make gpu-report builds .venv-cuda with it)")
  if not targets.is_tpu(target) and not targets.cuda_plugin_installed():
    pytest.skip("needs JAX's CUDA plugin, jax[cuda12] (make gpu-report builds it)")
  rows, stdout = _recommend(script, target)
  found_unit, chosen, estimates = rows[target]
  assert found_unit == unit, stdout
  _assert_never_slower_than_bf16(chosen, estimates)
