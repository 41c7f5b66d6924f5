"""Where did the inf come from: the per-module amax table of one traced step.

A model wrapped with ``PolicyRules(..., trace_nonfinite=True)`` and differentiated with
jaxmp's ``value_and_grad`` returns, in ``Gradients.nonfinite``, the absolute max of
every module call's inputs and output (forward) and of the gradient arriving at its
output, the gradient it sent back to its inputs and its parameter gradients (backward),
measured inside the compiled step (:mod:`jaxmp._src.nonfinite`).
:func:`nonfinite_report` reads it on the host: the first non-finite value of the step
(its module and direction) and a table of every module's amaxes in execution order,
for tracking outliers before they overflow. Backward amaxes are of the gradients as
the backward pass computed them: multiplied by the loss scale.

**The first non-finite value** (:func:`first_nonfinite`) is defined on events in the
order they happen:

1. the model's inputs were non-finite (the ``input`` of the model's own call: the call
   its caller made, the root's ``__call__`` or the method given to ``apply``; the root's
   other methods that it calls, ``self.embed(...)``, are calls inside it like a child's,
   :func:`jaxmp._src.nonfinite.model_calls`);
2. forward: the first call site, in the order calls finish, that made a non-finite
   output from finite inputs (``made_forward``): in its own code or a child's, and the
   innermost such call finishes first. (The earliest non-finite output alone would
   often name a call that only passed on a value it was given.)
3. backward: the gradient arriving at the model's output (the ``output_grad`` of its
   own call) was already non-finite (the loss, or the loss scale, overflowed);
4. backward: the first call site, in the order the backward pass finishes them
   (reverse start order), that made a non-finite gradient for its inputs from a finite
   output gradient (``made_backward``), or whose parameter gradients are non-finite
   while the output gradients of every call site of its module were finite (parameter
   gradients sum over all the module's calls: a shared embedding's lookups and its
   ``attend``);
5. failing those, the earliest non-finite value recorded at all (the forward first).

A forward origin wins over any backward one: a non-finite forward makes the backward
non-finite anyway.

Example:
  >>> import flax.linen as nn
  >>> model = jaxmp.linen.mixed_precision(nn.Dense(2), jaxmp.PolicyRules(
  ...     "float32", trace_nonfinite=True))
  >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
  >>> loss = lambda v, x: jnp.sum(model.apply(v, x))
  >>> _, grads = jaxmp.linen.value_and_grad(loss)(variables, jnp.full((1, 3), jnp.inf))
  >>> print(jaxmp.tools.nonfinite_report(grads.nonfinite).origin)
  forward input of <root>
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import numpy as np
from jax.typing import ArrayLike

from jaxmp._src import checks
from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src import nonfinite as nonfinite_lib
from jaxmp._src.tools import table

_AMAXES = ("input", "output", "output_grad", "input_grad", "param_grad")


VALUE_NAMES = {"input": "input", "output": "output", "output_grad": "output gradient",
               "input_grad": "input gradient", "param_grad": "parameter gradient"}
"""How messages name each measured value."""


def decoded(trace: nonfinite_lib.NonfiniteTrace) -> np.ndarray:
  """The values on the host, sums over ``vmap``/``shard_map`` divided back out."""
  values = np.array(jax.device_get(trace.values), np.float32)
  count = values[:, nonfinite_lib.COUNT]
  divisor = np.where(count > 0, count, 1.0).astype(np.float32)
  values[:, list(nonfinite_lib.COUNTED)] /= divisor[:, None]
  return values


def _refuse_unrecorded(values: np.ndarray, where: str) -> None:
  # Every row of the zero probe is zero, as in no step's trace: the wrapped model's own
  # call always records itself.
  if not np.any(values[:, nonfinite_lib.COUNT] > 0):
    raise ValueError(
        f"{where}: this non-finite trace recorded no module call: it is the zero probe "
        f"that init returns (variables['jaxmp_nonfinite'], model.nonfinite_probe(...)), not "
        f"a step's trace, or the differentiated function never called the model. Where "
        f"the step differentiates with jaxmp.linen.value_and_grad or "
        f"jaxmp.nnx.value_and_grad, pass grads.nonfinite, the trace returned beside the "
        f"gradients.")


def host_values(trace: Any, where: str) -> np.ndarray:
  """A step's trace read on the host (:func:`decoded`), refusing what is not one.

  Args:
    trace: what ``where`` was given as a step's trace.
    where: the host-side function, for messages.

  Raises:
    TypeError: if ``trace`` is not a :class:`NonfiniteTrace`, or traced (inside
      ``jit``: the reading is host-only).
    ValueError: if it recorded no module call (the zero probe, not a step's trace).
  """
  trace = nonfinite_lib.check_trace(trace, f"{where}: trace")
  checks.host_values(trace, "the trace", where=where,
                     fix="grads.nonfinite (or the metrics of jaxmp.tools.training_metrics)")
  values = decoded(trace)
  _refuse_unrecorded(values, where)
  return values


def check_recorded(trace: nonfinite_lib.NonfiniteTrace, where: str
                   ) -> nonfinite_lib.NonfiniteTrace:
  """``trace``, refused where it is concrete and recorded no module call.

  Inside ``jit`` its values are traced and cannot be read: a probe passed there is
  refused by :meth:`jaxmp.tools.Monitor.update`, which reads it on the host.

  Raises:
    ValueError: for a concrete trace that recorded no call (the zero probe).
  """
  if not checks.is_traced(trace.values):
    _refuse_unrecorded(decoded(trace), where)
  return trace


DIRECTION_VALUES = {"forward": ("input", "output"),
                    "backward": ("output_grad", "input_grad", "param_grad")}
"""The values each direction measures: an :class:`Origin`'s ``value`` by its ``direction``."""


def _one_of(names: Sequence[str]) -> str:
  quoted = [repr(n) for n in names]
  return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


class _OriginFields(NamedTuple):
  path: str
  method: str
  direction: str
  value: str
  amax: float


class Origin(checks.CheckedRecord, _OriginFields):
  """Where the first non-finite value of a step appeared (see the module docstring).

  Attributes:
    path: the module's '/'-joined path (``""`` for the root).
    method: the method called.
    direction: ``"forward"`` or ``"backward"``.
    value: which value was non-finite: forward ``"input"`` or ``"output"``, backward
      ``"output_grad"``, ``"input_grad"`` or ``"param_grad"`` (``DIRECTION_VALUES``;
      ``VALUE_NAMES`` says how messages name them).
    amax: that value's recorded absolute max, a float >= 0 (inf: it held inf or NaN).

  Raises:
    TypeError: for a path or method that is not a string, or an amax that is not a
      real number.
    ValueError: for an unknown direction, a value its direction does not measure, or
      an amax below 0 or NaN.
  """

  __slots__ = ()

  def __new__(cls, path: str, method: str, direction: str, value: str, amax: float):
    for name, text in (("path", path), ("method", method)):
      if not isinstance(text, str):
        raise TypeError(f"Origin: {name} must be a string, got {text!r} of type "
                        f"{type(text).__name__}.")
    if not (isinstance(direction, str) and direction in DIRECTION_VALUES):
      raise ValueError(f"Origin: direction must be {_one_of(tuple(DIRECTION_VALUES))}, got "
                       f"{direction!r}.")
    measured = DIRECTION_VALUES[direction]
    if not (isinstance(value, str) and value in measured):
      raise ValueError(f"Origin: a {direction} value must be {_one_of(measured)}, got "
                       f"{value!r}.")
    amax = checks.real_number(amax, "amax", where="Origin")
    if not amax >= 0:
      raise ValueError(f"Origin: amax must be >= 0 (inf for inf or NaN), got {amax!r}.")
    return super().__new__(cls, path, method, direction, value, amax)

  def __str__(self) -> str:
    call = nonfinite_lib.describe_call(self.path, self.method)
    return f"{self.direction} {VALUE_NAMES[self.value]} of {call}"


def _bad(column: np.ndarray) -> np.ndarray:
  # -inf means nothing was recorded: an amax is never negative.
  return ~np.isfinite(column) & (column != -np.inf)


def first_nonfinite(trace: nonfinite_lib.NonfiniteTrace, *,
                    where: str = "first_nonfinite") -> Origin | None:
  """The first non-finite value of the step a trace records, or ``None``.

  The events, in the order they are checked, are those of the module docstring.

  Args:
    trace: the gradient of a probe (``Gradients.nonfinite``), concrete.
    where: the function that reads it, for messages.

  Returns:
    An :class:`Origin`, or ``None`` when every recorded value was finite.

  Raises:
    TypeError: if ``trace`` is not a :class:`NonfiniteTrace`, or is traced (this reads
      it on the host: call it outside ``jit``).
    ValueError: if the trace recorded no module call (the zero probe, not a step's
      trace).

  Example:
    >>> from jaxmp._src import nonfinite
    >>> from jaxmp._src.tools import nonfinite as report
    >>> row = [1.0, 2.0, 1.0, jnp.inf, -jnp.inf, 0.0, 1.0, 1.0, 1.0, 1.0]  # made an inf gradient
    >>> trace = nonfinite.NonfiniteTrace((("dense", "__call__"),), jnp.array([row]))
    >>> print(report.first_nonfinite(trace))
    backward input gradient of dense
  """
  return _first_nonfinite(trace.calls, host_values(trace, where))


def _first_nonfinite(calls: tuple[nonfinite_lib.Call, ...],
                     values: np.ndarray) -> Origin | None:
  """:func:`first_nonfinite` of a trace's ``calls`` and its :func:`host_values`."""
  recorded = values[:, nonfinite_lib.COUNT] > 0
  # The model's own call, not every row of the root's path: the root's other methods
  # it calls (self.embed, self.decode) are calls inside it.
  model = recorded & nonfinite_lib.model_calls(values)
  bad = {name: _bad(values[:, i])
         for i, name in enumerate(nonfinite_lib.COLUMNS[:nonfinite_lib.PARAM_GRAD + 1])}
  made_forward = recorded & (values[:, nonfinite_lib.MADE_FORWARD] > 0)
  made_input_grad = recorded & (values[:, nonfinite_lib.MADE_BACKWARD] > 0)
  # A module's parameter gradients are the sum over all its calls (every method, every
  # call of one: a shared embedding's lookups and its attend), so the module made them
  # non-finite only if each of its call sites got a finite output gradient.
  paths = [path for path, _ in calls]
  fed_inf = {path for path, b in zip(paths, recorded & bad["output_grad"]) if b}
  made_param_grad = recorded & bad["param_grad"] & np.array([p not in fed_inf for p in paths])
  made_backward = made_input_grad | made_param_grad
  backward_value = lambda i: "input_grad" if made_input_grad[i] else "param_grad"
  # (rows, the position column, whether the first is the smallest, direction, value)
  events = (
      (model & bad["input"], nonfinite_lib.FORWARD, True, "forward", "input"),
      (made_forward, nonfinite_lib.FORWARD, True, "forward", "output"),
      (model & bad["output_grad"], nonfinite_lib.FORWARD, False, "backward", "output_grad"),
      (made_backward, nonfinite_lib.BACKWARD, False, "backward", backward_value),
      (recorded & bad["output"], nonfinite_lib.FORWARD, True, "forward", "output"),
      (recorded & bad["input"], nonfinite_lib.FORWARD, True, "forward", "input"),
      (recorded & bad["output_grad"], nonfinite_lib.FORWARD, False, "backward", "output_grad"),
      (bad["input_grad"] | bad["param_grad"], nonfinite_lib.BACKWARD, False, "backward",
       lambda i: "input_grad" if bad["input_grad"][i] else "param_grad"),
  )
  for rows, column, smallest, direction, value in events:
    i = _first(rows, values[:, column], smallest)
    if i is not None:
      value = value(i) if callable(value) else value
      path, method = calls[i]
      return Origin(path, method, direction, value,
                    float(values[i, nonfinite_lib.COLUMNS.index(value)]))
  return None


def _first(rows: np.ndarray, position: np.ndarray, smallest: bool) -> int | None:
  """The row among ``rows`` that comes first by ``position`` (unknown positions last)."""
  candidates = np.flatnonzero(rows)
  if not candidates.size:
    return None
  known = np.isfinite(position[candidates]) & (position[candidates] > 0)
  key = np.where(known, position[candidates], np.inf if smallest else -np.inf)
  return int(candidates[np.argmin(key) if smallest else np.argmax(key)])


class ModuleAmax(NamedTuple):
  """One traced call site's amaxes (inf when non-finite, ``None`` when not recorded).

  Attributes:
    path: the module's '/'-joined path (``""`` for the root).
    method: the method called.
    input, output: the amax of its floating-point inputs and of its output.
    output_grad: of the gradient that arrived at its output.
    input_grad: of the gradient it sent back to its inputs.
    param_grad: of its own parameters' gradients.
    forward: its position in the order calls finished (from 1).
  """

  path: str
  method: str
  input: float | None
  output: float | None
  output_grad: float | None
  input_grad: float | None
  param_grad: float | None
  forward: int | None


def _amax(value: float) -> float | None:
  return None if value == -math.inf else float(value)


def _cell(value: float | None) -> str:
  return "-" if value is None else f"{value:.3g}"


class NonfiniteReport(NamedTuple):
  """The first non-finite value of a traced step and every module's amaxes.

  Attributes:
    origin: where the first non-finite value appeared (an :class:`Origin`:
      ``str(origin)`` reads "forward output of block_1/mlp/down"), or ``None`` when
      every recorded value was finite.
    modules: a :class:`ModuleAmax` per recorded call site, in execution order.
    loss_scale: the scale the gradients were multiplied by, when given.
    step: the training step the trace is of, when known (:meth:`Monitor.nonfinite_report
      <jaxmp.tools.Monitor.nonfinite_report>` says which step it reports).
  """

  origin: Origin | None
  modules: tuple[ModuleAmax, ...]
  loss_scale: float | None
  step: int | None = None

  def largest(self, value: str = "output", n: int = 5) -> tuple[ModuleAmax, ...]:
    """The ``n`` call sites with the largest ``value`` amax (non-finite first): outliers.

    Raises:
      ValueError: for a ``value`` that is not one of the amax columns.
    """
    if value not in _AMAXES:
      raise ValueError(f"NonfiniteReport.largest: value must be one of {_AMAXES}, got "
                       f"{value!r}.")
    key = lambda m: (-math.inf if getattr(m, value) is None else
                     math.inf if math.isnan(getattr(m, value)) else getattr(m, value))
    return tuple(sorted(self.modules, key=key, reverse=True)[:n])

  def __str__(self) -> str:
    first = ("every recorded value was finite" if self.origin is None
             else f"first non-finite value: {self.origin}")
    scale = "" if self.loss_scale is None else f" (gradients x loss scale {self.loss_scale:g})"
    header = ("module", "input", "output", "output grad", "input grad", "param grad")
    body = [(nonfinite_lib.describe_call(m.path, m.method),
             *(_cell(getattr(m, v)) for v in _AMAXES)) for m in self.modules]
    if self.origin is not None:  # a column that points at the origin's row
      header += ("first",)
      origin = (self.origin.path, self.origin.method)
      body = [row + ("<- " + self.origin.value if (m.path, m.method) == origin else "",)
              for row, m in zip(body, self.modules)]
    of_step = "" if self.step is None else f" of step {self.step}"
    return (f"Non-finite trace{of_step}: {first}\nabsolute max per module call, forward then "
            f"backward{scale}:\n"
            + table.text_table(header, body, (False,) + (True,) * 5 + (False,)))


def nonfinite_report(trace: nonfinite_lib.NonfiniteTrace, *,
                     loss_scale: loss_scale_lib.LossScale | ArrayLike | None = None
                     ) -> NonfiniteReport:
  """Reads a step's non-finite trace: the first non-finite value and the amax table.

  The "first" non-finite value is ``first_nonfinite``'s: the model's inputs, else
  the first call (in the order calls finish) whose output is non-finite while its inputs
  were finite, else the model's output gradient, else the first call the backward pass
  finishes whose output gradient was finite while the gradients it produced (for its
  inputs or its parameters) were not.

  Args:
    trace: ``Gradients.nonfinite`` (or ``metrics["nonfinite_trace"]`` of
      :func:`jaxmp.tools.training_metrics`), concrete.
    loss_scale: the loss scale the step's gradients were multiplied by (a number or a
      :class:`jaxmp.LossScale`), shown with the table; optional.

  Returns:
    A :class:`NonfiniteReport`; ``print`` it for the table.

  Raises:
    TypeError: if ``trace`` is not a non-finite trace or is traced (this reads it on
      the host: call it outside ``jit``), or ``loss_scale`` is not a number or loss
      scale.
    ValueError: for a trace that recorded no module call (the zero probe, not a step's
      trace) or a ``loss_scale`` that is not positive and finite.

  Example:
    >>> from flax import nnx
    >>> model = jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), jaxmp.PolicyRules(
    ...     "float32", trace_nonfinite=True))
    >>> _, grads = jaxmp.nnx.value_and_grad(lambda m, x: jnp.sum(m(x)))(model, jnp.ones((1, 3)))
    >>> print(jaxmp.tools.nonfinite_report(grads.nonfinite))
    Non-finite trace: every recorded value was finite
    absolute max per module call, forward then backward:
    module  input  output  output grad  input grad  param grad
    ------  -----  ------  -----------  ----------  ----------
    <root>      1   0.908            1        1.18           1
  """
  trace = nonfinite_lib.check_trace(trace, "nonfinite_report: trace")
  scale = None
  if loss_scale is not None:
    scale = float(np.asarray(loss_scale_lib.loss_scale_array(loss_scale,
                                                             where="nonfinite_report")))
  values = host_values(trace, "nonfinite_report")
  rows = []
  for (path, method), row in zip(trace.calls, values):
    if row[nonfinite_lib.COUNT] <= 0:
      continue
    forward = row[nonfinite_lib.FORWARD]
    rows.append(ModuleAmax._make((path, method, *(_amax(row[i]) for i in range(len(_AMAXES))),
                                  int(forward) if np.isfinite(forward) else None)))
  rows.sort(key=lambda m: math.inf if m.forward is None else m.forward)
  return NonfiniteReport(_first_nonfinite(trace.calls, values), tuple(rows), scale)


__all__ = (
    "DIRECTION_VALUES",
    "VALUE_NAMES",
    "ModuleAmax",
    "NonfiniteReport",
    "Origin",
    "check_recorded",
    "decoded",
    "first_nonfinite",
    "host_values",
    "nonfinite_report",
)
