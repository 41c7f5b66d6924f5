"""Non-finite tracing for NNX models: the probe as an NNX variable, and its gradient.

A wrapper built with ``PolicyRules(trace_nonfinite=True)`` holds the probe of
:mod:`jaxmp._src.nonfinite` as a :class:`NonfiniteProbe` variable (its ``nonfinite``
attribute), one row per (module path, public method) of the model, the call sites as
the variable's ``calls`` metadata. :func:`jaxmp.nnx.value_and_grad` differentiates it
with the params (:func:`differentiates`) and turns its gradient into the step's
:class:`~jaxmp._src.nonfinite.NonfiniteTrace` (:func:`trace_of`). An optimizer on
``wrt=nnx.Param`` never sees it.

Example:
  >>> from flax import nnx
  >>> wrapped = jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), jaxmp.PolicyRules(
  ...     "float32", trace_nonfinite=True))
  >>> wrapped.nonfinite.calls
  (('', '__call__'),)
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from jaxmp._src import nonfinite
from jaxmp._src.nnx import fp8 as fp8_nnx


class NonfiniteProbe(nnx.Variable):
  """The non-finite probe of a tracing NNX wrapper: zeros, ``[calls, columns]`` float32.

  Its "gradient" under ``nnx.grad`` is the step's statistics; ``calls`` (metadata) names
  its rows. Never give it to an optimizer: keep optimizers on ``wrt=nnx.Param``.
  """


def new_probe(calls: tuple) -> NonfiniteProbe:
  """A zero probe for ``calls``."""
  return NonfiniteProbe(nonfinite.probe(calls).values, calls=tuple(calls))


def probe_trace(variable: NonfiniteProbe) -> Any:
  """The probe as the engine reads it: a ``NonfiniteTrace`` of the variable's value."""
  return nonfinite.NonfiniteTrace(variable.calls, variable.get_value())


def hooks(rules: Any, variable: NonfiniteProbe | None) -> tuple:
  """The engine hooks of one call of a wrapper holding ``variable`` (``None``: none).

  :func:`jaxmp._src.nonfinite.hooks` of the probe the variable holds.
  """
  return nonfinite.hooks(rules, None if variable is None else probe_trace(variable))


def differentiates(model: nnx.Module, wrt: Any) -> tuple[Any, bool]:
  """What ``value_and_grad`` differentiates: ``wrt``, the fp8 state, and any probe.

  Returns:
    The filter, and whether ``model`` holds a probe.
  """
  traced = bool(len(nnx.state(model, NonfiniteProbe)))
  if traced:
    return nnx.Any(wrt, fp8_nnx.Fp8State, NonfiniteProbe), True
  return nnx.Any(wrt, fp8_nnx.Fp8State), False


def trace_of(grads: nnx.State, wrt: Any) -> Any | None:
  """The step's ``NonfiniteTrace`` from the gradients, parameter gradients filled in.

  Args:
    grads: the gradients ``nnx.grad`` returned for the model, probe included.
    wrt: the filter of the params.

  Raises:
    ValueError: if the model holds several tracing wrappers (their positions would
      not be comparable: wrap the whole model once).
  """
  probes = list(nnx.to_flat_state(nnx.filter_state(grads, NonfiniteProbe)))
  if len(probes) != 1:
    raise ValueError(
        f"jaxmp.nnx.value_and_grad: the model holds {len(probes)} tracing wrappers, at "
        f"{', '.join('/'.join(map(str, p[:-1])) or '<root>' for p, _ in probes)}; each "
        f"numbers its calls on its own, so their traces cannot be ordered together: wrap "
        f"the whole model once with PolicyRules(trace_nonfinite=True).")
  (path, variable), = probes
  # The probe sits beside the wrapped model: its params are under <wrapper>/model.
  prefix = tuple(path[:-1]) + ("model",)
  params = [(tuple(str(k) for k in p[len(prefix):]), v.get_value())
            for p, v in nnx.to_flat_state(nnx.filter_state(grads, wrt))
            if tuple(p[:len(prefix)]) == prefix]
  trace = nonfinite.check_trace(probe_trace(variable), "the probe's gradient")
  return nonfinite.with_param_grads(trace, params)


__all__ = ("NonfiniteProbe", "differentiates", "hooks", "new_probe", "probe_trace",
           "trace_of")
