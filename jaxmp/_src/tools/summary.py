"""A per-module precision table: what each module was resolved to, and what it ran.

:func:`summary` traces one call of the model (``jax.make_jaxpr``: nothing is
computed) under the precision rules and lists every module that was called: its path,
class, the param, compute and output dtypes and fp8 recipe it was resolved to, the
rule that decided it, and, from the traced computation itself, the operand dtypes of
the matmuls and convolutions that ran in it (``ran``; ``-`` where it ran none of its
own). A module whose own code multiplied floating-point values of another dtype than
its resolved compute dtype (a layer with no ``dtype`` field that casts to float32
itself, say) is marked ``!`` and :func:`summary` warns with its path: a
:class:`~jaxmp.Rule` is the way to say that layer computes wider. (The fp8 and int8
operands of a recipe are what the rule asked for, never marked.) Use it to check that
a regex matches what you meant, and that the policy governs what actually runs.

Example:
  >>> import flax.linen as nn
  >>> model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
  >>> print(jaxmp.tools.summary(model, "p=f32,c=bf16,o=f32", jnp.ones((1, 3))))
  path      module      params   compute   output    fp8  rule     ran
  --------  ----------  -------  --------  --------  ---  -------  --------
  <root>    Sequential  float32  bfloat16  float32   -    default  -
  layers_0  Dense       float32  bfloat16  bfloat16  -    default  bfloat16
  layers_1  LayerNorm   float32  float32   bfloat16  -    norm     -
  layers_2  Dense       float32  bfloat16  bfloat16  -    default  bfloat16
"""

from __future__ import annotations

import collections
import dataclasses
import re
import warnings
from typing import Any
from typing import NamedTuple

import numpy as np

from jaxmp._src import adapter as adapter_lib
from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src import engine
from jaxmp._src import paths as paths_lib
from jaxmp._src import rules as rules_lib

# Imported to register the adapters that trace_calls (and the tools built on it) pick
# from: adapter.for_model knows only registered adapters, and a tool may be the first
# thing a user calls. The NNX adapter defines no NNX module until given an NNX model.
# (noqa: imported for that effect; an automatic fix once deleted them.)
from jaxmp._src.linen import adapter as _linen_adapter  # noqa: F401
from jaxmp._src.nnx import adapter as _nnx_adapter  # noqa: F401
from jaxmp._src.tools import table

_COLUMNS = ("path", "module", "params", "compute", "output", "fp8", "rule", "ran")
_MATMULS = ("dot_general", "conv_general_dilated")
_CALL = re.compile(re.escape(engine.ANNOTATION) + r"(\d+)")


class SummaryRow(NamedTuple):
  """One module (and method) in a :class:`PrecisionSummary`.

  Attributes:
    path: the module's path (``<root>`` for the root).
    module: its class name.
    method: the method called.
    param_dtype, compute_dtype, output_dtype: what it was resolved to.
    fp8: its fp8 recipe's class name, or ``-``.
    rule: the rule that decided it (``index: match``), ``norm`` or ``default``.
    ran: the operand dtypes of the matmuls and convolutions that ran in the module's
      own code (not its children's), comma-joined; ``-`` for none. Mixed operands
      read ``bfloat16*float32``.
    matmuls: how many matmul and convolution equations ran there (a loop body once).
    mismatch: whether a matmul multiplied floating-point operands of another dtype than
      ``compute_dtype`` (quantized operands, fp8 or int8, are never a mismatch: a
      recipe asks for them).
  """

  path: str
  module: str
  method: str
  param_dtype: str
  compute_dtype: str
  output_dtype: str
  fp8: str
  rule: str
  ran: str = "-"
  matmuls: int = 0
  mismatch: bool = False


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

  @property
  def mismatches(self) -> tuple[SummaryRow, ...]:
    """The rows whose code ran matmuls in another dtype than their compute dtype."""
    return tuple(r for r in self.rows if r.mismatch)

  def __str__(self) -> str:
    body = [
        (r.path if r.method == "__call__" else f"{r.path}.{r.method}", r.module, r.param_dtype,
         r.compute_dtype, r.output_dtype, r.fp8, r.rule, r.ran + (" !" if r.mismatch else ""))
        for r in self.rows]
    return table.text_table(_COLUMNS, body)


def _operand_class(eqn: Any) -> str:
  names = sorted({np.dtype(v.aval.dtype).name for v in eqn.invars})
  return "*".join(names)


def _sub_jaxprs(value: Any):
  if hasattr(value, "eqns"):
    yield value
  elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
    yield value.jaxpr
  elif isinstance(value, (tuple, list)):
    for item in value:
      yield from _sub_jaxprs(item)


def lowering_platform() -> str:
  """The platform ``lax.platform_dependent`` picks a branch for on JAX's default backend."""
  device = dtypes_lib.default_device()
  if device.platform == "gpu":
    return "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"
  return device.platform


def sub_jaxprs_that_run(eqn: Any, platform: str):
  """The jaxprs nested in ``eqn`` that run on ``platform``.

  A ``cond`` made by ``lax.platform_dependent`` runs one branch per platform (jaxmp's
  CUDA forms of fp8 GEMMs, fused attention, the finite check): only that one counts.
  """
  platforms = eqn.params.get("branches_platforms")
  if platforms is None:
    for value in eqn.params.values():
      yield from _sub_jaxprs(value)
    return
  index = next((i for i, names in enumerate(platforms) if names and platform in names),
               platforms.index(None))
  yield from _sub_jaxprs(eqn.params["branches"][index])


def _owner_index(name_stack: str) -> int | None:
  """The record index of the innermost annotated module call in a name stack."""
  found = list(_CALL.finditer(name_stack))
  if not found or engine.PARAM_ANNOTATION in name_stack[found[-1].end():]:
    return None  # outside any module call, or creating a param
  return int(found[-1].group(1))


def matmul_dtypes(jaxpr: Any, prefix: str = "",
                  platform: str | None = None) -> dict[int, collections.Counter]:
  """How many matmuls/convolutions of each operand dtype class each module call ran.

  Walks nested jaxprs (jit, scan, cond, remat, custom_vjp; a loop body counts once;
  of a ``lax.platform_dependent`` choice, the branch for ``platform``); an equation
  belongs to the innermost module call its name stack names
  (:data:`jaxmp._src.engine.ANNOTATION`).

  Args:
    jaxpr: a (closed) jaxpr.
    prefix: the name stack of the equation that holds ``jaxpr``.
    platform: the lowering platform (``"cpu"``, ``"cuda"``, ``"tpu"``...); by default
      that of JAX's default backend.

  Returns:
    Record index -> Counter of classes (``"bfloat16"``, ``"bfloat16*float32"``...).
  """
  platform = platform or lowering_platform()
  found: dict[int, collections.Counter] = {}
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    stack = f"{prefix}/{eqn.source_info.name_stack}"
    if eqn.primitive.name in _MATMULS:
      index = _owner_index(stack)
      if index is not None:
        found.setdefault(index, collections.Counter())[_operand_class(eqn)] += 1
    for sub in sub_jaxprs_that_run(eqn, platform):
      for index, counts in matmul_dtypes(sub, stack, platform).items():
        found.setdefault(index, collections.Counter()).update(counts)
  return found


def rows_from_records(rules: rules_lib.PolicyRules, records: list[engine.CallRecord],
                      ran: dict[int, collections.Counter] | None = None
                      ) -> tuple[SummaryRow, ...]:
  """Summary rows for module calls, one per (path, method), in call order.

  ``ran`` (from :func:`matmul_dtypes`) fills the ``ran``, ``matmuls`` and ``mismatch``
  columns.
  """
  ran = ran or {}
  classes: dict[tuple[str, str], collections.Counter] = {}
  rows = {}
  for index, r in enumerate(records):
    key = (r.path, r.method)
    classes.setdefault(key, collections.Counter()).update(ran.get(index, {}))
    if key in rows:
      continue
    policy = r.precision.policy
    rows[key] = SummaryRow(
        path=paths_lib.describe_path(r.path), module=r.module_type.__name__, method=r.method,
        param_dtype=policy.param_dtype.name, compute_dtype=policy.compute_dtype.name,
        output_dtype=r.output_dtype.name, fp8=_recipe_label(r.precision.fp8),
        rule=_rule_label(rules, r.precision, r.module_type))
  return tuple(
      row._replace(ran=",".join(sorted(classes[key])) or "-",
                   matmuls=sum(classes[key].values()),
                   mismatch=any(_mismatches(c, row.compute_dtype) for c in classes[key]))
      for key, row in rows.items())


def _mismatches(operand_class: str, compute_dtype: str) -> bool:
  """Whether a matmul of ``operand_class`` ("bfloat16*float32") computed in another dtype.

  Only floating-point operands that are not fp8 count: fp8 operands (an fp8 recipe) and
  integer ones (``Int8Scaling``: int8 x int8 -> int32) are asked for by a recipe.
  """
  return any(name != compute_dtype and dtypes_lib.is_float_dtype(name)
             and np.dtype(name) not in dtypes_lib.FP8_DTYPES
             for name in operand_class.split("*"))


def _warn_mismatches(summary: PrecisionSummary) -> None:
  if not summary.mismatches:
    return
  lines = [f"  {r.path} ({r.module}): ran {r.ran}, resolved compute {r.compute_dtype}"
           for r in summary.mismatches]
  warnings.warn(
      "jaxmp: these modules' own code computed in another dtype than their resolved "
      "compute dtype, which the wrapper cannot change (no dtype field, or a dtype fixed in "
      "the code):\n" + "\n".join(lines) + "\nGive them a jaxmp.Rule with the dtype they "
      "compute in to make the policy say so, or change the model's code.",
      UserWarning, stacklevel=3)


def summary(model_or_wrapper: Any, rules: rules_lib.PolicyOrRules | None = None,
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
    rules: a policy or :class:`jaxmp.PolicyRules`; ``None`` (or the wrapper's own
      rules) for a wrapper, which runs only its own.
    *args: the call's positional arguments (arrays or ``jax.ShapeDtypeStruct``).
    variables: the model's variables (those a tracing wrapper's ``init`` returned, with
      the non-finite probe, too); without them the call is traced as ``init``.
    rngs: PRNG keys for the call (``jax.random.key(0)`` for ``init`` by default).
    **kwargs: the call's keyword arguments (``method=``, ``mutable=``, flags).

  Returns:
    A :class:`PrecisionSummary`; print it for the table.

  Raises:
    TypeError: if the model is not a linen Module, an NNX Module or a wrapper, or
      ``variables``/``rngs`` are given for an NNX model.
    ValueError: for a wrapper with rules other than its own (summarise
      ``wrapper.model`` with them instead), or an unwrapped model without rules.

  Example:
    >>> import flax.linen as nn
    >>> rules = jaxmp.PolicyRules("p=f32,c=bf16,o=f32", [
    ...     jaxmp.Rule("layers_1", fp8=jaxmp.fp8.DelayedScaling())])
    >>> model = nn.Sequential([nn.Dense(4), nn.Dense(2)])
    >>> print(jaxmp.tools.summary(model, rules, jnp.ones((1, 3))))
    path      module      params   compute   output    fp8             rule           ran
    --------  ----------  -------  --------  --------  --------------  -------------  -------------
    <root>    Sequential  float32  bfloat16  float32   -               default        -
    layers_0  Dense       float32  bfloat16  bfloat16  -               default        bfloat16
    layers_1  Dense       float32  bfloat16  bfloat16  DelayedScaling  0: 'layers_1'  float8_e4m3fn
  """
  used, records, jaxpr = trace_calls(model_or_wrapper, rules, *args, variables=variables,
                                     rngs=rngs, **kwargs)
  result = PrecisionSummary(rows_from_records(used, records, matmul_dtypes(jaxpr)))
  _warn_mismatches(result)
  return result


def trace_calls(model_or_wrapper: Any, rules: rules_lib.PolicyOrRules | None = None,
                *args, variables: Any = None, rngs: Any = None,
                **kwargs) -> tuple[rules_lib.PolicyRules, list[engine.CallRecord], Any]:
  """Traces one call as :func:`summary` does; returns the rules, records and jaxpr.

  Takes what :func:`summary` takes.
  """
  adapter = adapter_lib.for_model(model_or_wrapper, "jaxmp.tools.summary")
  if isinstance(model_or_wrapper, engine.Wrapper) and rules is not None:
    given = rules_lib.as_rules(rules)
    if given != model_or_wrapper.rules:  # the table would show what the wrapper never runs
      raise ValueError(
          f"jaxmp.tools.summary: the wrapper runs its own rules, not the rules given "
          f"({given}); pass rules=None to see what it runs, or its model (wrapper.model) with "
          f"these rules.")
  return adapter.trace_abstract(model_or_wrapper, rules, args, kwargs, variables=variables,
                                rngs=rngs)


__all__ = ("PrecisionSummary", "SummaryRow", "lowering_platform", "matmul_dtypes",
           "sub_jaxprs_that_run", "summary", "trace_calls")
