"""Train steps for NNX models: params, loss scaling, fp8 state and other state together.

The NNX counterparts of :mod:`jaxmp.linen`'s steps, over the same framework-neutral
core (:mod:`jaxmp._src.step`): :func:`value_and_grad` differentiates the loss with
respect to the params and the fp8 state together, scaled by the loss scale, and
:func:`apply_gradients` steps an ``nnx.Optimizer`` on the params and merges the fp8
state (kept on a skipped step or where a layer got no cotangent).
``nnx.Optimizer.step`` counts every update, skipped ones included; the inner Optax
state (Adam's ``count``, and so its bias correction and any schedule) does not
advance on a step :func:`jaxmp.loss_scaling` skips.

The forward pass writes the model's other state in place (BatchNorm's running
statistics). :func:`value_and_grad` keeps what that state was before
(``Gradients.state_before``) and :func:`apply_gradients` puts it back on a skipped
step, so an overflowing float16 forward pass cannot leave inf in the statistics. RNG
streams (``nnx.RngState``) are not put back: a skipped step's random draws are spent,
as torch's and Keras's generators are, and the next step draws fresh dropout masks
rather than repeating the skipped step's. Sown intermediates (``nnx.Intermediate``)
stay as the skipped step wrote them, for inspecting what overflowed.

Example:
  >>> from flax import nnx
  >>> import optax
  >>> model = jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "float32")
  >>> optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(optax.sgd(0.1)), wrt=nnx.Param)
  >>> loss, grads = jaxmp.nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(
  ...     model, jnp.ones((4, 3)), loss_scale=jaxmp.get_loss_scale(optimizer.opt_state))
  >>> _ = jaxmp.nnx.apply_gradients(optimizer, model, grads)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src import loss_scaling as loss_scaling_lib
from jaxmp._src import step as step_lib
from jaxmp._src.nnx import fp8 as fp8_nnx
from jaxmp._src.nnx import nonfinite as nonfinite_nnx

Gradients = step_lib.Gradients

# The state a skipped step restores: everything the forward pass may write except what
# apply_gradients updates itself (params through the optimizer, fp8 state by merge),
# RNG streams (spent either way) and sown intermediates (outputs, kept for debugging).
_RESTORED_ON_SKIP = nnx.Not(nnx.Any(nnx.Param, fp8_nnx.Fp8State, nnx.RngState,
                                    nnx.Intermediate))


def value_and_grad(fun: Callable[..., Any], *, has_aux: bool = False,
                   wrt: Any = nnx.Param) -> Callable[..., Any]:
  """Differentiates ``fun(model, *args)`` w.r.t. the params and the fp8 state.

  The NNX counterpart of :func:`jaxmp.linen.value_and_grad`. The returned function
  takes ``(model, *args, loss_scale=None, **kwargs)``: it calls ``fun`` inside
  ``nnx.grad`` with the model's fp8 state read through
  :func:`jaxmp.nnx.fp8_for_grad` (a layer used several times, or inside ``nnx.scan``,
  records the max of its uses), and differentiates ``loss * loss_scale``. State the
  model updates during the call (batch statistics, RNG counts) is kept, as with
  ``nnx.grad``; what the batch statistics were before is returned in
  ``Gradients.state_before`` for :func:`apply_gradients` to restore on a skipped step.
  A wrapper built with ``PolicyRules(trace_nonfinite=True)`` has its non-finite probe
  differentiated too: ``Gradients.nonfinite`` is the step's per-module statistics.

  Args:
    fun: ``fun(model, *args, **kwargs) -> loss`` (or ``(loss, aux)`` with
      ``has_aux``). Keyword arguments are passed through, not differentiated; graph
      nodes (``nnx.Rngs``) go in ``args``.
    has_aux: whether ``fun`` returns ``(loss, aux)``.
    wrt: the filter of the variables to differentiate besides the fp8 state; the same
      as the optimizer's ``wrt``.

  Returns:
    A function returning ``(loss, Gradients)`` or ``((loss, aux), Gradients)``: the
    loss unscaled, ``Gradients.params`` (an ``nnx.State``) scaled by ``loss_scale``,
    ``Gradients.fp8`` the proposed next fp8 state (empty without fp8 layers),
    ``Gradients.state_before`` the model's state other than params, fp8 state, RNG
    streams and intermediates, before the call, ``Gradients.nonfinite`` the non-finite
    trace of a tracing wrapper (``None`` for others).

  Raises:
    TypeError: if ``fun`` is not callable or ``loss_scale`` not a jaxmp loss scale.
    ValueError: if the model holds more than one tracing wrapper.

  Example:
    >>> from flax import nnx
    >>> model = jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), jaxmp.PolicyRules(
    ...     "float32", [jaxmp.Rule(nnx.Linear, fp8=jaxmp.fp8.DelayedScaling(16))]))
    >>> loss_fn = lambda model, x: jnp.sum(model(x) ** 2)
    >>> loss, grads = jaxmp.nnx.value_and_grad(loss_fn)(
    ...     model, jnp.ones((4, 3)), loss_scale=jaxmp.StaticLossScale(8.0))
    >>> grads.fp8["fp8"][""]["input_amax_history"][...][0]   # the root layer's next state
    Array(1., dtype=float32)
  """
  if not callable(fun):
    raise TypeError(f"value_and_grad: fun must be callable, got {fun!r}.")
  def value_and_grads(model, *args, loss_scale=None, **kwargs):
    scale = loss_scale_lib.as_loss_scale(loss_scale, where="jaxmp.nnx.value_and_grad")
    differentiable, traced = nonfinite_nnx.differentiates(model, wrt)

    def with_fp8_for_grad(model, *args):
      with fp8_nnx.for_grad(model):
        return fun(model, *args, **kwargs)

    scaled = scale.scaled_fun(with_fp8_for_grad, has_aux=has_aux)

    state_before = nnx.as_pure(nnx.state(model, _RESTORED_ON_SKIP))
    grads, (loss, aux) = nnx.grad(
        scaled, argnums=nnx.DiffState(0, differentiable), has_aux=True)(model, *args)
    gradients = Gradients(nnx.filter_state(grads, wrt),
                          nnx.filter_state(grads, fp8_nnx.Fp8State), state_before,
                          nonfinite_nnx.trace_of(grads, wrt) if traced else None)
    return ((loss, aux) if has_aux else loss), gradients

  return value_and_grads


def apply_gradients(optimizer: nnx.Optimizer, model: nnx.Module, grads: Gradients,
                    **kwargs) -> optax.Updates:
  """One step of an ``nnx.Optimizer`` on the params, and the fp8 state merged.

  The params go through ``optimizer.update(model, grads.params)`` (which, with
  :func:`jaxmp.loss_scaling` inside, unscales and skips a non-finite step). The fp8
  state is merged with :func:`jaxmp.fp8.state.merge`: it keeps its old value on a
  skipped step (the loss scaling state's ``last_step_finite``, or the finiteness of the
  gradients without loss scaling) and wherever a layer got no cotangent. On a skipped
  step the state the forward pass wrote (batch statistics) is put back to
  ``grads.state_before`` bit for bit; RNG streams stay advanced.
  ``optimizer.step`` advances on every call, a skipped step included; the inner Optax
  state (e.g. Adam's ``count``) advances only on applied steps.

  Args:
    optimizer: an ``nnx.Optimizer`` over ``model`` (``wrt=nnx.Param``).
    model: the model (or wrapper) the gradients are of.
    grads: from :func:`value_and_grad`.
    **kwargs: passed on to ``optimizer.update``.

  Returns:
    The param updates ``optimizer.update`` returned.

  Raises:
    TypeError: if ``optimizer`` is not an ``nnx.Optimizer`` or ``grads`` not
      :class:`~jaxmp.linen.Gradients`.
    ValueError: if the optimizer's ``jaxmp.loss_scaling`` is not its outermost
      transform (:func:`jaxmp.get_loss_scale` says why), before anything changes.

  Example:
    >>> from flax import nnx
    >>> import optax
    >>> model = jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "float32")
    >>> optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(optax.sgd(0.1)), wrt=nnx.Param)
    >>> loss_fn = lambda model, x: jnp.mean(model(x) ** 2)
    >>> loss, grads = jaxmp.nnx.value_and_grad(loss_fn)(
    ...     model, jnp.ones((4, 3)), loss_scale=jaxmp.get_loss_scale(optimizer.opt_state))
    >>> _ = jaxmp.nnx.apply_gradients(optimizer, model, grads)
    >>> int(optimizer.step[...])
    1
  """
  if not isinstance(optimizer, nnx.Optimizer):
    raise TypeError(f"apply_gradients expects an nnx.Optimizer, got {optimizer!r} of type "
                    f"{type(optimizer).__name__}.")
  if not isinstance(grads, Gradients):
    raise TypeError(f"apply_gradients expects jaxmp.nnx.Gradients (from "
                    f"jaxmp.nnx.value_and_grad), got {type(grads).__name__}.")
  # Before the update, which changes the optimizer in place: a loss scaling nested
  # where it cannot decide the step is refused with nothing changed.
  loss_scaling_lib.find_state(optimizer.opt_state, "jaxmp.nnx.apply_gradients")
  updates = optimizer.update(model, grads.params, **kwargs)
  old = nnx.state(model, fp8_nnx.Fp8State)
  restore = jax.tree_util.tree_leaves(grads.state_before)
  if not (len(old) or restore):
    return updates
  finite = step_lib.step_was_finite(optimizer.opt_state, grads.params)
  if len(old):
    nnx.update(model, step_lib.merge_fp8(nnx.as_pure(old), nnx.as_pure(grads.fp8), finite))
  if restore:
    written = _at_paths_of(grads.state_before, nnx.as_pure(nnx.state(model, _RESTORED_ON_SKIP)))
    nnx.update(model, step_lib.keep_on_skip(grads.state_before, written, finite,
                                            what="jaxmp.nnx.apply_gradients: model state"))
  return updates


def _at_paths_of(before: Any, current: Any) -> Any:
  """``current`` cut down to the variables ``before`` has (the forward pass may add some)."""
  leaves = dict(jax.tree_util.tree_flatten_with_path(current)[0])
  paths, treedef = jax.tree_util.tree_flatten_with_path(before)
  return jax.tree_util.tree_unflatten(treedef, [leaves.get(path, leaf) for path, leaf in paths])


__all__ = ("Gradients", "apply_gradients", "value_and_grad")
