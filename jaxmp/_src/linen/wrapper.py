"""Flax linen integration: run any linen model, unchanged, under per-module policies.

:func:`mixed_precision` wraps a linen Module with a policy or :class:`~jaxmp.PolicyRules`
and returns an object whose ``init`` and ``apply`` take exactly what the Module's take.
Inside, a Flax method interceptor (``flax.linen.intercept_methods``) resolves every
module call by its path and class and:

1. casts the call's floating-point inputs to the module's compute dtype (integer
   inputs such as token ids, bools, PRNG keys and non-array arguments are untouched);
2. hands the module its own params in its compute dtype (the float32 master copies
   stay where they are, so gradients come back in the param dtype);
3. swaps the dot_general of matmul layers whose rule has an fp8 recipe, and passes
   their fp8 state through Flax's lifted transforms (``nn.scan``, ``nn.vmap``,
   ``nn.remat``, ``nn.RNN``...) wherever the params go (``jaxmp._src.linen.lifted``);
4. casts the output to the caller's compute dtype (an override is local), to the
   dtype the rule names, or, for the outermost call, to the default output dtype.

``init`` stores each module's params in its param dtype. A module reads its
:data:`CACHE_COLLECTION` variables (the KV caches Flax's decoders write in place) in
its compute dtype and writes them in the dtypes they hold, so a float32 cache stays
float32 (:func:`jaxmp._src.engine.written`). Other collections (``batch_stats``, fp8
state, collections of the model's own) are never cast: a module that writes a value it
computed in place into one of another dtype fails with lax's error, which ``apply``
re-raises naming the variable and the fix (a decode cache belongs in
:data:`CACHE_COLLECTION`).

With ``PolicyRules(..., trace_nonfinite=True)``, ``init`` also returns the non-finite
probe (:mod:`jaxmp._src.nonfinite`) as the collection :data:`NONFINITE_COLLECTION`,
one row per (module path, method) that ``init`` called, and ``apply`` takes it from
the variables it is given (it never reaches the Module): differentiate it (as
:func:`jaxmp.linen.value_and_grad` does) to get the step's per-module statistics.

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

import contextlib
import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from jaxmp._src import engine
from jaxmp._src import nonfinite
from jaxmp._src import paths as paths_lib
from jaxmp._src import rules as rules_lib
from jaxmp._src import tree as tree_lib
from jaxmp._src.fp8 import state as fp8_state_lib
from jaxmp._src.linen import injection
from jaxmp._src.linen import lifted

CallRecord = engine.CallRecord

NONFINITE_COLLECTION = "jaxmp_nonfinite"
"""The variables collection that holds the non-finite probe of a tracing wrapper."""

CACHE_COLLECTION = "cache"
"""The collection of caches a module writes in place (Flax's decode caches)."""


def _params_in(module: nn.Module, dtype: np.dtype, call: engine.Call):
  """Makes ``module.param(...)`` return its value cast to ``dtype`` (storage unchanged)."""
  unbound_param = type(module).param

  def param(*args, **kwargs):
    with call.param_scope():
      value = unbound_param(module, *args, **kwargs)
    return tree_lib.cast_tree(value, dtype)

  return injection.instance_attribute(module, "param", param)


class _CacheVariable(nn.Variable):
  """A :data:`CACHE_COLLECTION` variable as a wrapped module sees it.

  Read in the module's compute dtype and written in the dtypes the variable holds
  (:meth:`jaxmp._src.engine.Call.read_cache`, :func:`jaxmp._src.engine.written`).
  """

  def __init__(self, variable: nn.Variable, read: Callable[[Any], Any]):
    super().__init__(variable.scope, variable.collection, variable.name, variable.unbox)
    self._read = read

  # nn.Variable.value is a property with a getter and a setter; typeshed types a
  # property's fget/fset as Optional.
  @property
  def value(self) -> Any:
    return self._read(nn.Variable.value.fget(self))  # pyright: ignore[reportOptionalCall]

  @value.setter
  def value(self, value: Any) -> None:
    nn.Variable.value.fset(  # pyright: ignore[reportOptionalCall]
        self, engine.written(value, nn.Variable.value.fget(self)))  # pyright: ignore[reportOptionalCall]


def _caches_in(module: nn.Module, dtype: np.dtype, call: engine.Call) -> contextlib.ExitStack:
  """Makes ``module`` read its caches in ``dtype`` and write them in their own dtypes."""
  cls = type(module)
  read = lambda value: call.read_cache(value, dtype)

  def variable(col, name, *args, **kwargs):
    found = cls.variable(module, col, name, *args, **kwargs)
    return _CacheVariable(found, read) if col == CACHE_COLLECTION else found

  def get_variable(col, name, default=None):
    if col != CACHE_COLLECTION or not module.has_variable(col, name):
      return cls.get_variable(module, col, name, default)
    return read(cls.get_variable(module, col, name))

  def put_variable(col, name, value):
    if col == CACHE_COLLECTION and module.has_variable(col, name):
      value = engine.written(value, cls.get_variable(module, col, name))
    cls.put_variable(module, col, name, value)

  stack = contextlib.ExitStack()
  for name, method in (("variable", variable), ("get_variable", get_variable),
                       ("put_variable", put_variable)):
    stack.enter_context(injection.instance_attribute(module, name, method))
  return stack


def _field_values(module: nn.Module, precision, call: engine.Call) -> dict[str, Any]:
  """The fields set while the module runs: ``dtype`` and ``attention_fn``."""
  fields = getattr(module, "__dataclass_fields__", {})
  chosen = {}
  if "dtype" in fields:
    chosen["dtype"] = call.dtype_field(module.dtype, precision)
  if "attention_fn" in fields:
    chosen["attention_fn"] = call.attention_field(module.attention_fn, precision)
  return {k: v for k, v in chosen.items() if v is not engine.NOT_A_DTYPE_FIELD}


def _attention_fn(module: nn.Module) -> Any:
  """The module's ``attention_fn`` field, or None where it has no such field."""
  if "attention_fn" in getattr(module, "__dataclass_fields__", {}):
    return module.attention_fn
  return None


def _module_in(module: nn.Module, precision, call: engine.Call) -> contextlib.ExitStack:
  """Params and caches read in the compute dtype, and the fields the engine chose."""
  stack = contextlib.ExitStack()
  stack.enter_context(_params_in(module, precision.policy.compute_dtype, call))
  stack.enter_context(_caches_in(module, precision.policy.compute_dtype, call))
  for name, value in _field_values(module, precision, call).items():
    stack.enter_context(injection.instance_attribute(module, name, value))
  return stack


class _Interceptor:
  """Hands every linen module call to the engine; keeps the engine's records."""

  def __init__(self, rules: rules_lib.PolicyRules, annotate: bool = False,
               hooks: Sequence[engine.CallHook] = ()):
    self.call = engine.Call(rules, injection.supports_fp8, annotate=annotate, hooks=hooks)

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
    if method == "setup":
      with _module_in(module, precision, self.call):
        return next_fun(*args, **kwargs)
    precision = self.call.attention_precision(path, type(module), precision,
                                              _attention_fn(module), context.orig_method,
                                              args, kwargs)
    if precision.fp8 is not None and method == "__call__":
      next_fun = injection.fp8_call(module, precision.fp8, next_fun)

    def run(*args, **kwargs):
      with _module_in(module, precision, self.call):
        return next_fun(*args, **kwargs)

    return self.call.run(path, type(module), method, precision, run, args, kwargs)


def _without_probe(variables: Any) -> Any:
  """``variables`` without a tracing wrapper's probe, which is jaxmp's, not the Module's."""
  if isinstance(variables, Mapping) and NONFINITE_COLLECTION in variables:
    return {k: v for k, v in variables.items() if k != NONFINITE_COLLECTION}
  return variables


def _refuse_probe(variables: Any) -> None:
  """Refuses a tracing wrapper's probe in the variables of a wrapper that does not trace."""
  if isinstance(variables, Mapping) and NONFINITE_COLLECTION in variables:
    raise ValueError(
        f"jaxmp: this wrapper does not trace non-finite values (its rules have "
        f"trace_nonfinite=False), but the variables hold the {NONFINITE_COLLECTION!r} "
        f"collection: the probe of a tracing wrapper, which this one would not fill. Drop "
        f"it ({{k: v for k, v in variables.items() if k != {NONFINITE_COLLECTION!r}}}; "
        f"TrainState.with_rules drops it itself), or keep tracing: "
        f"PolicyRules(..., trace_nonfinite=True).")


# Collections a module reads and writes in their own dtype by design: batch statistics
# (their layers compute them in float32) and sow-n intermediates (written, not read).
_OWN_DTYPE_COLLECTIONS = ("batch_stats", "intermediates")


def _uncast_state(variables: Any) -> list[str]:
  """The floating-point variables ``apply`` neither casts nor reads as caches, described."""
  if not isinstance(variables, Mapping):
    return []
  kept = ("params", CACHE_COLLECTION, fp8_state_lib.OVERWRITE_WITH_GRADIENT,
          *_OWN_DTYPE_COLLECTIONS)
  described = []
  for collection, tree in variables.items():
    if collection in kept:
      continue
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if tree_lib.is_float_array(leaf):
        name = "/".join([str(collection), *(str(getattr(k, "key", k)) for k in path)])
        described.append(f"{name!r} ({leaf.dtype.name})")
  return described


def _path_tuple(path: str) -> tuple[str, ...]:
  return tuple(path.split("/")) if path else ()


def _param_dtypes_by_path(records: list[CallRecord]) -> dict[tuple[str, ...], np.dtype]:
  return {_path_tuple(r.path): r.precision.policy.param_dtype for r in records}


def _cast_params_to_storage(params: Any, dtypes: dict[tuple[str, ...], np.dtype],
                            default: np.dtype) -> Any:
  """Casts each param to its owning module's param dtype.

  A param belongs to the nearest enclosing module path that was called; params of
  modules that were never called keep the default param dtype.
  """

  def visit(node, path):
    if isinstance(node, Mapping):
      return {k: visit(v, path + (k,)) for k, v in node.items()}
    dtype = paths_lib.owner(path, dtypes)
    return tree_lib.cast_tree(node, default if dtype is None else dtype)

  return visit(params, ())


def _fp8_layer_names() -> str:
  return ", ".join(f"nn.{t.__name__}" for t in injection.FP8_LAYER_TYPES)


@dataclasses.dataclass(frozen=True, eq=False)
class MixedPrecision(engine.Wrapper):
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
  # The class of every module a trace of this wrapper ran, by path: a host-side memo of
  # facts about the model (like _warned), filled by trace(), which init, apply and
  # summary go through, so that with_rules and module_types need no example inputs.
  _module_types: dict = dataclasses.field(default_factory=dict, repr=False)
  # The dtype init stored each floating-point param in, by path: with _module_types,
  # what with_rules checks new rules against (they must store every param as it is).
  _param_dtypes: dict = dataclasses.field(default_factory=dict, repr=False)

  def trace(self, fun: Callable[[], Any], *, annotate: bool = False,
            hooks: Sequence[engine.CallHook] = ()) -> tuple[Any, list[CallRecord]]:
    """Runs ``fun`` under this wrapper's interceptor; returns its result and the calls.

    With ``annotate``, each module call runs in a named scope naming its record (see
    ``jaxmp._src.engine.ANNOTATION``); ``hooks`` run around each module call
    (``jaxmp._src.engine.CallHook``).
    """
    interceptor = _Interceptor(self.rules, annotate, hooks)
    with (nn.intercept_methods(interceptor), interceptor.call,
          lifted.fp8_state_follows_params()):
      out = fun()
    self._warn_unused(interceptor.records, interceptor.call.attention_rules_reached)
    self._module_types.update((r.path, r.module_type) for r in interceptor.records)
    return out, interceptor.records

  def module_types(self) -> dict[str, type]:
    """The class of every module this wrapper has run, by '/'-joined path.

    Linen builds submodules only while the model runs, so this is what ``init``,
    ``apply`` (traced once under ``jit``) or :func:`jaxmp.tools.summary` saw; empty
    before the first of them. A wrapper made by :meth:`with_rules` starts with its
    parent's.
    """
    return dict(self._module_types)

  def with_rules(self, rules: rules_lib.PolicyRules) -> MixedPrecision:
    """The same model under other rules; the variables it takes are the same.

    Nothing is re-initialised: ``apply`` of the new wrapper takes the variables this
    one's ``init`` returned (the fp8 state of a layer the new rules leave without a
    recipe stays in the variables, unused). The params stay in the dtypes they are
    stored in, so the new rules must store each param ``init`` made in that dtype:
    another param dtype is refused, as by NNX's ``with_rules``. A jitted step that
    closes over or is given ``apply`` traces again once, because the wrapper is a new
    static value. :class:`jaxmp.tools.PrecisionController` changes precision this way.

    Args:
      rules: the new :class:`jaxmp.PolicyRules`.

    Returns:
      A new :class:`MixedPrecision`; this one is unchanged.

    Raises:
      TypeError: if ``rules`` is not a :class:`jaxmp.PolicyRules`.
      ValueError: if the new rules store a param this wrapper's ``init`` made in
        another dtype (to store params in another dtype, ``init`` a wrapper with those
        rules, or cast the params and make their optimizer state again).

    Example:
      >>> import flax.linen as nn
      >>> model = jaxmp.linen.mixed_precision(nn.Dense(2), "p=f32,c=bf16,o=f32")
      >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> wider = model.with_rules(jaxmp.PolicyRules("float32"))
      >>> wider.model is model.model, wider.apply(variables, jnp.ones((1, 3))).dtype
      (True, dtype('float32'))
    """
    rules = rules_lib.check_rules(rules, "with_rules")
    modules = {_path_tuple(path): rules.resolve(path, cls).policy.param_dtype
               for path, cls in self._module_types.items()}
    for path, stored in self._param_dtypes.items():
      wanted = paths_lib.owner(path, modules) or rules.default.param_dtype
      if wanted != stored:
        raise engine.param_storage_error(
            "/".join(path), stored, wanted,
            "init a wrapper with these rules to store params in them, or cast the params "
            "to them yourself and make their optimizer state again")
    return MixedPrecision(self.model, rules, _module_types=dict(self._module_types),
                          _param_dtypes=dict(self._param_dtypes))

  def init_with_output(self, rngs, *args, **kwargs) -> tuple[Any, Any]:
    """Like ``Module.init_with_output``; params are stored in their param dtypes.

    A tracing wrapper's variables also hold the non-finite probe.
    """
    (out, variables), records = self.trace(
        lambda: self.model.init_with_output(rngs, *args, **kwargs))
    return out, self._store_params(variables, records)

  def init(self, rngs, *args, **kwargs) -> Any:
    """Like ``Module.init``; params are stored in their modules' param dtypes.

    A tracing wrapper's variables also hold the non-finite probe.
    """
    variables, records = self.trace(lambda: self.model.init(rngs, *args, **kwargs))
    return self._store_params(variables, records)

  def apply(self, variables, *args, **kwargs) -> Any:
    """Like ``Module.apply``, with every module computing in its resolved precision.

    Raises:
      ValueError: for a tracing wrapper, if ``variables`` holds no non-finite probe;
        for one that does not trace, if they hold one (the variables of a tracing
        wrapper: drop its collection, :data:`NONFINITE_COLLECTION`).
      TypeError: where a module writes a value it computed in place into
        floating-point state of another dtype that jaxmp does not read as a cache
        (a collection other than ``"cache"``): lax's error, with the
        state and the fix named.
    """
    probe = None
    if self.rules.trace_nonfinite:
      variables, probe = self._take_probe(variables)
    else:
      _refuse_probe(variables)
    try:
      out, _ = self.trace(lambda: self.model.apply(variables, *args, **kwargs),
                          hooks=nonfinite.hooks(self.rules, probe))
    except TypeError as error:
      explained = engine.uncast_state_error(
          error, _uncast_state(variables), f"the {CACHE_COLLECTION!r} collection",
          f"a variable of the {CACHE_COLLECTION!r} collection (Flax's collection for "
          f"decode caches)")
      if explained is None:
        raise
      raise explained from error
    return out

  def nonfinite_probe(self, variables, *args, **kwargs) -> Any:
    """The non-finite probe for ``apply(variables, *args, **kwargs)``.

    ``init`` returns a probe for the calls it makes; a call that makes others (another
    ``method=``, say) needs its own: put it in the variables under
    :data:`NONFINITE_COLLECTION`. Traced abstractly: nothing is computed.

    Raises:
      ValueError: if the wrapper's rules do not trace.
    """
    if not self.rules.trace_nonfinite:
      raise ValueError("nonfinite_probe: this wrapper does not trace non-finite values; "
                       "wrap the model with PolicyRules(..., trace_nonfinite=True).")
    variables = _without_probe(variables)
    records = []
    jax.eval_shape(lambda: records.extend(self.trace(
        lambda: self.model.apply(variables, *args, **kwargs))[1]))
    return nonfinite.probe(nonfinite.calls_of(records))

  def _take_probe(self, variables):
    if not isinstance(variables, Mapping) or NONFINITE_COLLECTION not in variables:
      keys = sorted(map(str, variables)) if isinstance(variables, Mapping) else variables
      raise ValueError(
          f"jaxmp: this wrapper traces non-finite values (PolicyRules(trace_nonfinite="
          f"True)), so apply needs the variables model.init returned, with their "
          f"{NONFINITE_COLLECTION!r} collection (the probe); got {keys!r}. Pass "
          f"{{**variables, {NONFINITE_COLLECTION!r}: model.nonfinite_probe(variables, ...)}} "
          f"for variables of your own.")
    variables = dict(variables)
    return variables, variables.pop(NONFINITE_COLLECTION)

  def _store_params(self, variables, records):
    if self.rules.trace_nonfinite:
      variables = {**variables,
                   NONFINITE_COLLECTION: nonfinite.probe(nonfinite.calls_of(records))}
    if "params" not in variables:
      return variables
    params = _cast_params_to_storage(variables["params"], _param_dtypes_by_path(records),
                                     self.rules.default.param_dtype)
    self._param_dtypes.update(
        (tuple(str(getattr(k, "key", k)) for k in path), np.dtype(leaf.dtype))
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        if tree_lib.is_float_array(leaf))
    return {**variables, "params": params}

  def _warn_unused(self, records: list[CallRecord], attention_rules_reached: set[int]) -> None:
    engine.warn_unused_rules(type(self.model).__name__, self.rules, records,
                             _fp8_layer_names(),
                             attention_rules_reached=attention_rules_reached,
                             already_warned=self._warned, stacklevel=4)


def trace_abstract(model_or_wrapper: Any, rules: rules_lib.PolicyOrRules | None,
                   args: tuple, kwargs: dict, *, variables: Any = None, rngs: Any = None
                   ) -> tuple[rules_lib.PolicyRules, list[CallRecord], Any]:
  """Traces one ``init`` or ``apply`` abstractly; for :func:`jaxmp.tools.summary`.

  Traces with ``jax.make_jaxpr``, every module call annotated
  (:data:`jaxmp._src.engine.ANNOTATION`) and param creation apart
  (:data:`jaxmp._src.engine.PARAM_ANNOTATION`); nothing is computed.

  Args:
    model_or_wrapper: a linen Module or a :class:`MixedPrecision`.
    rules: a policy or rules; ``None`` keeps a wrapper's own.
    args: the call's positional arguments (arrays or ``jax.ShapeDtypeStruct``).
    kwargs: its keyword arguments (``method=``, ``mutable=``, flags).
    variables: the model's variables; without them the call is traced as ``init``. A
      tracing wrapper's probe (:data:`NONFINITE_COLLECTION`) among them is left out.
    rngs: PRNG keys for the call (``jax.random.key(0)`` for ``init`` by default).

  Returns:
    The rules used, the call records and the traced ``ClosedJaxpr``.

  Raises:
    ValueError: if ``rules`` is ``None`` for an unwrapped model.
  """
  if isinstance(model_or_wrapper, MixedPrecision):
    wrapper = model_or_wrapper if rules is None else mixed_precision(model_or_wrapper.model,
                                                                       rules)
  elif rules is None:
    raise ValueError("jaxmp.tools.summary needs rules (a policy or jaxmp.PolicyRules) when "
                     f"given an unwrapped model {type(model_or_wrapper).__name__}.")
  else:
    wrapper = mixed_precision(model_or_wrapper, rules)
  # A summary traces no non-finite values: the identities change no dtype.
  variables = _without_probe(variables)
  records: list[CallRecord] = []
  # Array leaves (ShapeDtypeStructs included) are traced; everything else is static.
  is_array = lambda x: isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))
  leaves, treedef = jax.tree_util.tree_flatten((variables, rngs, args, kwargs))
  arrays = [x for x in leaves if is_array(x)]

  def call(arrays):
    it = iter(arrays)
    variables, rngs, args, kwargs = jax.tree_util.tree_unflatten(
        treedef, [next(it) if is_array(x) else x for x in leaves])
    if variables is None:
      fun = lambda: wrapper.model.init(  # pylint: disable=g-long-lambda
          jax.random.key(0) if rngs is None else rngs, *args, **kwargs)
    else:
      fun = lambda: wrapper.model.apply(variables, *args, rngs=rngs, **kwargs)
    out, calls = wrapper.trace(fun, annotate=True)
    records.extend(calls)
    return out

  jaxpr = jax.make_jaxpr(call)(arrays)
  return wrapper.rules, records, jaxpr


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


__all__ = ("NONFINITE_COLLECTION", "CallRecord", "MixedPrecision", "mixed_precision",
           "trace_abstract")
