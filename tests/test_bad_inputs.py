"""A catalogue of bad inputs across the public API.

Each case must raise a ValueError or TypeError (never another exception, never a silent
acceptance) whose message names the offending value: its repr, its name or its dtype.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp import fp8

RECIPE = fp8.DelayedScaling(amax_history_length=4)
STATE = fp8.init_state(RECIPE)
DIMS = (((1,), (0,)), ((), ()))
PARAMS = {"w": jnp.ones(2)}
X, W = jnp.ones((2, 3)), jnp.ones((3, 2))
BF16_PARAMS = {"w": jnp.ones(2, jnp.bfloat16)}


def _sgd_state():
  return jaxmp.linen.TrainState.create(apply_fn=lambda v, x: x, variables={"params": PARAMS},
                                       tx=optax.sgd(1.0))


def _batch_stats_state():
  return jaxmp.linen.TrainState.create(
      apply_fn=lambda v, x: x, variables={"params": PARAMS, "batch_stats": {"mean": jnp.ones(2)}},
      tx=optax.sgd(1.0))


def _grads_of(state):
  return jaxmp.linen.Gradients(jax.tree.map(jnp.zeros_like, state.params), {})


def _linen_fp8_grad_of_params_alone():
  model = jaxmp.linen.mixed_precision(nn.Dense(2), jaxmp.PolicyRules(
      "float32", [jaxmp.Rule(nn.Dense, fp8=RECIPE)]))
  variables = model.init(jax.random.key(0), X)
  return jax.grad(lambda p: jnp.sum(model.apply({**variables, "params": p}, X)))(
      variables["params"])


_REC = {"bf16": jaxmp.PolicyRules("params=float32,compute=bfloat16,output=float32")}


def _rec_build(rules):
  return (lambda x: x @ x), (X @ W,)


class _ScanBody(nn.Module):
  """A delayed-scaling layer as a scan's body: the carry in, ``(carry, None)`` out."""

  @nn.compact
  def __call__(self, c, _):
    return nn.Dense(X.shape[-1], name="gate")(c), None


def _linen_fp8_in_hand_written_scan_without_state():
  # Flax's lifted nn.scan carries the fp8 state with the params (one per layer); a
  # jax.lax.scan written around apply and given the stacked params alone cannot.
  block = jaxmp.linen.mixed_precision(_ScanBody(), jaxmp.PolicyRules(
      "float32", [jaxmp.Rule(nn.Dense, fp8=RECIPE)]))
  params = block.init(jax.random.key(0), X, None)["params"]
  stacked = jax.tree_util.tree_map(lambda p: jnp.stack([p, p]), params)
  return jax.lax.scan(lambda c, p: block.apply({"params": p}, c, None), X, stacked)


def _linen_fp8_apply_params_alone():
  model = nn.Dense(2, dot_general_cls=jaxmp.linen.Fp8DotGeneral)
  return model.apply({"params": model.init(jax.random.key(0), X)["params"]}, X)


def _nnx_fp8_plain_grad():
  from flax import nnx

  model = jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), jaxmp.PolicyRules(
      "float32", [jaxmp.Rule(nnx.Linear, fp8=RECIPE)]))
  return nnx.grad(lambda m: jnp.sum(m(X)))(model)


def _wrong_nesting_state():
  return optax.MultiSteps(jaxmp.loss_scaling(optax.sgd(1.0)), every_k_schedule=2).init(PARAMS)


TRACE_RULES = jaxmp.PolicyRules("float32", trace_nonfinite=True)
PROBE_CALLS = (("", "__call__"), ("dense", "__call__"))


def _traced_linen():
  model = jaxmp.linen.mixed_precision(nn.Dense(2), TRACE_RULES)
  return model, model.init(jax.random.key(0), X)


def _traced_linen_apply_without_probe():
  model, variables = _traced_linen()
  return model.apply({"params": variables["params"]}, X)


def _traced_linen_call_the_probe_lacks():
  model = jaxmp.linen.mixed_precision(nn.Embed(5, 3), TRACE_RULES)
  variables = model.init(jax.random.key(0), jnp.array([1, 2]))  # calls __call__ only
  return model.apply(variables, X, method="attend")


def _two_traced_nnx_wrappers():
  from flax import nnx

  class Pair(nnx.Module):
    def __init__(self):
      self.a = jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), TRACE_RULES)
      self.b = jaxmp.nnx.mixed_precision(nnx.Linear(2, 2, rngs=nnx.Rngs(1)), TRACE_RULES)

  return jaxmp.nnx.value_and_grad(lambda m: jnp.sum(m.b(m.a(X))))(Pair())


def _traces_of_two_models():
  from jaxmp._src import nonfinite
  a, b = _probe(), nonfinite.probe(PROBE_CALLS[:1])
  return jaxmp.linen.accumulate_gradients(jaxmp.linen.Gradients({}, {}, None, a),
                                          jaxmp.linen.Gradients({}, {}, None, b))


def _probe():
  from jaxmp._src import nonfinite
  return nonfinite.probe(PROBE_CALLS)


def _recorded_trace():
  """A step's trace: every call recorded once (count 1), every value finite."""
  values = jnp.zeros((len(PROBE_CALLS), 10)).at[:, -1].set(1.0)
  return jaxmp.tools.NonfiniteTrace(PROBE_CALLS, values)


def _controller(model=None, **kwargs):
  if model is None:
    model = jaxmp.linen.mixed_precision(nn.Dense(2), TRACE_RULES)
  return jaxmp.tools.PrecisionController(model, jaxmp.tools.Monitor(), **kwargs)


def _controller_update(metrics):
  controller = _controller()
  if metrics is not None:
    controller.monitor.update(metrics)
  return controller.update(jaxmp.linen.mixed_precision(nn.Dense(2), TRACE_RULES))


def _step_record(origin_path="dense", **fields):
  origin = jaxmp.tools.Origin(origin_path, "__call__", "forward", "output", float("inf"))
  return jaxmp.tools.StepRecord(**{"step": 0, "loss": None, "skipped": True, "loss_scale": 1.0,
                                   "origin": origin, "traced": True, "active": frozenset(),
                                   **fields})


def _propose(origin_path="dense", modules=None, **kwargs):
  args = {"culprit_steps": 1, "bfloat16": False, **kwargs}
  return jaxmp.tools.propose_change(TRACE_RULES, [_step_record(origin_path)],
                                    modules or {"": nn.Dense}, **args)


def _nnx_with_rules_restoring_params():
  from flax import nnx

  model = jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "float32")
  return model.with_rules(jaxmp.PolicyRules("bfloat16"))


class _Counter(nn.Module):
  """A model keeping an integer in its params."""

  @nn.compact
  def __call__(self, x):
    calls = self.param("calls", lambda key: jnp.zeros((), jnp.int32))
    return nn.Dense(2)(x) + calls.astype(x.dtype)


def _counter_state():
  model = jaxmp.linen.mixed_precision(_Counter(), "params=float32,compute=float16")
  return jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                       variables=model.init(jax.random.key(0), X),
                                       tx=jaxmp.loss_scaling(optax.adam(0.1)))


def _counter_train_step():
  state = _counter_state()
  _, grads = state.value_and_grad(lambda v: jnp.sum(state.apply_fn(v, X)))()
  return state.apply_gradients(grads)


def _nnx_value_and_grad_of_an_integer_param():
  from flax import nnx

  class Counter(nnx.Module):
    def __init__(self):
      self.linear = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
      self.calls = nnx.Param(jnp.zeros((), jnp.int32))

    def __call__(self, x):
      return self.linear(x) + self.calls[...]

  model = jaxmp.nnx.mixed_precision(Counter(), "float32")
  return jaxmp.nnx.value_and_grad(lambda m: jnp.sum(m(X)))(model)


def _nnx_optimizer_of_every_variable():
  from flax import nnx

  model = jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), jaxmp.PolicyRules(
      "float32", [jaxmp.Rule(nnx.Linear, fp8=RECIPE)]))
  optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Variable)
  _, grads = jaxmp.nnx.value_and_grad(lambda m: jnp.sum(m(X)))(model)
  return jaxmp.nnx.apply_gradients(optimizer, model, grads)


def _fp8_state_stepped_with_gradients_of_another_state():
  def state_of(rules):
    model = jaxmp.linen.mixed_precision(nn.Dense(2), rules)
    return jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                         variables=model.init(jax.random.key(0), X),
                                         tx=optax.sgd(0.1))
  fp8_state = state_of(jaxmp.PolicyRules("float32", [jaxmp.Rule(nn.Dense, fp8=RECIPE)]))
  plain = state_of(jaxmp.PolicyRules("float32"))
  _, grads = plain.value_and_grad(lambda v: jnp.sum(plain.apply_fn(v, X)))()
  return fp8_state.apply_gradients(grads)


def _linen_with_rules_restoring_params():
  model = jaxmp.linen.mixed_precision(nn.Dense(2), "float32")
  model.init(jax.random.key(0), X)
  return model.with_rules(jaxmp.PolicyRules("bfloat16"))


def _linen_probe_given_to_a_wrapper_that_does_not_trace():
  model, variables = _traced_linen()
  return model.with_rules(jaxmp.PolicyRules("float32")).apply(variables, X)


# (id, call, exception type, text the message must contain)
CASES = [
    # Policies and dtypes.
    ("get_policy unknown dtype", lambda: jaxmp.get_policy("c=f8"), ValueError, "'f8'"),
    ("get_policy unknown key", lambda: jaxmp.get_policy("p=f32,x=bf16"), ValueError, "'x'"),
    ("get_policy not a string", lambda: jaxmp.get_policy(3), TypeError, "got 3 of type int"),
    ("get_policy key set twice", lambda: jaxmp.get_policy("p=f32,p=bf16"), ValueError,
     "'p=f32,p=bf16' sets param_dtype twice"),
    ("get_policy integer dtype", lambda: jaxmp.get_policy("int8"), ValueError, "'int8'"),
    ("get_policy malformed part", lambda: jaxmp.get_policy("p=f32=bf16"), ValueError,
     "'p=f32=bf16'"),
    ("get_policy empty", lambda: jaxmp.get_policy("  "), ValueError, "'  '"),
    ("Policy integer compute", lambda: jaxmp.Policy("float32", "int32"), ValueError,
     "compute_dtype: Unknown dtype 'int32'"),
    ("Policy fp8 compute", lambda: jaxmp.Policy("float32", "float8_e4m3fn"), ValueError,
     "'float8_e4m3fn'"),
    ("Policy not a dtype", lambda: jaxmp.Policy([1]), TypeError, "got [1] of type list"),
    ("with_compute_dtype int8", lambda: jaxmp.Policy().with_compute_dtype("int8"), ValueError,
     "'int8'"),
    ("to_jmp not a policy", lambda: jaxmp.get_policy(5).to_jmp(), TypeError, "got 5 of type int"),
    ("parse_dtype unknown", lambda: jaxmp.tools.parse_dtype("floaty"), ValueError, "'floaty'"),
    ("parse_dtype fp8 not allowed", lambda: jaxmp.tools.parse_dtype("float8_e4m3fn"), ValueError,
     "'float8_e4m3fn'"),
    ("float_format integer", lambda: jaxmp.tools.float_format("int8"), ValueError, "'int8'"),
    ("half_dtype not a device", lambda: jaxmp.half_dtype("cpu"), TypeError,
     "got 'cpu' of type str"),
    # Trees.
    ("cast_tree integer target", lambda: jaxmp.cast_tree(PARAMS, "int32"), ValueError, "'int32'"),
    ("cast_tree bool target", lambda: jaxmp.cast_tree(PARAMS, jnp.bool_), ValueError, "'bool'"),
    ("all_finite of a string", lambda: jaxmp.all_finite("hello"), TypeError,
     "leaf (the tree itself) is 'hello' of type str"),
    ("all_finite object leaf", lambda: jaxmp.all_finite({"w": jnp.ones(2), "tag": object()}),
     TypeError, "leaf ['tag'] is <object object"),
    ("cast_tree None target", lambda: jaxmp.cast_tree(PARAMS, None), TypeError, "got None"),
    ("select_tree vector predicate",
     lambda: jaxmp.select_tree(jnp.array([True, False]), PARAMS, PARAMS), ValueError, "(2,)"),
    ("select_tree integer predicate", lambda: jaxmp.select_tree(1, PARAMS, PARAMS), TypeError,
     "dtype int"),
    ("select_tree string predicate", lambda: jaxmp.select_tree("yes", PARAMS, PARAMS),
     TypeError, "got 'yes' of type str"),
    ("select_tree structures", lambda: jaxmp.select_tree(
        True, {"a": jnp.ones(1)}, {"b": jnp.ones(1)}), ValueError, "'b'"),
    ("select_tree shapes", lambda: jaxmp.select_tree(
        True, {"a": jnp.ones(2)}, {"a": jnp.ones(3)}), ValueError, "['a'] has shape (2,)"),
    ("select_tree dtypes", lambda: jaxmp.select_tree(
        True, {"a": jnp.ones(2)}, {"a": jnp.ones(2, jnp.bfloat16)}), TypeError, "bfloat16"),
    # Loss scales.
    ("DynamicLossScale growth_interval 0", lambda: jaxmp.DynamicLossScale(growth_interval=0),
     ValueError, "got 0"),
    ("DynamicLossScale growth_factor string",
     lambda: jaxmp.DynamicLossScale(growth_factor="2"), TypeError, "got '2'"),
    ("DynamicLossScale min above max",
     lambda: jaxmp.DynamicLossScale(3.0, min_scale=4.0, max_scale=2.0), ValueError,
     "min_scale=4.0 > max_scale=2.0"),
    ("StaticLossScale negative", lambda: jaxmp.StaticLossScale(-1.0), ValueError, "got -1.0"),
    ("StaticLossScale string", lambda: jaxmp.StaticLossScale("8"), TypeError, "got '8'"),
    ("adjust vector flag", lambda: jaxmp.DynamicLossScale().adjust(jnp.array([True, False])),
     ValueError, "shape (2,)"),
    ("adjust float flag", lambda: jaxmp.DynamicLossScale().adjust(1.0), TypeError, "type float"),
    ("value_and_grad not callable", lambda: jaxmp.StaticLossScale(2.0).value_and_grad("loss"),
     TypeError, "got 'loss'"),
    # loss_scaling and its state.
    ("loss_scaling uncalled optimizer", lambda: jaxmp.loss_scaling(optax.adam), TypeError,
     "function adam"),
    ("loss_scaling number as scale", lambda: jaxmp.loss_scaling(optax.sgd(1.0), 1024.0),
     TypeError, "got 1024.0 of type float"),
    ("loss_scaling list axis_name",
     lambda: jaxmp.loss_scaling(optax.sgd(1.0), axis_name=["i"]), TypeError, "got ['i']"),
    ("loss_scaling foreign state", lambda: jaxmp.loss_scaling(optax.sgd(1.0)).update(
        PARAMS, optax.sgd(1.0).init(PARAMS), PARAMS), TypeError, "got tuple"),
    ("get_loss_scale without wrapper",
     lambda: jaxmp.get_loss_scale(optax.sgd(1.0).init(PARAMS)), ValueError, "of type tuple"),
    ("get_loss_scale two wrappers", lambda: jaxmp.get_loss_scale(
        (jaxmp.loss_scaling(optax.sgd(1.0)).init(PARAMS),) * 2), ValueError,
     "holds 2 LossScalingStates"),
    ("loss_scaling_metrics without wrapper", lambda: jaxmp.loss_scaling_metrics({"a": 1}),
     ValueError, "of type dict"),
    # Rules.
    ("Rule match not a class or regex", lambda: jaxmp.Rule(42), TypeError, "got 42 of type int"),
    ("Rule invalid regex", lambda: jaxmp.Rule("[unclosed"), ValueError, "'[unclosed'"),
    ("Rule bad policy", lambda: jaxmp.Rule(nn.Dense, "c=f8"), ValueError, "'f8'"),
    ("Rule fp8 not a recipe", lambda: jaxmp.Rule(nn.Dense, fp8="delayed"), TypeError,
     "got 'delayed' of type str"),
    ("Rule integer output", lambda: jaxmp.Rule(nn.Dense, output_dtype="int32"), ValueError,
     "'int32'"),
    ("Rule two output dtypes", lambda: jaxmp.Rule(nn.Dense, "c=f32,o=bf16",
                                                  output_dtype="float16"), ValueError,
     "bfloat16 in its policy and output_dtype=float16"),
    ("PolicyRules tuple instead of Rule",
     lambda: jaxmp.PolicyRules("f32", [("Dense", "bf16")]), TypeError, "('Dense', 'bf16')"),
    ("PolicyRules single Rule", lambda: jaxmp.PolicyRules("f32", jaxmp.Rule(nn.Dense)),
     TypeError, "Rule(match="),
    ("PolicyRules bad default", lambda: jaxmp.PolicyRules("nonsense"), ValueError, "'nonsense'"),
    ("PolicyRules float32_normalization string",
     lambda: jaxmp.PolicyRules("f32", float32_normalization="no"), TypeError, "got 'no'"),
    # Flax wrapper and summary.
    ("mixed_precision function", lambda: jaxmp.linen.mixed_precision(print, "f32"), TypeError,
     "print"),
    ("mixed_precision module class", lambda: jaxmp.linen.mixed_precision(nn.Dense, "f32"),
     TypeError, "Dense"),
    ("mixed_precision bare rule list",
     lambda: jaxmp.linen.mixed_precision(nn.Dense(3), [jaxmp.Rule(nn.Dense)]), TypeError,
     "[Rule(match="),
    ("mixed_precision bad policy", lambda: jaxmp.linen.mixed_precision(nn.Dense(3), "c=f7"),
     ValueError, "'f7'"),
    ("Rule causal_attention not a bool",
     lambda: jaxmp.Rule(nn.MultiHeadDotProductAttention, causal_attention=1), TypeError,
     "got 1 of type int"),
    ("Rule padded_attention not a bool",
     lambda: jaxmp.Rule(nn.MultiHeadDotProductAttention, padded_attention="right"), TypeError,
     "padded_attention must be True or False, got 'right' of type str"),
    ("Rule attention_window a float",
     lambda: jaxmp.Rule(nn.MultiHeadDotProductAttention, causal_attention=True,
                        attention_window=4.0), TypeError, "got 4.0 of type float"),
    ("Rule attention_window zero",
     lambda: jaxmp.Rule(nn.MultiHeadDotProductAttention, causal_attention=True,
                        attention_window=0), ValueError, "positive int"),
    ("Rule attention_window without causal attention",
     lambda: jaxmp.Rule(nn.MultiHeadDotProductAttention, attention_window=4), ValueError,
     "attention_window=4 needs causal_attention=True"),
    ("summary of a string", lambda: jaxmp.tools.summary("model"), TypeError, "got 'model'"),
    ("sensitivity progress of a string",
     lambda: jaxmp.tools.sensitivity(nn.Dense(2), {}, X, progress="yes"), TypeError,
     "got 'yes' of type str"),
    ("audit launch overhead a string",
     lambda: jaxmp.tools.audit(lambda x: x @ x, X @ W).estimated_seconds_with_launches("2us"),
     TypeError, "'2us'"),
    ("audit launch overhead negative",
     lambda: jaxmp.tools.audit(lambda x: x @ x, X @ W).estimated_seconds_with_launches(-1.0),
     ValueError, "-1.0"),
    ("summary without rules", lambda: jaxmp.tools.summary(nn.Dense(2), None, jnp.ones((1, 2))),
     ValueError, "Dense"),
    ("recommend_precision unknown target",
     lambda: jaxmp.tools.recommend_precision(_rec_build, _REC, target="tpu9"), ValueError,
     "recommend_precision: unknown target 'tpu9'; accepted targets are 'h100'"),
    ("recommend_precision target not a string",
     lambda: jaxmp.tools.recommend_precision(_rec_build, _REC, target=5), TypeError,
     "recommend_precision: target must be a string such as 'h100', got 5 of type int"),
    ("recommend_precision baseline not a candidate",
     lambda: jaxmp.tools.recommend_precision(_rec_build, _REC, target="v5e", baseline="fp32"),
     ValueError, "'fp32' is not among the candidates; accepted: 'bf16'"),
    ("recommend_precision no candidates",
     lambda: jaxmp.tools.recommend_precision(_rec_build, {}, target="v5e"), ValueError,
     "got {}"),
    ("recommend_precision candidate a policy string",
     lambda: jaxmp.tools.recommend_precision(_rec_build, {"bf16": "compute=bf16"}, target="v5e"),
     TypeError, "'bf16' is 'compute=bf16' of type str"),
    ("recommend_precision build not callable",
     lambda: jaxmp.tools.recommend_precision(None, _REC, target="v5e"), TypeError, "got None"),
    ("recommend_precision build returns the step alone",
     lambda: jaxmp.tools.recommend_precision(lambda rules: jnp.sum, _REC, target=None),
     TypeError, "for candidate 'bf16' it returned <"),
    ("recommend_precision per_launch negative",
     lambda: jaxmp.tools.recommend_precision(_rec_build, _REC, target=None, per_launch=-2e-6),
     ValueError, "-2e-06"),
    ("recommend_precision on a CPU",
     lambda: jaxmp.tools.recommend_precision(_rec_build, _REC, target=None), ValueError,
     "candidate 'bf16' for 'cpu' (cpu) gives no time estimate"),
    # fp8.
    ("DelayedScaling history 0", lambda: fp8.DelayedScaling(amax_history_length=0), ValueError,
     "got 0"),
    ("DelayedScaling history float", lambda: fp8.DelayedScaling(amax_history_length=4.0),
     TypeError, "got 4.0"),
    ("DelayedScaling amax_compute", lambda: fp8.DelayedScaling(amax_compute="mean"), ValueError,
     "'mean'"),
    ("DelayedScaling margin float", lambda: fp8.DelayedScaling(margin=1.5), TypeError, "got 1.5"),
    ("CurrentScaling negative margin", lambda: fp8.CurrentScaling(margin=-1), ValueError,
     "got -1"),
    ("CurrentScaling power_of_two string", lambda: fp8.CurrentScaling(power_of_two="yes"),
     TypeError, "power_of_two must be True or False, got 'yes'"),
    ("DelayedScaling power_of_two int", lambda: fp8.DelayedScaling(power_of_two=1), TypeError,
     "got 1 of type int"),
    ("RowwiseScaling negative margin", lambda: fp8.RowwiseScaling(margin=-1), ValueError,
     "got -1"),
    ("RowwiseScaling unknown gradient format", lambda: fp8.RowwiseScaling(
        gradient_format="e3m4"), ValueError, "unknown gradient_format 'e3m4'; accepted values "
     "are 'e4m3', 'e5m2'"),
    ("RowwiseScaling gradient format dtype", lambda: fp8.RowwiseScaling(
        gradient_format=jnp.float8_e5m2), TypeError, "gradient_format must be a string"),
    ("BlockScaling block size 0", lambda: fp8.BlockScaling(block_size=0), ValueError, "got 0"),
    ("BlockScaling block size float", lambda: fp8.BlockScaling(block_size=128.0), TypeError,
     "got 128.0 of type float"),
    ("MXScaling unknown gradient format", lambda: fp8.MXScaling(gradient_format="fp8"),
     ValueError, "'fp8'"),
    ("MXScaling unknown scale rounding", lambda: fp8.MXScaling(scale_rounding="round"),
     ValueError, "unknown scale_rounding 'round'; accepted values are 'floor', 'ceil', "
     "'rceil', 'even'"),
    ("MXScaling scale rounding not a string", lambda: fp8.MXScaling(scale_rounding=None),
     TypeError, "scale_rounding must be a string, one of ('floor', 'ceil', 'rceil', 'even'), "
     "got None"),
    ("OperandRecipes MX operand", lambda: fp8.OperandRecipes(
        input=fp8.MXScaling(), kernel=fp8.RowwiseScaling()), TypeError,
     "input must be None or one of CurrentScaling, RowwiseScaling (a recipe with one scale "
     "per row or tensor), got MXScaling("),
    ("OperandRecipes one operand", lambda: fp8.OperandRecipes(kernel=fp8.CurrentScaling()),
     ValueError, "exactly two of input, kernel, output_grad take a recipe; got ['kernel']"),
    ("GemmRecipes OperandRecipes of another GEMM", lambda: fp8.GemmRecipes(
        forward=fp8.OperandRecipes(output_grad=fp8.RowwiseScaling(),
                                   kernel=fp8.CurrentScaling())), ValueError,
     "the forward GEMM multiplies the input by the kernel, so its OperandRecipes takes "
     "recipes for input and kernel"),
    ("GemmRecipes OperandRecipes as a layer recipe", lambda: jaxmp.Rule(
        nn.Dense, fp8=fp8.OperandRecipes(input=fp8.CurrentScaling(),
                                         kernel=fp8.CurrentScaling())), TypeError,
     "got OperandRecipes("),
    ("GemmRecipes with delayed scaling", lambda: fp8.GemmRecipes(forward=fp8.DelayedScaling()),
     TypeError, "DelayedScaling keeps one state per tensor"),
    ("GemmRecipes a string", lambda: fp8.GemmRecipes(weight_grad="rowwise"), TypeError,
     "got 'rowwise' of type str"),
    ("GemmRecipes all None", lambda: fp8.GemmRecipes(), ValueError, "every GEMM is None"),
    ("compile_target unknown", lambda: fp8.compile_target("h300").__enter__(), ValueError,
     "unknown target 'h300'; accepted targets are a100, b200, cpu, h100, h200, v5e"),
    ("compile_target not a string", lambda: fp8.compile_target(100).__enter__(), TypeError,
     "got 100 of type int"),
    ("fp8_dot_general state with block scaling", lambda: fp8.fp8_dot_general(
        X, W, DIMS, state=STATE, recipe=fp8.BlockScaling()), ValueError, "keeps no state"),
    ("fp8_dot_general out_sharding with row scaling", lambda: fp8.fp8_dot_general(
        X, W, DIMS, out_sharding=jax.sharding.PartitionSpec(), recipe=fp8.RowwiseScaling()),
     ValueError, "per-tensor recipes only"),
    ("GemmRecipes Int8Scaling class", lambda: fp8.GemmRecipes(forward=fp8.Int8Scaling),
     TypeError, "Pass an instance, e.g. Int8Scaling()"),
    ("Rule int8 recipe class", lambda: jaxmp.Rule(nn.Dense, fp8=fp8.Int8Scaling), TypeError,
     "Pass an instance, e.g. Int8Scaling()"),
    ("fp8_dot_general state with int8", lambda: fp8.fp8_dot_general(
        X, W, DIMS, state=STATE, recipe=fp8.Int8Scaling()), ValueError, "keeps no state"),
    ("fp8_dot_general int8 scales over an axis the kernel lacks", lambda: fp8.fp8_dot_general(
        X, W, (((1,), (2,)), ((), ())), recipe=fp8.Int8Scaling()), ValueError,
     "name axis 2 of rhs (the kernel), which has shape (3, 2)"),
    ("fp8_dot_general batch axis the input lacks", lambda: fp8.fp8_dot_general(
        X, W, (((1,), (0,)), ((-1,), (1,))), recipe=fp8.RowwiseScaling()), ValueError,
     "name axis -1 of lhs (the input)"),
    ("init_state not a recipe", lambda: fp8.init_state("delayed"), TypeError, "got 'delayed'"),
    ("fp8_dot_general integer operand", lambda: fp8.fp8_dot_general(
        X.astype(jnp.int32), W, DIMS, state=STATE, recipe=RECIPE), TypeError, "dtype int32"),
    ("fp8_dot_general state with current scaling", lambda: fp8.fp8_dot_general(
        X, W, DIMS, state=STATE, recipe=fp8.CurrentScaling()), ValueError, "CurrentScaling("),
    ("fp8_dot_general history length", lambda: fp8.fp8_dot_general(
        X, W, DIMS, state=STATE, recipe=fp8.DelayedScaling(8)), ValueError,
     "shape (4,), but the recipe has amax_history_length=8"),
    ("fp8_dot_general dimension numbers", lambda: fp8.fp8_dot_general(
        X, W, "ij,jk", state=STATE, recipe=RECIPE), ValueError, "'ij,jk'"),
    ("fp8_dot_general recipe string", lambda: fp8.fp8_dot_general(X, W, DIMS, recipe="delayed"),
     TypeError, "got 'delayed'"),
    ("fp8_dot_general integer output", lambda: fp8.fp8_dot_general(
        X, W, DIMS, state=STATE, recipe=RECIPE, preferred_element_type=jnp.int32), TypeError,
     "got int32"),
    ("fp8_dot_general bfloat16 state", lambda: fp8.fp8_dot_general(
        X, W, DIMS, state=jax.tree.map(lambda a: a.astype(jnp.bfloat16), STATE), recipe=RECIPE),
     TypeError, "input_scale of dtype bfloat16"),
    ("fp8_einsum out_sharding", lambda: fp8.fp8_einsum(
        "ij,jk->ik", X, W, recipe=fp8.CurrentScaling(), out_sharding=jax.sharding.PartitionSpec()),
     ValueError, "out_sharding, got P()"),
    ("linen Fp8Einsum out_sharding", lambda: jaxmp.linen.Fp8Einsum(recipe=fp8.CurrentScaling()).apply(
        {}, "ij,jk->ik", X, W, out_sharding=jax.sharding.PartitionSpec()), ValueError,
     "out_sharding, got P()"),
    ("fp8_einsum three operands", lambda: fp8.fp8_einsum(
        "ij,jk,kl->il", X, W, recipe=fp8.CurrentScaling()), ValueError, "'ij,jk,kl->il'"),
    ("merge vector flag", lambda: fp8.state.merge(STATE, STATE, jnp.array([True])), ValueError,
     "shape (1,)"),
    ("merge float flag", lambda: fp8.state.merge(STATE, STATE, 1.0), TypeError, "dtype float"),
    ("merge shapes", lambda: fp8.state.merge(STATE, STATE._replace(input_scale=jnp.ones(2)), True),
     ValueError, ".input_scale has shape (1,) in the state and (2,)"),
    ("for_grad bfloat16 state", lambda: fp8.state.for_grad(
        jax.tree.map(lambda a: a.astype(jnp.bfloat16), STATE)), TypeError, "dtype bfloat16"),
    # Training.
    ("TrainState tx string", lambda: jaxmp.linen.TrainState.create(
        apply_fn=lambda v, x: x, variables={"params": PARAMS}, tx="adam"), TypeError, "got 'adam'"),
    ("TrainState apply_fn None", lambda: jaxmp.linen.TrainState.create(
        apply_fn=None, variables={"params": PARAMS}, tx=optax.sgd(1.0)), TypeError, "got None"),
    ("TrainState variables list", lambda: jaxmp.linen.TrainState.create(
        apply_fn=lambda v, x: x, variables=[PARAMS], tx=optax.sgd(1.0)), TypeError,
     "got list: [{'w'"),
    ("apply_gradients plain dict", lambda: _sgd_state().apply_gradients({"params": PARAMS}),
     TypeError, "got dict"),
    ("train.value_and_grad loss_scale a number", lambda: jaxmp.linen.value_and_grad(
        lambda v: jnp.sum(v["params"]["w"]))({"params": PARAMS}, loss_scale=1024.0), TypeError,
     "got 1024.0 of type float; for a fixed scale pass jaxmp.StaticLossScale(1024.0)"),
    ("train.value_and_grad not callable", lambda: jaxmp.linen.value_and_grad("loss"), TypeError,
     "got 'loss'"),
    ("accumulate_gradients plain dicts",
     lambda: jaxmp.linen.accumulate_gradients({"a": 1}, {"a": 2}), TypeError,
     "a must be jaxmp Gradients (from jaxmp.linen.value_and_grad or jaxmp.nnx.value_and_grad), got dict: {'a': 1}"),
    # Nothing silently lost (issue 13).
    ("apply_gradients collections of another structure", lambda: _batch_stats_state(
        ).apply_gradients(_grads_of(_batch_stats_state()), collections={"batch_stats": {}}),
     ValueError, "missing ['batch_stats']['mean']"),
    ("linen.apply_gradients collections without state_before", lambda: jaxmp.linen.apply_gradients(
        optax.sgd(1.0), PARAMS, {}, optax.sgd(1.0).init(PARAMS), _grads_of(_sgd_state()),
        collections={"batch_stats": {}}), ValueError, "state_before=None"),
    ("linen.apply_gradients collections of another structure", lambda: jaxmp.linen.apply_gradients(
        optax.sgd(1.0), PARAMS, {}, optax.sgd(1.0).init(PARAMS),
        _grads_of(_sgd_state())._replace(state_before={"batch_stats": {"mean": jnp.ones(2)}}),
        collections={"batch_stats": {}}), ValueError, "missing ['batch_stats']['mean']"),
    ("TrainState.create with Flax's params=", lambda: jaxmp.linen.TrainState.create(
        apply_fn=lambda v, x: x, params=PARAMS, tx=optax.sgd(1.0)), TypeError, "params="),
    ("TrainState.create variables without params", lambda: jaxmp.linen.TrainState.create(
        apply_fn=lambda v, x: x, variables=PARAMS, tx=optax.sgd(1.0)), ValueError, "['w']"),
    ("MultiSteps outside loss_scaling", lambda: jaxmp.get_loss_scale(_wrong_nesting_state()),
     ValueError, "jaxmp.loss_scaling(optax.MultiSteps(opt, k))"),
    ("TrainState.create with a MultiSteps object", lambda: jaxmp.linen.TrainState.create(
        apply_fn=lambda v, x: x, variables={"params": PARAMS},
        tx=optax.MultiSteps(optax.sgd(1.0), 2)), TypeError, "pass tx.gradient_transformation()"),
    ("clip chained before loss_scaling", lambda: jaxmp.get_loss_scale(optax.chain(
        optax.clip_by_global_norm(1.0), jaxmp.loss_scaling(optax.sgd(1.0))).init(PARAMS)),
     ValueError, "jaxmp.loss_scaling(optax.chain(..., opt))"),
    ("apply_if_finite around loss_scaling", lambda: jaxmp.loss_scaling_metrics(
        optax.apply_if_finite(jaxmp.loss_scaling(optax.sgd(1.0)), 3).init(PARAMS)),
     ValueError, "the scale never backs off"),
    ("loss_scaling max_consecutive_skips 0", lambda: jaxmp.loss_scaling(
        optax.sgd(1.0), max_consecutive_skips=0), ValueError, "max_consecutive_skips"),
    ("loss_scaling max_consecutive_skips string", lambda: jaxmp.loss_scaling(
        optax.sgd(1.0), max_consecutive_skips="3"), TypeError, "got '3'"),
    ("DelayedScaling margin overflowing float32", lambda: fp8.DelayedScaling(margin=200),
     ValueError, "got 200"),
    ("CurrentScaling margin overflowing float32", lambda: fp8.CurrentScaling(margin=57),
     ValueError, "[0, 56]"),
    ("linen fp8 params differentiated without the state", _linen_fp8_grad_of_params_alone,
     ValueError, "jaxmp.linen.value_and_grad"),
    ("nnx fp8 model under a plain nnx.grad", _nnx_fp8_plain_grad, ValueError,
     "jaxmp.nnx.value_and_grad"),
    # Correctness on published models (issue 24).
    ("linen fp8 state in a hand-written lax.scan given the params alone",
     _linen_fp8_in_hand_written_scan_without_state, ValueError, "the layer at 'gate'"),
    ("linen fp8 apply with the params alone", _linen_fp8_apply_params_alone, ValueError,
     "the layer at '<root>'"),
    ("Monitor.update misspelt metric", lambda: jaxmp.tools.Monitor().update({"loss_scael": 1.0}),
     ValueError, "'loss_scael'"),
    ("Monitor max_consecutive_skips 0", lambda: jaxmp.tools.Monitor(max_consecutive_skips=0),
     ValueError, "got 0"),
    # Memory (jaxmp.optim, jaxmp.tools.memory_report).
    ("master_weights over float32 params", lambda: jaxmp.optim.master_weights(
        optax.adam(1e-3)).init(PARAMS), ValueError, "the params have dtypes ['float32']"),
    ("master_weights remainders of float16", lambda: jaxmp.optim.master_weights(
        optax.adam(1e-3), remainders=True).init({"w": jnp.ones(2, jnp.float16)}), ValueError,
     "param w has dtype float16; accepted: bfloat16"),
    ("master_weights uncalled optimizer", lambda: jaxmp.optim.master_weights(optax.adam),
     TypeError, "did you mean to call adam"),
    ("master_weights remainders 1", lambda: jaxmp.optim.master_weights(
        optax.adam(1e-3), remainders=1), TypeError, "got 1 of type int"),
    ("master_weights update without params", lambda: jaxmp.optim.master_weights(
        optax.sgd(1.0)).update(BF16_PARAMS, jaxmp.optim.master_weights(optax.sgd(1.0)).init(
            BF16_PARAMS)), ValueError, "params=None"),
    ("master_params without master_weights", lambda: jaxmp.optim.master_params(
        {"a": 1}, BF16_PARAMS), ValueError, "found 0"),
    ("master_params of other params", lambda: jaxmp.optim.master_params(
        jaxmp.optim.master_weights(optax.sgd(1.0)).init(BF16_PARAMS), {"v": jnp.ones(2)}),
     ValueError, "the params have ['v'] where the master weights have ['w']"),
    ("master_params of params of another shape", lambda: jaxmp.optim.master_params(
        jaxmp.optim.master_weights(optax.sgd(1.0)).init(BF16_PARAMS),
        {"w": jnp.ones(3, jnp.bfloat16)}), ValueError,
     "param ['w'] has shape (3,) where its master has shape (2,)"),
    ("master_params of remainders, given float32 params", lambda: jaxmp.optim.master_params(
        jaxmp.optim.master_weights(optax.sgd(1.0), remainders=True).init(BF16_PARAMS), PARAMS),
     TypeError, "param ['w'] has dtype float32; with remainders=True"),
    ("master_weights inside master_weights", lambda: jaxmp.optim.master_weights(
        jaxmp.optim.master_weights(optax.sgd(1.0))).init(BF16_PARAMS), ValueError,
     "master_weights is nested inside master_weights"),
    ("stochastic_rounding inside master_weights", lambda: jaxmp.optim.master_weights(
        jaxmp.optim.stochastic_rounding(optax.sgd(1.0), jax.random.key(0))).init(BF16_PARAMS),
     ValueError, "stochastic_rounding is nested inside master_weights"),
    ("kahan_summation inside master_weights, deeper in a chain", lambda: jaxmp.optim.master_weights(
        optax.chain(optax.clip(1.0), jaxmp.optim.kahan_summation(optax.sgd(1.0)))).init(
            BF16_PARAMS), ValueError, "kahan_summation is nested inside master_weights"),
    ("state_dtypes choice of one argument", lambda: jaxmp.optim.state_dtypes(
        optax.adam(1e-3), lambda path: "bfloat16"), TypeError, "dtype(path, leaf)"),
    ("state_dtypes int8", lambda: jaxmp.optim.state_dtypes(optax.adam(1e-3), "int8"),
     ValueError, "storage dtype 'int8' is not accepted"),
    ("state_dtypes int32 dtype", lambda: jaxmp.optim.state_dtypes(optax.adam(1e-3), jnp.int32),
     ValueError, "'int32'"),
    ("state_dtypes fp8", lambda: jaxmp.optim.state_dtypes(optax.adam(1e-3), "float8_e4m3fn"),
     ValueError, "'float8_e4m3fn'"),
    ("state_dtypes None", lambda: jaxmp.optim.state_dtypes(optax.adam(1e-3), None), TypeError,
     "got None"),
    ("state_dtypes choice returns uint8", lambda: jaxmp.optim.state_dtypes(
        optax.adam(1e-3), lambda path, leaf: jnp.uint8).init(PARAMS), ValueError,
     "state leaf '0/mu/w': storage dtype 'uint8'"),
    ("state_dtypes float16 for Adam's nu", lambda: jaxmp.optim.state_dtypes(
        optax.adam(1e-3), "float16").init(PARAMS), ValueError,
     "'0/nu/w' (ScaleByAdamState.nu) holds squared gradients"),
    ("stochastic_round without a key", lambda: jaxmp.optim.stochastic_round(X, None), TypeError,
     "got None"),
    ("stochastic_round integer key", lambda: jaxmp.optim.stochastic_round(X, 0), TypeError,
     "got 0 of type int"),
    ("stochastic_round two keys", lambda: jaxmp.optim.stochastic_round(
        X, jax.random.split(jax.random.key(0))), ValueError, "shape (2,)"),
    ("stochastic_round float16 input", lambda: jaxmp.optim.stochastic_round(
        X.astype(jnp.float16), jax.random.key(0)), TypeError, "dtype float16"),
    ("stochastic_round to float16", lambda: jaxmp.optim.stochastic_round(
        X, jax.random.key(0), jnp.float16), ValueError, "got float16"),
    ("stochastic_rounding without a key", lambda: jaxmp.optim.stochastic_rounding(
        optax.sgd(1.0), None), TypeError, "got None"),
    ("stochastic_rounding float16 params", lambda: jaxmp.optim.stochastic_rounding(
        optax.sgd(1.0), jax.random.key(0)).init({"w": jnp.ones(2, jnp.float16)}), ValueError,
     "param w has dtype float16"),
    ("stochastic_rounding chained, given only a key", lambda: optax.chain(
        jaxmp.optim.stochastic_rounding(jax.random.key(0)), optax.sgd(1.0)), TypeError,
     "stochastic_rounding(inner, key)"),
    ("stochastic_rounding uncalled optimizer", lambda: jaxmp.optim.stochastic_rounding(
        optax.sgd, jax.random.key(0)), TypeError, "did you mean to call sgd"),
    ("kahan_summation over float32 params", lambda: jaxmp.optim.kahan_summation(
        optax.sgd(1.0)).init(PARAMS), ValueError, "the params have dtypes ['float32']"),
    ("kahan_summation chained, without its optimizer", lambda: optax.chain(
        jaxmp.optim.kahan_summation(), optax.sgd(1.0)), TypeError,
     r"inner, the optimizer, is missing; kahan_summation wraps the optimizer"),
    ("kahan_summation update without params", lambda: jaxmp.optim.kahan_summation(
        optax.sgd(1.0)).update(BF16_PARAMS, jaxmp.optim.kahan_summation(optax.sgd(1.0)).init(
            BF16_PARAMS)), ValueError, "params=None"),
    ("kahan_add float32 param", lambda: jaxmp.optim.kahan_add(X, X, X), TypeError,
     "dtype float32"),
    ("kahan_add update of another shape", lambda: jaxmp.optim.kahan_add(
        jnp.ones(3, jnp.bfloat16), jnp.ones(4), jnp.zeros(3, jnp.bfloat16)), ValueError,
     "update has shape (4,), the param (3,)"),
    ("kahan_add update a Python float", lambda: jaxmp.optim.kahan_add(
        jnp.ones((), jnp.bfloat16), 1e-4, jnp.zeros((), jnp.bfloat16)), TypeError,
     "update must be a floating-point array"),
    ("split_remainder of bfloat16", lambda: jaxmp.optim.split_remainder(
        BF16_PARAMS["w"]), TypeError, "dtype bfloat16"),
    ("join_remainder shapes", lambda: jaxmp.optim.join_remainder(
        BF16_PARAMS["w"], jnp.zeros(3, jnp.int16)), ValueError, "shape (3,)"),
    ("memory_report jitted function", lambda: jaxmp.tools.memory_report(
        PARAMS, compiled=jax.jit(lambda x: x)), TypeError, "got PjitFunction"),
    # Non-finite tracing.
    ("PolicyRules trace_nonfinite not a bool",
     lambda: jaxmp.PolicyRules("float32", trace_nonfinite="yes"), TypeError, "got 'yes'"),
    ("traced linen apply without the probe", _traced_linen_apply_without_probe, ValueError,
     "'jaxmp_nonfinite'"),
    ("traced linen apply of a call the probe lacks", _traced_linen_call_the_probe_lacks,
     ValueError, "<root>.attend"),
    ("nonfinite_probe of a wrapper that does not trace", lambda: jaxmp.linen.mixed_precision(
        nn.Dense(2), "float32").nonfinite_probe({}, X), ValueError, "trace_nonfinite=True"),
    ("NonfiniteTrace calls not pairs", lambda: jaxmp.tools.NonfiniteTrace(
        ["dense"], jnp.zeros((1, 10))), TypeError, "'dense'"),
    ("NonfiniteTrace repeated calls", lambda: jaxmp.tools.NonfiniteTrace(
        PROBE_CALLS[:1] * 2, jnp.zeros((2, 10))), ValueError, "('', '__call__')"),
    ("NonfiniteTrace values of the wrong shape", lambda: jaxmp.tools.NonfiniteTrace(
        PROBE_CALLS, jnp.zeros((2, 8))), ValueError, "got (2, 8)"),
    ("NonfiniteTrace float16 values", lambda: jaxmp.tools.NonfiniteTrace(
        PROBE_CALLS, jnp.zeros((2, 10), jnp.float16)), TypeError, "float16"),
    ("training_metrics nonfinite_trace not a trace", lambda: jaxmp.tools.training_metrics(
        PARAMS, nonfinite_trace={"w": 1}), TypeError, "got dict"),
    ("Monitor.update nonfinite_trace not a trace", lambda: jaxmp.tools.Monitor().update(
        {"nonfinite_trace": "inf"}), TypeError, "got str"),
    ("nonfinite_report not a trace", lambda: jaxmp.tools.nonfinite_report(PARAMS), TypeError,
     "got dict"),
    ("nonfinite_report negative loss scale", lambda: jaxmp.tools.nonfinite_report(
        _probe(), loss_scale=-1.0), ValueError, "-1.0"),
    ("NonfiniteReport.largest unknown value",
     lambda: jaxmp.tools.nonfinite_report(_recorded_trace()).largest("bogus"), ValueError,
     "'bogus'"),
    ("nonfinite_report of the zero probe", lambda: jaxmp.tools.nonfinite_report(_probe()),
     ValueError, "recorded no module call: it is the zero probe"),
    ("nonfinite_report inside jit", lambda: jax.jit(
        lambda t: jaxmp.tools.nonfinite_report(t).loss_scale)(_recorded_trace()), TypeError,
     "nonfinite_report reads the trace on the host"),
    ("Monitor.update negative loss scale", lambda: jaxmp.tools.Monitor().update(
        {"loss_scale": -1.0}), ValueError, "must be positive and finite, got -1.0"),
    ("Monitor.update last_step_finite string", lambda: jaxmp.tools.Monitor().update(
        {"last_step_finite": "yes"}), TypeError, "got 'yes'"),
    ("Monitor.update inside jit", lambda: jax.jit(
        lambda loss: jaxmp.tools.Monitor().update({}, loss) and loss)(1.0), TypeError,
     "Monitor.update reads the metrics and loss on the host"),
    ("suggest_scale negative magnitude", lambda: jaxmp.tools.suggest_scale(-1.0, 1e-3, "f16"),
     ValueError, "got -1.0"),
    ("suggest_scale NaN magnitude", lambda: jaxmp.tools.suggest_scale(float("nan"), 1e-3, "f16"),
     ValueError, "got nan"),
    ("suggest_scale min above max", lambda: jaxmp.tools.suggest_scale(1e-3, 1.0, "f16"),
     ValueError, "min_abs (1.0) is larger than max_abs (0.001)"),
    ("relative_error of other trees", lambda: jaxmp.tools.relative_error(
        {"a": jnp.ones(2)}, {"b": jnp.ones(2)}), ValueError, "'a' in the reference and 'b'"),
    ("relative_error of other shapes", lambda: jaxmp.tools.relative_error(
        jnp.ones(3), jnp.ones(4)), ValueError, "shape (3,) in the reference and (4,)"),
    ("summary of a wrapper with other rules", lambda: jaxmp.tools.summary(
        jaxmp.linen.mixed_precision(nn.Dense(2), "float32"), "bf16", X), ValueError,
     "the wrapper runs its own rules"),
    ("device_capabilities of a name", lambda: jaxmp.tools.device_capabilities("tpu"),
     TypeError, "types.SimpleNamespace(platform='tpu', device_kind='TPU v5 lite')"),
    ("accumulate_gradients traces of different models", _traces_of_two_models, ValueError,
     "2 and 1 call sites"),
    ("nnx value_and_grad with two tracing wrappers", _two_traced_nnx_wrappers, ValueError,
     "2 tracing wrappers"),
    # Adaptive precision (issue 25).
    ("PrecisionController of a model that does not trace", lambda: _controller(
        jaxmp.linen.mixed_precision(nn.Dense(2), "float16")), ValueError,
     "PolicyRules(..., trace_nonfinite=True)"),
    ("PrecisionController of a bare linen Module", lambda: _controller(nn.Dense(2)), TypeError,
     "got Dense"),
    ("PrecisionController monitor not a Monitor", lambda: jaxmp.tools.PrecisionController(
        jaxmp.linen.mixed_precision(nn.Dense(2), TRACE_RULES), None), TypeError, "got None"),
    ("PrecisionController window 0", lambda: _controller(window=0), ValueError,
     "window must be an integer >= 1, got 0"),
    ("PrecisionController culprit_steps above window", lambda: _controller(
        window=4, culprit_steps=5), ValueError,
     "culprit_steps must be an integer in [1, 4], got 5"),
    ("PrecisionController max_changes float", lambda: _controller(max_changes=2.0), TypeError,
     "got 2.0 of type float"),
    ("PrecisionController auto_apply string", lambda: _controller(auto_apply="yes"), TypeError,
     "got 'yes'"),
    ("PrecisionController.update before Monitor.update", lambda: _controller_update(None),
     ValueError, "call monitor.update(metrics, loss)"),
    ("PrecisionController.update of metrics without a trace", lambda: _controller_update(
        {"last_step_finite": False}), ValueError, "nonfinite_trace=grads.nonfinite"),
    ("propose_change rule that would match no module", lambda: _propose("decoder/attention"),
     ValueError, "'decoder/attention', which is not a module of the model"),
    ("propose_change culprit_steps 0", lambda: _propose(culprit_steps=0), ValueError, "got 0"),
    ("propose_change one StepRecord", lambda: jaxmp.tools.propose_change(
        TRACE_RULES, _step_record(), {"": nn.Dense}, culprit_steps=1, bfloat16=False),
     TypeError, "got one StepRecord (step 0); pass [record]"),
    ("propose_change class names as modules", lambda: _propose(modules={"": "Dense"}),
     TypeError, "'' maps to 'Dense' of type str"),
    ("Origin misspelt value", lambda: jaxmp.tools.Origin("dense", "__call__", "forward",
                                                         "outptu", 1.0), ValueError, "'outptu'"),
    ("StepRecord skipped as a string", lambda: _step_record(skipped="no"), TypeError,
     "skipped must be True, False or None, got 'no'"),
    ("StepRecord misspelt anomaly kind", lambda: _step_record(active={"scale_colapse"}),
     ValueError, "unknown anomaly kind 'scale_colapse'"),
    ("PrecisionChange unknown kind", lambda: jaxmp.tools.PrecisionChange(
        0, "bogus", None, "r", TRACE_RULES, TRACE_RULES, ()), ValueError, "got 'bogus'"),
    ("PrecisionController device name", lambda: _controller(device="h100"), TypeError,
     "a description of one"),
    ("propose_change bfloat16 string", lambda: _propose(bfloat16="yes"), TypeError, "got 'yes'"),
    ("linen with_rules of a policy string", lambda: jaxmp.linen.mixed_precision(
        nn.Dense(2), "float32").with_rules("bfloat16"), TypeError, "got 'bfloat16'"),
    ("TrainState.with_rules of a plain apply_fn", lambda: _sgd_state().with_rules(TRACE_RULES),
     TypeError, "apply_fn must be the apply of a jaxmp.linen wrapper"),
    ("nnx with_rules re-storing params", _nnx_with_rules_restoring_params, ValueError,
     "stored in float32, but the new rules store it in bfloat16"),
    # The Flax adapters: errors that named neither the cause nor the fix (issue 47).
    ("linen with_rules re-storing params", _linen_with_rules_restoring_params, ValueError,
     "'bias' is stored in float32, but the new rules store it in bfloat16"),
    ("linen probe given to a wrapper that does not trace",
     _linen_probe_given_to_a_wrapper_that_does_not_trace, ValueError,
     "Drop it ({k: v for k, v in variables.items() if k != 'jaxmp_nonfinite'}"),
    ("linen value_and_grad of an integer param", lambda: jaxmp.linen.value_and_grad(
        lambda v: jnp.sum(_counter_state().apply_fn(v, X)))(_counter_state().variables),
     TypeError, "'calls' (int32)"),
    ("TrainState step with an integer param", _counter_train_step, TypeError,
     "self.variable('state', name, ...) instead of self.param"),
    ("nnx value_and_grad of an integer param", _nnx_value_and_grad_of_an_integer_param,
     TypeError, "'model/calls' (Param, int32)"),
    ("nnx optimizer wrt=nnx.Variable with fp8 state", _nnx_optimizer_of_every_variable,
     ValueError, "nnx.Optimizer(model, tx, wrt=nnx.Param)"),
    ("fp8 state stepped with gradients of another state",
     _fp8_state_stepped_with_gradients_of_another_state, ValueError,
     "has 0 leaves, the state 6: the gradients lack ['Fp8DotGeneral_0']['input_amax_history']"),
]


def test_the_catalogue_is_large_and_its_ids_unique():
  ids = [case[0] for case in CASES]
  assert len(ids) == len(set(ids)) and len(ids) >= 25


@pytest.mark.parametrize("call, error, names", [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_bad_input_is_refused_with_a_message_naming_it(call, error, names):
  with pytest.raises((ValueError, TypeError)) as info:
    call()
  assert type(info.value) is error or isinstance(info.value, error), (
      f"raised {type(info.value).__name__}, expected {error.__name__}: {info.value}")
  assert names in str(info.value), f"message does not name {names!r}: {info.value}"


def test_bad_input_inside_jit_is_refused_at_trace_time():
  # Checks run on the static structure, so they also fire inside jit.
  with pytest.raises(ValueError, match=re.escape("shape (2,)")):
    jax.jit(lambda f: jaxmp.DynamicLossScale().adjust(f))(jnp.array([True, False]))
  with pytest.raises(TypeError, match="dtype int32"):
    jax.jit(lambda p: jaxmp.select_tree(p, PARAMS, PARAMS))(jnp.int32(1))


# Every flag (an argument that is True or False) takes a Python or a NumPy bool, holds
# it as a Python bool, and refuses anything else with one message (checks.flag).
MHA = nn.MultiHeadDotProductAttention
FLAGS = {
    "Rule causal_attention": lambda b: jaxmp.Rule(MHA, causal_attention=b).causal_attention,
    "Rule padded_attention": lambda b: jaxmp.Rule(MHA, padded_attention=b).padded_attention,
    "PolicyRules fused_attention":
        lambda b: jaxmp.PolicyRules("float32", fused_attention=b).fused_attention,
    "PolicyRules float32_normalization":
        lambda b: jaxmp.PolicyRules("float32", float32_normalization=b).float32_normalization,
    "PolicyRules trace_nonfinite":
        lambda b: jaxmp.PolicyRules("float32", trace_nonfinite=b).trace_nonfinite,
    **{f"{recipe.__name__} power_of_two": (lambda b, r=recipe: r(power_of_two=b).power_of_two)
       for recipe in (fp8.DelayedScaling, fp8.CurrentScaling, fp8.RowwiseScaling,
                      fp8.BlockScaling)},
}


@pytest.mark.parametrize("read", FLAGS.values(), ids=list(FLAGS))
def test_numpy_bools_are_flags_wherever_a_bool_is(read):
  for value in (True, False):
    held = read(np.bool_(value))
    assert held is value, held
  with pytest.raises(TypeError, match=r"must be True or False, got 1 of type int\."):
    read(1)
  with pytest.raises(TypeError, match=r"must be True or False, got np.int64\(0\) of type int64"):
    read(np.int64(0))


def test_master_weights_remainders_takes_a_numpy_bool():
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  made = lambda b: jaxmp.optim.master_weights(optax.sgd(1.0), remainders=b).init(params)
  assert jax.tree.map(lambda x: x.dtype, made(np.bool_(True))) == jax.tree.map(
      lambda x: x.dtype, made(True))
  with pytest.raises(TypeError, match=r"remainders must be True or False, got 1 of type int"):
    made(1)
