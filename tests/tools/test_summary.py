"""jaxmp.tools.summary: the per-module precision table for a real call."""

import pathlib
import subprocess
import sys
import re
import textwrap
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxmp


class Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.LayerNorm()(x)
    return nn.Dense(4, name="proj")(x)


class Net(nn.Module):

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(10, 4)(ids)
    x = Block(name="block")(x)
    return nn.Dense(2, name="head")(x)


RULES = jaxmp.PolicyRules("p=f32,c=bf16,o=f32", [jaxmp.Rule("head", "p=f32,c=f32,o=f32")])


def _rows(summary):
  return {row.path: row for row in summary.rows}


def test_rows_for_init_trace():
  rows = _rows(jaxmp.tools.summary(Net(), RULES, jnp.ones((2, 3), jnp.int32)))
  assert list(rows) == ["<root>", "Embed_0", "block", "block/LayerNorm_0", "block/proj",
                        "head"]
  assert rows["<root>"].output_dtype == "float32"
  assert rows["block"].compute_dtype == "bfloat16"
  assert rows["block/LayerNorm_0"].compute_dtype == "float32"
  assert rows["block/LayerNorm_0"].output_dtype == "bfloat16"
  assert rows["block/LayerNorm_0"].rule == "norm"
  assert rows["head"].compute_dtype == "float32"
  assert rows["head"].output_dtype == "float32"
  assert rows["head"].rule == "0: 'head'"
  assert rows["block/proj"].rule == "default"
  assert rows["block/proj"].fp8 == "-"


def test_apply_trace_with_variables_and_wrapper():
  wrapped = jaxmp.linen.mixed_precision(Net(), RULES)
  ids = jnp.ones((2, 3), jnp.int32)
  variables = wrapped.init(jax.random.key(0), ids)
  summary = jaxmp.tools.summary(wrapped, None, ids, variables=variables)
  assert _rows(summary)["head"].compute_dtype == "float32"
  # The wrapper's own rules again are what it runs; other rules are for its model.
  assert jaxmp.tools.summary(wrapped, RULES, ids, variables=variables) == summary
  summary = jaxmp.tools.summary(wrapped.model, "bf16", ids, variables=variables)
  assert _rows(summary)["head"].compute_dtype == "bfloat16"


def test_a_wrapper_with_rules_it_does_not_run_is_refused():
  # The table would show rules the wrapper does not run.
  from flax import nnx  # pylint: disable=g-import-not-at-top
  ids = jnp.ones((2, 3), jnp.int32)
  wrappers = [(jaxmp.linen.mixed_precision(Net(), RULES), ids),
              (jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), RULES.default),
               jnp.ones((1, 3)))]
  for wrapped, x in wrappers:
    with pytest.raises(ValueError, match=re.escape(
        "jaxmp.tools.summary: the wrapper runs its own rules, not the rules given "
        "(PolicyRules(default=Policy(param_dtype=float32, compute_dtype=float32")) as info:
      jaxmp.tools.summary(wrapped, "float32", x)
    assert str(info.value).endswith(
        "pass rules=None to see what it runs, or its model (wrapper.model) with these rules.")


def test_table_text():
  text = str(jaxmp.tools.summary(Net(), RULES, jnp.ones((2, 3), jnp.int32)))
  lines = text.splitlines()
  assert lines[0].split() == ["path", "module", "params", "compute", "output", "fp8", "rule",
                              "ran"]
  assert set(lines[1]) <= {"-", " "}
  head = next(line for line in lines if line.startswith("head"))
  assert head.split() == ["head", "Dense", "float32", "float32", "float32", "-", "0:", "'head'",
                          "float32"]


def test_other_methods_are_listed():

  class Tied(nn.Module):

    @nn.compact
    def __call__(self, ids):
      embed = nn.Embed(10, 4, name="embed")
      return embed.attend(embed(ids))

  rows = jaxmp.tools.summary(Tied(), "bf16", jnp.ones((1, 2), jnp.int32)).rows
  assert [(r.path, r.method) for r in rows] == [
      ("<root>", "__call__"), ("embed", "__call__"), ("embed", "attend")]
  assert "embed.attend" in str(jaxmp.tools.summary(Tied(), "bf16", jnp.ones((1, 2), jnp.int32)))


def test_summary_computes_nothing():
  # Abstract shapes are enough: nothing is allocated or run.
  ids = jax.ShapeDtypeStruct((4096, 4096), jnp.int32)
  assert len(jaxmp.tools.summary(Net(), RULES, ids).rows) == 6


def test_bad_input():
  with pytest.raises(TypeError, match="linen Module"):
    jaxmp.tools.summary(lambda x: x, RULES, jnp.ones(2))
  with pytest.raises(ValueError, match="needs rules"):
    jaxmp.tools.summary(Net(), None, jnp.ones((1, 2), jnp.int32))


def test_a_tracing_wrapper_is_summarized_with_the_variables_its_init_returned():
  # Flax's own setup-style linen/NNX pair (docs_nnx/migrating/linen_to_nnx.rst).
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from tests.published.flax_autoencoder import linen_autoencoder, nnx_autoencoder  # pylint: disable=g-import-not-at-top
  x = jnp.ones((2, 12))
  tables = {}
  for trace in (False, True):
    rules = jaxmp.PolicyRules("p=f32,c=bf16,o=f32", trace_nonfinite=trace)
    linen = jaxmp.linen.mixed_precision(linen_autoencoder.AutoEncoder(8, 12), rules)
    variables = linen.init(jax.random.key(0), x)
    assert (jaxmp.linen.NONFINITE_COLLECTION in variables) == trace
    nnx_model = jaxmp.nnx.mixed_precision(
        nnx_autoencoder.AutoEncoder(12, 8, 12, rngs=nnx.Rngs(0)), rules)
    tables[trace] = (str(jaxmp.tools.summary(linen, None, x, variables=variables)),
                     str(jaxmp.tools.summary(nnx_model, None, x)))
  assert tables[True] == tables[False]  # tracing changes no dtype and no matmul
  assert [line.split()[:2] for line in tables[True][0].splitlines()[2:]] == [
      ["<root>", "AutoEncoder"], ["<root>.encode", "AutoEncoder"], ["encoder", "Dense"],
      ["<root>.decode", "AutoEncoder"], ["decoder", "Dense"]]
  assert tables[True][0].splitlines()[4].split()[-1] == "bfloat16"  # encoder's matmul


@pytest.mark.parametrize("recipe", [
    jaxmp.fp8.Int8Scaling(),
    jaxmp.fp8.GemmRecipes(jaxmp.fp8.Int8Scaling(), jaxmp.fp8.Int8Scaling(), None),
    jaxmp.fp8.DelayedScaling(),
], ids=["int8", "int8 GemmRecipes", "fp8"])
def test_quantized_matmuls_asked_for_by_rule_are_not_mismatches(recipe):
  # int8 x int8 -> int32 is what an int8 recipe asks for, as fp8 operands are for fp8:
  # neither is a layer computing in another dtype than its policy says.
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(10, name="head")(nn.relu(nn.Dense(128, name="hidden")(x)))

  class NnxMlp(nnx.Module):
    def __init__(self, rngs):
      self.hidden = nnx.Linear(64, 128, rngs=rngs)
      self.head = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
      return self.head(nnx.relu(self.hidden(x)))

  x = jnp.ones((2, 64))
  narrow = "float8_e4m3fn" if isinstance(recipe, jaxmp.fp8.DelayedScaling) else "int8"
  for model, layer in ((Mlp(), nn.Dense), (NnxMlp(nnx.Rngs(0)), nnx.Linear)):
    rules = jaxmp.PolicyRules("p=f32,c=bf16,o=f32", [jaxmp.Rule("head"),
                                                     jaxmp.Rule(layer, fp8=recipe)])
    with warnings.catch_warnings():
      warnings.simplefilter("error")   # no "change the model's code" warning
      summary = jaxmp.tools.summary(model, rules, x)
    rows = _rows(summary)
    assert (rows["hidden"].ran, rows["hidden"].mismatch) == (narrow, False)
    assert rows["head"].ran == "bfloat16" and summary.mismatches == ()
    assert "!" not in str(summary)


def test_a_float_matmul_in_another_dtype_is_still_a_mismatch_beside_quantized_operands():
  # hidden computes in bfloat16 by the policy but multiplies float32 values by itself.
  class CastsUp(nn.Module):
    @nn.compact
    def __call__(self, x):
      kernel = self.param("kernel", nn.initializers.ones, (x.shape[-1], 2))
      return x.astype(jnp.float32) @ kernel.astype(jnp.float32)

  with pytest.warns(UserWarning, match="ran float32, resolved compute bfloat16"):
    summary = jaxmp.tools.summary(CastsUp(), "p=f32,c=bf16,o=f32", jnp.ones((1, 3)))
  assert [(r.path, r.ran, r.mismatch) for r in summary.rows] == [("<root>", "float32", True)]


def test_ran_counts_the_platform_branch_that_runs_here():
  # On CUDA a 4-element contraction multiplies its fp8 values as bfloat16
  # (lax.platform_dependent): the CPU's table says fp8, and the CUDA branch holds the
  # bfloat16 GEMM, which is counted only when asked for that platform.
  from jaxmp._src.tools import summary as summary_lib
  rules = jaxmp.PolicyRules("p=f32,c=bf16,o=f32",
                            [jaxmp.Rule(nn.Dense, fp8=jaxmp.fp8.CurrentScaling())])
  x = jnp.ones((2, 4))
  table = jaxmp.tools.summary(nn.Dense(3), rules, x)
  assert _rows(table)["<root>"].ran == "float8_e4m3fn"
  model = jaxmp.linen.mixed_precision(nn.Dense(3), rules)
  jaxpr = jax.make_jaxpr(model.apply)(model.init(jax.random.key(0), x), x)

  def operands(jaxpr, platform):
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
      if eqn.primitive.name == "dot_general":
        yield tuple(str(v.aval.dtype) for v in eqn.invars)
      for sub in summary_lib.sub_jaxprs_that_run(eqn, platform):
        yield from operands(sub, platform)

  assert list(operands(jaxpr, "cpu")) == [("float8_e4m3fn", "float8_e4m3fn")]
  assert list(operands(jaxpr, "cuda")) == [("bfloat16", "bfloat16")]


def test_a_tool_is_the_first_thing_a_user_calls():
  # A fresh process that imports jaxmp and calls a tool before anything has imported
  # jaxmp.linen or jaxmp.nnx: the tool finds the model's adapter itself (it once raised
  # "expects  or a jaxmp mixed_precision wrapper" with an empty list of kinds).
  code = textwrap.dedent("""\
      import flax.linen as nn, jax.numpy as jnp
      from flax import nnx
      import jaxmp
      print(jaxmp.tools.summary(nn.Dense(2), "bfloat16", jnp.ones((1, 3))).rows[0].ran)
      print(jaxmp.tools.summary(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "bfloat16",
                                jnp.ones((1, 3))).rows[0].ran)
      """)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=pathlib.Path(__file__).resolve().parents[2])
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split() == ["bfloat16", "bfloat16"], out.stdout
