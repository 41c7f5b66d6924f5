"""Which modules can compute in half precision: per-module sensitivity of a model.

:func:`sensitivity` runs each module of a Flax model (linen or NNX) alone in each
candidate dtype, with the rest in float32, ranks the modules by how far the output
moves, and recommends :class:`~jaxmp.PolicyRules` that keep only the sensitive ones in
float32. :func:`deviation` measures any rules the same way.

Example:
  >>> float(jaxmp.tools.relative_error(jnp.array([3.0, 4.0]), jnp.array([3.0, 4.0])))
  0.0
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import adapter as adapter_lib
from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src import engine
from jaxmp._src import policy as policy_lib
from jaxmp._src import rules as rules_lib
from jaxmp._src import tree as tree_lib
from jaxmp._src.tools import leaves as leaves_lib
from jaxmp._src.tools import summary as summary_lib
from jaxmp._src.tools import table

ROOT = leaves_lib.ROOT

Metric = Callable[[Any, Any], Any]


def relative_error(reference: Any, output: Any) -> jax.Array:
  """``||output - reference|| / ||reference||`` over all float leaves, in float32.

  The L2 norms run over every floating-point leaf of the two trees, paired by path: the
  trees must have the same float leaves (by path and shape; dtypes may differ). Where the
  reference is all zeros the absolute error ``||output||`` is returned. Any non-finite
  value in ``output`` makes the error ``inf``.

  Raises:
    ValueError: for trees whose float leaves differ in number, path or shape.

  Example:
    >>> float(jaxmp.tools.relative_error(jnp.array([3.0, 4.0]), jnp.array([3.0, 6.5])))
    0.5
  """
  ref_leaves = leaves_lib.float_leaves(reference)
  out_leaves = leaves_lib.float_leaves(output)
  if len(ref_leaves) != len(out_leaves):
    raise ValueError(f"relative_error: the reference has {len(ref_leaves)} float leaves and the "
                     f"output {len(out_leaves)}.")
  for i, ((ref_path, r), (out_path, o)) in enumerate(zip(ref_leaves, out_leaves)):
    name = "/".join(ref_path) or ROOT
    if ref_path != out_path:  # paired by position, {"a": x} and {"b": x} would read as equal
      raise ValueError(f"relative_error: the reference and the output differ in structure: "
                       f"float leaf {i} is {name!r} in the reference and "
                       f"{'/'.join(out_path) or ROOT!r} in the output.")
    if np.shape(r) != np.shape(o):  # broadcasting would compare other elements
      raise ValueError(f"relative_error: float leaf {name!r} has shape {np.shape(r)} in the "
                       f"reference and {np.shape(o)} in the output.")
  ref = [jnp.asarray(x, jnp.float32) for _, x in ref_leaves]
  out = [jnp.asarray(x, jnp.float32) for _, x in out_leaves]
  diff = sum(jnp.sum(jnp.square(o - r)) for r, o in zip(ref, out))
  norm = sum(jnp.sum(jnp.square(r)) for r in ref)
  error = jnp.where(norm > 0, jnp.sqrt(diff / jnp.where(norm > 0, norm, 1)), jnp.sqrt(diff))
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(o)) for o in out]))
  return jnp.where(finite, error, jnp.inf)


class _Runner:
  """Runs one model under different rules, each configuration jitted once."""

  def __init__(self, model_or_wrapper: Any, variables: Any, args: tuple, kwargs: dict,
               metric: Metric, where: str):
    self.where = where
    if isinstance(model_or_wrapper, engine.Wrapper):  # either adapter's
      model_or_wrapper = model_or_wrapper.model
    # The tools' summary module imports both adapters, which registers them.
    self.adapter = adapter_lib.for_model(model_or_wrapper, where)
    kind = self.adapter.model_kind
    if self.adapter.holds_variables and variables is not None:
      raise TypeError(f"{where}: {kind} holds its own variables; pass variables=None, got "
                      f"{type(variables).__name__}.")
    if not self.adapter.holds_variables and variables is None:
      raise TypeError(f"{where}: {kind} needs its variables (what init returned), got None.")
    if not callable(metric):
      raise TypeError(f"{where}: metric must be a callable (reference, output) -> scalar, got "
                      f"{metric!r} of type {type(metric).__name__}.")
    self.model = model_or_wrapper
    self.variables = variables
    self.args, self.kwargs = args, kwargs
    self.metric = metric
    # Array leaves are traced; everything else (flags, method names) stays static.
    leaves, self.treedef = jax.tree_util.tree_flatten((args, kwargs))
    self.is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]
    self.static = [None if a else x for x, a in zip(leaves, self.is_array)]
    self.arrays = [x for x, a in zip(leaves, self.is_array) if a]
    self._reference = None

  def _call_args(self, arrays):
    it = iter(arrays)
    leaves = [next(it) if a else s for a, s in zip(self.is_array, self.static)]
    return jax.tree_util.tree_unflatten(self.treedef, leaves)

  def _state_and_call(self, rules: rules_lib.PolicyRules):
    """(state, f(state, arrays) -> output in float32) for ``rules``."""
    state, apply = self.adapter.functional(self.model, rules, self.variables)

    def call(state, arrays):
      args, kwargs = self._call_args(arrays)
      return tree_lib.cast_tree(apply(state, *args, **kwargs), jnp.float32)

    return state, call

  def reference(self) -> Any:
    if self._reference is None:
      state, call = self._state_and_call(rules_lib.PolicyRules("float32"))
      self._reference = jax.jit(call)(state, self.arrays)
    return self._reference

  def deviation(self, rules: rules_lib.PolicyRules) -> float:
    state, call = self._state_and_call(rules)
    metric = self.metric
    value = jax.jit(lambda s, a, ref: metric(ref, call(s, a)))(
        state, self.arrays, self.reference())
    if np.shape(value) != ():
      raise ValueError(f"{self.where}: metric must return a scalar, got shape "
                       f"{np.shape(value)} from {metric!r}.")
    return float(value)

  def module_paths(self) -> list[tuple[str, str]]:
    """(path, class name) of every module a real call reaches, in call order."""
    kwargs = dict(self.kwargs)
    rngs = kwargs.pop("rngs", None)
    if self.adapter.holds_variables:
      _, records, _ = summary_lib.trace_calls(self.model, "float32", *self.args, **kwargs)
    else:
      _, records, _ = summary_lib.trace_calls(self.model, "float32", *self.args,
                                              variables=self.variables, rngs=rngs, **kwargs)
    paths = {}
    for record in records:
      paths.setdefault(record.path, record.module_type.__name__)
    return list(paths.items())


def _candidates(candidates: Any) -> tuple[np.dtype, ...]:
  if isinstance(candidates, str) or not isinstance(candidates, Sequence) or not candidates:
    raise TypeError(f"sensitivity: candidates must be a non-empty sequence of dtypes, e.g. "
                    f"('bfloat16', 'float16'), got {candidates!r}.")
  parsed = tuple(dtypes_lib.parse_dtype(c) for c in candidates)
  names = [d.name for d in parsed]
  if len(set(names)) != len(names):
    raise ValueError(f"sensitivity: candidates {candidates!r} name a dtype twice ({names}).")
  return parsed


def _module_policy(dtype: np.dtype) -> policy_lib.Policy:
  # Output == compute names no output dtype, so the override is local: the module
  # hands its output back in its caller's dtype (float32 here).
  return policy_lib.Policy(np.float32, dtype, dtype)


class SensitivityRow(NamedTuple):
  """One module of a :class:`SensitivityReport`.

  Attributes:
    path: the module's '/'-joined path (``""`` for the root module).
    module: its class name.
    deviations: the metric with this module alone in each candidate dtype (in the
      report's ``candidates`` order), everything else in float32.
  """

  path: str
  module: str
  deviations: tuple[float, ...]

  @property
  def worst(self) -> float:
    """The largest deviation over the candidates (NaN counts as inf)."""
    return max(math.inf if math.isnan(d) else d for d in self.deviations)


def _format_value(value: float) -> str:
  return "nan" if math.isnan(value) else "inf" if math.isinf(value) else f"{value:.2e}"


@dataclasses.dataclass(frozen=True)
class SensitivityReport:
  """Modules ranked by how much computing them alone in half precision moves the output.

  Built by :func:`sensitivity`.

  Attributes:
    model: the model's class name.
    candidates: the dtype names measured, e.g. ``("bfloat16", "float16")``.
    metric: the metric's name.
    rows: one :class:`~jaxmp._src.tools.sensitivity.SensitivityRow` per module path,
      most sensitive first (by the worst deviation over the candidates; ties keep call
      order).
    whole_model: the metric with *every* module (normalization layers included) in
      each candidate dtype, for scale.
  """

  model: str
  candidates: tuple[str, ...]
  metric: str
  rows: tuple[SensitivityRow, ...]
  whole_model: tuple[float, ...]

  def deviation(self, path: str, candidate: dtypes_lib.DTypeLike) -> float:
    """The deviation of the module at ``path`` in ``candidate``."""
    index = self._index(candidate)
    for row in self.rows:
      if row.path == path:
        return row.deviations[index]
    raise KeyError(f"no module {path!r}; the modules are {[r.path for r in self.rows]}")

  def _index(self, candidate: dtypes_lib.DTypeLike) -> int:
    name = dtypes_lib.parse_dtype(candidate).name
    if name not in self.candidates:
      raise ValueError(f"{name!r} was not measured; the candidates are {self.candidates}.")
    return self.candidates.index(name)

  def sensitive(self, threshold: float, low: dtypes_lib.DTypeLike | None = None
                ) -> tuple[str, ...]:
    """Paths whose deviation in ``low`` exceeds ``threshold`` or is not finite."""
    threshold = _check_threshold(threshold)
    index = self._index(self.candidates[0] if low is None else low)
    return tuple(r.path for r in self.rows
                 if not math.isfinite(r.deviations[index]) or r.deviations[index] > threshold)

  def recommended_rules(self, threshold: float = 0.01,
                        low: dtypes_lib.DTypeLike | None = None, *,
                        float32_normalization: bool = True) -> rules_lib.PolicyRules:
    """Rules computing in ``low`` except the modules whose deviation exceeds ``threshold``.

    The default policy is ``params=float32,compute=<low>,output=float32``; each module
    whose deviation in ``low`` is above ``threshold`` (or not finite) gets a rule
    ``Rule(re.escape(path), "float32")``, most sensitive first. A rule is local: the
    module computes in float32 and hands its output back in its caller's dtype, and
    its children follow the default (each module was measured with its children in
    float32, so its deviation is its own operations').

    Args:
      threshold: the largest acceptable deviation (the metric's units; for the
        default relative error 0.01 is 1%). >= 0.
      low: the half-precision dtype, one of the candidates; the first by default.
      float32_normalization: passed to :class:`jaxmp.PolicyRules`: with ``True``
        (jaxmp's default) normalization layers also stay in float32; with ``False``
        only the measurements decide.

    Returns:
      A :class:`jaxmp.PolicyRules`.

    Raises:
      ValueError: for a negative or non-finite threshold, or ``low`` not measured.
    """
    low_name = self.candidates[self._index(self.candidates[0] if low is None else low)]
    keep = self.sensitive(threshold, low_name)
    default = policy_lib.Policy(np.float32, low_name, np.float32)
    return rules_lib.PolicyRules(
        default, [rules_lib.Rule(re.escape(path), "float32") for path in keep],
        float32_normalization=float32_normalization)

  @property
  def recommended(self) -> rules_lib.PolicyRules:
    """``recommended_rules()`` with its defaults (threshold 0.01, the first candidate)."""
    return self.recommended_rules()

  def __str__(self) -> str:
    lines = [f"{self.model}: {self.metric} of the output vs float32, each module alone in "
             f"each dtype (the rest in float32), most sensitive first"]
    header = ("rank", "path", "module", *self.candidates)
    body = [(str(i + 1), r.path or ROOT, r.module, *map(_format_value, r.deviations))
            for i, r in enumerate(self.rows)]
    body.append(("", "whole model", "", *map(_format_value, self.whole_model)))
    right = (True, False, False, *([True] * len(self.candidates)))
    lines.append(table.text_table(header, body, right))
    return "\n".join(lines)


def _progress_fn(progress: Any) -> Callable[[str], object]:
  """What reports each step: a line on stderr (``True``), nothing, or the caller's function."""
  if progress is True:
    # sys.stderr is looked up at each line, so a redirect made after the call still gets it.
    return lambda message: print(
        f"[jaxmp.tools.sensitivity {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr,
        flush=True)
  if progress is False:
    return lambda message: None
  if callable(progress):
    return progress
  raise TypeError(f"sensitivity: progress must be True (lines on stderr), False (quiet) or a "
                  f"callable taking each message, got {progress!r} of type "
                  f"{type(progress).__name__}.")


def _deviations_text(names: Sequence[str], deviations: Sequence[float]) -> str:
  return ", ".join(f"{name} {_format_value(d)}" for name, d in zip(names, deviations))


def _check_threshold(threshold: Any) -> float:
  if isinstance(threshold, (bool, np.bool_)) or not isinstance(threshold, (int, float, np.number)):
    raise TypeError(f"threshold must be a number, got {threshold!r} of type "
                    f"{type(threshold).__name__}.")
  if not (math.isfinite(threshold) and threshold >= 0):
    raise ValueError(f"threshold must be finite and >= 0, got {threshold!r}.")
  return float(threshold)


def _metric_name(metric: Metric | None) -> str:
  if metric is None:
    return "relative L2 error"
  return getattr(metric, "__name__", type(metric).__name__)


def _select_paths(paths: list[tuple[str, str]], modules: str | None) -> list[tuple[str, str]]:
  if modules is None:
    return paths
  if not isinstance(modules, str):
    raise TypeError(f"sensitivity: modules must be a regex string over module paths or None, "
                    f"got {modules!r} of type {type(modules).__name__}.")
  try:
    regex = re.compile(modules)
  except re.error as e:
    raise ValueError(f"sensitivity: modules={modules!r} is not a valid regex: {e}.") from None
  chosen = [(p, m) for p, m in paths if regex.fullmatch(p)]
  if not chosen:
    raise ValueError(f"sensitivity: modules={modules!r} matches none of the module paths "
                     f"{[p or ROOT for p, _ in paths]}.")
  return chosen


def sensitivity(model_or_wrapper: Any, variables: Any, *args,
                candidates: Sequence[dtypes_lib.DTypeLike] = ("bfloat16", "float16"),
                metric: Metric | None = None, modules: str | None = None,
                progress: bool | Callable[[str], None] = True,
                **kwargs) -> SensitivityReport:
  """Ranks modules by how much computing each alone in half precision moves the output.

  First one abstract call (:func:`jaxmp.tools.summary`'s tracing) lists every module path a
  real call reaches. Then, for each path and each candidate dtype, the model runs with
  ``PolicyRules("float32", [Rule(re.escape(path), Policy(float32, candidate,
  candidate))])``: that module alone computes in the candidate (its inputs and params
  cast, its output handed back in float32), its children and every other module in
  float32. ``metric(reference, output)`` compares the output to the all-float32
  output. Each configuration is jitted once: one compilation per (module, candidate)
  pair, plus the reference and one whole-model run per candidate (the demo
  transformer's 26 modules and two candidates take about 40 s on a 2-core CPU,
  nearly all of it compiling). Pick modules with ``modules=`` to measure fewer; a line
  on stderr reports each module as it is measured (``progress=``). The
  numbers are those of the compiled programs, as in a jitted training step: XLA
  may fuse or simplify operations (it removes ``(x + c) - c`` in float16 on a CPU).

  Measuring one module at a time isolates its own operations; effects that only show
  when several modules are in half precision together are not seen (the report's
  ``whole_model`` and :func:`deviation` show the total).

  Args:
    model_or_wrapper: a linen Module or :func:`jaxmp.linen.mixed_precision` wrapper
      (whose rules are ignored: the reference is float32), or an NNX Module or
      :func:`jaxmp.nnx.mixed_precision` wrapper (copied, never changed).
    variables: the linen model's variables; ``None`` for an NNX model.
    *args: the call's positional arguments (e.g. a batch). Array leaves are traced;
      other leaves are static.
    candidates: the dtypes to try, e.g. ``("bfloat16", "float16")``.
    metric: ``metric(reference_output, output) -> scalar``, traced under jit, on
      outputs cast to float32; by default :func:`relative_error`.
    modules: a regex ``re.fullmatch``-ed against the module paths to measure; all
      modules by default (the root module's path is ``""``).
    progress: ``True`` (default) prints a line to stderr (stdout stays free for the
      report) when the modules are listed, after each module and after the whole-model
      runs, with the deviations and the seconds each took: a large model takes
      minutes. ``False`` prints nothing; a callable gets each message (without the
      ``[jaxmp.tools.sensitivity HH:MM:SS]`` prefix of the stderr lines) instead.
    **kwargs: keyword arguments of the call (``train=False``, ``method=``, ``rngs=``).
      The call must be deterministic: the same inputs give the same output.

  Returns:
    A :class:`SensitivityReport`; ``print`` it, or get rules from
    ``recommended_rules(threshold, low)``.

  Raises:
    TypeError: for a model that is not a Flax module or wrapper, missing (linen) or
      extra (NNX) variables, a non-callable metric, bad candidates, or a ``progress``
      that is neither a bool nor callable.
    ValueError: for an unknown candidate dtype, a ``modules`` regex that matches no
      module, or a metric that does not return a scalar.

  Example:
    >>> import flax.linen as nn
    >>> class Fragile(nn.Module):  # E[x^2] - E[x]^2 of shifted data cancels in 16 bits
    ...   def __call__(self, x):
    ...     x = x + 100.0
    ...     return jnp.mean(jnp.square(x), -1) - jnp.square(jnp.mean(x, -1))
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return Fragile(name="fragile")(nn.Dense(4, name="dense")(x))
    >>> x = jnp.linspace(-1, 1, 12).reshape(4, 3)
    >>> variables = Net().init(jax.random.key(0), x)
    >>> report = jaxmp.tools.sensitivity(Net(), variables, x, candidates=["bfloat16"],
    ...                                  progress=False)
    >>> report.rows[0].path, report.rows[0].deviations[0] > 0.5
    ('fragile', True)
    >>> [rule.match for rule in report.recommended_rules(threshold=0.05).rules]
    ['fragile']
  """
  parsed = _candidates(candidates)
  report = _progress_fn(progress)
  runner = _Runner(model_or_wrapper, variables, args, kwargs,
                   relative_error if metric is None else metric, "sensitivity")
  paths = _select_paths(runner.module_paths(), modules)
  names = tuple(d.name for d in parsed)
  report(f"{len(paths)} module(s) x {len(parsed)} dtype(s): "
         f"{len(paths) * len(parsed) + len(parsed) + 1} compilations")
  rows = []
  for number, (path, module) in enumerate(paths, 1):
    start = time.perf_counter()
    deviations = tuple(runner.deviation(rules_lib.PolicyRules(
        "float32", [rules_lib.Rule(re.escape(path), _module_policy(d))])) for d in parsed)
    rows.append(SensitivityRow(path, module, deviations))
    report(f"module {number}/{len(paths)} {path or ROOT} ({module}): "
           f"{_deviations_text(names, deviations)} ({time.perf_counter() - start:.1f} s)")
  rows.sort(key=lambda r: -r.worst)  # stable: ties keep call order
  start = time.perf_counter()
  whole = tuple(runner.deviation(rules_lib.PolicyRules(
      policy_lib.Policy(np.float32, d, np.float32), float32_normalization=False))
      for d in parsed)
  report(f"whole model: {_deviations_text(names, whole)} ({time.perf_counter() - start:.1f} s)")
  return SensitivityReport(type(runner.model).__name__, names, _metric_name(metric),
                           tuple(rows), whole)


def deviation(model_or_wrapper: Any, variables: Any, *args,
              rules: (rules_lib.PolicyOrRules | list[rules_lib.PolicyOrRules]
                     | tuple[rules_lib.PolicyOrRules, ...]),
              metric: Metric | None = None, **kwargs) -> float | tuple[float, ...]:
  """How far the output under ``rules`` is from the all-float32 output.

  The measurement :func:`sensitivity` makes, for any rules: e.g. to check that its
  recommendation is closer to float32 than computing everything in half precision.

  Args:
    model_or_wrapper, variables, args, metric, kwargs: as for :func:`sensitivity`.
    rules: a policy or :class:`jaxmp.PolicyRules`, or a list of them (the float32
      reference is then computed once).

  Returns:
    ``metric(reference, output)`` as a float, or a tuple of floats for a list of rules.

  Raises:
    TypeError, ValueError: as for :func:`sensitivity`, and for bad rules.

  Example:
    >>> import flax.linen as nn
    >>> model, x = nn.Dense(3), jnp.ones((2, 4))
    >>> variables = model.init(jax.random.key(0), x)
    >>> jaxmp.tools.deviation(model, variables, x, rules=["float32", "bfloat16"])[0]
    0.0
  """
  runner = _Runner(model_or_wrapper, variables, args, kwargs,
                   relative_error if metric is None else metric, "deviation")
  if isinstance(rules, (list, tuple)):
    return tuple(runner.deviation(rules_lib.as_rules(r)) for r in rules)
  return runner.deviation(rules_lib.as_rules(rules))



__all__ = (
    "SensitivityReport",
    "SensitivityRow",
    "deviation",
    "relative_error",
    "sensitivity",
)
