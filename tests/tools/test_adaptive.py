"""jaxmp.tools.propose_change and PrecisionController: overflow evidence in, rules out.

The decision is a pure function of the rules, the recent steps' records
(:class:`jaxmp.tools.StepRecord`, what :class:`jaxmp.tools.Monitor` keeps) and the
model's module classes, so most of it is tested here on made-up steps, with exact
rules and reasons. The controller around it is tested on small linen and NNX models;
Flax's published models, sharding and the example are in
``tests/test_adaptive_precision.py``.
"""

import logging
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
from tests import nonfinite_models

FP16 = "params=float32,compute=float16,output=float32"
INF = float("inf")
MODULES = {"": nn.Module, "block": nn.Module, "block/attention": nn.MultiHeadDotProductAttention,
           "block/mlp": nn.Module, "block/mlp/up": nn.Dense, "block/norm": nn.LayerNorm}
ATTENTION = jaxmp.tools.Origin("block/attention", "__call__", "forward", "output", INF)
UP = jaxmp.tools.Origin("block/mlp/up", "__call__", "backward", "input_grad", INF)
MLP = jaxmp.tools.Origin("block/mlp", "__call__", "backward", "param_grad", INF)
INPUT = jaxmp.tools.Origin("", "__call__", "forward", "input", INF)
LOSS = jaxmp.tools.Origin("", "__call__", "backward", "output_grad", INF)


def _steps(*origins, skipped=True, active=(), first=0):
  """A StepRecord per origin (None: a step whose trace recorded nothing non-finite)."""
  return tuple(jaxmp.tools.StepRecord(first + i, 2.0, skipped if o is not None else False,
                                      2.0**(10 - i), o, True, frozenset(active))
               for i, o in enumerate(origins))


def _propose(rules, steps, culprit_steps=2, bfloat16=False, modules=MODULES):
  return jaxmp.tools.propose_change(jaxmp.PolicyRules(rules) if isinstance(rules, str) else rules,
                                    steps, modules, culprit_steps=culprit_steps,
                                    bfloat16=bfloat16)


def _policy(rules, path):
  return str(rules.resolve(path, MODULES[path]).policy)


# ---- a module that keeps making the first non-finite value -------------------------------------


def test_a_module_first_in_k_of_the_steps_is_kept_in_float32():
  steps = _steps(ATTENTION, None, ATTENTION, UP)
  change = _propose(FP16, steps)
  assert change.kind == "module_float32" and change.module == "block/attention"
  assert change.step == 3 and change.evidence == steps and not change.applied
  assert change.previous == jaxmp.PolicyRules(FP16)
  assert change.reason == (
      "forward output of block/attention was the first non-finite value in 2 of the last 4 "
      "steps (0, 2): block/attention computes in float32 (was float16)")
  assert str(change) == ("step 3: proposed block/attention in float32: " + change.reason)
  # One rule, for that path only, first: its params keep their dtype, its output stays local.
  (rule,) = change.rules.rules
  assert rule == jaxmp.Rule("block/attention", "params=float32,compute=float32")
  assert rule.output_dtype is None and rule.fp8 is None
  assert _policy(change.rules, "block/attention") == "params=float32,compute=float32,output=float32"
  assert _policy(change.rules, "block/mlp/up") == FP16
  assert change.rules.trace_nonfinite == change.previous.trace_nonfinite


def test_fewer_than_k_or_no_overflow_changes_nothing():
  assert _propose(FP16, _steps(ATTENTION, UP, MLP, None)) is None
  assert _propose(FP16, _steps(None, None, None)) is None
  assert _propose(FP16, ()) is None
  # k = 1: the first overflow is enough.
  assert _propose(FP16, _steps(None, UP), culprit_steps=1).module == "block/mlp/up"


def test_the_module_named_most_often_wins_and_then_the_one_named_first():
  assert _propose(FP16, _steps(UP, ATTENTION, ATTENTION, UP, ATTENTION)).module == "block/attention"
  assert _propose(FP16, _steps(UP, ATTENTION, ATTENTION, UP)).module == "block/mlp/up"


def test_the_new_rule_keeps_what_the_old_rules_gave_the_module_but_its_fp8_recipe():
  recipe = jaxmp.fp8.DelayedScaling(amax_history_length=4)
  rules = jaxmp.PolicyRules(FP16, [
      jaxmp.Rule(nn.Dense, "params=bfloat16,compute=float16", fp8=recipe,
                 output_dtype="float32", float32_ops=())])
  change = _propose(rules, _steps(UP, UP))
  assert change.reason.endswith("block/mlp/up computes in float32 (was float16), without its "
                                "fp8 recipe DelayedScaling")
  precision = change.rules.resolve("block/mlp/up", nn.Dense)
  assert str(precision.policy) == "params=bfloat16,compute=float32,output=float32"
  assert precision.fp8 is None and precision.output_dtype == np.float32
  assert precision.float32_ops == frozenset()
  assert change.rules.rules[1:] == rules.rules  # the other Dense layers keep fp8
  # A float32 module with an fp8 recipe: the recipe goes, nothing else changes.
  f32 = jaxmp.PolicyRules("float32", [jaxmp.Rule(nn.Dense, fp8=recipe)])
  change = _propose(f32, _steps(UP, UP))
  assert change.module == "block/mlp/up" and change.reason.endswith(
      "block/mlp/up computes without its fp8 recipe DelayedScaling (in float32 already)")
  assert change.rules.resolve("block/mlp/up", nn.Dense).fp8 is None


def test_a_module_already_in_float32_moves_its_caller_to_float32():
  # It overflows where its float32 result is handed back to a float16 caller (or its
  # float32 input gradient to the caller's float16): the caller is widened instead.
  rules = jaxmp.PolicyRules(FP16, [jaxmp.Rule("block/mlp/up", "params=float32,compute=float32")])
  change = _propose(rules, _steps(UP, UP))
  assert change.module == "block/mlp" and change.reason == (
      "backward input gradient of block/mlp/up was the first non-finite value in 2 of the "
      "last 2 steps (0, 1), and block/mlp/up computes in float32: its caller block/mlp "
      "computes in float32 (was float16)")
  assert _policy(change.rules, "block/mlp") == "params=float32,compute=float32,output=float32"
  # A normalization layer computes in float32 by default; paths that are not modules
  # (an NNX container's) are skipped on the way up.
  norm = jaxmp.tools.Origin("block/norm", "__call__", "forward", "output", INF)
  assert _propose(FP16, _steps(norm, norm)).module == "block"
  nnx_modules = {"": nnx.Module, "layers/0": nnx.LayerNorm}
  norm = jaxmp.tools.Origin("layers/0", "__call__", "forward", "output", INF)
  assert _propose(FP16, _steps(norm, norm), modules=nnx_modules).module == ""


def test_a_module_in_float32_inside_float32_callers_is_a_bug_not_precision():
  rules = jaxmp.PolicyRules("float32")
  with pytest.raises(jaxmp.tools.DivergenceError) as info:
    _propose(rules, _steps(ATTENTION, ATTENTION))
  assert str(info.value) == (
      "forward output of block/attention was the first non-finite value in 2 of the last 2 "
      "steps (0, 1), with block/attention and every module around it computing in float32: "
      "a bug in the model or the data, not precision.")
  assert info.value.evidence == _steps(ATTENTION, ATTENTION)
  assert isinstance(info.value, FloatingPointError)


def test_non_finite_model_inputs_are_a_bug_in_the_data():
  with pytest.raises(jaxmp.tools.DivergenceError, match=(
      r"the model's inputs held inf or NaN in 2 of the last 3 steps \(0, 2\): a bug in the "
      r"data or in the code before the model; no precision change can fix it\.")):
    _propose(FP16, _steps(INPUT, UP, INPUT))


def test_a_culprit_that_is_not_a_module_of_the_model_is_refused():
  stranger = jaxmp.tools.Origin("decoder/elsewhere", "__call__", "forward", "output", INF)
  with pytest.raises(ValueError, match="'decoder/elsewhere', which is not a module of the model"):
    _propose(FP16, _steps(stranger, stranger))


# ---- no single culprit: the whole model -------------------------------------------------------

COLLAPSED = ("scale_collapse",)


def test_a_collapsing_float16_run_with_no_culprit_moves_to_bfloat16_where_the_device_has_it():
  steps = _steps(ATTENTION, UP, MLP, LOSS, None, active=COLLAPSED)
  rules = jaxmp.PolicyRules(FP16, [jaxmp.Rule("block/mlp", "float16"),
                                   jaxmp.Rule(nn.Dense, output_dtype="float16")])
  change = _propose(rules, steps, culprit_steps=2, bfloat16=True)
  assert change.kind == "bfloat16" and change.module is None
  assert change.reason == (
      "4 of the last 5 steps were skipped with no module first to overflow in 2 of them "
      "(forward output of block/attention: 1, backward input gradient of block/mlp/up: 1, "
      "backward parameter gradient of block/mlp: 1, backward output gradient of <root>: 1) "
      "and the loss scale collapsed: float16 computes in bfloat16, which the device has")
  assert str(change).startswith("step 4: proposed the model in bfloat16: ")
  assert str(change.rules.default) == "params=float32,compute=bfloat16,output=float32"
  # Params keep their dtype (a float16 param is not re-stored); outputs follow compute.
  assert str(change.rules.rules[0].policy) == "params=float16,compute=bfloat16,output=bfloat16"
  assert change.rules.rules[1].output_dtype == jnp.bfloat16
  # Without bfloat16 on the device, everything computes in float32 and fp8 goes.
  recipe = jaxmp.fp8.CurrentScaling()
  with_fp8 = jaxmp.PolicyRules(FP16, [jaxmp.Rule(nn.Dense, fp8=recipe)])
  change = _propose(with_fp8, steps, bfloat16=False)
  assert change.kind == "float32" and change.reason.endswith(
      "and the loss scale collapsed: every module computes in float32 without fp8 (the "
      "device has no bfloat16)")
  assert str(change.rules.default) == "params=float32,compute=float32,output=float32"
  assert change.rules.rules == (jaxmp.Rule(nn.Dense),)


def test_a_bfloat16_run_that_keeps_skipping_moves_to_float32_and_then_fails():
  steps = _steps(UP, LOSS, None, active=("skip_streak",))
  change = _propose("params=float32,compute=bfloat16,output=float32", steps, bfloat16=True)
  assert change.kind == "float32" and change.reason.endswith(
      "and a streak of skipped steps: every module computes in float32 without fp8")
  with pytest.raises(jaxmp.tools.DivergenceError, match=(
      r"2 of the last 3 steps were skipped with every module computing in float32 without "
      r"fp8 and a streak of skipped steps: a bug in the model or the data, not precision\.")):
    _propose("float32", steps, bfloat16=True)


def test_skips_without_a_collapse_or_a_collapse_without_k_skips_change_nothing():
  # A dynamic scale backing off at the start of a run skips steps: it is not collapsing.
  assert _propose(FP16, _steps(UP, LOSS, MLP)) is None
  # A scale still collapsed after a change, with fresh steps finite: no new evidence.
  assert _propose(FP16, _steps(None, None, UP, active=COLLAPSED)) is None


@pytest.mark.parametrize("kwargs, error, text", [
    ({"culprit_steps": 0}, ValueError, "culprit_steps must be an integer >= 1, got 0"),
    ({"culprit_steps": 2.0}, TypeError, "got 2.0 of type float"),
    ({"bfloat16": "yes"}, TypeError, "bfloat16 must be True or False, got 'yes'"),
    ({"rules": "float32"}, TypeError, "rules must be jaxmp.PolicyRules, got 'float32'"),
    ({"evidence": [1]}, TypeError, "evidence must be jaxmp.tools.StepRecord"),
    ({"modules": ["block"]}, TypeError, "modules must be a mapping"),
    # Evidence it could not read right: each was once read as something else.
    ({"evidence": _steps(UP, UP)[0]}, TypeError,
     "evidence must be a sequence of jaxmp.tools.StepRecord, got one StepRecord (step 0); "
     "pass [record]"),
    ({"evidence": _steps(UP, UP, UP)[::-1]}, ValueError,
     "evidence must be the records of distinct steps, oldest first (as Monitor.latest gives "
     "them, one per step), got steps 2, 1, 0"),
    ({"evidence": _steps(UP)[:1] * 3}, ValueError, "got steps 0, 0, 0"),
    ({"modules": {"": "Module", "block/mlp/up": "Dense"}}, TypeError,
     "modules must map module paths (str) to classes (the wrapper's module_types()); '' maps "
     "to 'Module' of type str"),
])
def test_propose_change_bad_inputs(kwargs, error, text):
  args = {"rules": jaxmp.PolicyRules(FP16), "evidence": _steps(UP, UP), "modules": MODULES,
          "culprit_steps": 2, "bfloat16": False, **kwargs}
  with pytest.raises(error, match=re.escape(text)):
    jaxmp.tools.propose_change(args.pop("rules"), args.pop("evidence"), args.pop("modules"),
                               **args)


@pytest.mark.parametrize("fields, error, text", [
    ({"kind": "bogus"}, ValueError,
     "kind must be 'module_float32', 'bfloat16' or 'float32', got 'bogus'"),
    ({"module": None}, ValueError,
     "module must be the path (a string) of the module a 'module_float32' change keeps in "
     "float32, got None"),
    ({"kind": "bfloat16"}, ValueError,
     "module must be None for a 'bfloat16' change (the whole model), got 'block/mlp/up'"),
    ({"rules": "float32"}, TypeError, "rules must be jaxmp.PolicyRules, got 'float32'"),
    ({"previous": None}, TypeError, "previous must be jaxmp.PolicyRules, got None"),
    ({"reason": 3}, TypeError, "reason must be a string, got 3"),
    ({"step": 1}, ValueError, "step must be the step of the last record of evidence (0), got 1"),
    ({"evidence": [UP]}, TypeError, "evidence must be jaxmp.tools.StepRecord objects"),
    ({"applied": "yes"}, TypeError, "applied must be True or False, got 'yes'"),
])
def test_a_precision_change_is_checked_when_built(fields, error, text):
  good = dict(step=0, kind="module_float32", module="block/mlp/up", reason="r",
              previous=jaxmp.PolicyRules(FP16), rules=jaxmp.PolicyRules("float32"),
              evidence=_steps(UP), applied=False)
  with pytest.raises(error, match=re.escape(f"PrecisionChange: {text}")):
    jaxmp.tools.PrecisionChange(**{**good, **fields})
  with pytest.raises(error, match=re.escape(f"PrecisionChange: {text}")):
    jaxmp.tools.PrecisionChange(**good)._replace(**fields)
  assert jaxmp.tools.PrecisionChange(**good)._replace(applied=True).applied


# ---- the controller on small linen and NNX models ---------------------------------------------
#
# tests/nonfinite_models.py's net (up -> gelu -> down -> boom -> head, float16 compute)
# with down's kernel times 1e6: down's float16 output overflows. Kept in float32, it
# still overflows where its output is handed back to the float16 root, so the root is
# widened; the root's float32 value then overflows where boom and head take it in
# float16, and the large gradient where up hands it back: five changes, one a step
# (k = 1), each read from the trace, until every module computes in float32.

CHAIN = ["down", "", "boom", "head", "up"]


def _linen_chain(steps, closure=False, **kwargs):
  model = jaxmp.linen.mixed_precision(nonfinite_models.LinenNet(), nonfinite_models.RULES)
  x = nonfinite_models.data()
  variables = model.init(jax.random.key(0), x[:1], 0)
  params = jax.tree.map(lambda a: a, variables["params"])
  params["down"]["kernel"] = params["down"]["kernel"] * nonfinite_models.FORWARD_FACTOR
  # A zero learning rate: the fault stays as it is, the test is of precision alone.
  tx = jaxmp.loss_scaling(optax.sgd(0.0), jaxmp.DynamicLossScale(2.0**10))
  state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
                                        variables={**variables, "params": params}, tx=tx)

  @jax.jit
  def step(state):
    # closure: the step calls the model it closed over, which no change reaches.
    apply = model.apply if closure else state.apply_fn
    loss_fn = lambda v: jnp.mean(apply(v, x, jnp.int32(0)) ** 2)
    loss, grads = state.value_and_grad(loss_fn)()
    new = state.apply_gradients(grads)
    return new, loss, jaxmp.tools.training_metrics(grads.params, new.opt_state,
                                                   nonfinite_trace=grads.nonfinite)

  monitor = jaxmp.tools.Monitor()
  controller = jaxmp.tools.PrecisionController(state, monitor, window=1, culprit_steps=1,
                                               **kwargs)
  finite = []
  for _ in range(steps):
    state, loss, metrics = step(state)
    monitor.update(metrics, loss)
    finite.append(bool(metrics["last_step_finite"]))
    state, _ = controller.update(state)
  return controller, finite, state


def _nnx_chain(steps, **kwargs):
  model = jaxmp.nnx.mixed_precision(nonfinite_models.NnxNet(nnx.Rngs(0)), nonfinite_models.RULES)
  model.model.down.kernel[...] = model.model.down.kernel[...] * nonfinite_models.FORWARD_FACTOR
  x = nonfinite_models.data()
  optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(optax.sgd(0.0),
                                                      jaxmp.DynamicLossScale(2.0**10)),
                            wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss, grads = jaxmp.nnx.value_and_grad(lambda m: jnp.mean(m(x, jnp.int32(0)) ** 2))(
        model, loss_scale=jaxmp.get_loss_scale(optimizer.opt_state))
    jaxmp.nnx.apply_gradients(optimizer, model, grads)
    return loss, jaxmp.tools.training_metrics(grads.params, optimizer.opt_state,
                                              nonfinite_trace=grads.nonfinite)

  monitor = jaxmp.tools.Monitor()
  controller = jaxmp.tools.PrecisionController(model, monitor, window=1, culprit_steps=1,
                                               **kwargs)
  finite = []
  for _ in range(steps):
    loss, metrics = step(model, optimizer)
    monitor.update(metrics, loss)
    finite.append(bool(metrics["last_step_finite"]))
    model, _ = controller.update(model)
  return controller, finite, model


@pytest.mark.slow  # five recompiles each (about 10 s)
@pytest.mark.parametrize("chain", [_linen_chain, _nnx_chain], ids=["linen", "nnx"])
def test_an_overflow_that_moves_is_followed_module_by_module_until_the_run_heals(chain, caplog):
  with caplog.at_level(logging.WARNING, logger="jaxmp"):
    controller, finite, _ = chain(7, max_changes=5, auto_apply=True)
  assert finite == [False] * 5 + [True] * 2
  changes = controller.changes
  assert [c.module for c in changes] == CHAIN and [c.step for c in changes] == [0, 1, 2, 3, 4]
  assert all(c.applied and c.kind == "module_float32" for c in changes)
  assert [str(c.evidence[-1].origin) for c in changes] == [
      "forward output of down", "forward output of down", "forward output of boom",
      "forward output of head", "backward input gradient of up"]
  assert changes[1].reason.endswith("and down computes in float32: its caller <root> computes "
                                    "in float32 (was float16)")
  # Each change starts from the last one's rules, and the controller runs the last.
  assert all(b.previous == a.rules for a, b in zip(changes, changes[1:]))
  assert controller.rules == changes[-1].rules and len(controller.rules.rules) == 5
  # Logged as it happened, one line per change.
  logged = [r.getMessage() for r in caplog.records if r.name == "jaxmp"]
  assert logged == [f"jaxmp.tools.PrecisionController: {c}" for c in changes]
  # The log reproduces the run: each decision again from its inputs.
  for c in changes:
    again = jaxmp.tools.propose_change(c.previous, c.evidence, controller._modules,
                                       culprit_steps=1, bfloat16=controller.bfloat16)
    assert again == c._replace(applied=False)


@pytest.mark.slow  # three recompiles
def test_a_step_that_closes_over_model_apply_is_told_to_read_the_model_from_its_state():
  with pytest.raises(jaxmp.tools.DivergenceError) as info:
    _linen_chain(3, closure=True, max_changes=5, auto_apply=True)
  message = str(info.value)
  assert message.startswith(
      "the steps do not seem to run the rules the controller set: the changes applied at "
      "step 0 (down in float32) and step 1 (<root> in float32) were to stop this overflow")
  assert "state.apply_fn(variables, ...) for a train state" in message
  assert [c.module for c in info.value.changes] == CHAIN[:2]


def test_one_change_more_than_max_changes_is_an_error_that_lists_the_changes():
  with pytest.raises(jaxmp.tools.DivergenceError) as info:
    _linen_chain(3, max_changes=1, auto_apply=True)
  message = str(info.value)
  assert message.startswith("the run still overflows after max_changes=1 precision changes; "
                            "the next would be: step 1: proposed <root> in float32: ")
  assert message.endswith("Changes so far: step 0: applied down in float32: forward output of "
                          "down was the first non-finite value in 1 of the last 1 steps (0): "
                          "down computes in float32 (was float16).")
  assert [c.module for c in info.value.changes] == CHAIN[:1]


def test_without_auto_apply_changes_are_proposed_and_the_model_is_left_alone():
  controller, finite, model = _nnx_chain(3)  # auto_apply=False: the default
  assert finite == [False, False, False]
  assert [(c.module, c.applied) for c in controller.changes] == [("down", False)] * 3
  assert controller.rules == nonfinite_models.RULES and model.rules == nonfinite_models.RULES


# ---- the controller on made-up traces: what it says when a change cannot help ----------------


class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name="head")(nn.relu(nn.Dense(4, name="hidden")(x)))


class _NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(3, 4, rngs=rngs)
    self.head = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.hidden(x)))


TRACED = jaxmp.PolicyRules(FP16, trace_nonfinite=True)
_CALLS = (("", "__call__"), ("hidden", "__call__"), ("head", "__call__"))


def _linen_state(module=None):
  model = jaxmp.linen.mixed_precision(module or _MLP(), TRACED)
  variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
  return jaxmp.linen.TrainState.create(apply_fn=model.apply, variables=variables,
                                       tx=optax.sgd(0.1))


def _overflow_in(path):
  """The metrics of a skipped step whose first non-finite value is ``path``'s output."""
  # Columns: input, output, output_grad, input_grad, param_grad, made_forward,
  # made_backward, forward, backward, count (jaxmp._src.nonfinite.COLUMNS).
  rows = [[1.0, INF if p in ("", path) else 1.0, 1.0, 1.0, 1.0, float(p == path), 0.0,
           float(i + 1), float(i + 1), 1.0] for i, (p, _) in enumerate(_CALLS)]
  return {"nonfinite_trace": jaxmp.tools.NonfiniteTrace(_CALLS, jnp.array(rows, jnp.float32)),
          "last_step_finite": False}


def test_a_step_that_never_runs_the_applied_changes_is_named_as_the_likely_cause():
  # A step that calls the model it closed over (model.apply, not state.apply_fn) keeps
  # overflowing where it did, whatever the controller applies: that, not the model, is
  # what the error must say first.
  state = _linen_state()
  monitor = jaxmp.tools.Monitor()
  controller = jaxmp.tools.PrecisionController(state, monitor, window=1, culprit_steps=1,
                                               max_changes=5, auto_apply=True)
  applied = []
  with pytest.raises(jaxmp.tools.DivergenceError) as info:
    for _ in range(3):
      monitor.update(_overflow_in("hidden"))
      state, change = controller.update(state)
      applied.append(change.module)
  assert applied == ["hidden", ""]
  message = str(info.value)
  assert message.startswith(
      "the steps do not seem to run the rules the controller set: the changes applied at "
      "step 0 (hidden in float32) and step 1 (<root> in float32) were to stop this overflow, "
      "yet the steps after them overflowed where they did before. ")
  assert ("a jitted step that calls a model it closed over (model.apply, or an NNX wrapper "
          "captured from outside the step) keeps the rules it was traced with; call the model "
          "the step is given: state.apply_fn(variables, ...) for a train state, or the NNX "
          "wrapper controller.update returned, passed to the step as an argument.") in message
  assert message.endswith(
      "If the step does: forward output of hidden was the first non-finite value in 1 of the "
      "last 1 steps (2), with hidden and every module around it computing in float32: a bug "
      "in the model or the data, not precision. Changes so far: step 0: applied hidden in "
      "float32: forward output of hidden was the first non-finite value in 1 of the last 1 "
      "steps (0): hidden computes in float32 (was float16); step 1: applied <root> in "
      "float32: forward output of hidden was the first non-finite value in 1 of the last 1 "
      "steps (1), and hidden computes in float32: its caller <root> computes in float32 (was "
      "float16).")
  assert info.value.module == "hidden" and len(info.value.changes) == 2


def test_an_overflow_that_moves_after_a_change_is_followed_without_that_hint():
  state = _linen_state()
  monitor = jaxmp.tools.Monitor()
  controller = jaxmp.tools.PrecisionController(state, monitor, window=1, culprit_steps=1,
                                               max_changes=5, auto_apply=True)
  for path in ("hidden", "hidden", "head"):
    monitor.update(_overflow_in(path))
    state, change = controller.update(state)
  assert [c.module for c in controller.changes] == ["hidden", "", "head"]


def test_a_controller_refuses_another_model_with_equal_rules():
  nnx_model = jaxmp.nnx.mixed_precision(_NnxMLP(nnx.Rngs(0)), TRACED)
  monitor = jaxmp.tools.Monitor()
  controller = jaxmp.tools.PrecisionController(nnx_model, monitor)
  monitor.update(_overflow_in("hidden"))
  with pytest.raises(ValueError, match=re.escape(
      "PrecisionController.update: the model is not the one the controller was built on (an "
      "NNX Module _NnxMLP), got a flax linen Module _MLP; pass the model (or state) the last "
      "update returned.")):
    controller.update(_linen_state())
  assert controller.update(nnx_model) == (nnx_model, None)   # the refused update kept nothing

  class _Other(_MLP):
    pass

  controller = jaxmp.tools.PrecisionController(_linen_state(), monitor)
  monitor.update(_overflow_in("hidden"))
  with pytest.raises(ValueError, match="got a flax linen Module _Other"):
    controller.update(_linen_state(_Other()))
  state = _linen_state(_MLP())   # an equal linen module is the same model
  assert controller.update(state) == (state, None)
