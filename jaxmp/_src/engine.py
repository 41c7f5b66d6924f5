"""The per-call precision decisions that the linen and NNX adapters share.

A wrapped model is run one *call* at a time (``init`` or ``apply`` of a linen wrapper,
one call of an NNX wrapper). A :class:`Call` holds what that call needs to decide,
for every module the adapter hands it:

1. **resolve**: the module's :class:`~jaxmp._src.rules.ModulePrecision` from its
   '/'-joined path and class (an fp8 recipe on a layer the adapter cannot put in fp8
   is dropped here and reported by :func:`unused_rules`);
2. **run**: the module's floating-point inputs cast to its compute dtype, the module
   run with the caller stack pushed, and its output cast to the dtype it hands back:
   the dtype its rule names, else its caller's compute dtype (an override is local),
   else, for the outermost call, the default policy's output dtype;
3. **record**: a :class:`CallRecord` per module call, for the unused-rule report and
   :func:`jaxmp.tools.summary`.

The adapters only find modules, give them their params in the compute dtype, and
install fp8; every dtype decision is made here.

Example:
  >>> from jaxmp._src import engine, rules
  >>> call = engine.Call(rules.PolicyRules("p=f32,c=bf16,o=f32"), supports_fp8=lambda t: False)
  >>> precision = call.resolve("", object)
  >>> call.run("", object, "__call__", precision, lambda x: x * 2, (jnp.ones(2),), {}).dtype
  dtype('float32')
  >>> [(r.path, r.output_dtype.name) for r in call.records]
  [('', 'float32')]
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar

import jax
import numpy as np

from jaxmp._src import rules as rules_lib
from jaxmp._src import tree as tree_lib

T = TypeVar("T")

ROOT = "<root>"
"""How messages and tables name the root module, whose path is ``""``."""

_MAX_PATHS_IN_WARNING = 60


def describe_path(path: str) -> str:
  """``path`` as messages show it: the root module is :data:`ROOT`."""
  return path or ROOT


@dataclasses.dataclass(frozen=True)
class CallRecord:
  """One module call: where it is and how it computed.

  Attributes:
    path: the module's '/'-joined path (``""`` for the root).
    module_type: the module's class.
    method: the method called (``"__call__"``, ``"attend"``, ...).
    precision: the resolved :class:`~jaxmp._src.rules.ModulePrecision`.
    output_dtype: the dtype the call's floating-point output was handed back in.
  """

  path: str
  module_type: type
  method: str
  precision: rules_lib.ModulePrecision
  output_dtype: np.dtype


def resolve(rules: rules_lib.PolicyRules, path: str, module_type: type,
            supports_fp8: Callable[[type], bool]) -> rules_lib.ModulePrecision:
  """The precision of one module; an fp8 recipe is dropped where it cannot apply.

  The dropped recipe is not lost silently: :func:`unused_rules` reports a rule whose
  fp8 recipe reached no layer that supports it.
  """
  precision = rules.resolve(path, module_type)
  if precision.fp8 is not None and not supports_fp8(module_type):
    precision = dataclasses.replace(precision, fp8=None)
  return precision


class Call:
  """One call of a wrapped model: the rules, the callers' compute dtypes, the records.

  Args:
    rules: the wrapper's rules.
    supports_fp8: whether the adapter can put a module class's matmuls in fp8.
    is_node: leaves for which this returns True are never cast (NNX graph nodes);
      ``None`` casts every floating-point array leaf.
  """

  def __init__(self, rules: rules_lib.PolicyRules, supports_fp8: Callable[[type], bool], *,
               is_node: Optional[Callable[[Any], bool]] = None):
    self.rules = rules
    self.supports_fp8 = supports_fp8
    self.records: list[CallRecord] = []
    self._is_node = is_node
    self._callers: list[np.dtype] = []

  def resolve(self, path: str, module_type: type) -> rules_lib.ModulePrecision:
    """:func:`resolve` under this call's rules."""
    return resolve(self.rules, path, module_type, self.supports_fp8)

  def cast(self, tree: T, dtype: np.dtype) -> T:
    """Casts the floating-point array leaves of ``tree``, leaving nodes alone."""
    if self._is_node is None:
      return tree_lib.cast_tree(tree, dtype)
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=self._is_node)
    leaves = [x if self._is_node(x) else tree_lib.cast_tree(x, dtype) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, leaves)

  def output_dtype(self, precision: rules_lib.ModulePrecision) -> np.dtype:
    """The dtype a module hands its output back in (see the module docstring)."""
    caller = self._callers[-1] if self._callers else None
    return precision.output_dtype or caller or self.rules.default.output_dtype

  def run(self, path: str, module_type: type, method: str,
          precision: rules_lib.ModulePrecision, fn: Callable[..., Any],
          args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """Runs ``fn(*args, **kwargs)`` as a call of the module at ``path``.

    Casts the floating-point inputs to the compute dtype, records the call, and casts
    the output to :meth:`output_dtype`.
    """
    compute = precision.policy.compute_dtype
    output_dtype = self.output_dtype(precision)
    self.records.append(CallRecord(path, module_type, method, precision, output_dtype))
    args, kwargs = self.cast((tuple(args), dict(kwargs)), compute)
    self._callers.append(compute)
    try:
      out = fn(*args, **kwargs)
    finally:
      self._callers.pop()
    return self.cast(out, output_dtype)


def owner(path: tuple, by_path: Mapping[tuple, T]) -> Optional[T]:
  """The entry of the nearest module strictly enclosing ``path`` (a variable's path).

  Example:
    >>> from jaxmp._src import engine
    >>> engine.owner(("block", "dense", "kernel"), {(): "root", ("block",): "block"})
    'block'
  """
  for end in range(len(path) - 1, -1, -1):
    if path[:end] in by_path:
      return by_path[path[:end]]
  return None


def unused_rules(rules: rules_lib.PolicyRules, records: Sequence[CallRecord],
                 fp8_layer_names: str) -> list[str]:
  """Describes each rule that decided no module's precision in ``records``.

  Args:
    rules: the rules.
    records: the calls of one run of the model.
    fp8_layer_names: the adapter's fp8-capable layers, for the message.

  Returns:
    One sentence per problem: a rule that matches no module, a rule shadowed by
    earlier ones, an fp8 rule that matches no fp8-capable layer.

  Example:
    >>> from jaxmp._src import engine
    >>> rules = jaxmp.PolicyRules("float32", [jaxmp.Rule("encoder", "bf16")])
    >>> engine.unused_rules(rules, [], "Dense")
    ["rule 0 ('encoder') matches no module"]
  """
  problems = []
  for index, rule in enumerate(rules.rules):
    decided = [r for r in records if r.precision.rule is rule]
    if decided and rule.fp8 is not None and not any(r.precision.fp8 for r in decided):
      problems.append(f"rule {index} ({rule.describe()}) has an fp8 recipe but matches no "
                      f"layer fp8 applies to ({fp8_layer_names})")
    if decided:
      continue
    if any(rule.matches(r.path, r.module_type) for r in records):
      problems.append(f"rule {index} ({rule.describe()}) is shadowed by earlier rules for "
                      f"every module it matches")
    else:
      problems.append(f"rule {index} ({rule.describe()}) matches no module")
  return problems


def describe_paths(records: Sequence[CallRecord]) -> str:
  """The model's module paths and classes, one per line, for warnings."""
  seen = list(dict.fromkeys((describe_path(r.path), r.module_type.__name__) for r in records))
  lines = [f"  {path} ({cls})" for path, cls in seen[:_MAX_PATHS_IN_WARNING]]
  if len(seen) > _MAX_PATHS_IN_WARNING:
    lines.append(f"  ... and {len(seen) - _MAX_PATHS_IN_WARNING} more")
  return "\n".join(lines)


def warn_unused_rules(model_name: str, rules: rules_lib.PolicyRules,
                      records: Sequence[CallRecord], fp8_layer_names: str, *,
                      already_warned: Optional[set] = None, stacklevel: int = 2) -> None:
  """Warns once per problem :func:`unused_rules` finds, listing the model's paths.

  Args:
    model_name: the wrapped model's class name.
    rules: the rules.
    records: the calls of one run of the model.
    fp8_layer_names: the adapter's fp8-capable layers.
    already_warned: problems warned about before (updated); ``None`` warns every time.
    stacklevel: as for ``warnings.warn``, counted from the caller of this function.
  """
  problems = unused_rules(rules, records, fp8_layer_names)
  if already_warned is not None:
    problems = [p for p in problems if p not in already_warned]
    already_warned.update(problems)
  if problems:
    warnings.warn(
        f"jaxmp: in {model_name}, " + "; ".join(problems)
        + ". The model's module paths are:\n" + describe_paths(records),
        UserWarning, stacklevel=stacklevel + 1)


__all__ = (
    "ROOT",
    "Call",
    "CallRecord",
    "describe_path",
    "describe_paths",
    "owner",
    "resolve",
    "unused_rules",
    "warn_unused_rules",
)
