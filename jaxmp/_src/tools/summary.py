"""A per-module precision table, resolved for a real call of the model.

:func:`summary` traces one call of the model abstractly (``jax.eval_shape``: nothing is
computed) under the precision rules and lists every module that was called: its path,
class, and the param, compute and output dtypes and fp8 recipe it actually got, with
the rule that decided it. Use it to check that a regex matches what you meant.

Example:
  >>> import flax.linen as nn
  >>> model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
  >>> print(jaxmp.tools.summary(model, "p=f32,c=bf16,o=f32", jnp.ones((1, 3))))
  path      module      params   compute   output    fp8  rule
  --------  ----------  -------  --------  --------  ---  -------
  <root>    Sequential  float32  bfloat16  float32   -    default
  layers_0  Dense       float32  bfloat16  bfloat16  -    default
  layers_1  LayerNorm   float32  float32   bfloat16  -    norm
  layers_2  Dense       float32  bfloat16  bfloat16  -    default
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Sequence

import flax.linen as nn
import jax
from flax import nnx

from jaxmp._src import engine
from jaxmp._src import rules as rules_lib
from jaxmp._src.linen import wrapper as linen_lib
from jaxmp._src.nnx import wrapper as nnx_lib
from jaxmp._src.tools import table

_COLUMNS = ("path", "module", "params", "compute", "output", "fp8", "rule")


class SummaryRow(NamedTuple):
  """One module call in a :class:`PrecisionSummary`."""

  path: str
  module: str
  method: str
  param_dtype: str
  compute_dtype: str
  output_dtype: str
  fp8: str
  rule: str


def _rule_label(rules: rules_lib.PolicyRules, precision: rules_lib.ModulePrecision,
                module_type: type) -> str:
  if precision.rule is not None:
    return f"{rules.rules.index(precision.rule)}: {precision.rule.describe()}"
  if rules.float32_normalization and rules_lib.is_normalization(module_type):
    return "norm"
  return "default"


def _recipe_label(recipe: Any) -> str:
  return "-" if recipe is None else type(recipe).__name__


@dataclasses.dataclass(frozen=True)
class PrecisionSummary:
  """The rows of a precision table; ``str()`` renders it."""

  rows: tuple[SummaryRow, ...]

  def __str__(self) -> str:
    body = [
        (r.path if r.method == "__call__" else f"{r.path}.{r.method}", r.module, r.param_dtype,
         r.compute_dtype, r.output_dtype, r.fp8, r.rule) for r in self.rows]
    return table.text_table(_COLUMNS, body)


def rows_from_records(rules: rules_lib.PolicyRules,
                      records: list[linen_lib.CallRecord]) -> tuple[SummaryRow, ...]:
  """Summary rows for intercepted calls, one per (path, method), in call order."""
  rows = {}
  for r in records:
    key = (r.path, r.method)
    if key in rows:
      continue
    policy = r.precision.policy
    rows[key] = SummaryRow(
        path=engine.describe_path(r.path), module=r.module_type.__name__, method=r.method,
        param_dtype=policy.param_dtype.name, compute_dtype=policy.compute_dtype.name,
        output_dtype=r.output_dtype.name, fp8=_recipe_label(r.precision.fp8),
        rule=_rule_label(rules, r.precision, r.module_type))
  return tuple(rows.values())


def _linen_wrapper(model: Any, rules: Optional[rules_lib.PolicyOrRules]):
  if isinstance(model, linen_lib.MixedPrecision):
    return model if rules is None else linen_lib.mixed_precision(model.model, rules)
  if rules is None:
    raise ValueError("jaxmp.tools.summary needs rules (a policy or jaxmp.PolicyRules) when given "
                     f"an unwrapped model {type(model).__name__}.")
  return linen_lib.mixed_precision(model, rules)


def summary(model_or_wrapper: Any, rules: Optional[rules_lib.PolicyOrRules] = None,
            *args, variables: Any = None, rngs: Any = None, **kwargs) -> PrecisionSummary:
  """Resolves the precision of every module for one call of the model.

  An NNX model (or :func:`jaxmp.nnx.mixed_precision`'s wrapper) is called on a copy
  of itself under ``jax.eval_shape``: the model is not changed, not even its params'
  storage dtypes. It holds its own variables, so ``variables`` and ``rngs`` are for
  linen only; pick another method than ``__call__`` with ``method="name"``.

  Args:
    model_or_wrapper: a linen Module, an NNX Module, or what
      :func:`jaxmp.linen.mixed_precision` or :func:`jaxmp.nnx.mixed_precision`
      returned.
    rules: a policy or :class:`jaxmp.PolicyRules`; may be ``None`` for a wrapper.
    *args: the call's positional arguments (arrays or ``jax.ShapeDtypeStruct``).
    variables: the model's variables; without them the call is traced as ``init``.
    rngs: PRNG keys for the call (``jax.random.key(0)`` for ``init`` by default).
    **kwargs: the call's keyword arguments (``method=``, ``mutable=``, flags).

  Returns:
    A :class:`PrecisionSummary`; print it for the table.

  Raises:
    TypeError: if the model is not a linen Module, an NNX Module or a wrapper, or
      ``variables``/``rngs`` are given for an NNX model.

  Example:
    >>> import flax.linen as nn
    >>> rules = jaxmp.PolicyRules("p=f32,c=bf16,o=f32", [
    ...     jaxmp.Rule("layers_1", fp8=jaxmp.fp8.DelayedScaling())])
    >>> model = nn.Sequential([nn.Dense(4), nn.Dense(2)])
    >>> print(jaxmp.tools.summary(model, rules, jnp.ones((1, 3))))
    path      module      params   compute   output    fp8             rule
    --------  ----------  -------  --------  --------  --------------  -------------
    <root>    Sequential  float32  bfloat16  float32   -               default
    layers_0  Dense       float32  bfloat16  bfloat16  -               default
    layers_1  Dense       float32  bfloat16  bfloat16  DelayedScaling  0: 'layers_1'
  """
  used, records = trace_calls(model_or_wrapper, rules, *args, variables=variables, rngs=rngs,
                              **kwargs)
  return PrecisionSummary(rows_from_records(used, records))


def trace_calls(model_or_wrapper: Any, rules: Optional[rules_lib.PolicyOrRules] = None,
                *args, variables: Any = None, rngs: Any = None,
                **kwargs) -> tuple[rules_lib.PolicyRules, list[engine.CallRecord]]:
  """Traces one call abstractly, as :func:`summary` does; returns the rules and records.

  Takes what :func:`summary` takes.
  """
  if isinstance(model_or_wrapper, nnx.Module):
    if variables is not None or rngs is not None:
      raise TypeError("jaxmp.tools.summary: an NNX model holds its own variables and RNGs; "
                      "variables= and rngs= are for linen models.")
    method = kwargs.pop("method", "__call__")
    return nnx_lib.trace_abstract(model_or_wrapper, rules, method, args, kwargs)
  if not isinstance(model_or_wrapper, (nn.Module, linen_lib.MixedPrecision)):
    raise TypeError(f"jaxmp.tools.summary expects a flax linen Module, an NNX Module or a jaxmp "
                    f"wrapper, got {model_or_wrapper!r} of type "
                    f"{type(model_or_wrapper).__name__}.")
  wrapper = _linen_wrapper(model_or_wrapper, rules)
  records = []

  def call():
    if variables is None:
      fun = lambda: wrapper.model.init(  # pylint: disable=g-long-lambda
          jax.random.key(0) if rngs is None else rngs, *args, **kwargs)
    else:
      fun = lambda: wrapper.model.apply(variables, *args, rngs=rngs, **kwargs)
    _, calls = wrapper.trace(fun)
    records.extend(calls)

  jax.eval_shape(call)
  return wrapper.rules, records


__all__ = ("PrecisionSummary", "SummaryRow", "summary", "trace_calls")
