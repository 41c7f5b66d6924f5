"""Is my mixed-precision run healthy? In-jit training metrics and a host-side monitor.

:func:`training_metrics` is a pure function to call inside the jitted train step: the
gradients' global norm, the number of non-finite gradient values per top-level module,
and, given the optimizer state, the loss scale, the skipped-step count and whether the
last step was finite (:func:`jaxmp.loss_scaling_metrics`). Return the dict from the
step; it is a handful of scalars.

:class:`Monitor` lives on the host. Fed each step's metrics and loss, it keeps their
history and flags the ways mixed precision fails quietly:

* ``scale_collapse``: the loss scale has fallen to within ``collapse_factor`` of
  ``min_scale`` and below the largest scale seen (so a fixed scale never counts; the
  first update's scale is the first one seen): the gradients overflow at almost any
  scale, usually because a layer overflows in float16 by itself;
* ``skip_rate``: more than ``max_skip_rate`` of the last ``skip_window`` steps were
  skipped for non-finite gradients (the message names the top-level modules whose
  gradients were non-finite);
* ``loss_spike``: the loss exceeds ``spike_factor`` times the median of the
  previous ``spike_window`` finite losses;
* ``nonfinite_loss``: the loss is inf or NaN;
* ``skip_streak``: ``max_consecutive_skips`` steps in a row were skipped (the
  ``consecutive_skips`` metric of :func:`jaxmp.loss_scaling_metrics`): no update has
  been applied for that long, the run trains nothing. ``jaxmp.loss_scaling``'s own
  ``max_consecutive_skips`` raises instead;
* ``nonfinite_origin``: a step was skipped and the metrics carry a non-finite trace (a
  model wrapped with ``PolicyRules(trace_nonfinite=True)``, its
  ``Gradients.nonfinite`` passed to :func:`training_metrics`): the message names the
  module and direction of the step's first non-finite value ("skipped step 12: first
  non-finite value: forward output of block_1/mlp/down"); :meth:`Monitor.nonfinite_report`
  gives the per-module amax table of the latest step that overflowed (at the end of a
  loop too, when later steps were finite).

Each kind is reported at the step its condition becomes true, and again only after it
has been false for a step, so a long collapse is one anomaly, not one per step.

Example:
  >>> import optax
  >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**15))
  >>> opt_state = tx.init({"w": jnp.ones(2)})
  >>> grads = {"w": jnp.array([jnp.inf, 1.0])}
  >>> _, opt_state = tx.update(grads, opt_state)
  >>> metrics = jax.jit(jaxmp.tools.training_metrics)(grads, opt_state)
  >>> {k: v.tolist() for k, v in metrics["nonfinite"].items()}, metrics["skipped_steps"].item()
  ({'w': 1}, 1)
  >>> monitor = jaxmp.tools.Monitor(skip_window=1, max_skip_rate=0.5)
  >>> [a.kind for a in monitor.update(metrics, loss=2.3)]
  ['skip_rate']
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from jaxmp._src import checks
from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src import loss_scaling as loss_scaling_lib
from jaxmp._src import nonfinite as nonfinite_lib
from jaxmp._src.tools import leaves as leaves_lib
from jaxmp._src.tools import nonfinite as report_lib

# ---- in-jit metrics ------------------------------------------------------------------------


def _inverse_scale(loss_scale: Any) -> Any:
  if loss_scale is None:
    return None
  return 1.0 / loss_scale_lib.loss_scale_array(loss_scale, where="training_metrics")


def training_metrics(grads: optax.Updates, opt_state: optax.OptState | None = None, *,
                     loss_scale: loss_scale_lib.LossScale | ArrayLike | None = None,
                     nonfinite_trace: nonfinite_lib.NonfiniteTrace | None = None
                     ) -> dict[str, Any]:
  """Scalars that say whether a mixed-precision step was healthy; pure and jit-able.

  Args:
    grads: the gradients to measure, any pytree (an ``nnx.State`` too). Counts are
      grouped by the first element of each leaf's path: pass the params' gradients
      (``grads.params`` from :func:`jaxmp.linen.value_and_grad`, or
      ``grads["params"]``) to group by top-level module. The norm is of what you pass:
      gradients of a scaled loss are scaled, unless ``loss_scale`` says by how much.
    opt_state: an optimizer state holding one :class:`jaxmp.LossScalingState`, for
      the loss-scaling entries; ``None`` for none. Pass the state *after* the update
      to read that update's outcome.
    loss_scale: the scale ``grads`` were multiplied by (a :class:`jaxmp.LossScale`,
      number or scalar array); the norm is then of the unscaled gradients. Give the
      scale that produced them (the one before the update), not the adjusted one.
    nonfinite_trace: the step's non-finite trace (``Gradients.nonfinite`` of a model wrapped
      with ``PolicyRules(trace_nonfinite=True)``), passed through for
      :class:`Monitor` and :func:`jaxmp.tools.nonfinite_report`; ``None`` for none. Not
      the zero probe the model's variables hold: a trace that recorded no module call
      is refused here where its values are concrete, else by :meth:`Monitor.update`.

  Returns:
    A dict with

    * ``"grad_norm"``: the global L2 norm of all floating-point leaves, computed in
      float32 (float16 squares would overflow), unscaled by ``loss_scale``; inf or
      NaN when a gradient is;
    * ``"nonfinite"``: a dict from each top-level key (``"<root>"`` for a bare array)
      to the int32 number of inf/NaN values under it;
    * with ``opt_state``: ``"loss_scale"``, ``"skipped_steps"`` and
      ``"last_step_finite"`` from :func:`jaxmp.loss_scaling_metrics`;
    * with ``nonfinite_trace``: ``"nonfinite_trace"``, the trace itself (a few floats
      per module call).

  Raises:
    ValueError: if ``opt_state`` holds no (or several) ``LossScalingState``, a
      concrete ``loss_scale`` is not positive and finite, or a concrete
      ``nonfinite_trace`` recorded no module call (the zero probe).
    TypeError: for a ``loss_scale`` that is not a number, scalar array or loss scale,
      or a ``nonfinite_trace`` that is not a non-finite trace.

  Example:
    >>> metrics = jaxmp.tools.training_metrics({"a": {"w": jnp.array([3.0, jnp.nan])},
    ...                                   "b": jnp.array([8.0])}, loss_scale=2.0)
    >>> {k: int(v) for k, v in metrics["nonfinite"].items()}
    {'a': 1, 'b': 0}
    >>> metrics = jaxmp.tools.training_metrics({"w": jnp.array([6.0, 8.0])}, loss_scale=2.0)
    >>> float(metrics["grad_norm"])
    5.0
  """
  inverse = _inverse_scale(loss_scale)
  leaves = leaves_lib.float_leaves(grads)
  squares = []
  nonfinite: dict[str, Any] = {}
  for path, x in leaves:
    x = jnp.asarray(x).astype(dtypes_lib.arithmetic_dtype(x.dtype))
    if inverse is not None:
      x = x * inverse.astype(x.dtype)
    squares.append(jnp.sum(jnp.square(x), dtype=jnp.float32))
    key = path[0] if path else leaves_lib.ROOT
    count = jnp.sum(~jnp.isfinite(x), dtype=jnp.int32)
    nonfinite[key] = nonfinite[key] + count if key in nonfinite else count
  metrics: dict[str, Any] = {
      "grad_norm": jnp.sqrt(sum(squares)) if squares else jnp.zeros((), jnp.float32),
      "nonfinite": nonfinite,
  }
  if opt_state is not None:
    metrics.update(loss_scaling_lib.loss_scaling_metrics(opt_state))
  if nonfinite_trace is not None:
    metrics["nonfinite_trace"] = report_lib.check_recorded(nonfinite_lib.check_trace(
        nonfinite_trace, "training_metrics: nonfinite_trace"), "training_metrics")
  return metrics


# ---- the host-side monitor -----------------------------------------------------------------


class Anomaly(NamedTuple):
  """One flagged event.

  Attributes:
    step: the step it was flagged at (the ``step`` given to :meth:`Monitor.update`;
      by default updates are numbered 0, 1, 2, ...).
    kind: ``"scale_collapse"``, ``"skip_rate"``, ``"loss_spike"``,
      ``"nonfinite_loss"``, ``"skip_streak"`` or ``"nonfinite_origin"``.
    message: what happened, with the numbers.
  """

  step: int
  kind: str
  message: str

  def __str__(self) -> str:
    return f"step {self.step}: {self.kind}: {self.message}"


KINDS = ("scale_collapse", "skip_rate", "loss_spike", "nonfinite_loss", "skip_streak",
         "nonfinite_origin")
"""The anomaly kinds (:attr:`Anomaly.kind`, :attr:`StepRecord.active`)."""


class _StepFields(NamedTuple):
  step: int
  loss: float | None
  skipped: bool | None
  loss_scale: float | None
  origin: report_lib.Origin | None
  traced: bool
  active: frozenset


def _optional_real(value: Any, name: str) -> float | None:
  if value is None:
    return None
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
    raise TypeError(f"StepRecord: {name} must be a real number or None, got {value!r} of type "
                    f"{type(value).__name__}.")
  return float(value)


def _anomaly_kinds(active: Any, where: str) -> frozenset:
  if not isinstance(active, AbstractSet):
    raise TypeError(f"{where}: active must be a set of anomaly kinds, got {active!r} of type "
                    f"{type(active).__name__}.")
  unknown = sorted((k for k in active if k not in KINDS), key=repr)
  if unknown:
    raise ValueError(f"{where}: unknown anomaly kind {unknown[0]!r} in active; accepted: "
                     f"{', '.join(repr(k) for k in KINDS)}.")
  return frozenset(active)


class StepRecord(checks.CheckedRecord, _StepFields):
  """What :meth:`Monitor.update` recorded for one step: :attr:`Monitor.latest`.

  Host values only, so a record can be logged and compared; what
  :class:`jaxmp.tools.PrecisionController` decides from. Checked when built (by hand
  too), since the decision reads every field.

  Attributes:
    step: the step number.
    loss: the loss given, or ``None``.
    skipped: whether the optimizer skipped the step (``last_step_finite`` false);
      ``None`` when the metrics did not say.
    loss_scale: the loss scale after the step (positive and finite), or ``None``.
    origin: the first non-finite value of the step's non-finite trace
      (:func:`jaxmp.tools.nonfinite_report`'s ``origin``); ``None`` without a trace or
      when every traced value was finite.
    traced: whether the metrics carried a non-finite trace.
    active: the anomaly kinds (``KINDS``) whose condition holds at this step, whether
      they started here or earlier (a collapsed loss scale stays ``"scale_collapse"``
      while it is collapsed); a set, kept as a ``frozenset``.

  Raises:
    TypeError: for a field of the wrong type (``skipped="no"``, ``active`` as a string
      or list).
    ValueError: for an unknown anomaly kind, a loss scale that is not positive and
      finite, or an origin without ``traced=True``.
  """

  __slots__ = ()

  def __new__(cls, step: int, loss: float | None, skipped: bool | None,
              loss_scale: float | None, origin: report_lib.Origin | None, traced: bool,
              active: AbstractSet):
    where = "StepRecord"
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
      raise TypeError(f"{where}: step must be an integer, got {step!r} of type "
                      f"{type(step).__name__}.")
    if skipped is not None and not isinstance(skipped, (bool, np.bool_)):
      raise TypeError(f"{where}: skipped must be True, False or None, got {skipped!r} of type "
                      f"{type(skipped).__name__}.")
    loss_scale = _optional_real(loss_scale, "loss_scale")
    if loss_scale is not None and not (math.isfinite(loss_scale) and loss_scale > 0):
      raise ValueError(f"{where}: loss_scale must be positive and finite or None, got "
                       f"{loss_scale!r}.")
    if origin is not None and not isinstance(origin, report_lib.Origin):
      raise TypeError(f"{where}: origin must be a jaxmp.tools.Origin or None, got {origin!r} "
                      f"of type {type(origin).__name__}.")
    traced = checks.flag(traced, "traced", where=where)
    if origin is not None and not traced:
      raise ValueError(f"{where}: an origin needs traced=True (it is read from the step's "
                       f"non-finite trace), got origin {origin} with traced=False.")
    return super().__new__(cls, int(step), _optional_real(loss, "loss"),
                           None if skipped is None else bool(skipped), loss_scale, origin,
                           traced, _anomaly_kinds(active, where))


METRICS = ("grad_norm", "nonfinite", "loss_scale", "skipped_steps", "last_step_finite",
           "consecutive_skips", "nonfinite_trace")
"""The metric keys :meth:`Monitor.update` reads (what :func:`training_metrics` returns)."""


def _check_metric_keys(metrics: Mapping) -> None:
  for key in metrics:
    if key not in METRICS:
      raise ValueError(f"Monitor.update: unknown metric {key!r}; accepted: "
                       f"{', '.join(repr(k) for k in METRICS)}.")


def _positive(name: str, value: Any, *, integer: bool = False, at_least: float = 0.0,
              strict: bool = True) -> Any:
  kind = "an integer" if integer else "a number"
  ok_type = (isinstance(value, (int, np.integer)) if integer
             else isinstance(value, (int, float, np.integer, np.floating)))
  if isinstance(value, (bool, np.bool_)) or not ok_type:
    raise TypeError(f"Monitor: {name} must be {kind}, got {value!r} of type "
                    f"{type(value).__name__}.")
  bad = value <= at_least if strict else value < at_least
  if bad or not math.isfinite(value):
    relation = ">" if strict else ">="
    raise ValueError(f"Monitor: {name} must be finite and {relation} {at_least:g}, got "
                     f"{value!r}.")
  return int(value) if integer else float(value)


def _scalar(metrics: Mapping, key: str) -> np.ndarray | None:
  """``metrics[key]`` as a 0-d array, or ``None`` when it is missing."""
  if key not in metrics:
    return None
  value = np.asarray(metrics[key])
  if value.shape != ():
    raise ValueError(f"Monitor.update: metrics[{key!r}] must be a scalar, got shape "
                     f"{value.shape}.")
  return value


def _real(value: np.ndarray, name: str) -> float:
  if value.dtype == object or not checks.is_real_dtype(value.dtype):
    raise TypeError(f"Monitor.update: {name} must be a real number, got {value.item()!r}.")
  return float(value)


def _count(value: Any, name: str) -> int:
  value = np.asarray(value)
  if value.shape != () or value.dtype == bool or not np.issubdtype(value.dtype, np.integer):
    raise TypeError(f"Monitor.update: {name} must be an integer count, got {value.tolist()!r}.")
  if value < 0:
    raise ValueError(f"Monitor.update: {name} must be a count >= 0, got {int(value)}.")
  return int(value)


def _real_metric(metrics: Mapping, key: str, valid, requirement: str) -> float | None:
  """``metrics[key]`` as a float, ``None`` when missing; ``valid(value)`` or a ValueError."""
  value = _scalar(metrics, key)
  if value is None:
    return None
  number = _real(value, f"metrics[{key!r}]")
  if not valid(number):
    raise ValueError(f"Monitor.update: metrics[{key!r}] must be {requirement}, got {number!r}.")
  return number


def _finite_metric(metrics: Mapping) -> bool | None:
  value = _scalar(metrics, "last_step_finite")
  if value is None:
    return None
  if value.dtype != bool:  # 1 or "yes" would read as True
    raise TypeError(f"Monitor.update: metrics['last_step_finite'] must be a bool (True: the "
                    f"step was applied), got {value.item()!r}.")
  return bool(value)


def _count_metric(metrics: Mapping, key: str) -> int | None:
  value = _scalar(metrics, key)
  return None if value is None else _count(value, f"metrics[{key!r}]")


def _nonfinite_metric(metrics: Mapping) -> dict[str, int]:
  counts = metrics.get("nonfinite", {})
  if not isinstance(counts, Mapping):
    raise TypeError(f"Monitor.update: metrics['nonfinite'] must be a mapping of top-level keys "
                    f"to counts, got {counts!r}.")
  return {str(k): _count(v, f"metrics['nonfinite'][{k!r}]") for k, v in counts.items()}


@dataclasses.dataclass
class _Series:
  steps: list
  loss: list
  grad_norm: list
  loss_scale: list
  skipped: list
  nonfinite: list


class Monitor:
  """Keeps a run's metric history on the host and flags anomalies as they start.

  A plain (mutable) class rather than an immutable pytree: it never enters ``jit``,
  and its history grows every step, which an immutable object would copy at every
  update (quadratic in the number of steps). Call :meth:`update` once per training
  step with that step's :func:`training_metrics` (or :func:`jaxmp.loss_scaling_metrics`,
  or any dict with some of the keys) and loss; checks whose inputs are missing are
  skipped. See the module docstring for the anomaly kinds.

  Args:
    min_scale: the loss scale's ``min_scale`` (``DynamicLossScale``'s default 1.0);
      > 0.
    collapse_factor: the scale collapses when ``loss_scale <= collapse_factor *
      min_scale`` and is below the largest scale seen; >= 1.
    skip_window: the number of recent steps the skip rate is measured over; it is
      checked from the ``skip_window``-th update on; integer >= 1.
    max_skip_rate: the skip rate (skipped / ``skip_window``) above which to flag; in
      ``[0, 1)``.
    spike_window: the number of previous finite losses the median is taken over; the
      check starts once there are that many; integer >= 1.
    spike_factor: flag a loss above ``spike_factor`` times that median (only when the
      median is positive); > 1.
    max_consecutive_skips: flag a run of this many skipped steps in a row; integer
      >= 1. The default, 20, lies past the start of a typical float16 run, where
      ``DynamicLossScale()`` backs off from 2**15 for a few steps to find its level.

  Raises:
    TypeError, ValueError: for a bad argument, naming it.

  Example:
    >>> monitor = jaxmp.tools.Monitor(spike_window=3, spike_factor=2.0)
    >>> for step, loss in enumerate([2.0, 2.1, 1.9, 2.0, 9.0, 2.0]):
    ...   for anomaly in monitor.update({}, loss=loss):
    ...     print(anomaly)
    step 4: loss_spike: loss 9 > 2 x 2, the median of the previous 3 finite losses
  """

  def __init__(self, *, min_scale: float = 1.0, collapse_factor: float = 8.0,
               skip_window: int = 100, max_skip_rate: float = 0.05, spike_window: int = 50,
               spike_factor: float = 2.0, max_consecutive_skips: int = 20):
    self.min_scale = _positive("min_scale", min_scale)
    self.collapse_factor = _positive("collapse_factor", collapse_factor, at_least=1.0,
                                     strict=False)
    self.skip_window = _positive("skip_window", skip_window, integer=True, at_least=1,
                                 strict=False)
    self.max_skip_rate = _positive("max_skip_rate", max_skip_rate, strict=False)
    if self.max_skip_rate >= 1:
      raise ValueError(f"Monitor: max_skip_rate must be in [0, 1), got {max_skip_rate!r}.")
    self.spike_window = _positive("spike_window", spike_window, integer=True, at_least=1,
                                  strict=False)
    self.spike_factor = _positive("spike_factor", spike_factor, at_least=1.0)
    self.max_consecutive_skips = _positive("max_consecutive_skips", max_consecutive_skips,
                                           integer=True, at_least=1, strict=False)
    self._series = _Series([], [], [], [], [], [])
    self._anomalies: list[Anomaly] = []
    self._active: set[str] = set()
    self._max_scale = -math.inf
    # The last spike_window finite losses, kept apart so that the spike check costs
    # O(spike_window) per step however long the history grows.
    self._recent_losses: collections.deque = collections.deque(maxlen=self.spike_window)
    # (step, trace) of the latest step that carried a trace, and of the latest whose
    # trace recorded a non-finite value or that was skipped.
    self._latest_trace: tuple[int, nonfinite_lib.NonfiniteTrace] | None = None
    self._overflow_trace: tuple[int, nonfinite_lib.NonfiniteTrace] | None = None
    self._latest: StepRecord | None = None

  # -- history ---------------------------------------------------------------------------

  @property
  def steps(self) -> int:
    """The number of updates so far."""
    return len(self._series.steps)

  @property
  def anomalies(self) -> tuple[Anomaly, ...]:
    """Every anomaly flagged so far, in order."""
    return tuple(self._anomalies)

  @property
  def latest(self) -> StepRecord | None:
    """The :class:`StepRecord` of the latest update, or ``None`` before the first."""
    return self._latest

  def history(self) -> dict[str, Any]:
    """The history as arrays, one entry per update (NaN / -1 where a value was missing).

    Returns:
      A dict of copies (safe to keep) with float64/int64 arrays under ``"step"``,
      ``"loss"``, ``"grad_norm"`` and ``"loss_scale"``, an int8 array under ``"skipped"``
      (1 skipped, 0 not, -1 unknown) and ``{key: int64 array}`` under ``"nonfinite"``.
    """
    s = self._series
    keys = sorted({k for d in s.nonfinite for k in d})
    floats = lambda values: np.array([math.nan if v is None else v for v in values], np.float64)
    return {
        "step": np.array(s.steps, np.int64),
        "loss": floats(s.loss),
        "grad_norm": floats(s.grad_norm),
        "loss_scale": floats(s.loss_scale),
        "skipped": np.array(s.skipped, np.int8),
        "nonfinite": {k: np.array([d.get(k, 0) for d in s.nonfinite], np.int64) for k in keys},
    }

  # -- update ----------------------------------------------------------------------------

  def update(self, metrics: Mapping[str, Any], loss: Any = None, *,
             step: int | None = None) -> tuple[Anomaly, ...]:
    """Records one step and returns the anomalies that start at it.

    Args:
      metrics: a mapping with any of ``"grad_norm"``, ``"nonfinite"``,
        ``"loss_scale"``, ``"skipped_steps"``, ``"last_step_finite"``,
        ``"consecutive_skips"``, ``"nonfinite_trace"`` (``METRICS``; arrays or
        numbers, fetched from the device here). ``last_step_finite`` says whether the
        step was skipped.
      loss: the step's (unscaled) loss, a real scalar, or ``None``.
      step: the step number to record; by default one more than the previous one
        (0 for the first update). Must be larger than the previous one.

    Returns:
      The anomalies flagged at this step (usually none).

    Raises:
      TypeError: if ``metrics`` is not a mapping, ``loss`` not a real scalar, a metric
        of the wrong type (``last_step_finite`` not a bool, a count not an integer),
        ``"nonfinite_trace"`` not a non-finite trace, or a value traced (the monitor
        runs on the host: call it outside ``jit``).
      ValueError: for an unknown metric key (a misspelt one would silently turn its
        check off), a non-scalar metric, a loss scale that is not positive and finite, a
        negative count or gradient norm, a trace that recorded no module call (the zero
        probe, not ``grads.nonfinite``) or a step that does not increase. A refused
        update records nothing.
    """
    if not isinstance(metrics, Mapping):
      raise TypeError(f"Monitor.update: metrics must be a mapping (what training_metrics "
                      f"returns), got {type(metrics).__name__}.")
    _check_metric_keys(metrics)
    checks.host_values((dict(metrics), loss), "the metrics and loss", where="Monitor.update",
                       fix="the metrics and the loss")
    # Everything is read and checked before anything is recorded: a refused update
    # leaves the monitor as it was.
    metrics = jax.device_get(dict(metrics))
    loss = self._loss(loss)
    step = self._step(step)
    scale = _real_metric(metrics, "loss_scale", lambda v: math.isfinite(v) and v > 0,
                         "positive and finite")  # as every loss scale is
    finite = _finite_metric(metrics)
    nonfinite = _nonfinite_metric(metrics)
    grad_norm = _real_metric(metrics, "grad_norm", lambda v: not v < 0,
                             ">= 0 (or inf or NaN for non-finite gradients)")
    streak = _count_metric(metrics, "consecutive_skips")
    _count_metric(metrics, "skipped_steps")
    trace = metrics.get("nonfinite_trace")
    origin = None
    if trace is not None:
      trace = nonfinite_lib.check_trace(trace, "Monitor.update: metrics['nonfinite_trace']")
      origin = report_lib.first_nonfinite(trace,
                                          where="Monitor.update: metrics['nonfinite_trace']")
    s = self._series
    s.steps.append(step)
    s.loss.append(loss)
    s.grad_norm.append(grad_norm)
    s.loss_scale.append(scale)
    s.skipped.append(-1 if finite is None else int(not finite))
    s.nonfinite.append(nonfinite)
    self._keep_trace(trace, origin, finite, step)

    found = {
        "scale_collapse": self._scale_collapse(scale),
        "skip_rate": self._skip_rate(),
        "loss_spike": self._loss_spike(loss),
        "nonfinite_loss": (None if loss is None or math.isfinite(loss)
                           else f"the loss is {loss}"),
        "skip_streak": self._skip_streak(streak, scale, step),
        "nonfinite_origin": self._nonfinite_origin(trace, origin, finite, step),
    }
    new = []
    for kind in KINDS:
      message = found[kind]
      if message is None:
        self._active.discard(kind)
      elif kind not in self._active:
        self._active.add(kind)
        new.append(Anomaly(step, kind, message))
    self._anomalies.extend(new)
    self._latest = StepRecord(step, loss, None if finite is None else not finite, scale, origin,
                              trace is not None, frozenset(self._active))
    return tuple(new)

  def _loss(self, loss: Any) -> float | None:
    if loss is None:
      return None
    if isinstance(loss, (bool, np.bool_, str)) or not (
        isinstance(loss, (int, float, np.number)) or hasattr(loss, "dtype")):
      raise TypeError(f"Monitor.update: loss must be a real scalar or None, got {loss!r} of "
                      f"type {type(loss).__name__}.")
    value = np.asarray(jax.device_get(loss))
    if value.shape != () or not np.issubdtype(value.dtype, np.number):
      raise TypeError(f"Monitor.update: loss must be a real scalar, got {loss!r}.")
    return float(value)

  def _step(self, step: int | None) -> int:
    previous = self._series.steps[-1] if self._series.steps else None
    if step is None:
      return 0 if previous is None else previous + 1
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
      raise TypeError(f"Monitor.update: step must be an integer, got {step!r}.")
    if previous is not None and step <= previous:
      raise ValueError(f"Monitor.update: step must increase, got {step} after {previous}.")
    return int(step)

  def _scale_collapse(self, scale: float | None) -> str | None:
    if scale is None:
      return None
    self._max_scale = max(self._max_scale, scale)
    limit = self.collapse_factor * self.min_scale
    if scale <= limit and scale < self._max_scale:
      return (f"loss scale {scale:g} <= {self.collapse_factor:g} x min_scale {self.min_scale:g} "
              f"(down from {self._max_scale:g}): gradients overflow at almost any scale")
    return None

  def _skip_rate(self) -> str | None:
    window = self._series.skipped[-self.skip_window:]
    if len(window) < self.skip_window or -1 in window:
      return None
    skipped = sum(window)
    if skipped / self.skip_window <= self.max_skip_rate:
      return None
    culprits: dict[str, int] = {}
    for counts in self._series.nonfinite[-self.skip_window:]:
      for key, count in counts.items():
        if count:
          culprits[key] = culprits.get(key, 0) + count
    message = (f"{skipped} of the last {self.skip_window} steps skipped "
               f"({skipped / self.skip_window:.0%} > {self.max_skip_rate:.0%})")
    if culprits:
      ranked = sorted(culprits.items(), key=lambda kv: -kv[1])
      message += "; non-finite gradients in " + ", ".join(f"{k} ({v:,})" for k, v in ranked)
    return message

  def _skip_streak(self, streak: int | None, scale: float | None,
                   step: int) -> str | None:
    if streak is None or streak < self.max_consecutive_skips:
      return None
    at_scale = "" if scale is None else f" at loss scale {scale:g}"
    last = step - streak
    since = f"step {last}" if last >= self._series.steps[0] else "the first update"
    return (f"{streak} consecutive steps skipped (>= max_consecutive_skips "
            f"{self.max_consecutive_skips}){at_scale}: no step has been applied since "
            f"{since}")

  def _keep_trace(self, trace: nonfinite_lib.NonfiniteTrace | None,
                  origin: report_lib.Origin | None, finite: bool | None, step: int) -> None:
    """Keeps the step's trace (first non-finite value ``origin``) for :meth:`nonfinite_report`."""
    if trace is None:
      return
    self._latest_trace = (step, trace)
    if origin is not None or finite is False:
      self._overflow_trace = (step, trace)

  def _nonfinite_origin(self, trace: nonfinite_lib.NonfiniteTrace | None,
                        origin: report_lib.Origin | None, finite: bool | None,
                        step: int) -> str | None:
    if trace is None or finite is not False:
      return None
    if origin is None:
      return (f"skipped step {step}: no traced module recorded a non-finite value (it arose "
              f"outside the wrapped model's calls: in the loss function, say)")
    return f"skipped step {step}: first non-finite value: {origin} (amax {origin.amax:g})"

  def nonfinite_report(self) -> report_lib.NonfiniteReport | None:
    """The per-module amax table of the latest step that overflowed, saying which step.

    The step is the latest whose trace recorded a non-finite value, or that was
    skipped, so that called at the end of a loop it reports the overflow rather than
    the finite steps after it; when no step did, the latest step that carried a trace.
    Its ``step`` attribute (and the table's first line) says which step it is.

    Returns:
      A :class:`jaxmp.tools.NonfiniteReport`, or ``None`` until metrics with
      ``"nonfinite_trace"`` have been given.

    Example:
      >>> calls = (("", "__call__"),)
      >>> clean = [1.0, 2.0, 1.0, 1.0, -jnp.inf, 0.0, 0.0, 1.0, 1.0, 1.0]
      >>> overflow = [1.0, jnp.inf, 1.0, 1.0, -jnp.inf, 1.0, 0.0, 1.0, 1.0, 1.0]
      >>> monitor = jaxmp.tools.Monitor()
      >>> for row in (clean, overflow, clean):
      ...   trace = jaxmp.tools.NonfiniteTrace(calls, jnp.array([row]))
      ...   _ = monitor.update({"nonfinite_trace": trace})
      >>> print(str(monitor.nonfinite_report()).splitlines()[0])
      Non-finite trace of step 1: first non-finite value: forward output of <root>
    """
    chosen = self._overflow_trace or self._latest_trace
    if chosen is None:
      return None
    step, trace = chosen
    return report_lib.nonfinite_report(trace)._replace(step=step)

  def _loss_spike(self, loss: float | None) -> str | None:
    if loss is None or not math.isfinite(loss):
      return None
    previous = list(self._recent_losses)
    self._recent_losses.append(loss)
    if len(previous) < self.spike_window:
      return None
    median = float(np.median(previous))
    if median > 0 and loss > self.spike_factor * median:
      return (f"loss {loss:g} > {self.spike_factor:g} x {median:g}, the median of the previous "
              f"{self.spike_window} finite losses")
    return None

  def __str__(self) -> str:
    if not self.steps:
      return "Monitor: no steps yet"
    s = self._series
    known = [x for x in s.skipped if x >= 0]
    parts = [f"{self.steps} steps"]
    if known:
      parts.append(f"{sum(known)} skipped ({sum(known) / len(known):.1%})")
    for name, values in (("loss", s.loss), ("grad norm", s.grad_norm),
                         ("loss scale", s.loss_scale)):
      if values[-1] is not None:
        parts.append(f"{name} {values[-1]:.4g}")
    lines = ["Monitor: " + ", ".join(parts)]
    if self._anomalies:
      lines.append(f"{len(self._anomalies)} anomalies:")
      lines += [f"  {a}" for a in self._anomalies]
    else:
      lines.append("no anomalies")
    return "\n".join(lines)


__all__ = ("KINDS", "METRICS", "Anomaly", "Monitor", "StepRecord", "training_metrics")
