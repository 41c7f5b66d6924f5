"""Where did the inf come from? Per-module non-finite tracing inside the compiled step.

With ``PolicyRules(..., trace_nonfinite=True)``, the engine runs every module call of a
wrapped model (linen or NNX) through :class:`NonfiniteHook`, one of the engine's
per-call hooks (:class:`jaxmp._src.engine.CallHook`), which puts the call between two
identity functions with custom derivatives:
*enter*, on the floating-point arguments as the caller passed them, and *leave*, on the
output as the caller gets it back. Forward, they measure the absolute max (amax) of the
inputs and of the output; backward, of the gradient arriving at the output and of the
gradient the call sends back to its inputs. The casts into and out of the module's
compute dtype lie between the two, so an overflow in a cast is the module's own.

**Transport.** The backward statistics exist only in the backward pass, and a function
cannot write state, so every statistic leaves as a *gradient*, the pattern of jaxmp's
fp8 state: the model takes a *probe*, a :class:`NonfiniteTrace` of zeros with one row
per (module path, method), and both identities hand their row back as the cotangent of
the probe. Differentiating with respect to the probe (``jaxmp.linen.value_and_grad`` and
``jaxmp.nnx.value_and_grad`` do it, and so can a plain ``jax.grad``) returns a
:class:`NonfiniteTrace` of statistics: a few scalar reductions per module call inside
the compiled step, no host callback. The rows are read as
:data:`~jaxmp._src.fp8.maxgrad.max_float32`, whose autodiff accumulation is ``max``, so
a module called in every iteration of a ``scan`` (or several times, or under
``remat``) reports the max over its calls. ``vmap`` and ``shard_map`` add a row up over
their axis instead; a count column lets the reader divide that back out (the flags and
positions are then exact, an amax is the mean over the axis). Under ``jit`` with sharded
arrays every reduction is global already.

**Columns** (:data:`COLUMNS`): ``input``, ``output``, ``output_grad``, ``input_grad``
(the amaxes above); ``param_grad`` (the amax of the module's own parameter gradients,
filled in from the gradients by jaxmp's ``value_and_grad``); ``made_forward`` (positive
when, in some call, the output was non-finite although the inputs of *that* call were
finite) and ``made_backward`` (positive when, in some call, the gradient sent to the
inputs was non-finite although the gradient arriving at the output of *that* call was
finite); ``forward`` (the call's position among the calls in the order they *finish*,
from 1); ``backward`` (its position in the order they *start*, from 1: the backward
pass finishes them in reverse); and ``count``. The two flags are decided per call,
inside one iteration of a ``scan``: a recurrent layer whose inf becomes its own next
input still made it. (The enter identity hands its input amax to the leave identity as
an extra scalar, and the leave identity hands the output-gradient amax back to the
enter identity as that scalar's cotangent.) A column that no identity wrote is
``-inf``; a row no call wrote is all zero. An amax of inf means the value held inf or
NaN: NaN is measured as inf, because a max across devices (sharded ``jit``) drops NaN.

Reading a trace (which value came first, the amax table) is
:mod:`jaxmp._src.tools.nonfinite`.

Example:
  >>> from jaxmp._src import nonfinite
  >>> probe = nonfinite.probe((("", "__call__"),))
  >>> def loss(x, probe):
  ...   (slot,) = nonfinite.Tracer(probe).rows
  ...   (y,) = nonfinite.leave((x * 1e38 * 10,), slot, forward=1, backward=1)
  ...   return jnp.sum(y)
  >>> trace = jax.grad(loss, argnums=1)(jnp.ones(2), probe)
  >>> dict(zip(nonfinite.COLUMNS, trace.values[0].tolist()))
  {'input': -inf, 'output': inf, 'output_grad': 1.0, 'input_grad': -inf, 'param_grad': -inf,
   'made_forward': 1.0, 'made_backward': -inf, 'forward': 1.0, 'backward': 1.0, 'count': 1.0}
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import paths as paths_lib
from jaxmp._src import pytree as pytree_lib
from jaxmp._src.fp8 import maxgrad

COLUMNS = ("input", "output", "output_grad", "input_grad", "param_grad", "made_forward",
           "made_backward", "forward", "backward", "count")
"""The columns of :attr:`NonfiniteTrace.values` (see the module docstring)."""

(INPUT, OUTPUT, OUTPUT_GRAD, INPUT_GRAD, PARAM_GRAD, MADE_FORWARD, MADE_BACKWARD, FORWARD,
 BACKWARD, COUNT) = range(10)

COUNTED = (INPUT, OUTPUT, OUTPUT_GRAD, INPUT_GRAD, FORWARD, BACKWARD)
"""The columns a sum-accumulating transform (vmap, shard_map) adds up: divide by count."""

Call = tuple[str, str]
"""A traced call site: (the module's '/'-joined path, the method)."""


def describe_call(path: str, method: str) -> str:
  """``block_1/mlp/down``, ``embed.attend``: a call site as messages show it."""
  where = paths_lib.describe_path(path)
  return where if method == "__call__" else f"{where}.{method}"


def _check_calls(calls: Any) -> tuple[Call, ...]:
  if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
    raise TypeError(f"NonfiniteTrace: calls must be a sequence of (path, method) string "
                    f"pairs, got {calls!r} of type {type(calls).__name__}.")
  checked = []
  for call in calls:
    if (not isinstance(call, tuple) or len(call) != 2
        or not all(isinstance(s, str) for s in call)):
      raise TypeError(f"NonfiniteTrace: each call must be a (path, method) pair of strings, "
                      f"got {call!r}.")
    checked.append(call)
  if len(set(checked)) != len(checked):
    raise ValueError(f"NonfiniteTrace: calls must be distinct, got {tuple(checked)!r}.")
  return tuple(checked)


class NonfiniteTrace(pytree_lib.Immutable):
  """Per-module non-finite statistics of one step, or the zero probe that collects them.

  A pytree with one leaf, ``values`` (float32, ``[len(calls), len(COLUMNS)]``); the
  call sites are static. The gradient of a loss with respect to a probe is a
  :class:`NonfiniteTrace` with the same calls, so it comes out of ``jit`` as it is and
  reads with :func:`jaxmp.tools.nonfinite_report`.

  Args:
    calls: the traced call sites, ``(path, method)`` pairs, one per row.
    values: ``[len(calls), len(COLUMNS)]`` float32 (zeros for a probe).

  Raises:
    TypeError: for calls that are not (path, method) string pairs, or non-float32
      values.
    ValueError: for repeated calls or values of the wrong shape.

  Example:
    >>> from jaxmp._src import nonfinite
    >>> probe = nonfinite.probe((("", "__call__"), ("dense", "__call__")))
    >>> probe.values.shape, jax.tree_util.tree_leaves(probe)[0] is probe.values
    ((2, 10), True)
  """

  __slots__ = ("_calls", "_values")
  _IMMUTABLE_HINT = "jaxmp's value_and_grad makes new ones"

  def __init__(self, calls: Sequence[Call], values: Any):
    calls = _check_calls(calls)
    shape = (len(calls), len(COLUMNS))
    if np.shape(values) != shape:
      raise ValueError(f"NonfiniteTrace: values must have shape {shape} (calls x columns "
                       f"{COLUMNS}), got {np.shape(values)}.")
    dtype = getattr(values, "dtype", None)
    if dtype is None or np.dtype(dtype) != np.float32:
      raise TypeError(f"NonfiniteTrace: values must be float32, got {dtype}.")
    object.__setattr__(self, "_calls", calls)
    object.__setattr__(self, "_values", values)

  @property
  def calls(self) -> tuple[Call, ...]:
    """The traced call sites, one per row of :attr:`values`."""
    return self._calls

  @property
  def values(self) -> Any:
    """The statistics, ``[len(calls), len(COLUMNS)]`` float32 (see ``COLUMNS``)."""
    return self._values

  def __repr__(self) -> str:
    return f"NonfiniteTrace({len(self._calls)} calls, values={self._values!r})"

  def _tree_flatten_with_keys(self):
    return ((jax.tree_util.GetAttrKey("values"), self._values),), self._calls

  def _tree_flatten(self):
    return (self._values,), self._calls

  @classmethod
  def _tree_unflatten(cls, aux, children):
    # Leaves come as JAX hands them (tracers, None, shardings): not user input.
    out = object.__new__(cls)
    object.__setattr__(out, "_calls", aux)
    object.__setattr__(out, "_values", children[0])
    return out


jax.tree_util.register_pytree_with_keys(
    NonfiniteTrace, NonfiniteTrace._tree_flatten_with_keys,  # pylint: disable=protected-access
    NonfiniteTrace._tree_unflatten, NonfiniteTrace._tree_flatten)  # pylint: disable=protected-access


def probe(calls: Sequence[Call]) -> NonfiniteTrace:
  """The zero probe for ``calls``: differentiate a loss with respect to it.

  Example:
    >>> from jaxmp._src import nonfinite
    >>> float(nonfinite.probe((("", "__call__"),)).values.sum())
    0.0
  """
  calls = _check_calls(calls)
  return NonfiniteTrace(calls, jnp.zeros((len(calls), len(COLUMNS)), jnp.float32))


def calls_of(records: Iterable[Any]) -> tuple[Call, ...]:
  """The distinct call sites of ``records``, in the order they were first called.

  Args:
    records: the engine's :class:`~jaxmp._src.engine.CallRecord` list (anything with
      ``path`` and ``method``; the engine imports this module, not the other way).
  """
  return tuple(dict.fromkeys((r.path, r.method) for r in records))


MODEL_CALL_START = 1
"""The start position (the ``backward`` column) of the wrapped model's own call."""


def model_calls(values: np.ndarray) -> np.ndarray:
  """Which rows of a decoded trace are the wrapped model's own call, as a bool mask.

  The model's own call is the one its caller made: the root's ``__call__``, or the
  method given to linen's ``apply(..., method=)`` or called on the NNX wrapper. Its
  inputs are the model's inputs and its output gradient is the one the loss sent. The
  engine numbers the calls of one call of a wrapped model in start order from 1, so it
  is the row at start position :data:`MODEL_CALL_START`. The root's other methods that
  it calls (``self.embed(...)``, ``self.decode(...)``) share its path ``""`` but are
  calls inside it, like a child's, and start later.

  Args:
    values: the trace's values on the host, sums divided back out (what
      :func:`jaxmp._src.tools.nonfinite.decoded` returns).

  Example:
    >>> from jaxmp._src import nonfinite
    >>> values = np.zeros((2, len(nonfinite.COLUMNS)), np.float32)
    >>> values[:, nonfinite.COUNT] = 1.0
    >>> values[:, nonfinite.BACKWARD] = [1.0, 2.0]   # ("", "__call__"), ("", "embed")
    >>> nonfinite.model_calls(values).tolist()
    [True, False]
  """
  return (values[:, COUNT] > 0) & (values[:, BACKWARD] == MODEL_CALL_START)


def check_trace(trace: Any, where: str) -> NonfiniteTrace:
  """``trace`` if it is a :class:`NonfiniteTrace`; else a TypeError naming ``where``."""
  if not isinstance(trace, NonfiniteTrace):
    raise TypeError(f"{where} must be a NonfiniteTrace (Gradients.nonfinite from "
                    f"jaxmp.linen.value_and_grad or jaxmp.nnx.value_and_grad), got "
                    f"{type(trace).__name__}: {trace!r:.80}.")
  return trace


# ---- the identities at the module boundary ----------------------------------------------


def _amax(xs: Sequence[jax.Array]) -> jax.Array:
  """The float32 absolute max over ``xs``; inf when one of them holds inf or NaN."""
  maxima = []
  for x in xs:
    # fp8 has no arithmetic of its own on some backends, so it is measured as float32.
    x = x.astype(jnp.float32) if x.dtype.itemsize == 1 else x
    # NaN counts as inf: a max across devices (sharded jit) drops NaN, inf it keeps.
    # (A float max is also the cheapest reduction on a CPU: cheaper than a sum, and
    # than an integer max of the bits, which would keep NaN apart from inf.)
    maxima.append(jnp.max(jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x))).astype(jnp.float32))
  return functools.reduce(jnp.maximum, maxima)


def _row(entries: dict[int, Any]) -> jax.Array:
  """A probe row: ``entries`` at their columns, -inf (nothing written) elsewhere."""
  return jnp.stack([jnp.asarray(entries.get(i, -np.inf), jnp.float32)
                    for i in range(len(COLUMNS))])


def _nonfinite(amax: jax.Array) -> jax.Array:
  return ~jnp.isfinite(amax) & (amax != -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _enter(xs: tuple, slot: jax.Array, backward: int) -> tuple[tuple, jax.Array]:
  del slot, backward
  # The token carries the input amax to the call's leave identity (unused, and so
  # removed by XLA, when nothing is differentiated).
  return xs, _amax(xs)


def _enter_fwd(xs, slot, backward):
  del slot, backward
  amax = _amax(xs)
  return (xs, amax), amax


def _enter_bwd(backward, amax, cts):
  xs_cts, output_grad = cts  # the token's cotangent: the output-gradient amax
  input_grad = _amax(xs_cts)
  made = ~_nonfinite(output_grad) & _nonfinite(input_grad)
  return xs_cts, _row({INPUT: amax, INPUT_GRAD: input_grad, MADE_BACKWARD: made,
                       BACKWARD: backward, COUNT: 1.0})


_enter.defvjp(_enter_fwd, _enter_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _leave(xs: tuple, slot: jax.Array, token: jax.Array, forward: int, backward: int) -> tuple:
  del slot, token, forward, backward
  return xs


def _leave_fwd(xs, slot, token, forward, backward):
  del slot, forward, backward
  return xs, (_amax(xs), token)


def _leave_bwd(forward, backward, residuals, cts):
  output, input_amax = residuals
  output_grad = _amax(cts)
  made = _nonfinite(output) & ~_nonfinite(input_amax)
  row = _row({OUTPUT: output, OUTPUT_GRAD: output_grad, MADE_FORWARD: made,
              FORWARD: forward, BACKWARD: backward, COUNT: 1.0})
  return cts, row, output_grad


_leave.defvjp(_leave_fwd, _leave_bwd)


def enter(xs: Sequence[jax.Array], slot: jax.Array, *,
          backward: int) -> tuple[tuple, jax.Array]:
  """The identity on a call's float inputs that measures them and their gradient.

  Args:
    xs: the call's non-empty floating-point array arguments.
    slot: the call site's row, as :class:`Tracer` reads it.
    backward: the call's position in start order, from 1.

  Returns:
    ``xs``, and the token to hand to the call's :func:`leave`.
  """
  return _enter(tuple(xs), maxgrad.from_max_float32(slot), backward)


def leave(xs: Sequence[jax.Array], slot: jax.Array, token: jax.Array | None = None, *,
          forward: int, backward: int) -> tuple:
  """The identity on a call's float outputs that measures them and their gradient.

  Args:
    xs: the call's non-empty floating-point array outputs.
    slot: the call site's row, as :class:`Tracer` reads it.
    token: what the call's :func:`enter` returned; ``None`` for a call with no float
      inputs.
    forward: the call's position in finish order, from 1.
    backward: the call's position in start order, from 1.
  """
  token = jnp.float32(-np.inf) if token is None else token
  return _leave(tuple(xs), maxgrad.from_max_float32(slot), token, forward, backward)


class Tracer:
  """A probe as one call of a wrapped model reads it: a max-accumulating row per site.

  Built once per call of the model, outside any ``scan`` the model runs, so that every
  read of a row inside one accumulates by ``max``.

  Args:
    trace: the probe (its values may be traced).

  Raises:
    TypeError: if ``trace`` is not a :class:`NonfiniteTrace`.
  """

  def __init__(self, trace: NonfiniteTrace):
    trace = check_trace(trace, "the non-finite probe")
    self.calls = trace.calls
    values = trace.values
    self.rows = [maxgrad.to_max_float32(values[i]) for i in range(len(self.calls))]
    self._index = {call: i for i, call in enumerate(self.calls)}
    self._finished = 0

  def slot(self, path: str, method: str) -> jax.Array:
    """The row of the call site ``(path, method)``.

    Raises:
      ValueError: if the probe has no row for it (it was built for other calls).
    """
    index = self._index.get((path, method))
    if index is None:
      raise ValueError(
          f"jaxmp: the non-finite probe has no row for the module call "
          f"{describe_call(path, method)}: it was built for other calls (linen: the calls "
          f"model.init made; NNX: the modules the model had when it was wrapped). Build "
          f"one for this call with model.nonfinite_probe(variables, *args, **kwargs) "
          f"(linen) or wrap the model again (NNX). The probe's calls: "
          f"{', '.join(describe_call(*c) for c in self.calls[:20])}"
          f"{' ...' if len(self.calls) > 20 else ''}.")
    return self.rows[index]

  def finished(self) -> int:
    """Counts one more finished call; returns its position in finish order (from 1)."""
    self._finished += 1
    return self._finished


class NonfiniteHook:
  """Non-finite tracing as a per-call hook of the engine (:class:`~jaxmp._src.engine.CallHook`).

  Around each module call: :func:`enter` on the arguments as the caller passed them,
  :func:`leave` on the output as the caller gets it back, both writing the call
  site's row of the probe (see the module docstring). Built once per call of the
  wrapped model, like its :class:`Tracer`.

  Args:
    trace: the probe (its values may be traced).

  Raises:
    TypeError: if ``trace`` is not a :class:`NonfiniteTrace`.
  """

  def __init__(self, trace: NonfiniteTrace):
    self.tracer = Tracer(trace)

  def enter(self, site: Any, xs: tuple) -> tuple[tuple, Any]:
    """Measures the inputs; the token is the site's row and the inputs' amax.

    Raises:
      ValueError: if the probe has no row for the call site.
    """
    slot = self.tracer.slot(site.record.path, site.record.method)
    if not xs:
      return xs, (slot, None)
    xs, amax = enter(xs, slot, backward=site.start)
    return xs, (slot, amax)

  def leave(self, site: Any, xs: tuple, token: Any) -> tuple:
    """Counts the call finished and measures its output."""
    finish = self.tracer.finished()
    if not xs:
      return xs
    slot, amax = token
    return leave(xs, slot, amax, forward=finish, backward=site.start)


def hooks(rules: Any, trace: NonfiniteTrace | None) -> tuple[NonfiniteHook, ...]:
  """The engine hooks of one call of a wrapped model: the adapters' one entry to tracing.

  Args:
    rules: the wrapper's :class:`~jaxmp._src.rules.PolicyRules`.
    trace: the probe to differentiate, or ``None`` (this call traces nothing: tracing
      is off, or the call is not differentiated, as for ``summary``).

  Returns:
    ``(NonfiniteHook(trace),)``, or ``()`` without a probe.

  Raises:
    ValueError: for a probe under rules that do not trace.
    TypeError: for a probe that is not a :class:`NonfiniteTrace`.

  Example:
    >>> from jaxmp._src import nonfinite
    >>> nonfinite.hooks(jaxmp.PolicyRules("float32"), None)
    ()
  """
  if trace is None:
    return ()
  if not rules.trace_nonfinite:
    raise ValueError("jaxmp: a non-finite probe was given to a model whose rules do not "
                     "trace (PolicyRules(..., trace_nonfinite=True) turns tracing on).")
  return (NonfiniteHook(trace),)


# ---- reading a trace ------------------------------------------------------------------------


def with_param_grads(trace: NonfiniteTrace,
                     grads: Iterable[tuple[tuple[str, ...], Any]]) -> NonfiniteTrace:
  """Fills the ``param_grad`` column: the amax of each module's own parameter gradients.

  A gradient belongs to the nearest enclosing module that has a row (every method of it
  gets the same value); rows of modules that own none stay ``-inf``.

  Args:
    trace: the probe's gradient.
    grads: ``(path, gradient)`` pairs, the path as strings relative to the wrapped model
      (``("block_0", "mlp", "down", "kernel")``).

  Returns:
    The trace with the column filled.
  """
  rows_of: dict[tuple[str, ...], list[int]] = {}
  for i, (path, _) in enumerate(trace.calls):
    rows_of.setdefault(tuple(path.split("/")) if path else (), []).append(i)
  owned: dict[tuple[str, ...], list[jax.Array]] = {}
  for path, leaf in grads:
    owner = paths_lib.owner(tuple(path), {p: p for p in rows_of})
    if owner is not None and jnp.size(leaf):
      owned.setdefault(owner, []).append(leaf)
  column: list[np.float32 | jax.Array] = [np.float32(-np.inf)] * len(trace.calls)
  for owner, leaves in owned.items():
    amax = _amax(leaves)
    for i in rows_of[owner]:
      column[i] = amax
  values = trace.values.at[:, PARAM_GRAD].set(jnp.stack([jnp.asarray(c) for c in column]))
  return NonfiniteTrace(trace.calls, values)


def accumulate(a: NonfiniteTrace, b: NonfiniteTrace) -> NonfiniteTrace:
  """Combines the traces of two micro-batches of one step: the element-wise max.

  Raises:
    ValueError: if their calls differ (they are not traces of the same model).

  Example:
    >>> from jaxmp._src import nonfinite
    >>> a = nonfinite.probe((("", "__call__"),))
    >>> b = nonfinite.NonfiniteTrace(a.calls, a.values.at[0, 1].set(jnp.inf))
    >>> float(nonfinite.accumulate(a, b).values[0, 1])
    inf
  """
  if a.calls != b.calls:
    raise ValueError("accumulate_gradients: the two non-finite traces are of different "
                     f"calls ({len(a.calls)} and {len(b.calls)} call sites): not gradients "
                     f"of the same model.")
  return NonfiniteTrace(a.calls, jnp.maximum(a.values, b.values))


__all__ = (
    "COLUMNS",
    "COUNTED",
    "MODEL_CALL_START",
    "NonfiniteHook",
    "NonfiniteTrace",
    "Tracer",
    "accumulate",
    "calls_of",
    "check_trace",
    "describe_call",
    "enter",
    "hooks",
    "leave",
    "model_calls",
    "probe",
    "with_param_grads",
)
