"""Flax linen integration: run any linen model, unchanged, under per-module policies.

:func:`mixed_precision` wraps a linen Module with a policy or :class:`~jaxmp.PolicyRules`
and returns an object whose ``init`` and ``apply`` take exactly what the Module's take.
Inside, a Flax method interceptor (``flax.linen.intercept_methods``) resolves every
module call by its path and class and:

1. casts the call's floating-point inputs to the module's compute dtype (integer
   inputs such as token ids, bools, PRNG keys and non-array arguments are untouched);
2. hands the module its own params in its compute dtype (the float32 master copies
   stay where they are, so gradients come back in the param dtype);
3. swaps the dot_general of matmul layers whose rule has an fp8 recipe;
4. casts the output to the caller's compute dtype (an override is local), to the
   dtype the rule names, or, for the outermost call, to the default output dtype.

``init`` stores each module's params in its param dtype. Other collections
(``batch_stats``, caches, fp8 state) are never cast.

Example:
  >>> import flax.linen as nn
  >>> model = jaxmp.linen.mixed_precision(
  ...     nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)]),
  ...     "params=float32,compute=bfloat16,output=float32")
  >>> variables = model.init(jax.random.key(0), jnp.ones((4, 3)))
  >>> variables["params"]["layers_0"]["kernel"].dtype
  dtype('float32')
  >>> model.apply(variables, jnp.ones((4, 3))).dtype
  dtype('float32')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import flax.linen as nn
import numpy as np

from jaxmp._src import engine
from jaxmp._src import rules as rules_lib
from jaxmp._src import tree as tree_lib
from jaxmp._src.linen import injection

CallRecord = engine.CallRecord


def _params_in(module: nn.Module, dtype: np.dtype):
  """Makes ``module.param(...)`` return its value cast to ``dtype`` (storage unchanged)."""
  unbound_param = type(module).param

  def param(*args, **kwargs):
    return tree_lib.cast_tree(unbound_param(module, *args, **kwargs), dtype)

  return injection.instance_attribute(module, "param", param)


class _Interceptor:
  """Hands every linen module call to the engine; keeps the engine's records."""

  def __init__(self, rules: rules_lib.PolicyRules):
    self.call = engine.Call(rules, injection.supports_fp8)

  @property
  def records(self) -> list[CallRecord]:
    return self.call.records

  def __call__(self, next_fun: Callable, args, kwargs, context):
    module, method = context.module, context.method_name
    # Lifted transforms (nn.scan, nn.remat, ...) call their wrapped module through
    # anonymous functions on a detached scope; the real call is intercepted inside.
    # Private helpers run inside a public method that already set the precision up.
    if (method.startswith("<") or (method.startswith("_") and method != "__call__")
        or isinstance(module, injection.FP8_MODULE_TYPES)):
      return next_fun(*args, **kwargs)
    path = "/".join(module.path)
    precision = self.call.resolve(path, type(module))
    compute = precision.policy.compute_dtype
    if method == "setup":
      with _params_in(module, compute):
        return next_fun(*args, **kwargs)
    if precision.fp8 is not None and method == "__call__":
      next_fun = injection.fp8_call(module, precision.fp8, next_fun)

    def run(*args, **kwargs):
      with _params_in(module, compute):
        return next_fun(*args, **kwargs)

    return self.call.run(path, type(module), method, precision, run, args, kwargs)


def _param_dtypes_by_path(records: list[CallRecord]) -> dict[tuple[str, ...], np.dtype]:
  return {tuple(r.path.split("/")) if r.path else (): r.precision.policy.param_dtype
          for r in records}


def _cast_params_to_storage(params: Any, dtypes: dict[tuple[str, ...], np.dtype],
                            default: np.dtype) -> Any:
  """Casts each param to its owning module's param dtype.

  A param belongs to the nearest enclosing module path that was called; params of
  modules that were never called keep the default param dtype.
  """

  def visit(node, path):
    if isinstance(node, Mapping):
      return {k: visit(v, path + (k,)) for k, v in node.items()}
    dtype = engine.owner(path, dtypes)
    return tree_lib.cast_tree(node, default if dtype is None else dtype)

  return visit(params, ())


def _fp8_layer_names() -> str:
  return ", ".join(t.__name__ for t in injection.FP8_LAYER_TYPES)


@dataclasses.dataclass(frozen=True, eq=False)
class MixedPrecision:
  """A linen model under per-module precision rules; built by :func:`mixed_precision`.

  ``init``, ``init_with_output`` and ``apply`` take exactly what the wrapped Module's
  methods of the same names take (rngs, ``mutable=``, ``method=``,
  ``capture_intermediates=``, extra keyword arguments) and return the same things.

  Attributes:
    model: the wrapped linen Module, unchanged.
    rules: the resolved :class:`~jaxmp.PolicyRules`.

  Example:
    >>> import flax.linen as nn
    >>> rules = jaxmp.PolicyRules("p=f32,c=bf16,o=f32", [jaxmp.Rule("layers_1", "bf16")])
    >>> model = jaxmp.linen.mixed_precision(nn.Sequential([nn.Dense(4), nn.Dense(2)]), rules)
    >>> x = jnp.ones((1, 3))
    >>> out, variables = model.init_with_output(jax.random.key(0), x)
    >>> jax.tree.map(lambda p: p.dtype.name, variables["params"])
    {'layers_0': {'bias': 'float32', 'kernel': 'float32'},
     'layers_1': {'bias': 'bfloat16', 'kernel': 'bfloat16'}}
    >>> model.apply(variables, x).dtype
    dtype('float32')
  """

  model: nn.Module
  rules: rules_lib.PolicyRules
  _warned: set = dataclasses.field(default_factory=set, repr=False)

  def trace(self, fun: Callable[[], Any]) -> tuple[Any, list[CallRecord]]:
    """Runs ``fun`` under this wrapper's interceptor; returns its result and the calls."""
    interceptor = _Interceptor(self.rules)
    with nn.intercept_methods(interceptor):
      out = fun()
    self._warn_unused(interceptor.records)
    return out, interceptor.records

  def init_with_output(self, rngs, *args, **kwargs) -> tuple[Any, Any]:
    """Like ``Module.init_with_output``; params are stored in their param dtypes."""
    (out, variables), records = self.trace(
        lambda: self.model.init_with_output(rngs, *args, **kwargs))
    return out, self._store_params(variables, records)

  def init(self, rngs, *args, **kwargs) -> Any:
    """Like ``Module.init``; params are stored in their modules' param dtypes."""
    variables, records = self.trace(lambda: self.model.init(rngs, *args, **kwargs))
    return self._store_params(variables, records)

  def apply(self, variables, *args, **kwargs) -> Any:
    """Like ``Module.apply``, with every module computing in its resolved precision."""
    out, _ = self.trace(lambda: self.model.apply(variables, *args, **kwargs))
    return out

  def _store_params(self, variables, records):
    if "params" not in variables:
      return variables
    params = _cast_params_to_storage(variables["params"], _param_dtypes_by_path(records),
                                     self.rules.default.param_dtype)
    return {**variables, "params": params}

  def _warn_unused(self, records: list[CallRecord]) -> None:
    engine.warn_unused_rules(type(self.model).__name__, self.rules, records,
                             _fp8_layer_names(), already_warned=self._warned, stacklevel=4)


def mixed_precision(model: nn.Module,
                    policy_or_rules: rules_lib.PolicyOrRules) -> MixedPrecision:
  """Wraps a linen model so that each module computes in its resolved precision.

  Args:
    model: an (unbound) ``flax.linen.Module``; its code is not changed.
    policy_or_rules: a policy for every module (any form :func:`jaxmp.get_policy`
      takes) or :class:`jaxmp.PolicyRules` with per-module overrides.

  Returns:
    A :class:`MixedPrecision` with ``init``, ``init_with_output`` and ``apply``.

  Raises:
    TypeError: if ``model`` is not a linen Module, or ``policy_or_rules`` is neither a
      policy nor rules.

  Example:
    >>> import flax.linen as nn
    >>> rules = jaxmp.PolicyRules("p=f32,c=bf16,o=f32", [jaxmp.Rule(r"layers_2", "f32")])
    >>> model = jaxmp.linen.mixed_precision(
    ...     nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)]), rules)
    >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> model.apply(variables, jnp.ones((1, 3))).dtype
    dtype('float32')
  """
  if isinstance(model, MixedPrecision):
    raise TypeError("mixed_precision got a model that is already wrapped; wrap the "
                    "original linen Module once, with all its rules.")
  if not isinstance(model, nn.Module):
    raise TypeError(
        f"jaxmp.linen.mixed_precision expects a flax.linen.Module, got {model!r} of type "
        f"{type(model).__name__}. For flax.nnx models use jaxmp.nnx.mixed_precision.")
  if model.scope is not None:
    raise TypeError(f"jaxmp.linen.mixed_precision expects an unbound Module; "
                    f"{type(model).__name__} is bound. Pass the Module before .bind().")
  return MixedPrecision(model, rules_lib.as_rules(policy_or_rules))


__all__ = ("CallRecord", "MixedPrecision", "mixed_precision")
