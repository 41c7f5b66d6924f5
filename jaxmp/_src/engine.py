"""The per-call precision decisions that the linen and NNX adapters share.

A wrapped model is run one *call* at a time (``init`` or ``apply`` of a linen wrapper,
one call of an NNX wrapper). A :class:`Call` holds what that call needs to decide,
for every module the adapter hands it:

1. **resolve**: the module's :class:`~jaxmp._src.rules.ModulePrecision` from its
   '/'-joined path and class (an fp8 recipe on a layer the adapter cannot put in fp8
   is dropped here and reported by :func:`unused_rules`).
2. **module dtype**: what the module's own computation-dtype field (``dtype``) holds
   while it runs (:meth:`Call.dtype_field`): its resolved compute dtype, whatever
   the model's config set, so that Flax layers, which promote their inputs and
   kernels to ``self.dtype``, compute in the policy's dtype.
3. **inputs**: floating-point inputs cast to the compute dtype. A value that was
   rounded to a narrower dtype on its way here and not changed since (a model input
   the root passes on untouched, say) is widened from the value it was rounded from,
   so nothing is rounded through a narrower dtype into a wider computation.
4. **float32 ops**: the module's float32 op list is in effect while it runs
   (:mod:`jaxmp._src.float32_ops`).
5. **output**: cast to the dtype the module hands back: the dtype its rule names,
   else its caller's compute dtype (an override is local), else, for the outermost
   call, the default policy's output dtype. State threaded through the call (an
   element of a tuple, list or dict output with the same structure and shapes as an
   argument: a KV cache, a recurrent carry) goes back in the dtypes it came in, so a
   ``lax.scan`` over the wrapped model keeps its carry type.
6. **caches written in place** (linen's ``cache`` collection, NNX's ``nnx.Cache``
   variables, the model's own or handed to a module as an argument: a KV cache a
   decoder updates with ``lax.dynamic_update_slice`` and assigns back): read like an
   input, in the compute dtype of the module that owns them or is handed them
   (:meth:`Call.read_cache`), and written, like a param, in the dtypes the variable
   held (:func:`written`; a cache read and not written keeps its bits). The in-place
   update sees one dtype, and the cache keeps the dtype the model built it with (a
   float32 ``init_cache`` stays float32). Other floating-point state is left as it
   is held; an in-place update that meets it in another dtype fails with lax's error,
   which the adapters re-raise naming the state and the fix
   (:func:`uncast_state_error`).
7. **record**: a :class:`CallRecord` per module call, for the unused-rule report and
   :func:`jaxmp.tools.summary` (which, with ``annotate=True``, attributes every
   traced matmul to the module call it ran in).
8. **hooks**: per-call features (:class:`CallHook`) the adapter hands the call, run
   generically around every module call: each sees the call's floating-point
   arguments as the caller passed them, before the input casts, and its output as the
   caller gets it back, after the output cast, and may pass them on through
   identities of its own (custom VJPs that measure the gradient path). Non-finite
   tracing (:class:`jaxmp._src.nonfinite.NonfiniteHook`) is one. Without hooks, the
   call is exactly what it was before hooks existed.

The adapters only find modules, give them their params in the compute dtype, set the
dtype field the engine chose, and install fp8; every dtype decision is made here.

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

import contextlib
import dataclasses
import warnings
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Protocol
from typing import TypeVar

import jax
import numpy as np

from jaxmp._src import attention as attention_lib
from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src import float32_ops as float32_ops_lib
from jaxmp._src import paths as paths_lib
from jaxmp._src import rules as rules_lib
from jaxmp._src import tree as tree_lib
from jaxmp._src.fp8 import ops as fp8_ops

T = TypeVar("T")

_MAX_PATHS_IN_WARNING = 60


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


@dataclasses.dataclass(frozen=True)
class CallSite:
  """What a :class:`CallHook` is told about the module call it surrounds.

  Attributes:
    record: the call's :class:`CallRecord` (path, module class, method, precision,
      output dtype).
    start: the call's position among the calls of this :class:`Call` in the order
      they start, from 1 (call 1 is the one the model's caller made).
  """

  record: CallRecord
  start: int


class CallHook(Protocol):
  """A per-call feature of the engine: code run around every module call.

  :meth:`Call.run` runs its hooks around each module call, the first hook outermost:
  ``enter`` of each hook in order, the call (input casts, the module, output cast),
  then ``leave`` of each hook in reverse order. A hook sees values, never the
  engine's decisions: what it returns for a value stands for that value from then on
  (a value the engine knows as rounded from a wider one stays known as such, so a
  hook changes no cast). Anything it measures on the gradient path it measures with
  identities that have custom derivatives, whose cotangents carry the measurements
  out (as :mod:`jaxmp._src.nonfinite` does); anything it keeps between calls it
  keeps itself. A hook is built per call of the model, by the adapter, from what the
  adapter is given (:func:`jaxmp._src.nonfinite.hooks`).

  Non-finite tracing is :class:`jaxmp._src.nonfinite.NonfiniteHook`.
  """

  def enter(self, site: CallSite, xs: tuple[jax.Array, ...]) -> tuple[Sequence[jax.Array], Any]:
    """Before the call: the arguments as the caller passed them.

    Args:
      site: the call.
      xs: the call's non-empty floating-point JAX array arguments (positional, then
        keyword, in tree-flatten order), before the input casts; may be empty.

    Returns:
      What the call receives instead of ``xs`` (as many arrays, the same shapes and
      dtypes), and a token handed to this hook's :meth:`leave` of the same call.
    """
    ...

  def leave(self, site: CallSite, xs: tuple[jax.Array, ...], token: Any) -> Sequence[jax.Array]:
    """After the call: the output as the caller gets it back.

    Args:
      site: the call.
      xs: the output's non-empty floating-point JAX arrays, after the output cast;
        may be empty.
      token: what :meth:`enter` returned for this call.

    Returns:
      What the caller receives instead of ``xs``.
    """
    ...


def check_hooks(hooks: Any) -> tuple[CallHook, ...]:
  """``hooks`` as a tuple of :class:`CallHook`; a TypeError for anything else."""
  if isinstance(hooks, (str, bytes)) or not isinstance(hooks, Sequence):
    raise TypeError(f"Call: hooks must be a sequence of CallHook (objects with enter and "
                    f"leave methods), got {hooks!r} of type {type(hooks).__name__}.")
  for hook in hooks:
    if not (callable(getattr(hook, "enter", None)) and callable(getattr(hook, "leave", None))):
      raise TypeError(f"Call: each hook must be a CallHook (an object with enter(site, xs) "
                      f"and leave(site, xs, token) methods), got {hook!r} of type "
                      f"{type(hook).__name__}.")
  return tuple(hooks)


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


class Wrapper:
  """The base of the adapters' wrappers: a model wrapped by jaxmp, by either adapter.

  ``jaxmp.linen.MixedPrecision`` and ``jaxmp.nnx.MixedPrecision`` derive from it. It
  holds nothing: it lets code recognise a wrapped model without importing the adapter
  that made it (the NNX adapter pointing a linen wrapper to ``jaxmp.linen``), so
  neither adapter imports the other.
  """

  __slots__ = ()
  model: Any  # the wrapped model; each adapter's wrapper sets it
  rules: rules_lib.PolicyRules  # the rules it runs; each adapter's wrapper sets it

  def module_types(self) -> dict[str, type]:
    """The class of every module of the wrapped model, by '/'-joined path."""
    raise NotImplementedError(f"{type(self).__name__} does not list its modules.")


def param_storage_error(path: str, stored: np.dtype, wanted: np.dtype, restore: str
                        ) -> ValueError:
  """The refusal of a ``with_rules`` whose rules store a param in another dtype.

  Both adapters' ``with_rules`` swap the rules and keep every variable as it is, and an
  optimizer state made for the params as they are stored; converting the param would
  change both behind the user's back, and keeping it while the rules say otherwise
  would leave the rules untrue. So the new rules must store every param as it is.

  Args:
    path: the param's '/'-joined path.
    stored: the dtype it is stored in.
    wanted: the dtype the new rules store it in.
    restore: how the user stores params in another dtype with this adapter.

  Example:
    >>> from jaxmp._src import engine
    >>> print(engine.param_storage_error("head/kernel", np.dtype("float32"),
    ...                                  jnp.dtype("bfloat16"), "wrap the model again"))
    with_rules: the param 'head/kernel' is stored in float32, but the new rules store it
    in bfloat16; ... not how params are stored: wrap the model again.
  """
  return ValueError(
      f"with_rules: the param {path!r} is stored in {np.dtype(stored).name}, but the new "
      f"rules store it in {np.dtype(wanted).name}; with_rules keeps every variable (and an "
      f"optimizer state made for the params) as it is, so it changes how modules compute, "
      f"not how params are stored: {restore}.")


def integer_params_error(differentiated: str, integers: Sequence[str], keep: str
                         ) -> TypeError:
  """The refusal of integer (or bool) params by both adapters' ``value_and_grad``.

  Differentiating only the floating-point params instead would hand the optimizer
  gradients it cannot take for the others (``float0``, which no Optax transform
  accepts; or integer zeros, which turn Adam's integer moments into floats and break a
  skipped step's branch): an integer is state, not a parameter.

  Args:
    differentiated: what the adapter's ``value_and_grad`` differentiates, in words.
    integers: the integer params, one description each.
    keep: where the adapter keeps integer state instead.

  Example:
    >>> from jaxmp._src import engine
    >>> print(engine.integer_params_error("every param", ["'calls' (int32)"], "elsewhere"))
    every param is differentiated (and stepped by the optimizer), but these hold
    integers, which have no gradient: 'calls' (int32). Keep integer state elsewhere.
  """
  return TypeError(
      f"{differentiated} is differentiated (and stepped by the optimizer), but these hold "
      f"integers, which have no gradient: {', '.join(integers)}. Keep integer state {keep}.")


NOT_A_DTYPE_FIELD = object()
"""Returned by :meth:`Call.dtype_field` and :meth:`Call.attention_field` for a field
the engine leaves alone."""

ANNOTATION = "jaxmp_call_"
"""Prefix of the named scope each module call runs in when a :class:`Call` annotates:
``jaxmp_call_<index into Call.records>``; :mod:`jaxmp._src.tools.summary` reads it."""

PARAM_ANNOTATION = "jaxmp_param"
"""Named scope of parameter creation during an annotated call (not the model's compute)."""


class Call:
  """One call of a wrapped model: the rules, the callers' compute dtypes, the records.

  Enter it (``with call:``) around the model's call: while entered, the float32 op
  list is in effect (:mod:`jaxmp._src.float32_ops`).

  Args:
    rules: the wrapper's rules.
    supports_fp8: whether the adapter can put a module class's matmuls in fp8.
    is_node: leaves for which this returns True are never cast (NNX graph nodes);
      ``None`` casts every floating-point array leaf.
    annotate: run each module call in a named scope (:data:`ANNOTATION`), so that a
      traced jaxpr says which module each operation belongs to.
    hooks: the per-call features run around every module call (:class:`CallHook`),
      the first outermost; ``()`` (the default) runs none.

  Raises:
    TypeError: for hooks that are not a sequence of :class:`CallHook`.
  """

  def __init__(self, rules: rules_lib.PolicyRules, supports_fp8: Callable[[type], bool], *,
               is_node: Callable[[Any], bool] | None = None, annotate: bool = False,
               hooks: Sequence[CallHook] = ()):
    self.rules = rules
    self.supports_fp8 = supports_fp8
    self.annotate = annotate
    self.records: list[CallRecord] = []
    self.hooks = check_hooks(hooks)
    self._is_node = is_node
    self._callers: list[np.dtype] = []
    # id(narrowed value) -> (narrowed value, the wider value it was cast from). Holding
    # both keeps the ids valid for the call's lifetime.
    self._narrowed: dict[int, tuple[Any, Any]] = {}
    self._float32_ops = contextlib.ExitStack()
    # The rules whose causal_attention or padded_attention reached a module's attention
    # function: a rule that declares either and reaches none did nothing (unused_rules
    # says so).
    self.attention_rules_reached: set[int] = set()

  def __enter__(self) -> Call:
    self._float32_ops.enter_context(float32_ops_lib.installed())
    return self

  def __exit__(self, *exc_info) -> None:
    self._narrowed.clear()
    self._float32_ops.close()

  def resolve(self, path: str, module_type: type) -> rules_lib.ModulePrecision:
    """:func:`resolve` under this call's rules."""
    return resolve(self.rules, path, module_type, self.supports_fp8)

  def dtype_field(self, value: Any, precision: rules_lib.ModulePrecision) -> Any:
    """What a module's computation-dtype field (``dtype``) holds while it runs.

    The resolved compute dtype, whatever the model set (``None``, float32, ...),
    unless the rules let the model's fields win (``module_dtypes="model"``). A field
    that holds something other than ``None`` or a floating-point dtype is not a
    computation dtype and is left as it is.

    Returns:
      The value to set, or :data:`NOT_A_DTYPE_FIELD` to leave the field alone.
    """
    if self.rules.module_dtypes == "model":
      return NOT_A_DTYPE_FIELD
    if value is not None and not _is_float_dtype_value(value):
      return NOT_A_DTYPE_FIELD
    return precision.policy.compute_dtype

  def attention_field(self, value: Any, precision: rules_lib.ModulePrecision) -> Any:
    """What a module's ``attention_fn`` field holds while it runs.

    With ``PolicyRules(fused_attention=True)`` or a rule's ``causal_attention=True``
    (then in causal mode), the fused attention of :mod:`jaxmp._src.attention` standing
    in for ``value`` (which still runs where the fused one cannot); otherwise, or for a
    field that is not a function, :data:`NOT_A_DTYPE_FIELD` (leave it alone).
    """
    causal, padded = precision.causal_attention, precision.padded_attention
    if (causal or padded) and callable(value):
      self.attention_rules_reached.add(id(precision.rule))
    if (not (self.rules.fused_attention or causal or padded) or not callable(value)
        or attention_lib.is_fused(value)):
      return NOT_A_DTYPE_FIELD
    return attention_lib.fused_attention_fn(value, causal=causal, padded=padded,
                                            window=precision.attention_window)

  def attention_precision(self, path: str, module_type: type,
                          precision: rules_lib.ModulePrecision, attention_fn: Any,
                          method: Callable[..., Any], args: tuple, kwargs: dict[str, Any]
                          ) -> rules_lib.ModulePrecision:
    """The precision of one call of a module: causal attention only as self-attention.

    A causal declaration (``Rule(causal_attention=True)``, its ``attention_window``)
    relates a sequence's positions to its own. Where a module with an attention
    function is called as cross-attention
    (:func:`jaxmp._src.attention.cross_attention_argument`: keys from another
    sequence), the call gets ``precision`` without it, and so computes as the layer
    does with the mask it is handed, with a warning naming the layer (once per
    message, Python's default filter: once per jitted step's trace).

    Args:
      path: the module's '/'-joined path.
      module_type: the module's class.
      precision: the module's resolved precision.
      attention_fn: the module's ``attention_fn`` field, or ``None`` where it has none.
      method: the method called, bound.
      args: the call's positional arguments as the caller passed them (before any
        cast: the query is recognised by identity).
      kwargs: the call's keyword arguments, likewise.

    Returns:
      ``precision``, or ``precision`` without its causal declaration for a
      cross-attention call.
    """
    rule = precision.rule
    if rule is None or not (precision.causal_attention and callable(attention_fn)):
      return precision
    argument = attention_lib.cross_attention_argument(method, args, kwargs)
    if argument is None:
      return precision
    # Reached: its warning is this one, not the unused-rule report's.
    self.attention_rules_reached.add(id(rule))
    index = next(i for i, r in enumerate(self.rules.rules) if r is rule)
    window = ("" if precision.attention_window is None
              else f" with attention_window={precision.attention_window}")
    warnings.warn(
        f"jaxmp: rule {index} ({rule.describe()}) declares causal "
        f"attention{window}, but {paths_lib.describe_path(path)} ({module_type.__name__}) "
        f"is called as cross-attention (its {argument} is not its inputs_q): its keys "
        "come from another sequence, so this call computes as the layer does, with the "
        "mask it is handed. A causal declaration applies to self-attention calls only "
        "(no inputs_k/inputs_v, or the query itself); match only the self-attention "
        "layers (a path regex) to leave the cross-attention ones out of the rule. (A "
        "self-attention call written layer(x, x) of a layer class lifted by nn.remat or "
        "another transform reaches the layer as two values: call it as layer(x).)",
        UserWarning, stacklevel=4)
    return dataclasses.replace(precision, causal_attention=False, attention_window=None)

  def _cast_leaf(self, x: Any, dtype: np.dtype) -> Any:
    if not tree_lib.is_float_array(x) or x.dtype == dtype:
      return x
    narrowed = self._narrowed.get(id(x))
    if narrowed is not None and narrowed[0] is x and dtype.itemsize > x.dtype.itemsize:
      # x was rounded from a wider value on its way here, unchanged since: widen that
      # value instead of the rounded one, so nothing is rounded through a narrower
      # dtype on its way into a wider computation.
      x = narrowed[1]
      return x if x.dtype == dtype else x.astype(dtype)
    y = x.astype(dtype)
    if dtype.itemsize < x.dtype.itemsize:
      wide = narrowed[1] if narrowed is not None and narrowed[0] is x else x
      self._narrowed[id(y)] = (y, wide)
    return y

  def cast(self, tree: T, dtype: np.dtype) -> T:
    """Casts the floating-point array leaves of ``tree``, leaving nodes alone."""
    dtype = np.dtype(dtype)
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=self._is_node)
    leaves = [x if self._is_node is not None and self._is_node(x) else self._cast_leaf(x, dtype)
              for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, leaves)

  def read_cache(self, value: T, dtype: np.dtype) -> T:
    """A cache variable's value as the module that owns it reads it.

    Step 6 of the module docstring. A cache is an input of the module's computation:
    its floating-point leaves of 16 bits or more are read in the module's compute
    dtype ``dtype`` (no rounding through a narrower dtype, as for :meth:`cast`).
    Integer leaves (the cache index) and 8-bit floats (a cache the model quantizes
    itself) are read as stored.
    """
    dtype = np.dtype(dtype)
    leaves, treedef = jax.tree_util.tree_flatten(value, is_leaf=self._is_node)
    return jax.tree_util.tree_unflatten(treedef, [
        self._cast_leaf(x, dtype) if tree_lib.is_float_array(x) and x.dtype.itemsize > 1 else x
        for x in leaves])

  def output_dtype(self, precision: rules_lib.ModulePrecision) -> np.dtype:
    """The dtype a module hands its output back in (see the module docstring)."""
    if precision.output_dtype is not None:
      return precision.output_dtype
    if self._callers:
      return self._callers[-1]
    return self.rules.default.output_dtype

  def _threaded_state(self, out: Any, args: tuple, kwargs: dict) -> list[Any | None]:
    """For each element of a tuple/list/dict output, the argument it threads, or None.

    An element is threaded state (a KV cache, a recurrent carry) when an argument has
    the same tree structure and leaf shapes; it goes back in that argument's dtypes.
    """
    elements = _elements(out)
    if elements is None:
      return []
    candidates = [a for a in (*args, *kwargs.values())
                  if any(tree_lib.is_float_array(x)
                         for x in jax.tree_util.tree_leaves(a, is_leaf=self._is_node))]
    return [next((a for a in candidates if _same_shapes(e, a, self._is_node)), None)
            for e in elements]

  def _cast_output(self, out: Any, dtype: np.dtype, args: tuple, kwargs: dict) -> Any:
    threaded = self._threaded_state(out, args, kwargs)
    elements = _elements(out)
    if elements is None or not any(a is not None for a in threaded):
      return self.cast(out, dtype)
    cast = [self.cast(e, dtype) if a is None else self._cast_like(e, a)
            for e, a in zip(elements, threaded)]
    return _rebuild(out, cast)

  def _cast_like(self, tree: Any, like: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=self._is_node)
    like_leaves = jax.tree_util.tree_leaves(like, is_leaf=self._is_node)
    cast = [self._cast_leaf(x, np.dtype(y.dtype)) if tree_lib.is_float_array(y) else x
            for x, y in zip(leaves, like_leaves)]
    return jax.tree_util.tree_unflatten(treedef, cast)

  def run(self, path: str, module_type: type, method: str,
          precision: rules_lib.ModulePrecision, fn: Callable[..., Any],
          args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """Runs ``fn(*args, **kwargs)`` as a call of the module at ``path``.

    Casts the floating-point inputs to the compute dtype, records the call, puts the
    module's float32 ops in effect, and casts the output to :meth:`output_dtype`
    (threaded state back to the dtype it came in). The call's hooks run around all
    that (:class:`CallHook`; step 8 of the module docstring). Calls are numbered in
    the order they start, from 1 (:attr:`CallSite.start`): call 1 is the one the
    model's caller made.

    Raises:
      whatever a hook raises (the non-finite hook: a ValueError if its probe has no
      row for this call site).
    """
    record = CallRecord(path, module_type, method, precision, self.output_dtype(precision))
    if not self.hooks:
      return self._run(record, fn, args, kwargs)
    site = CallSite(record, len(self.records) + 1)
    tokens = []
    args, kwargs = tuple(args), dict(kwargs)
    for hook in self.hooks:
      token = []

      def enter(xs, hook=hook, token=token):
        xs, token_value = hook.enter(site, xs)
        token.append(token_value)
        return xs

      args, kwargs = self._through((args, kwargs), enter)
      tokens.append(token[0])
    out = self._run(record, fn, args, kwargs)
    for hook, token in zip(reversed(self.hooks), reversed(tokens)):
      out = self._through(out, lambda xs, hook=hook, token=token: hook.leave(site, xs, token))
    return out

  def _through(self, tree: T, hook: Callable[[tuple], Sequence]) -> T:
    """``tree`` with its non-empty float JAX arrays passed through ``hook``.

    ``hook`` is called even when there are none (with an empty tuple), so that a hook
    sees every call. A value rounded from a wider one (see :meth:`cast`) stays known
    as such on the other side, so a hook changes no cast.

    Raises:
      ValueError: if ``hook`` returns a different number of arrays.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=self._is_node)
    at = [i for i, x in enumerate(leaves)
          if isinstance(x, jax.Array) and tree_lib.is_float_array(x) and x.size
          and not (self._is_node is not None and self._is_node(x))]
    out = tuple(hook(tuple(leaves[i] for i in at)))
    if len(out) != len(at):
      raise ValueError(f"jaxmp: a call hook returned {len(out)} arrays for {len(at)}: a hook "
                       f"returns what stands for each array it was given.")
    if not at:
      return tree
    for i, y in zip(at, out):
      narrowed = self._narrowed.get(id(leaves[i]))
      if narrowed is not None and narrowed[0] is leaves[i]:
        self._narrowed[id(y)] = (y, narrowed[1])
      leaves[i] = y
    return jax.tree_util.tree_unflatten(treedef, leaves)

  def _run(self, record: CallRecord, fn: Callable[..., Any], args: Sequence[Any],
           kwargs: Mapping[str, Any]) -> Any:
    """:meth:`run` without the hooks."""
    precision, output_dtype = record.precision, record.output_dtype
    compute = precision.policy.compute_dtype
    index = len(self.records)
    self.records.append(record)
    args, kwargs = tuple(args), dict(kwargs)
    cast_args, cast_kwargs = self.cast((args, kwargs), compute)
    self._callers.append(compute)
    try:
      with contextlib.ExitStack() as stack:
        stack.enter_context(float32_ops_lib.module_ops(precision.float32_ops))
        if self.annotate:
          stack.enter_context(jax.named_scope(f"{ANNOTATION}{index}"))
        out = fn(*cast_args, **cast_kwargs)
    finally:
      self._callers.pop()
    return self._cast_output(out, output_dtype, args, kwargs)

  def param_scope(self) -> Any:
    """A context for creating params: named :data:`PARAM_ANNOTATION` when annotating."""
    return jax.named_scope(PARAM_ANNOTATION) if self.annotate else contextlib.nullcontext()


def _is_float_dtype_value(value: Any) -> bool:
  try:
    return dtypes_lib.is_float_dtype(np.dtype(value))
  except TypeError:
    return False


def _elements(out: Any) -> list | None:
  if isinstance(out, (tuple, list)) and len(out) > 1:
    return list(out)
  if isinstance(out, dict) and len(out) > 1:
    return list(out.values())
  return None


def _rebuild(out: Any, elements: list) -> Any:
  if isinstance(out, dict):
    return type(out)(zip(out.keys(), elements))
  if hasattr(out, "_fields"):  # NamedTuple
    return type(out)(*elements)
  return type(out)(elements)


def _same_shapes(a: Any, b: Any, is_node: Callable[[Any], bool] | None) -> bool:
  leaves_a, def_a = jax.tree_util.tree_flatten(a, is_leaf=is_node)
  leaves_b, def_b = jax.tree_util.tree_flatten(b, is_leaf=is_node)
  return def_a == def_b and all(
      np.shape(x) == np.shape(y) and tree_lib.is_float_array(x) == tree_lib.is_float_array(y)
      for x, y in zip(leaves_a, leaves_b))


def written(value: T, stored: Any, read: Any = None) -> T:
  """``value``, written in place to a variable that held ``stored``, in ``stored``'s dtypes.

  The rule for state a module writes in place (a param it overwrites, a cache, step 6
  of the module docstring): each floating-point leaf goes back in the dtype of the
  leaf it replaces, so the variable keeps the dtype the model gave it. A value of
  another tree structure (a variable that held ``None``) is written as it is.

  Args:
    value: what the module left in the variable.
    stored: what the variable held before the module read it.
    read: what the module was given for ``stored`` (:meth:`Call.read_cache`), or
      ``None``. A leaf of ``value`` that is still the leaf it was given goes back as
      the stored leaf itself: a cache read in a narrower dtype and not written keeps
      its bits.

  Returns:
    The value to store.

  Example:
    >>> from jaxmp._src import engine
    >>> cache = {"k": jnp.zeros(4, jnp.float32), "index": jnp.int32(0)}
    >>> new = engine.written({"k": jnp.ones(4, jnp.bfloat16), "index": jnp.int32(1)}, cache)
    >>> new["k"].dtype, new["index"].dtype
    (dtype('float32'), dtype('int32'))
    >>> stored = jnp.float32(1 / 3)
    >>> given = stored.astype(jnp.bfloat16)
    >>> engine.written(given, stored, read=given) is stored   # read, not written
    True
  """
  leaves, treedef = jax.tree_util.tree_flatten(value)
  stored_leaves, stored_treedef = jax.tree_util.tree_flatten(stored)
  if treedef != stored_treedef:
    return value
  read_leaves = jax.tree_util.tree_leaves(read)
  if jax.tree_util.tree_structure(read) != treedef:
    read_leaves = [None] * len(leaves)
  return jax.tree_util.tree_unflatten(treedef, [
      y if x is r else
      x.astype(y.dtype) if tree_lib.is_float_array(x) and tree_lib.is_float_array(y)
      and x.dtype != y.dtype else x
      for x, y, r in zip(leaves, stored_leaves, read_leaves)])


_LAX_DTYPE_MISMATCH = "requires arguments to have the same dtypes"
"""How lax refuses operands of two dtypes (``lax.dynamic_update_slice``, ``lax.add``)."""

_MAX_STATE_IN_ERROR = 8


def uncast_state_error(error: Exception, uncast_state: Sequence[str], caches: str,
                       declare: str) -> TypeError | None:
  """Explains lax's two-dtype error where the model keeps state jaxmp leaves as stored.

  Step 6 of the module docstring reads only the state an adapter knows as caches in a
  module's compute dtype; any other floating-point state a module holds (a buffer in
  a variable of another type or collection) keeps its dtype. A decoder that writes a
  value it computed into such a buffer in place then meets two dtypes, and lax's
  error names neither the buffer nor the fix.

  Args:
    error: what the model's call raised.
    uncast_state: the model's floating-point state that jaxmp neither casts nor reads
      as a cache, one ``"name (kind, dtype)"`` each.
    caches: the state the adapter reads as caches, in words.
    declare: how a user makes a buffer such a cache, in words.

  Returns:
    A TypeError naming the state and the fix, to raise from ``error``; ``None`` when
    ``error`` is not lax's two-dtype error or there is no such state.

  Example:
    >>> from jaxmp._src import engine
    >>> error = TypeError("lax.dynamic_update_slice requires arguments to have the same "
    ...                   "dtypes, got float32, bfloat16.")
    >>> explained = engine.uncast_state_error(error, ["'k' (Variable, float32)"],
    ...                                       "nnx.Cache variables", "an nnx.Cache")
    >>> "'k' (Variable, float32)" in str(explained)
    True
  """
  if not (isinstance(error, TypeError) and _LAX_DTYPE_MISMATCH in str(error)
          and uncast_state):
    return None
  listed = ", ".join(uncast_state[:_MAX_STATE_IN_ERROR])
  if len(uncast_state) > _MAX_STATE_IN_ERROR:
    listed += f" and {len(uncast_state) - _MAX_STATE_IN_ERROR} more"
  return TypeError(
      f"jaxmp: {error} The model keeps floating-point state that jaxmp leaves in the "
      f"dtype it is stored in, whatever a module computes in: {listed}. A module that "
      f"writes a value it computed into such state in place (lax.dynamic_update_slice, "
      f"as a decoder updates its KV cache) meets two dtypes. jaxmp reads {caches} in the "
      f"compute dtype of the module that uses them and writes them back in their own "
      f"dtype: if this state is a cache the model writes in place, make it {declare}; "
      f"or create it in the compute dtype.")


def unused_rules(rules: rules_lib.PolicyRules, records: Sequence[CallRecord],
                 fp8_layer_names: str, attention_rules_reached: Collection[int] | None = None
                 ) -> list[str]:
  """Describes each rule that decided no module's precision in ``records``.

  Args:
    rules: the rules.
    records: the calls of one run of the model.
    fp8_layer_names: the adapter's fp8-capable layers, for the message.
    attention_rules_reached: the ``id`` of each rule whose ``causal_attention`` or
      ``padded_attention`` reached a module's ``attention_fn``
      (:attr:`Call.attention_rules_reached`); ``None``: not checked.

  Returns:
    One sentence per problem: a rule that matches no module, a rule shadowed by
    earlier ones, an fp8 rule that matches no fp8-capable layer, a causal-attention
    rule that matches no module with an ``attention_fn``, a rule or the model-wide
    ``PolicyRules(float32_ops=...)`` list that asks for float32 ops jaxmp cannot
    intercept (with the paths of the modules it applies to).

  Example:
    >>> from jaxmp._src import engine
    >>> rules = jaxmp.PolicyRules("float32", [jaxmp.Rule("encoder", "bf16")])
    >>> engine.unused_rules(rules, [], "Dense")
    ["rule 0 ('encoder') matches no module"]
  """
  problems = []
  # The model-wide list governs every module whose rule (if any) gives no list of its own.
  governed = [r for r in records
              if r.precision.rule is None or r.precision.rule.float32_ops is None]
  problems += _uninterceptable_ops("PolicyRules float32_ops", rules.float32_ops, governed)
  for index, rule in enumerate(rules.rules):
    decided = [r for r in records if r.precision.rule is rule]
    problems += _uninterceptable_ops(f"rule {index} ({rule.describe()})", rule.float32_ops,
                                     decided)
    if decided and rule.fp8 is not None and not any(r.precision.fp8 for r in decided):
      problems.append(f"rule {index} ({rule.describe()}) has an "
                      f"{fp8_ops.narrow_type(rule.fp8)} recipe but matches no layer "
                      f"fp8 applies to ({fp8_layer_names}): it matches only "
                      f"{_qualified_classes(decided)}, whose matmuls stay in the compute "
                      f"dtype (fp8 replaces the product of the layers it applies to "
                      f"through their own dot_general or einsum hook; a layer that calls "
                      f"lax.dot_general itself has none)")
    declared = [d for d, on in (("causal", rule.causal_attention),
                                ("padded", rule.padded_attention)) if on]
    if (decided and declared and attention_rules_reached is not None
        and id(rule) not in attention_rules_reached):
      problems.append(f"rule {index} ({rule.describe()}) declares {' and '.join(declared)} "
                      "attention but matches no module with an attention_fn field "
                      "(Flax's MultiHeadDotProductAttention, or a layer with such a "
                      "field): nothing computes "
                      f"{'causally' if rule.causal_attention else 'with padding lengths'}")
    if decided:
      continue
    if any(rule.matches(r.path, r.module_type) for r in records):
      problems.append(f"rule {index} ({rule.describe()}) is shadowed by earlier rules for "
                      f"every module it matches")
    else:
      problems.append(f"rule {index} ({rule.describe()}) matches no module")
  return problems


def _qualified_classes(records: Sequence[CallRecord]) -> str:
  """The records' module classes by module and name: a model's own ``DenseGeneral``
  reads apart from Flax's."""
  return ", ".join(dict.fromkeys(f"{r.module_type.__module__}.{r.module_type.__qualname__}"
                                 for r in records))


def _uninterceptable_ops(who: str, ops: frozenset | None,
                         records: Sequence[CallRecord]) -> list[str]:
  """The problem of a float32 op list naming ops jaxmp cannot intercept, where it applies."""
  uninterceptable = sorted(set(ops or ()) & set(float32_ops_lib.UNINTERCEPTABLE))
  if not (records and uninterceptable):
    return []
  paths = ", ".join(dict.fromkeys(paths_lib.describe_path(r.path) for r in records))
  return [f"{who} asks for {', '.join(uninterceptable)} in float32, which jaxmp cannot "
          f"intercept (it intercepts {', '.join(float32_ops_lib.INTERCEPTABLE)}): they run in "
          f"the compute dtype in {paths}"]


def describe_paths(records: Sequence[CallRecord]) -> str:
  """The model's module paths and classes, one per line, for warnings."""
  seen = list(dict.fromkeys((paths_lib.describe_path(r.path), r.module_type.__name__)
                            for r in records))
  lines = [f"  {path} ({cls})" for path, cls in seen[:_MAX_PATHS_IN_WARNING]]
  if len(seen) > _MAX_PATHS_IN_WARNING:
    lines.append(f"  ... and {len(seen) - _MAX_PATHS_IN_WARNING} more")
  return "\n".join(lines)


def warn_unused_rules(model_name: str, rules: rules_lib.PolicyRules,
                      records: Sequence[CallRecord], fp8_layer_names: str, *,
                      attention_rules_reached: Collection[int] | None = None,
                      already_warned: set | None = None, stacklevel: int = 2) -> None:
  """Warns once per problem :func:`unused_rules` finds, listing the model's paths.

  Args:
    model_name: the wrapped model's class name.
    rules: the rules.
    records: the calls of one run of the model.
    fp8_layer_names: the adapter's fp8-capable layers.
    attention_rules_reached: as for :func:`unused_rules`.
    already_warned: problems warned about before (updated); ``None`` warns every time.
    stacklevel: as for ``warnings.warn``, counted from the caller of this function.
  """
  problems = unused_rules(rules, records, fp8_layer_names, attention_rules_reached)
  if already_warned is not None:
    problems = [p for p in problems if p not in already_warned]
    already_warned.update(problems)
  if problems:
    warnings.warn(
        f"jaxmp: in {model_name}, " + "; ".join(problems)
        + ". The model's module paths are:\n" + describe_paths(records),
        UserWarning, stacklevel=stacklevel + 1)


__all__ = (
    "ANNOTATION",
    "NOT_A_DTYPE_FIELD",
    "PARAM_ANNOTATION",
    "Call",
    "CallHook",
    "CallRecord",
    "CallSite",
    "Wrapper",
    "check_hooks",
    "describe_paths",
    "integer_params_error",
    "param_storage_error",
    "resolve",
    "uncast_state_error",
    "unused_rules",
    "warn_unused_rules",
    "written",
)
