"""Adaptive precision: a run that keeps overflowing changes its rules, by rule, and says so.

:class:`jaxmp.tools.Monitor` sees a float16 run skip steps and its loss scale collapse;
the non-finite trace (``PolicyRules(trace_nonfinite=True)``) names the module and
direction of each step's first inf or NaN. :func:`propose_change` turns those records
into a precision change, and :class:`PrecisionController` runs it between steps.

**The decision** (:func:`propose_change`, pure: old rules and evidence in, new rules
and a reason out) reads the records of the last ``window`` steps since the last change,
in this order:

1. the model's inputs were the first non-finite value in ``culprit_steps`` of them:
   :class:`DivergenceError`, a bug in the data; no precision change can fix it;
2. a module made the first non-finite value (its forward output, its input or
   parameter gradient) in ``culprit_steps`` of them: a :class:`jaxmp.Rule` for that
   path alone, first in the rules, keeps it in float32 and drops its fp8 recipe, with
   everything else it had (param dtype, so no param is re-stored; output dtype; float32
   op list). A module that computes in float32 already overflows where it hands a value
   to its caller (its output, or its input gradient, rounded to the caller's float16):
   its nearest enclosing module that does not is moved instead; if there is none, a
   :class:`DivergenceError`;
3. with no such module, ``culprit_steps`` of them were skipped and the Monitor says the
   loss scale collapsed (``scale_collapse``) or no step was applied for long
   (``skip_streak``): float16 becomes bfloat16 everywhere, where the device computes
   bfloat16 (same range as float32, no loss scale needed), and otherwise every module
   computes in float32 without fp8; when everything is float32 already, a
   :class:`DivergenceError`.

Precision only widens, and only on evidence gathered under the current rules (the
controller starts a new window after each change): nothing proposes to narrow back.

**Applying a change** swaps the rules of the wrapper and nothing else:
``jaxmp.linen.MixedPrecision.with_rules`` (a state's ``apply_fn`` replaced, every array
kept) and ``jaxmp.nnx.MixedPrecision.with_rules`` (a wrapper sharing every variable).
Params, optimizer state, loss scale and fp8 state are the same arrays, and a jitted
step traces once more, for the new static rules.

**Sharding.** The decision reads only the loss scale, the skip flags and the trace: all
replicated outputs of a sharded step (the trace's reductions are global), so every
host decides the same. It reads the device's bfloat16 support from
``jax.devices()[0]``, the same device on every host.

Example:
  >>> rules = jaxmp.PolicyRules("params=float32,compute=float16,output=float32")
  >>> culprit = jaxmp.tools.Origin("block/attention", "__call__", "forward", "output", float("inf"))
  >>> steps = [jaxmp.tools.StepRecord(i, None, True, 2.0**(15 - i), culprit, True, frozenset())
  ...          for i in range(3)]
  >>> modules = {"": object, "block": object, "block/attention": object}
  >>> change = jaxmp.tools.propose_change(rules, steps, modules, culprit_steps=3, bfloat16=False)
  >>> print(change)
  step 2: proposed block/attention in float32: forward output of block/attention was the
  first non-finite value in 3 of the last 3 steps (0, 1, 2): block/attention computes in
  float32 (was float16)
  >>> print(change.rules.resolve("block/attention", object).policy)
  params=float32,compute=float32,output=float32
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import numpy as np

from jaxmp._src import adapter as adapter_lib
from jaxmp._src import checks
from jaxmp._src import dtypes
from jaxmp._src import paths as paths_lib
from jaxmp._src import policy as policy_lib
from jaxmp._src import rules as rules_lib
from jaxmp._src.tools import hardware
from jaxmp._src.tools import monitor as monitor_lib

KINDS = ("module_float32", "bfloat16", "float32")
"""The kinds of change: one module (or its caller) to float32, the model to bfloat16 or
to float32."""

# The first non-finite values a module makes itself, so that a rule on it can help (an
# Origin's value "input" is the model's inputs: data; "output_grad" the gradient the
# loss sent in: the loss scale's business).
_MADE = ("output", "input_grad", "param_grad")
# The Monitor's anomalies that say a run is not recovering by itself: the dynamic scale
# fell to its floor, or no step was applied for max_consecutive_skips steps.
_STUCK = {"scale_collapse": "the loss scale collapsed",
          "skip_streak": "a streak of skipped steps"}
_F16, _BF16, _F32 = (np.dtype(t) for t in ("float16", jax.numpy.bfloat16, "float32"))

logger = logging.getLogger("jaxmp")


class DivergenceError(FloatingPointError):
  """The run keeps overflowing where no precision change can help (or may: ``max_changes``).

  Attributes:
    evidence: the :class:`jaxmp.tools.StepRecord` of each step the decision read.
    changes: the changes made before (:attr:`PrecisionController.changes`).
    cause: ``"inputs"`` (the model's inputs were non-finite), ``"module"`` (a module
      overflowed with it and every module around it in float32), ``"stuck"`` (a run
      that keeps skipping with everything in float32) or ``"max_changes"``.
    module: the module that overflowed, for ``cause="module"``; else ``None``.
  """

  def __init__(self, message: str, evidence: tuple = (), changes: tuple = (), *,
               cause: str | None = None, module: str | None = None):
    super().__init__(message)
    self.evidence = tuple(evidence)
    self.changes = tuple(changes)
    self.cause = cause
    self.module = module


class _ChangeFields(NamedTuple):
  step: int
  kind: str
  module: str | None
  reason: str
  previous: rules_lib.PolicyRules
  rules: rules_lib.PolicyRules
  evidence: tuple
  applied: bool = False


def _kinds_text(kinds: Sequence[str]) -> str:
  quoted = [repr(k) for k in kinds]
  return f"{', '.join(quoted[:-1])} or {quoted[-1]}"


class PrecisionChange(checks.CheckedRecord, _ChangeFields):
  """One precision change, with its evidence: a log record a run can be rebuilt from.

  ``propose_change(change.previous, change.evidence, modules, ...)`` returns it again
  (with ``applied=False``), and ``change.rules`` is what the run used from the next step.
  Checked when built (by hand too), as its evidence is.

  Attributes:
    step: the step it was decided after (the last of ``evidence``).
    kind: ``"module_float32"`` (``module`` computes in float32, without fp8),
      ``"bfloat16"`` (float16 becomes bfloat16 everywhere) or ``"float32"`` (every
      module computes in float32, without fp8).
    module: the path the new rule matches, for ``"module_float32"``; else ``None``.
    reason: why, with the numbers.
    previous: the rules before.
    rules: the new :class:`jaxmp.PolicyRules`.
    evidence: the steps it was decided from (:class:`jaxmp.tools.StepRecord`, distinct
      steps, oldest first), as a tuple.
    applied: whether the controller applied it (``auto_apply=True``) or only proposed it.

  Raises:
    TypeError: for a field of the wrong type.
    ValueError: for an unknown kind, a module that does not fit the kind, evidence out
      of step order, or a step that is not the last record's.
  """

  __slots__ = ()

  def __new__(cls, step: int, kind: str, module: str | None, reason: str,
              previous: rules_lib.PolicyRules, rules: rules_lib.PolicyRules, evidence: tuple,
              applied: bool = False):
    where = "PrecisionChange"
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
      raise TypeError(f"{where}: step must be an integer, got {step!r} of type "
                      f"{type(step).__name__}.")
    if not (isinstance(kind, str) and kind in KINDS):
      raise ValueError(f"{where}: kind must be {_kinds_text(KINDS)}, got {kind!r}.")
    if kind == "module_float32" and not isinstance(module, str):
      raise ValueError(f"{where}: module must be the path (a string) of the module a "
                       f"'module_float32' change keeps in float32, got {module!r}.")
    if kind != "module_float32" and module is not None:
      raise ValueError(f"{where}: module must be None for a {kind!r} change (the whole "
                       f"model), got {module!r}.")
    if not isinstance(reason, str):
      raise TypeError(f"{where}: reason must be a string, got {reason!r} of type "
                      f"{type(reason).__name__}.")
    for name, value in (("previous", previous), ("rules", rules)):
      if not isinstance(value, rules_lib.PolicyRules):
        raise TypeError(f"{where}: {name} must be jaxmp.PolicyRules, got {value!r} of type "
                        f"{type(value).__name__}.")
    evidence = _check_evidence(evidence, where)
    if evidence and step != evidence[-1].step:
      raise ValueError(f"{where}: step must be the step of the last record of evidence "
                       f"({evidence[-1].step}), got {step}.")
    return super().__new__(cls, int(step), kind, module, reason, previous, rules, evidence,
                           checks.flag(applied, "applied", where=where))

  def __str__(self) -> str:
    what = {"module_float32": f"{paths_lib.describe_path(self.module or '')} in float32",
            "bfloat16": "the model in bfloat16", "float32": "the model in float32"}[self.kind]
    return f"step {self.step}: {'applied' if self.applied else 'proposed'} {what}: {self.reason}"


# ---- the decision ------------------------------------------------------------------------------


def _steps_text(steps: Sequence[int]) -> str:
  return ", ".join(map(str, steps))


def _is_wide(precision: rules_lib.ModulePrecision) -> bool:
  return precision.policy.compute_dtype.itemsize >= 4 and precision.fp8 is None


def _keep_in_float32(rules: rules_lib.PolicyRules, path: str,
                     precision: rules_lib.ModulePrecision) -> rules_lib.PolicyRules:
  """``rules`` with a first rule for ``path`` alone: float32 compute, no fp8, the rest kept."""
  policy = precision.policy
  if policy.compute_dtype.itemsize < 4:
    # Output equal to compute, so the rule names no output dtype of its own (the
    # module's stays precision.output_dtype); the param dtype stays what the params are
    # stored in.
    policy = policy_lib.Policy(policy.param_dtype, _F32, _F32)
  # A module that followed the rules' float32 op list keeps following it.
  ops = None if precision.rule is None else precision.rule.float32_ops
  rule = rules_lib.Rule(re.escape(path), policy, fp8=None, output_dtype=precision.output_dtype,
                        float32_ops=ops)
  return dataclasses.replace(rules, rules=(rule,) + rules.rules)


def _what_changes(precision: rules_lib.ModulePrecision) -> str:
  compute = precision.policy.compute_dtype
  recipe = ("" if precision.fp8 is None
            else f"without its fp8 recipe {type(precision.fp8).__name__}")
  if compute.itemsize >= 4:
    return f"computes {recipe} (in {compute.name} already)"
  return f"computes in float32 (was {compute.name})" + (f", {recipe}" if recipe else "")


def _callers(path: str, modules: Mapping[str, type]) -> list[str]:
  """The modules enclosing ``path``, nearest first (paths that are not modules skipped)."""
  return sorted((p for p in modules if p != path and (p == "" or path.startswith(p + "/"))),
                key=len, reverse=True)


def _widened(rules: rules_lib.PolicyRules, narrow: tuple, to: np.dtype,
             drop_fp8: bool) -> rules_lib.PolicyRules:
  """Every policy computing in a ``narrow`` dtype computes in ``to``; outputs likewise.

  Params keep their dtypes (a change never re-stores a variable). An output in a narrow
  dtype follows, or the wider result would be rounded back into its range.
  """
  def output(dtype):
    return to if dtype is not None and dtype in narrow else dtype

  def policy(p):
    if p is None or p.compute_dtype not in narrow:
      return p
    return policy_lib.Policy(p.param_dtype, to, output(p.output_dtype))

  new = tuple(dataclasses.replace(r, policy=policy(r.policy), output_dtype=output(r.output_dtype),
                                  fp8=None if drop_fp8 else r.fp8) for r in rules.rules)
  return dataclasses.replace(rules, default=policy(rules.default), rules=new)


def _computes_in(rules: rules_lib.PolicyRules, dtypes: tuple) -> bool:
  policies = [rules.default] + [r.policy for r in rules.rules if r.policy is not None]
  return any(p.compute_dtype in dtypes for p in policies)


def _check_evidence(evidence: Any, where: str) -> tuple:
  """``evidence`` as a tuple of StepRecords of distinct steps, oldest first."""
  if isinstance(evidence, monitor_lib.StepRecord):  # a NamedTuple: a sequence of its fields
    raise TypeError(f"{where}: evidence must be a sequence of jaxmp.tools.StepRecord, got one "
                    f"StepRecord (step {evidence.step}); pass [record].")
  if isinstance(evidence, (str, bytes)) or not isinstance(evidence, Sequence):
    raise TypeError(f"{where}: evidence must be a sequence of jaxmp.tools.StepRecord, got "
                    f"{evidence!r}.")
  for record in evidence:
    if not isinstance(record, monitor_lib.StepRecord):
      raise TypeError(f"{where}: evidence must be jaxmp.tools.StepRecord objects "
                      f"(Monitor.latest), got {record!r} of type {type(record).__name__}.")
  steps = [record.step for record in evidence]
  # Read in any other order, "the last k steps" and the change's step would be wrong.
  if any(later <= earlier for earlier, later in zip(steps, steps[1:])):
    raise ValueError(f"{where}: evidence must be the records of distinct steps, oldest first "
                     f"(as Monitor.latest gives them, one per step), got steps "
                     f"{_steps_text(steps)}.")
  return tuple(evidence)


def _check_propose_args(rules, evidence, modules, culprit_steps, bfloat16) -> tuple:
  where = "propose_change"
  rules_lib.check_rules(rules, where)
  evidence = _check_evidence(evidence, where)
  if not isinstance(modules, Mapping):
    raise TypeError(f"{where}: modules must be a mapping from module path to class (the "
                    f"wrapper's module_types()), got {modules!r}.")
  for path, module_type in modules.items():
    if not (isinstance(path, str) and isinstance(module_type, type)):
      raise TypeError(f"{where}: modules must map module paths (str) to classes (the "
                      f"wrapper's module_types()); {path!r} maps to {module_type!r} of type "
                      f"{type(module_type).__name__}.")
  checks.positive_int(culprit_steps, "culprit_steps", where=where)
  checks.flag(bfloat16, "bfloat16", where=where)
  return evidence


def propose_change(rules: rules_lib.PolicyRules, evidence: Sequence[monitor_lib.StepRecord],
                   modules: Mapping[str, type], *, culprit_steps: int,
                   bfloat16: bool) -> PrecisionChange | None:
  """The precision change the evidence calls for, or ``None``; pure.

  The decision of the module docstring, in its order: non-finite model inputs, a
  module first to overflow in ``culprit_steps`` of the steps (the one named most often,
  then the one named first), and a run stuck with no such module.

  Args:
    rules: the rules the steps ran with.
    evidence: the records of the steps since the last change, oldest first
      (:attr:`jaxmp.tools.Monitor.latest` after each; the controller keeps the last
      ``window``).
    modules: the class of every module of the model by path (``module_types()`` of
      the wrapper), to resolve the culprit's current precision and find its callers.
    culprit_steps: how many of the steps must name the same module (``k``); also how
      many must be skipped for a whole-model change.
    bfloat16: whether the device computes bfloat16 natively
      (:attr:`jaxmp.tools.DeviceCapabilities.supports_bf16`).

  Returns:
    A :class:`PrecisionChange` (``applied=False``) or ``None``.

  Raises:
    DivergenceError: for non-finite model inputs, a culprit with every module around it
      in float32, or a stuck run with everything in float32 already.
    ValueError: if the culprit is not among ``modules`` (a rule for it would match
      nothing); evidence that is not of distinct steps, oldest first; or a bad
      ``culprit_steps``.
    TypeError: for arguments of the wrong type (one ``StepRecord`` rather than a
      sequence of them, modules given as class names).

  Example:
    >>> rules = jaxmp.PolicyRules("params=float32,compute=float16,output=float32")
    >>> steps = [jaxmp.tools.StepRecord(i, None, True, 8.0 / 2**i, None, True,
    ...                                 frozenset({"scale_collapse"})) for i in range(3)]
    >>> change = jaxmp.tools.propose_change(rules, steps, {"": object}, culprit_steps=2,
    ...                                     bfloat16=True)
    >>> change.kind, str(change.rules.default)
    ('bfloat16', 'params=float32,compute=bfloat16,output=float32')
  """
  evidence = _check_propose_args(rules, evidence, modules, culprit_steps, bfloat16)
  if not evidence:
    return None
  n, step = len(evidence), evidence[-1].step
  of_the_last = lambda count, steps: (f"in {count} of the last {n} steps "
                                      f"({_steps_text(steps)})")

  inputs = [e.step for e in evidence if e.origin is not None and e.origin.value == "input"]
  if len(inputs) >= culprit_steps:
    raise DivergenceError(
        f"the model's inputs held inf or NaN {of_the_last(len(inputs), inputs)}: a bug in the "
        f"data or in the code before the model; no precision change can fix it.", evidence,
        cause="inputs")

  named: dict[str, list] = {}  # path -> the records that named it, in order
  for e in evidence:
    if e.origin is not None and e.origin.value in _MADE:
      named.setdefault(e.origin.path, []).append(e)
  if named:
    # The most often named; among those, the first named (dicts keep insertion order).
    path, records = max(named.items(), key=lambda kv: len(kv[1]))
    if len(records) >= culprit_steps:
      why = (f"{records[-1].origin} was the first non-finite value "
             f"{of_the_last(len(records), [r.step for r in records])}")
      module, precision, reason = _module_to_widen(rules, path, modules, why, evidence)
      return PrecisionChange(step, "module_float32", module, reason, rules,
                             _keep_in_float32(rules, module, precision), evidence)

  skipped = sum(bool(e.skipped) for e in evidence)
  stuck = [text for kind, text in _STUCK.items() if kind in evidence[-1].active]
  if skipped < culprit_steps or not stuck:
    return None
  tally = collections.Counter(str(e.origin) if e.origin is not None else "none recorded"
                              for e in evidence if e.skipped)
  why = (f"{skipped} of the last {n} steps were skipped with no module first to overflow in "
         f"{culprit_steps} of them ({', '.join(f'{k}: {v}' for k, v in tally.items())}) and "
         f"{' and '.join(stuck)}")
  change = lambda **kw: PrecisionChange(step=step, module=None, previous=rules,
                                        evidence=evidence, **kw)
  if bfloat16 and _computes_in(rules, (_F16,)):
    return change(kind="bfloat16", rules=_widened(rules, (_F16,), _BF16, drop_fp8=False),
                  reason=f"{why}: float16 computes in bfloat16, which the device has")
  widened = _widened(rules, (_F16, _BF16), _F32, drop_fp8=True)
  if widened == rules:
    raise DivergenceError(
        f"{skipped} of the last {n} steps were skipped with every module computing in "
        f"float32 without fp8 and {' and '.join(stuck)}: a bug in the model or the data, "
        f"not precision.", evidence, cause="stuck")
  no_bf16 = " (the device has no bfloat16)" if _computes_in(rules, (_F16,)) else ""
  return change(kind="float32", rules=widened,
                reason=f"{why}: every module computes in float32 without fp8{no_bf16}")


def _module_to_widen(rules: rules_lib.PolicyRules, path: str, modules: Mapping[str, type],
                     why: str, evidence: tuple
                     ) -> tuple[str, rules_lib.ModulePrecision, str]:
  """The module to keep in float32 for a culprit at ``path``: it, or its nearest narrow caller.

  Returns:
    Its path, its current precision and the reason.
  """
  if path not in modules:
    shown = ", ".join(repr(p) for p in sorted(modules)[:20])
    raise ValueError(
        f"propose_change: the evidence names {path!r}, which is not a module of the model "
        f"(its modules: {shown or 'none known'}); a rule for it would match nothing: is the "
        f"evidence of another model?")
  precision = rules.resolve(path, modules[path])
  if not _is_wide(precision):
    return path, precision, f"{why}: {paths_lib.describe_path(path)} {_what_changes(precision)}"
  for caller in _callers(path, modules):
    outer = rules.resolve(caller, modules[caller])
    if not _is_wide(outer):
      return caller, outer, (f"{why}, and {paths_lib.describe_path(path)} computes in float32: "
                             f"its caller {paths_lib.describe_path(caller)} {_what_changes(outer)}")
  raise DivergenceError(
      f"{why}, with {paths_lib.describe_path(path)} and every module around it computing in "
      f"float32: a bug in the model or the data, not precision.", evidence, cause="module",
      module=path)


# ---- the controller ----------------------------------------------------------------------------


def _widens(change: PrecisionChange, path: str | None) -> bool:
  """Whether ``change`` widened the module at ``path`` (``None``: the whole model)."""
  if change.kind != "module_float32":
    return True
  module = change.module or ""
  return path is not None and (module in ("", path) or path.startswith(module + "/"))


_STEP_READS_THE_MODEL = (
    "a jitted step that calls a model it closed over (model.apply, or an NNX wrapper "
    "captured from outside the step) keeps the rules it was traced with; call the model the "
    "step is given: state.apply_fn(variables, ...) for a train state, or the NNX wrapper "
    "controller.update returned, passed to the step as an argument.")


def _wrapper_of(model: Any, where: str) -> Any:
  """The jaxmp wrapper of ``model``: a wrapper itself, or a state whose ``apply_fn`` is one's."""
  apply_fn = getattr(model, "apply_fn", None)
  wrapper = getattr(apply_fn, "__self__", None) if apply_fn is not None else model
  if not (isinstance(getattr(wrapper, "rules", None), rules_lib.PolicyRules)
          and callable(getattr(wrapper, "with_rules", None))
          and callable(getattr(wrapper, "module_types", None))):
    raise TypeError(
        f"{where}: expected a jaxmp wrapper (jaxmp.linen.mixed_precision or "
        f"jaxmp.nnx.mixed_precision) or a train state whose apply_fn is a linen wrapper's "
        f"apply, got {type(model).__name__}: {model!r:.200}")
  return wrapper


class PrecisionController:
  """Runs :func:`propose_change` between steps and applies what it proposes, if asked.

  A plain (mutable) host-side class, like :class:`jaxmp.tools.Monitor`, which it reads:
  call ``monitor.update(metrics, loss)`` after each step (the metrics of
  :func:`jaxmp.tools.training_metrics` with ``opt_state`` and
  ``nonfinite_trace=grads.nonfinite``), then ``model, change = controller.update(model)``.
  It keeps the records of the last ``window`` steps since its last change; when they
  call for a change, it returns it (and logs it on the ``"jaxmp"`` logger), and with
  ``auto_apply=True`` applies it: the model it returns is the same model under the new
  rules (every array kept; see the module docstring). :attr:`changes` is the log.

  Args:
    model: the wrapped model (``jaxmp.linen.mixed_precision`` or
      ``jaxmp.nnx.mixed_precision``, with ``PolicyRules(trace_nonfinite=True)``), or a
      train state whose ``apply_fn`` is a linen wrapper's ``apply``.
    monitor: the :class:`jaxmp.tools.Monitor` the loop updates; its ``scale_collapse``
      and ``skip_streak`` thresholds decide when a run is stuck.
    window: the number of recent steps the decision reads (``n``); integer >= 1.
    culprit_steps: how many of them must name the same module (``k``), or be skipped
      for a whole-model change; integer in ``[1, window]``.
    max_changes: the most changes to apply (``m``); evidence for one more raises
      :class:`DivergenceError`; integer >= 1.
    auto_apply: apply changes (``True``) or only propose them (``False``, the default:
      the model is returned unchanged and the change has ``applied=False``).
    device: the device whose bfloat16 support decides between bfloat16 and float32
      (a ``jax.Device`` or a description, as :func:`jaxmp.tools.device_capabilities`
      takes); ``jax.devices()[0]`` by default, the same on every host.

  Raises:
    TypeError, ValueError: for a bad argument, naming it; ``ValueError`` for a model
      whose rules do not trace non-finite values.

  Example:
    >>> import flax.linen as nn, optax
    >>> model = jaxmp.linen.mixed_precision(
    ...     nn.Dense(2, kernel_init=nn.initializers.ones),
    ...     jaxmp.PolicyRules("params=float32,compute=float16,output=float32",
    ...                       trace_nonfinite=True))
    >>> monitor = jaxmp.tools.Monitor()
    >>> controller = jaxmp.tools.PrecisionController(model, monitor, culprit_steps=2,
    ...                                             auto_apply=True)
    >>> x = jnp.full((1, 3), 6e4)  # x @ kernel = 1.8e5 overflows float16
    >>> state = jaxmp.linen.TrainState.create(apply_fn=model.apply,
    ...     variables=model.init(jax.random.key(0), x), tx=jaxmp.loss_scaling(optax.sgd(0.1)))
    >>> @jax.jit
    ... def step(state):
    ...   loss_fn = lambda v: jnp.mean(state.apply_fn(v, x) ** 2) * 1e-9
    ...   loss, grads = state.value_and_grad(loss_fn)()
    ...   new = state.apply_gradients(grads)
    ...   return new, loss, jaxmp.tools.training_metrics(grads.params, new.opt_state,
    ...                                                  nonfinite_trace=grads.nonfinite)
    >>> for i in range(3):
    ...   state, loss, metrics = step(state)
    ...   _ = monitor.update(metrics, loss)
    ...   state, change = controller.update(state)
    ...   print(i, bool(metrics["last_step_finite"]), change)
    0 False None
    1 False step 1: applied <root> in float32: forward output of <root> was the first
    non-finite value in 2 of the last 2 steps (0, 1): <root> computes in float32 (was float16)
    2 True None
  """

  def __init__(self, model: Any, monitor: monitor_lib.Monitor, *, window: int = 10,
               culprit_steps: int = 3, max_changes: int = 3, auto_apply: bool = False,
               device: Any = None):
    where = "PrecisionController"
    wrapper = _wrapper_of(model, where)
    self._adapter = adapter_lib.for_model(wrapper, where)
    self._model = wrapper.model
    if not wrapper.rules.trace_nonfinite:
      raise ValueError(
          f"{where}: the model's rules do not trace non-finite values, and the controller "
          f"decides from the trace: wrap the model with PolicyRules(..., "
          f"trace_nonfinite=True) and pass nonfinite_trace=grads.nonfinite to "
          f"jaxmp.tools.training_metrics.")
    if not isinstance(monitor, monitor_lib.Monitor):
      raise TypeError(f"{where}: monitor must be a jaxmp.tools.Monitor, got {monitor!r} of "
                      f"type {type(monitor).__name__}.")
    self.window = checks.positive_int(window, "window", where=where)
    self.culprit_steps = checks.positive_int(culprit_steps, "culprit_steps", where=where,
                                             maximum=self.window)
    self.max_changes = checks.positive_int(max_changes, "max_changes", where=where)
    self.auto_apply = checks.flag(auto_apply, "auto_apply", where=where)
    # Decided once, from a device every host sees as the same.
    self.bfloat16 = hardware.device_capabilities(
        dtypes.default_device() if device is None else device).supports_bf16
    self.monitor = monitor
    self._rules = wrapper.rules
    self._modules: dict[str, type] = {}
    self._steps: collections.deque = collections.deque(maxlen=self.window)
    self._last_step: int | None = None
    self._changes: list[PrecisionChange] = []

  @property
  def rules(self) -> rules_lib.PolicyRules:
    """The rules the model runs with now (after the changes applied so far)."""
    return self._rules

  @property
  def changes(self) -> tuple[PrecisionChange, ...]:
    """Every change proposed or applied so far, in order (the run's precision log)."""
    return tuple(self._changes)

  def update(self, model: Any) -> tuple[Any, PrecisionChange | None]:
    """Reads the monitor's latest step; returns the model (new rules if applied) and the change.

    Args:
      model: the model or train state the step ran (what the last ``update`` returned).

    Returns:
      ``(model, change)``: ``change`` is ``None`` when the evidence calls for nothing.
      With ``auto_apply`` and a change, ``model`` is the same model under
      ``change.rules`` (a linen state with a new ``apply_fn``, a new NNX wrapper
      sharing every variable); otherwise it is ``model`` itself.

    Raises:
      DivergenceError: when no precision change can help (see :func:`propose_change`),
        or one more change would exceed ``max_changes``.
      ValueError: if the monitor has no step since the last update or its metrics
        carried no non-finite trace, or ``model`` runs other rules than the controller's.
      TypeError: if ``model`` is not a wrapper or a state of one.
    """
    where = "PrecisionController.update"
    wrapper = _wrapper_of(model, where)
    self._check_same_model(wrapper, where)
    if wrapper.rules != self._rules:
      raise ValueError(f"{where}: the model runs other rules than the controller's "
                       f"({self._rules}); pass the model (or state) the last update returned.")
    latest = self.monitor.latest
    if latest is None or latest.step == self._last_step:
      raise ValueError(f"{where}: the monitor has no new step; call monitor.update(metrics, "
                       f"loss) once after each step, before controller.update.")
    if not latest.traced:
      raise ValueError(f"{where}: step {latest.step}'s metrics carry no non-finite trace; pass "
                       f"nonfinite_trace=grads.nonfinite to jaxmp.tools.training_metrics.")
    self._last_step = latest.step
    self._steps.append(latest)
    if not self._modules:  # linen knows its modules once a step has been traced
      self._modules = wrapper.module_types()
    try:
      change = propose_change(self._rules, tuple(self._steps), self._modules,
                              culprit_steps=self.culprit_steps, bfloat16=self.bfloat16)
    except DivergenceError as e:
      raise DivergenceError(self._unreached(e) + str(e) + self._history(), e.evidence,
                            self.changes, cause=e.cause, module=e.module) from None
    if change is None:
      return model, None
    self._steps.clear()  # the next decision reads only steps run under the new rules
    if self.auto_apply:
      applied = sum(c.applied for c in self._changes)
      if applied >= self.max_changes:
        raise DivergenceError(
            f"the run still overflows after max_changes={self.max_changes} precision changes; "
            f"the next would be: {change}. Raise max_changes, or look for a bug in the model "
            f"or the data.{self._history()}", change.evidence, self.changes,
            cause="max_changes")
      new_wrapper = wrapper.with_rules(change.rules)
      model = (model.replace(apply_fn=new_wrapper.apply) if model is not wrapper
               else new_wrapper)
      self._rules = change.rules
      change = change._replace(applied=True)
    self._changes.append(change)
    logger.warning("jaxmp.tools.PrecisionController: %s", change)
    return model, change

  def _check_same_model(self, wrapper: Any, where: str) -> None:
    adapter = adapter_lib.for_model(wrapper, where)
    # A linen Module is its configuration (equal modules are the same model); an NNX
    # Module holds its variables, and a copy of it (nnx.merge) is a new object.
    same = (adapter is self._adapter and type(wrapper.model) is type(self._model)
            and (adapter.holds_variables or wrapper.model == self._model))
    if not same:
      raise ValueError(
          f"{where}: the model is not the one the controller was built on "
          f"({self._adapter.model_kind} {type(self._model).__name__}), got "
          f"{adapter.model_kind} {type(wrapper.model).__name__}; pass the model (or state) the "
          f"last update returned.")

  def _unreached(self, error: DivergenceError) -> str:
    """What to say first when applied changes should have stopped the overflow, else ""."""
    if error.cause not in ("module", "stuck"):
      return ""
    unreached = [c for c in self._changes if c.applied and _widens(c, error.module)]
    if not unreached:
      return ""
    what = lambda c: (f"{paths_lib.describe_path(c.module or '')} in float32"
                      if c.kind == "module_float32" else f"the model in {c.kind}")
    listed = " and ".join(f"step {c.step} ({what(c)})" for c in unreached)
    return (f"the steps do not seem to run the rules the controller set: the change"
            f"{'s' if len(unreached) > 1 else ''} applied at {listed} were to stop this "
            f"overflow, yet the steps after them overflowed where they did before. Most likely "
            f"{_STEP_READS_THE_MODEL} If the step does: ")

  def _history(self) -> str:
    if not self._changes:
      return ""
    return " Changes so far: " + "; ".join(str(c) for c in self._changes) + "."


__all__ = ("KINDS", "DivergenceError", "PrecisionChange", "PrecisionController",
           "propose_change")
