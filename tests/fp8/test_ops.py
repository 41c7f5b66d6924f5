"""The fp8 ops table: one entry per recipe type, and a new recipe by one entry.

A recipe defined here, outside jaxmp (every operand E5M2 with one power-of-two scale
per tensor, its quantization and GEMM written in this file), is registered with
``jaxmp.fp8.register_recipe`` and then runs by rule through Flax's published models,
linen and NNX, with no jaxmp file changed: the jaxpr shows its E5M2 GEMMs, and the
models train. The table's own rules are checked too: what it refuses, and that no
module outside the recipes and the table chooses behaviour by a recipe's type.
"""

import ast
import dataclasses
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
from jaxmp import fp8
from jaxmp._src.fp8 import ops as ops_lib
from jaxmp._src.fp8 import recipes as recipes_lib
from tests.published import matmuls
from tests.published import models as registry

BF16 = "params=float32,compute=bfloat16,output=float32"
E5M2 = jnp.float8_e5m2
E5M2_MAX = 57344.0
CANONICAL = (((2,), (2,)), ((0,), (0,)))


@dataclasses.dataclass(frozen=True)
class E5M2Tensorwise(fp8.GemmRecipe):
  """Test-only: every operand in E5M2 with one power-of-two scale for the whole tensor."""


def _pow2_scale(x):
  """The smallest power of two ``s`` with ``max|x| / s <= 57344`` (1 for an all-zero x)."""
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
  exponent = jnp.ceil(jnp.log2(jnp.where(amax > 0, amax / E5M2_MAX, 1.0)))
  return jnp.exp2(exponent).reshape(1, 1, 1)


def _quantize(x, recipe, role):
  del recipe, role
  scale = _pow2_scale(x)
  return fp8.Quantized((x.astype(jnp.float32) / scale).astype(E5M2), scale)


def _gemm(a, b, recipe, call):
  del recipe
  product = jax.lax.dot_general(a.data, b.data, CANONICAL, preferred_element_type=jnp.float32)
  return (product * (a.scale * b.scale)).astype(call.out_dtype)


OPS = fp8.RecipeOps(
    narrow="fp8",
    lowering=lambda recipe, target: fp8.Lowering("fp8", "an E5M2 GEMM"),
    operand=fp8.OperandOps(grouping=lambda recipe, role: fp8.Grouping(None, None),
                           element_format=lambda recipe, role: np.dtype(E5M2),
                           quantize=_quantize),
    gemm=_gemm)
fp8.register_recipe(E5M2Tensorwise, OPS)  # once, where the recipe is defined
RECIPE = E5M2Tensorwise()


def _dots(jaxpr) -> list:
  """The operand dtypes of every dot_general anywhere in ``jaxpr`` (that runs here)."""
  return [dtypes for name, dtypes in matmuls.iter_matmuls(jaxpr) if name == "dot_general"]


def test_the_registered_recipe_computes_its_own_formula():
  x = jax.random.normal(jax.random.key(0), (8, 16)) * 1000
  w = jax.random.normal(jax.random.key(1), (16, 4))
  got = fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), recipe=RECIPE)
  # The reference in NumPy: each operand scaled by its power of two, rounded to E5M2.
  def rounded(v):
    v = np.asarray(v, np.float32)
    s = 2.0 ** np.ceil(np.log2(np.abs(v).max() / E5M2_MAX))
    return (v / s).astype(E5M2).astype(np.float64) * s
  np.testing.assert_allclose(np.asarray(got), rounded(x) @ rounded(w), rtol=1e-6)
  assert fp8.init_state(RECIPE) is None                       # no per-tensor op: no state
  assert recipes_lib.per_gemm(RECIPE) == fp8.GemmRecipes(RECIPE, RECIPE, RECIPE)


def test_its_three_gemms_are_e5m2_in_the_jaxpr_and_the_fallback_table_reads_its_entry():
  x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.bfloat16)
  loss = lambda x, w: fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())),
                                          recipe=RECIPE).astype(jnp.float32).sum()
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
  assert _dots(jaxpr.jaxpr) == [(np.dtype(E5M2), np.dtype(E5M2))] * 3
  found = jaxmp._src.fp8.support.lowering(RECIPE, jaxmp._src.fp8.chips.TARGETS["h100"])
  assert (found.kind, found.detail) == ("fp8", "an E5M2 GEMM")
  # And in a GemmRecipes beside a built-in recipe.
  mixed = fp8.GemmRecipes(RECIPE, fp8.RowwiseScaling(), None)
  jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: fp8.fp8_dot_general(
      x, w, (((1,), (0,)), ((), ())), recipe=mixed).astype(jnp.float32).sum(),
      argnums=(0, 1)))(x, w)
  assert _dots(jaxpr.jaxpr)[0] == (np.dtype(E5M2), np.dtype(E5M2))


@pytest.mark.slow
def test_linen_lm1b_trains_with_the_registered_recipe_by_rule():
  entry = registry.BY_NAME["lm1b_transformer_lm"]
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule("decoder/logitdense"),
                                   jaxmp.Rule((nn.Dense, nn.DenseGeneral), fp8=RECIPE)])
  batch = entry.batch(jax.random.key(1))
  model = jaxmp.linen.mixed_precision(entry.module("train"), rules)
  variables = entry.init(model, jax.random.key(0), batch)
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply, variables=variables,
                                        tx=jaxmp.loss_scaling(optax.adam(1e-3)))

  def loss(v):
    logits, _ = entry.forward(model, v, batch, "train", jax.random.key(2))
    return registry.cross_entropy(logits, batch.targets)

  jaxpr = jax.make_jaxpr(lambda s: s.value_and_grad(loss)())(state)
  dots = _dots(jaxpr.jaxpr)
  e5m2 = dots.count((np.dtype(E5M2), np.dtype(E5M2)))
  # Per decoder block 6 Dense GEMMs (query, key, value, out, MLP in and out), 3 each.
  assert e5m2 == registry.LAYERS * 6 * 3, dots

  @jax.jit
  def step(state):
    value, grads = state.value_and_grad(loss)()
    return state.apply_gradients(grads), value

  losses = []
  for _ in range(4):
    state, value = step(state)
    losses.append(float(value))
  assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


@pytest.mark.slow
def test_nnx_mnist_cnn_trains_with_the_registered_recipe_by_rule():
  entry = registry.BY_NAME["mnist_cnn"]
  rules = jaxmp.PolicyRules(BF16, [jaxmp.Rule(nnx.Linear, fp8=RECIPE)])
  model = jaxmp.nnx.mixed_precision(entry.module(nnx.Rngs(0)), rules)
  batch = entry.batch(jax.random.key(1))
  optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(optax.adam(1e-3)), wrt=nnx.Param)

  def loss(model):
    return registry.cross_entropy(entry.forward(model, batch, "train", jax.random.key(2)),
                                  batch.targets)

  graph, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(lambda s: jaxmp.nnx.value_and_grad(loss)(nnx.merge(graph, s)))(state)
  assert _dots(jaxpr.jaxpr).count((np.dtype(E5M2), np.dtype(E5M2))) == 2 * 3  # two Linears

  @nnx.jit
  def step(model, optimizer):
    value, grads = jaxmp.nnx.value_and_grad(loss)(
        model, loss_scale=jaxmp.get_loss_scale(optimizer.opt_state))
    jaxmp.nnx.apply_gradients(optimizer, model, grads)
    return value

  losses = [float(step(model, optimizer)) for _ in range(4)]
  assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def test_register_recipe_refuses_what_the_table_cannot_run():
  @dataclasses.dataclass
  class Mutable(fp8.GemmRecipe):
    pass

  @dataclasses.dataclass(frozen=True)
  class NotAGemmRecipe:
    pass

  with pytest.raises(TypeError, match=r"frozen dataclass derived from jaxmp.fp8.GemmRecipe"):
    fp8.register_recipe(Mutable, OPS)
  with pytest.raises(TypeError, match=r"frozen dataclass derived from jaxmp.fp8.GemmRecipe"):
    fp8.register_recipe(NotAGemmRecipe, OPS)
  with pytest.raises(TypeError, match=r"ops must be a jaxmp.fp8.RecipeOps with operand"):
    fp8.register_recipe(E5M2Tensorwise, fp8.RecipeOps("fp8", OPS.lowering))
  with pytest.raises(ValueError, match=r"E5M2Tensorwise already has an entry"):
    fp8.register_recipe(E5M2Tensorwise, OPS)


def test_an_unregistered_recipe_is_refused_where_it_is_given_naming_the_fix():
  @dataclasses.dataclass(frozen=True)
  class Unregistered(fp8.GemmRecipe):
    pass

  with pytest.raises(TypeError, match=r"Rule fp8: .*Unregistered has no entry in the fp8 ops "
                                      r"table.*jaxmp.fp8.register_recipe\(Unregistered"):
    jaxmp.Rule(nn.Dense, fp8=Unregistered())
  with pytest.raises(TypeError, match=r"fp8_dot_general: .*Unregistered has no entry"):
    fp8.fp8_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), (((1,), (0,)), ((), ())),
                        recipe=fp8.GemmRecipes(Unregistered(), None, None))


def test_every_built_in_recipe_has_an_entry_and_each_gemm_recipe_prepares_operands():
  built_in = [getattr(recipes_lib, name) for name in recipes_lib.__all__]
  built_in = [t for t in built_in if isinstance(t, type) and dataclasses.is_dataclass(t)]
  assert len(built_in) == 8
  for recipe_type in set(built_in) - {fp8.GemmRecipes}:
    entry = ops_lib._TABLE[recipe_type]
    if issubclass(recipe_type, fp8.GemmRecipe):
      assert entry.gemm is not None, recipe_type
    else:
      assert entry.per_tensor is not None, recipe_type
  assert [t for t in ops_lib._TABLE if ops_lib._TABLE[t].per_tensor is not None] == [
      fp8.DelayedScaling, fp8.CurrentScaling]


_RECIPE_CLASSES = {name for name in recipes_lib.__all__
                   if isinstance(getattr(recipes_lib, name), type)}
_TABLE_AND_CONFIG = {"jaxmp/_src/fp8/recipes.py", "jaxmp/_src/fp8/ops.py"}


def _type_checks_naming_a_recipe(source: str) -> list[int]:
  """Lines of ``isinstance(x, <a recipe class>)`` (or a tuple naming one) in ``source``."""
  lines = []
  for node in ast.walk(ast.parse(source)):
    if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
        and len(node.args) == 2):
      names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None)
               for n in ast.walk(node.args[1])}
      if names & _RECIPE_CLASSES:
        lines.append(node.lineno)
  return lines


def test_no_module_but_the_recipes_and_the_table_chooses_by_a_recipe_type():
  root = pathlib.Path(jaxmp.__file__).resolve().parent.parent
  found = {}
  for path in sorted((root / "jaxmp").rglob("*.py")):
    rel = path.relative_to(root).as_posix()
    if rel in _TABLE_AND_CONFIG:
      continue
    lines = _type_checks_naming_a_recipe(path.read_text())
    if lines:
      found[rel] = lines
  assert found == {}
  # The table's own: the two composites, GemmRecipes and the operands of a GemmRecipe.
  table = (root / "jaxmp/_src/fp8/ops.py").read_text()
  assert len(_type_checks_naming_a_recipe(table)) <= 8
