"""Flax NNX integration: run any NNX model, unchanged, under per-module policies.

:func:`mixed_precision` wraps an ``nnx.Module`` with a policy or
:class:`~jaxmp.PolicyRules` and returns a :class:`MixedPrecision`, itself an
``nnx.Module`` called like the model. Its ``model`` attribute *is* the model: the
parameters are the model's own ``nnx.Param`` variables, stored in their param dtype,
so ``nnx.state``, ``nnx.split``/``merge``, ``nnx.jit``, ``nnx.grad`` and
``nnx.Optimizer`` see them as usual. Rules resolve exactly as for linen, by class
and by path; a module's path is its attribute path joined with '/'
(``"blocks/0/attn/query"``; the root is ``""``).

How a call works. NNX has no method interceptor, so each call of the wrapper runs the
model on a private copy, the way ``nnx.jit`` runs a function on a merged copy of its
inputs:

1. the model (and any graph nodes among the arguments, such as an ``nnx.Rngs``) is
   split and merged again with fresh variables (``nnx.merge(..., copy=True)``);
2. in the copy, every ``nnx.Param`` holds its value cast to the compute dtype of the
   module that owns it (the nearest enclosing module), and every module's class is
   swapped for a generated subclass whose ``__call__`` and public methods cast
   floating-point inputs to the module's compute dtype and the output to the
   caller's compute dtype (an override is local), to the dtype the rule names, or,
   for the outermost call, to the default output dtype. Integer inputs, bools, PRNG
   keys and graph nodes (``nnx.Rngs``, variables, modules) are never cast. An
   ``nnx.Cache`` (a KV cache the model writes in place) holds its value in the
   compute dtype of its module, as an input would be; so does one a module is handed
   among its arguments (a decoder's per-layer cache objects), while that module runs,
   going back to the caller in the dtype it came in. Other non-param variables
   (``BatchStat``, fp8 state, a plain ``nnx.Variable``) are not cast: an in-place
   update that meets one in another dtype fails with lax's error, re-raised naming
   the variable and the fix (make a cache an ``nnx.Cache``). The module's path and
   precision ride on the copy as a static attribute, so modules that NNX transforms
   inside the model (``nnx.scan``, ``nnx.vmap``, ``nnx.remat``) split and merge again
   keep them;
3. layers an fp8 rule matches (``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``
   and the projections of ``nnx.MultiHeadAttention``) compute their product with the
   :class:`~jaxmp.nnx.Fp8DotGeneral`/:class:`~jaxmp.nnx.Fp8Einsum` the
   wrapper created for them, whose :class:`~jaxmp.nnx.Fp8State` lives in the
   wrapper's ``fp8`` dict, keyed by layer path;
4. after the call, the variables the model changed (batch statistics, RNG counts,
   caches, ``sow``-n intermediates) are written back to the model's own variables;
   a param or cache the model itself overwrote is written back in the dtype it is
   stored in (:func:`jaxmp._src.engine.written`), so a float32 cache stays float32.
   Nothing else of the model is touched: the casts, class swaps and traced values
   live and die with the copy, even when the call raises.

Gradients flow through the casts to the stored params, so they come back in the param
dtype. Params are cast to their param dtype once, by :func:`mixed_precision`.

Training with fp8 state or loss scaling: :func:`value_and_grad` differentiates with
respect to the params and the fp8 state together (repeated uses take the max), scaled
by the loss scale, and :func:`apply_gradients` steps an ``nnx.Optimizer`` on the
params and merges the fp8 state (kept on a skipped step or where a layer got no
cotangent), mirroring :mod:`jaxmp.linen` for linen. ``nnx.Optimizer.step`` counts
every update, skipped ones included; the inner Optax state (Adam's ``count``, and so
its bias correction and any schedule) does not advance on a step
:func:`jaxmp.loss_scaling` skips, so read the number of applied steps from there.

fp8 layers of a stack (a module built by ``nnx.vmap``, applied by ``nnx.scan`` or
``nnx.vmap``) get stacked fp8 state, one scale and history per layer with the layer
axes first (sharded as the kernel's layer axes are, where its metadata names them),
held by the layer's copy as its child for the call: the transform that slices the
layer's params slices its state, so each layer quantizes with its own scales.

What it cannot do: a module called directly through its class's unbound function
(``nnx.remat(Block.__call__)(block, x)``) runs unwrapped itself (its children are
still wrapped); variables in NNX's ``ref``/``hijax`` modes are not supported.

Example:
  >>> from flax import nnx
  >>> model = nnx.Sequential(nnx.Linear(3, 8, rngs=nnx.Rngs(0)), nnx.LayerNorm(8, rngs=nnx.Rngs(0)),
  ...                        nnx.Linear(8, 2, rngs=nnx.Rngs(0)))
  >>> wrapped = jaxmp.nnx.mixed_precision(model, "params=float32,compute=bfloat16,output=float32")
  >>> wrapped(jnp.ones((4, 3))).dtype
  dtype('float32')
  >>> wrapped.model.layers[0].kernel[...].dtype   # stored in the param dtype
  dtype('float32')
  >>> grads = nnx.grad(lambda m, x: m(x).sum())(wrapped, jnp.ones((4, 3)))
  >>> grads["model"]["layers"][0]["kernel"][...].dtype
  dtype('float32')
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import types
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import flax.linen as linen
import jax
import numpy as np
from flax import nnx
from flax.nnx import graphlib

from jaxmp._src import engine
from jaxmp._src import paths as paths_lib
from jaxmp._src import policy as policy_lib
from jaxmp._src import rules as rules_lib
from jaxmp._src import tree as tree_lib
from jaxmp._src.nnx import fp8 as fp8_nnx
from jaxmp._src.nnx import nonfinite as nonfinite_nnx

CallRecord = engine.CallRecord

_CONTAINER_TYPES = (nnx.List, nnx.Dict)
_CALL_ATTRIBUTE = "_jaxmp_call"
# Names nnx.Module itself defines (sow, iter_modules, train, eval, ...): NNX
# machinery, never intercepted.
_MODULE_NAMES = frozenset(dir(nnx.Module))


def _is_node(x: Any) -> bool:
  return graphlib.is_graph_node(x) or isinstance(x, nnx.Variable)


def _path_str(path: tuple) -> str:
  return "/".join(str(k) for k in path)


def _path_order(path: tuple) -> tuple:
  return tuple((0, k, "") if isinstance(k, int) else (1, 0, str(k)) for k in path)


# ---- interception ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _ModuleCall:
  """What a module of the private copy needs to know; hashed by identity.

  Stored on the copy as a static attribute, so it survives NNX transforms inside the
  model, which put static attributes in their graphdefs.
  """

  path: str
  module_type: type
  precision: rules_lib.ModulePrecision
  call: engine.Call


def _intercepted(name: str, attribute: Any) -> Callable[..., Any]:
  def method(self, *args, **kwargs):
    # Looked up at call time in the model's class (the generated class is always the
    # instance's own), so that later changes to it, such as
    # nnx.capture(method_outputs=...), are seen.
    bound = getattr(super(type(self), self), name)
    module_call = vars(self).get(_CALL_ATTRIBUTE)
    if module_call is None:
      return bound(*args, **kwargs)
    call = module_call.call
    precision = call.attention_precision(module_call.path, module_call.module_type,
                                         module_call.precision,
                                         vars(self).get("attention_fn"), bound, args, kwargs)
    with _attention_fn_in(self, precision, call), _argument_caches_read(module_call,
                                                                        (args, kwargs)):
      return call.run(module_call.path, module_call.module_type, name, precision, bound,
                      args, kwargs)

  if isinstance(attribute, types.FunctionType):
    functools.update_wrapper(method, attribute)
  else:
    method.__name__ = name
  return method


@contextlib.contextmanager
def _attention_fn_in(module: nnx.Module, precision: rules_lib.ModulePrecision,
                     call: engine.Call) -> Iterator[None]:
  """The copy's ``attention_fn`` while one call of it runs: what the engine chose.

  Per call, as linen's fields are: a module called as self- and as cross-attention
  computes each call as its own precision says (:meth:`engine.Call.attention_precision`).
  """
  attributes = vars(module)
  chosen = (call.attention_field(attributes["attention_fn"], precision)
            if "attention_fn" in attributes else engine.NOT_A_DTYPE_FIELD)
  if chosen is engine.NOT_A_DTYPE_FIELD:
    yield
    return
  original = attributes["attention_fn"]
  object.__setattr__(module, "attention_fn", chosen)
  try:
    yield
  finally:
    object.__setattr__(module, "attention_fn", original)


@contextlib.contextmanager
def _argument_caches_read(module_call: _ModuleCall, arguments: Any) -> Iterator[None]:
  """The caches a module is handed, read in its compute dtype while it runs.

  A cache the caller owns (an ``nnx.Cache`` variable among the call's arguments, or
  held by a module among them: a decoder's per-layer cache objects) is an input of
  the module, as the module's own caches are (:meth:`MixedPrecision._prepare`): read
  in the module's compute dtype (:meth:`jaxmp._src.engine.Call.read_cache`), so that
  an in-place update (``lax.dynamic_update_slice``) sees one dtype, and written back
  when the module returns in the dtype the caller handed it in
  (:func:`jaxmp._src.engine.written`; a cache the module did not write keeps its bits).
  """
  dtype = module_call.precision.policy.compute_dtype
  held = [(variable, variable.get_raw_value()) for variable in _caches_among(arguments)]
  given = [module_call.call.read_cache(value, dtype) for _, value in held]
  for (variable, _), value in zip(held, given):
    variable.set_raw_value(value)
  try:
    yield
  finally:
    for (variable, stored), value in zip(held, given):
      variable.set_raw_value(engine.written(variable.get_raw_value(), stored, value))


def _caches_among(arguments: Any) -> list[nnx.Variable]:
  """The ``nnx.Cache`` variables among ``arguments``'s graph nodes and in them, once each."""
  caches: dict[int, nnx.Variable] = {}
  for node in jax.tree_util.tree_leaves(arguments, is_leaf=_is_node):
    if isinstance(node, nnx.Variable):
      if isinstance(node, nnx.Cache):
        caches[id(node)] = node
    elif graphlib.is_graph_node(node):
      caches.update((id(v), v) for _, v in _variables(node, nnx.Cache))
  return list(caches.values())


def _public_methods(cls: type) -> dict[str, Any]:
  methods = {}
  for name in dir(cls):
    if name != "__call__" and (name.startswith("_") or name in _MODULE_NAMES):
      continue
    attribute = inspect.getattr_static(cls, name)
    if isinstance(attribute, (staticmethod, classmethod, property, type)):
      continue
    if callable(attribute) and hasattr(attribute, "__get__"):
      methods[name] = attribute
  return methods


# Generated subclasses, one per module class; a memo of derived classes, not state.
# (Each generated class registers itself with NNX's graph, so it must not be rebuilt
# per call.)
_INTERCEPTING: dict[type, type] = {}
_ORIGINAL: dict[type, type] = {}


def _intercepting_class(cls: type) -> type:
  cls = _ORIGINAL.get(cls, cls)
  sub = _INTERCEPTING.get(cls)
  if sub is None:
    namespace: dict[str, Any] = {name: _intercepted(name, attribute)
                                 for name, attribute in _public_methods(cls).items()}
    namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__,
                     __doc__=cls.__doc__)
    sub = types.new_class(cls.__name__, (cls,), {"pytree": cls._pytree__is_pytree},
                          lambda ns: ns.update(namespace))
    _INTERCEPTING[cls] = sub
    _ORIGINAL[sub] = cls
  return sub


# ---- resolution ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Resolved:
  path: str
  module: nnx.Module
  precision: rules_lib.ModulePrecision


def _resolve(model: nnx.Module, rules: rules_lib.PolicyRules) -> dict[tuple, _Resolved]:
  """Every module of ``model`` that gets a precision, by path, parents first."""
  resolved = {}
  found = sorted(nnx.iter_modules(model), key=lambda item: _path_order(item[0]))
  for path, module in found:
    if isinstance(module, _CONTAINER_TYPES + fp8_nnx.FP8_MODULE_TYPES):
      continue
    module_type = _ORIGINAL.get(type(module), type(module))
    precision = engine.resolve(rules, _path_str(path), module_type, fp8_nnx.supports_fp8)
    resolved[path] = _Resolved(_path_str(path), module, precision)
  return resolved


def _variables(model: nnx.Module, kind: type = nnx.Param) -> list[tuple[tuple, nnx.Variable]]:
  return list(nnx.to_flat_state(nnx.state(model, kind)))


def _policy(path: tuple, modules: dict[tuple, _Resolved],
            rules: rules_lib.PolicyRules) -> policy_lib.Policy:
  """The policy of the module that owns the variable at ``path``."""
  owner = paths_lib.owner(path, modules)
  return owner.precision.policy if owner else rules.default


def _fp8_layer_names() -> str:
  return ", ".join(f"nnx.{t.__name__}" for t in fp8_nnx.FP8_LAYER_TYPES)


# ---- the wrapper -----------------------------------------------------------------------------


class MixedPrecision(nnx.Module, engine.Wrapper):
  """An NNX model under per-module precision rules; built by :func:`mixed_precision`.

  Call it like the model (``wrapped(x)``, ``wrapped.encode(x)`` for another public
  method). It is an ``nnx.Module``: pass it to ``nnx.jit``, ``nnx.grad``,
  ``nnx.Optimizer(wrapped, tx, wrt=nnx.Param)``, ``nnx.split``.

  Attributes:
    model: the wrapped model; its variables are the wrapper's.
    rules: the resolved :class:`~jaxmp.PolicyRules` (static).
    fp8: an ``nnx.Dict`` from layer path to the fp8 module (and state) that layer
      computes with; empty without fp8 rules.
    nonfinite: with ``PolicyRules(trace_nonfinite=True)`` only, the non-finite probe
      (a :class:`~jaxmp._src.nnx.nonfinite.NonfiniteProbe`, one row per module path
      and public method), which :func:`jaxmp.nnx.value_and_grad` differentiates.

  Example:
    >>> from flax import nnx
    >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> wrapped = jaxmp.nnx.mixed_precision(model, "p=bf16,c=bf16,o=f32")
    >>> wrapped.model is model, model.kernel[...].dtype  # params cast in place
    (True, dtype(bfloat16))
    >>> nnx.jit(lambda m, x: m(x))(wrapped, jnp.ones((1, 3))).dtype
    dtype('float32')
  """

  def __init__(self, model: nnx.Module, rules: rules_lib.PolicyRules,
               fp8_modules: dict[str, fp8_nnx.Fp8Module] | None = None,
               nonfinite: nonfinite_nnx.NonfiniteProbe | None = None):
    self.model = model
    self.rules = rules
    self.fp8: nnx.Dict[fp8_nnx.Fp8Module] = nnx.Dict(fp8_modules or {})
    if nonfinite is not None:
      self.nonfinite = nonfinite

  def __call__(self, *args, **kwargs) -> Any:
    """Calls the model with every module computing in its resolved precision."""
    return self._trace("__call__", args, kwargs)[0]

  def __getattr__(self, name: str) -> Any:
    # Only reached for names the wrapper lacks: public methods of the model run
    # wrapped. vars() rather than self.model, which would recurse while NNX builds
    # the wrapper attribute by attribute.
    model = vars(self).get("model")
    if name.startswith("_") or model is None:
      raise AttributeError(name)
    if inspect.ismethod(getattr(model, name, None)):
      return functools.partial(self._call_method, name)
    raise AttributeError(
        f"{type(self).__name__} has no attribute {name!r}; the model's methods are "
        f"forwarded, its other attributes are at .model.{name}.")

  def module_types(self) -> dict[str, type]:
    """The class of every module of the model, by '/'-joined path (containers left out).

    Example:
      >>> from flax import nnx
      >>> wrapped = jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "float32")
      >>> wrapped.module_types()
      {'': <class 'flax.nnx.nn.linear.Linear'>}
    """
    return {r.path: _ORIGINAL.get(type(r.module), type(r.module))
            for r in _resolve(self.model, self.rules).values()}

  def with_rules(self, rules: rules_lib.PolicyRules) -> MixedPrecision:
    """A wrapper of the same model under other rules, sharing every variable.

    Nothing is re-initialised or copied: the new wrapper holds this one's model (its
    params, batch statistics, RNG state), the fp8 modules (and state) of the layers
    that keep the same recipe, and the non-finite probe. A layer the new rules give
    no fp8 recipe loses its fp8 state; a layer given a new recipe gets fresh state. An
    ``nnx.Optimizer(..., wrt=nnx.Param)`` built for this wrapper updates the new one,
    and ``nnx.jit`` traces once more for it (the rules are static).
    :class:`jaxmp.tools.PrecisionController` changes precision this way.

    Args:
      rules: the new :class:`jaxmp.PolicyRules`.

    Returns:
      A new :class:`MixedPrecision`; this one keeps its rules.

    Raises:
      TypeError: if ``rules`` is not a :class:`jaxmp.PolicyRules`.
      ValueError: if the new rules store a param in another dtype than it is stored
        in (the storage is the variables'; wrap the model again to recast), or for an
        fp8 rule on a layer that cannot take it.

    Example:
      >>> from flax import nnx
      >>> wrapped = jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "p=f32,c=bf16")
      >>> wider = wrapped.with_rules(jaxmp.PolicyRules("float32"))
      >>> wider.model is wrapped.model, wider(jnp.ones((1, 3))).dtype
      (True, dtype('float32'))
    """
    rules = rules_lib.check_rules(rules, "with_rules")
    modules = _resolve(self.model, rules)
    for path, variable in _variables(self.model):
      value = variable.get_raw_value()
      dtype = _policy(path, modules, rules).param_dtype
      if tree_lib.cast_tree(value, dtype) is not value:
        raise engine.param_storage_error(
            _path_str(path), value.dtype, dtype,
            "wrap the model again with jaxmp.nnx.mixed_precision to recast params, and "
            "make its optimizer")
    _warn_unused(self.model, rules, modules)
    probe = vars(self).get("nonfinite")
    if probe is None and rules.trace_nonfinite:
      probe = _new_probe(modules)
    return MixedPrecision(self.model, rules, _fp8_modules(modules, dict(self.fp8.items())),
                          probe if rules.trace_nonfinite else None)

  def _call_method(self, name: str, *args, **kwargs) -> Any:
    return self._trace(name, args, kwargs)[0]

  def _trace(self, method: str, args: tuple, kwargs: dict, *, annotate: bool = False,
             hooks: Sequence[engine.CallHook] = ()) -> tuple[Any, list[CallRecord]]:
    """Calls ``model.<method>(*args, **kwargs)`` under the rules.

    With ``annotate``, each module call runs in a named scope naming its record (see
    :data:`jaxmp._src.engine.ANNOTATION`); otherwise a tracing wrapper traces each
    call with its probe. ``hooks`` run around each module call, inside the wrapper's
    own (:class:`jaxmp._src.engine.CallHook`).

    Returns:
      The output and the :class:`~jaxmp.linen.CallRecord` of every module call, in
      call order.

    Raises:
      AttributeError: if the model has no public method ``method``.
    """
    if method != "__call__" and (method.startswith("_") or not inspect.ismethod(
        getattr(self.model, method, None))):
      raise AttributeError(f"{type(self.model).__name__} has no public method {method!r}.")
    probe = None if annotate else vars(self).get("nonfinite")
    call = engine.Call(self.rules, fp8_nnx.supports_fp8, is_node=_is_node, annotate=annotate,
                       hooks=(*nonfinite_nnx.hooks(self.rules, probe), *hooks))
    nodes = tuple(x for x in jax.tree_util.tree_leaves((args, kwargs), is_leaf=_is_node)
                  if _is_node(x))
    graph = (self.model, nodes)
    graphdef, state = nnx.split(graph)
    originals = dict(nnx.to_flat_state(state))
    copy = nnx.merge(graphdef, state, copy=True)
    self._prepare(copy[0], call, nnx.merge(*nnx.split(self.fp8), copy=True))
    before = {path: _Snapshot(v.get_raw_value())
              for path, v in nnx.to_flat_state(nnx.state(copy))}
    substitutes = {id(node): twin for node, twin in zip(nodes, copy[1])}
    args, kwargs = jax.tree_util.tree_map(
        lambda x: substitutes.get(id(x), x) if _is_node(x) else x, (args, kwargs),
        is_leaf=_is_node)
    with call:
      try:
        out = getattr(copy[0], method)(*args, **kwargs)
      except TypeError as error:
        explained = engine.uncast_state_error(
            error, _uncast_state(originals), "nnx.Cache variables",
            "an nnx.Cache (Flax's variable type for caches)")
        if explained is None:
          raise
        raise explained from error
    _write_back(graph, originals, copy, before)
    return out, call.records

  def _prepare(self, model: nnx.Module, call: engine.Call,
               fp8_modules: nnx.Dict[fp8_nnx.Fp8Module]) -> None:
    """Casts the copy's params and caches, installs (copies of) the fp8 modules, swaps in
    the intercepting classes."""
    modules = _resolve(model, self.rules)
    for path, variable in _variables(model):
      dtype = _policy(path, modules, self.rules).compute_dtype
      variable.set_raw_value(tree_lib.cast_tree(variable.get_raw_value(), dtype))
    for path, variable in _variables(model, nnx.Cache):
      dtype = _policy(path, modules, self.rules).compute_dtype
      variable.set_raw_value(call.read_cache(variable.get_raw_value(), dtype))
    by_path = dict(fp8_modules.items())
    for r in modules.values():
      precision = r.precision
      if r.path in by_path:
        fp8_nnx.install(r.module, by_path[r.path])
        precision = dataclasses.replace(precision, fp8=by_path[r.path].recipe)
      _set_fields(r.module, precision, call)
      module_type = _ORIGINAL.get(type(r.module), type(r.module))
      object.__setattr__(r.module, "__class__", _intercepting_class(module_type))
      object.__setattr__(r.module, _CALL_ATTRIBUTE,
                         _ModuleCall(r.path, module_type, precision, call))


def _set_fields(module: nnx.Module, precision: rules_lib.ModulePrecision,
                call: engine.Call) -> None:
  """Sets the copy's ``dtype`` to what the engine chose (``attention_fn``: per call)."""
  attributes = vars(module)
  if "dtype" in attributes:
    dtype = call.dtype_field(attributes["dtype"], precision)
    if dtype is not engine.NOT_A_DTYPE_FIELD:
      object.__setattr__(module, "dtype", dtype)


# Variables a module reads and writes in their own dtype by design: batch statistics
# (their layers compute them in float32) and sow-n intermediates (written, not read).
_OWN_DTYPE_STATE = (nnx.BatchStat, nnx.Intermediate)


def _uncast_state(variables: dict[tuple, nnx.Variable]) -> list[str]:
  """The floating-point variables a call neither casts nor reads as caches, described.

  ``variables``: the call's graph (the model, then the graph nodes among the
  arguments) by path.
  """
  described = []
  for path, variable in variables.items():
    if isinstance(variable, (nnx.Param, nnx.Cache, *_OWN_DTYPE_STATE)):
      continue
    dtypes = {x.dtype.name for x in jax.tree_util.tree_leaves(variable.get_raw_value())
              if tree_lib.is_float_array(x)}
    if dtypes:
      where = _path_str(path[1:]) if path[0] == 0 else f"argument {_path_str(path[1:])}"
      described.append(f"{where!r} ({type(variable).__name__}, {', '.join(sorted(dtypes))})")
  return described


class _Snapshot:
  """A variable's value before the call: its tree structure and leaves, by identity.

  A container value (``nnx.capture``'s dict of intermediates) changes in place, so the
  value object alone does not tell.
  """

  def __init__(self, value: Any):
    self.leaves, self.treedef = jax.tree_util.tree_flatten(value)

  def unchanged(self, value: Any) -> bool:
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return treedef == self.treedef and all(a is b for a, b in zip(leaves, self.leaves))


def _write_back(graph: Any, originals: dict, copy: Any, before: dict) -> None:
  """Writes the variables the call changed in ``copy`` back to ``graph``'s own."""
  new = []
  for path, variable in nnx.to_flat_state(nnx.state(copy)):
    if isinstance(variable, fp8_nnx.Fp8State):
      continue  # the ops never write it: its next value is its gradient
    value = variable.get_raw_value()
    if path not in before:
      new.append((path, variable))
    elif not before[path].unchanged(value):
      original = originals[path]
      if isinstance(original, (nnx.Param, nnx.Cache)):
        value = engine.written(value, original.get_raw_value())
      original.set_raw_value(value)
  if new:
    nnx.update(graph, nnx.from_flat_state(new))


def mixed_precision(model: nnx.Module,
                    policy_or_rules: rules_lib.PolicyOrRules) -> MixedPrecision:
  """Wraps an NNX model so that each module computes in its resolved precision.

  Casts every ``nnx.Param`` of the model, in place, to the param dtype of the module
  that owns it, and creates the fp8 state of the layers that fp8 rules match. Warns,
  listing the model's module paths, about rules that match no module.

  Args:
    model: an ``nnx.Module``; its code is not changed.
    policy_or_rules: a policy for every module (any form :func:`jaxmp.get_policy`
      takes) or :class:`jaxmp.PolicyRules` with per-module overrides.

  Returns:
    A :class:`MixedPrecision` module holding ``model``.

  Raises:
    TypeError: if ``model`` is not an NNX Module (a linen Module points to
      :func:`jaxmp.linen.mixed_precision`), is or contains a wrapper already, or
      ``policy_or_rules`` is neither a policy nor rules.
    ValueError: for a bad policy, or an fp8 rule on a layer that already has a
      custom dot_general or einsum_op.

  Example:
    >>> from flax import nnx
    >>> class Net(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.body = nnx.Linear(3, 8, rngs=rngs)
    ...     self.head = nnx.Linear(8, 2, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.head(nnx.relu(self.body(x)))
    >>> rules = jaxmp.PolicyRules("p=f32,c=bf16,o=f32", [
    ...     jaxmp.Rule("head", "float32"),
    ...     jaxmp.Rule(nnx.Linear, fp8=jaxmp.fp8.DelayedScaling(amax_history_length=16))])
    >>> wrapped = jaxmp.nnx.mixed_precision(Net(nnx.Rngs(0)), rules)
    >>> wrapped(jnp.ones((4, 3))).dtype
    dtype('float32')
    >>> list(wrapped.fp8)   # "head" is decided by the first rule: no fp8
    ['body']
  """
  if isinstance(model, MixedPrecision):
    raise TypeError("mixed_precision got a model that is already wrapped; wrap the "
                    "original NNX Module once, with all its rules.")
  if not isinstance(model, nnx.Module):
    hint = ""
    # Not an NNX module, so a jaxmp wrapper here is linen's.
    if isinstance(model, (linen.Module, engine.Wrapper)):
      hint = " For flax.linen models use jaxmp.linen.mixed_precision."
    raise TypeError(f"jaxmp.nnx.mixed_precision expects a flax.nnx.Module, got {model!r} "
                    f"of type {type(model).__name__}.{hint}")
  for path, module in nnx.iter_modules(model):
    if isinstance(module, MixedPrecision):
      raise TypeError(f"jaxmp.nnx.mixed_precision got a model that contains a jaxmp wrapper "
                      f"at {_path_str(path)!r}; wrap the whole model once instead.")
  rules = rules_lib.as_rules(policy_or_rules)
  modules = _resolve(model, rules)

  for path, variable in _variables(model):
    dtype = _policy(path, modules, rules).param_dtype
    value = variable.get_raw_value()
    cast = tree_lib.cast_tree(value, dtype)
    if cast is not value:
      variable.set_raw_value(cast)

  fp8_modules = _fp8_modules(modules, {})
  _warn_unused(model, rules, modules)
  return MixedPrecision(model, rules, fp8_modules,
                        _new_probe(modules) if rules.trace_nonfinite else None)


def _fp8_modules(modules: dict[tuple, _Resolved],
                 existing: dict[str, fp8_nnx.Fp8Module]) -> dict[str, fp8_nnx.Fp8Module]:
  """The fp8 module of every layer an fp8 rule reaches; ``existing`` ones kept by recipe."""
  fp8_modules: dict[str, fp8_nnx.Fp8Module] = {}
  for r in modules.values():  # parents first: an attention rule decides its projections
    if r.precision.fp8 is None:
      continue
    for layer_path, layer in fp8_nnx.fp8_layers(r.path, r.module):
      if layer_path in fp8_modules:
        continue
      kept = existing.get(layer_path)
      fp8_modules[layer_path] = (kept if kept is not None and kept.recipe == r.precision.fp8
                                 else fp8_nnx.new_fp8_module(layer, r.precision.fp8,
                                                             layer_path))
  return fp8_modules


def _new_probe(modules: dict[tuple, _Resolved]) -> nonfinite_nnx.NonfiniteProbe:
  """A zero probe with a row per method the wrapper intercepts."""
  return nonfinite_nnx.new_probe(tuple(
      (r.path, name) for r in modules.values()
      for name in _public_methods(_ORIGINAL.get(type(r.module), type(r.module)))))


def _warn_unused(model: nnx.Module, rules: rules_lib.PolicyRules,
                 modules: dict[tuple, _Resolved]) -> None:
  records = [CallRecord(r.path, type(r.module), "__call__", r.precision,
                        r.precision.output_dtype or rules.default.output_dtype)
             for r in modules.values()]
  # As each call's attention_fn is set (_attention_fn_in): a callable attention_fn attribute.
  reached = {id(r.precision.rule) for r in modules.values()
             if callable(vars(r.module).get("attention_fn"))}
  engine.warn_unused_rules(type(model).__name__, rules, records, _fp8_layer_names(),
                           attention_rules_reached=reached)


def trace_abstract(model_or_wrapper: nnx.Module, rules: rules_lib.PolicyOrRules | None,
                   method: str, args: tuple, kwargs: dict
                   ) -> tuple[rules_lib.PolicyRules, list[CallRecord], Any]:
  """Traces one call of an NNX model or wrapper abstractly; for :func:`jaxmp.tools.summary`.

  Traces the call with ``jax.make_jaxpr`` on a copy of the model, every module call
  annotated (:data:`jaxmp._src.engine.ANNOTATION`): nothing is computed and neither
  the model nor the arguments are changed.

  Args:
    model_or_wrapper: an ``nnx.Module`` or a :class:`MixedPrecision`.
    rules: a policy or rules; ``None`` keeps a wrapper's own.
    method: the model's method to call.
    args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
    kwargs: its keyword arguments.

  Returns:
    The rules used, the call records and the traced ``ClosedJaxpr``.

  Raises:
    ValueError: if ``rules`` is ``None`` for an unwrapped model.

  Example:
    >>> from flax import nnx
    >>> from jaxmp._src.nnx import wrapper
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    >>> x = jax.ShapeDtypeStruct((1, 3), jnp.float32)
    >>> rules, calls, _ = wrapper.trace_abstract(model, "bf16", "__call__", (x,), {})
    >>> [(c.path, c.precision.policy.param_dtype.name) for c in calls]
    [('', 'bfloat16'), ('layers/0', 'bfloat16'), ('layers/1', 'bfloat16')]
    >>> model.layers[0].kernel[...].dtype  # the model itself is not changed
    dtype('float32')
  """
  if rules is None and not isinstance(model_or_wrapper, MixedPrecision):
    raise ValueError("jaxmp.tools.summary needs rules (a policy or jaxmp.PolicyRules) when "
                     f"given an unwrapped model {type(model_or_wrapper).__name__}.")
  is_abstract = lambda x: isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_node)
  nodes = [x for x in leaves if _is_node(x)]
  graphdef, state = nnx.split((model_or_wrapper, nodes))
  arrays = [x for x in leaves if is_abstract(x)]
  found: list = []

  def run(state, arrays):
    obj, node_copies = nnx.merge(graphdef, state, copy=True)
    node_iter, array_iter = iter(node_copies), iter(arrays)
    call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, [
        next(node_iter) if _is_node(x) else next(array_iter) if is_abstract(x) else x
        for x in leaves])
    if isinstance(obj, MixedPrecision):
      wrapper = obj if rules is None else mixed_precision(obj.model, rules)
    else:
      assert rules is not None  # checked above for an unwrapped model
      wrapper = mixed_precision(obj, rules)
    out, records = wrapper._trace(method, call_args, call_kwargs, annotate=True)  # pylint: disable=protected-access
    found.append((wrapper.rules, records))
    return out

  jaxpr = jax.make_jaxpr(run)(state, arrays)
  return found[0][0], found[0][1], jaxpr


__all__ = (
    "CallRecord",
    "MixedPrecision",
    "mixed_precision",
    "trace_abstract",
)
