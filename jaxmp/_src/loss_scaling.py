"""Loss scaling as an Optax transform: unscale, check, update or skip, adjust.

:func:`loss_scaling` wraps any Optax optimizer. It receives gradients of the *scaled*
loss and, inside ``jit``:

1. unscales them with the loss scale that produced them (the one in its state);
2. checks that every unscaled value is finite (all-reduced over ``axis_name`` when
   given, so that every device takes the same decision);
3. on a finite step runs the inner optimizer on the unscaled gradients; on a
   non-finite step returns zero updates and leaves the inner state bit for bit as it
   was, so the inner step count, LR schedules and accumulators do not advance;
4. adjusts the loss scale (:meth:`jaxmp.DynamicLossScale.adjust`) and counts the
   skipped step.

The skip is a ``jax.lax.cond``: only the branch taken runs, so a finite step costs the
inner update plus the unscaling multiply and one plain sum per gradient leaf (the
finite check, exact: see :func:`jaxmp.all_finite`). Computing the update unconditionally and
then selecting between the new and the old state (``jaxmp.select_tree``) makes XLA
copy the state and compute the update twice; ``benchmarks/bench_loss_scaling.py``
measures the variants. Under ``jax.vmap`` with a batched predicate ``lax.cond`` turns
into a select, so both branches run there; the results are the same.

Gradient clipping, ``optax.MultiSteps``, ``optax.inject_hyperparams`` or an
``optax.chain`` inside the wrapper see the unscaled gradients; the wrapper itself can
sit inside an ``optax.chain`` (first, as it expects the gradients of the scaled loss).

Example:
  >>> import optax
  >>> tx = jaxmp.loss_scaling(optax.sgd(0.5), jaxmp.DynamicLossScale(4.0, growth_interval=2))
  >>> params = {"w": jnp.array([1.0])}
  >>> state = tx.init(params)
  >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
  >>> loss, grads = jaxmp.get_loss_scale(state).value_and_grad(loss_fn)(params)
  >>> grads  # gradients of 4 * loss
  {'w': Array([8.], dtype=float32)}
  >>> updates, state = tx.update(grads, state, params)
  >>> updates  # -0.5 * unscaled gradient
  {'w': Array([-1.], dtype=float32)}
  >>> updates, state = tx.update({"w": jnp.array([jnp.inf])}, state, params)
  >>> updates, {k: v.item() for k, v in jaxmp.loss_scaling_metrics(state).items()}
  ({'w': Array([0.], dtype=float32)},
   {'loss_scale': 2.0, 'skipped_steps': 1, 'last_step_finite': False})
"""

from __future__ import annotations

import sys
from typing import Any, Hashable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src import sharding
from jaxmp._src import tree as tree_lib


class LossScalingState(NamedTuple):
  """The state of :func:`loss_scaling`.

  Attributes:
    loss_scale: the loss scale to multiply the next loss by (a
      :class:`jaxmp.LossScale` pytree); the gradients passed to the next ``update``
      must come from it.
    inner_state: the state of the wrapped optimizer; unchanged by skipped steps.
    skipped_steps: how many steps were skipped because their gradients were not
      finite, an int32 scalar (saturates at the int32 maximum).
    last_step_finite: whether the last step's gradients were finite (and so the
      inner optimizer ran), a bool scalar; ``True`` before the first step.

  Example:
    >>> import optax
    >>> tx = jaxmp.loss_scaling(optax.adam(0.1), jaxmp.StaticLossScale(8.0))
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({"w": jnp.array([jnp.nan, 8.0])}, state, params)
    >>> state.skipped_steps, state.last_step_finite
    (Array(1, dtype=int32), Array(False, dtype=bool))
    >>> state.inner_state[0].count  # Adam did not step
    Array(0, dtype=int32)
  """

  loss_scale: loss_scale_lib.LossScale
  inner_state: optax.OptState
  skipped_steps: jax.Array
  last_step_finite: jax.Array


def _check_inner(inner: Any) -> optax.GradientTransformationExtraArgs:
  if isinstance(inner, optax.MultiSteps):
    inner = inner.gradient_transformation()
  if isinstance(inner, optax.GradientTransformation):
    return optax.with_extra_args_support(inner)
  hint = ""
  if callable(inner):
    name = getattr(inner, "__name__", type(inner).__name__)
    hint = f" (did you mean to call {name}, e.g. optax.adam(1e-3) rather than optax.adam?)"
  raise TypeError(
      f"loss_scaling: inner must be an optax.GradientTransformation (or optax.MultiSteps), "
      f"got {inner!r} of type {type(inner).__name__}{hint}.")


def _check_loss_scale(loss_scale: Any) -> loss_scale_lib.LossScale:
  if loss_scale is None:
    return loss_scale_lib.DynamicLossScale()
  if isinstance(loss_scale, loss_scale_lib.LossScale):
    return loss_scale
  hint = ""
  if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
    hint = f"; for a fixed scale pass jaxmp.StaticLossScale({loss_scale!r})"
  raise TypeError(
      "loss_scaling: loss_scale must be a jaxmp.NoOpLossScale, StaticLossScale or "
      f"DynamicLossScale (or None for DynamicLossScale()), got {loss_scale!r} of type "
      f"{type(loss_scale).__name__}{hint}.")


def _check_axis_name(axis_name: Any) -> Optional[Hashable]:
  if axis_name is None:
    return None
  try:
    hash(axis_name)
  except TypeError:
    raise TypeError(
        "loss_scaling: axis_name must be None, an axis name (e.g. 'batch') or a tuple of "
        f"axis names, got {axis_name!r} of type {type(axis_name).__name__}.") from None
  return axis_name


def _make_varying(tree: Any, axes: Any) -> Any:
  return jax.tree_util.tree_map(sharding.make_varying, tree, axes)


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: Optional[loss_scale_lib.LossScale] = None,
    *,
    axis_name: Optional[Hashable] = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps an optimizer to take gradients of a scaled loss and skip non-finite steps.

  ``update(scaled_grads, state, params=None, **extra_args)`` unscales the gradients
  with ``state.loss_scale``, checks that they are all finite inside ``jit``, runs
  ``inner.update`` on them (forwarding ``params`` and the extra arguments) only if
  they are, and otherwise returns exact zero updates (in the dtypes ``inner`` returns
  updates in) with ``inner_state`` untouched. Then it adjusts the loss scale and
  counts the step in ``skipped_steps`` if it was skipped. See the module docstring
  for how the skip is formulated.

  Args:
    inner: the optimizer to wrap: any ``optax.GradientTransformation`` (with or
      without extra-args support) or an ``optax.MultiSteps``.
    loss_scale: the initial loss scale; ``None`` means ``jaxmp.DynamicLossScale()``.
      Use ``jaxmp.NoOpLossScale()`` to only skip non-finite steps (bfloat16 / fp8).
    axis_name: the mapped axis name(s) (``shard_map``, ``pmap``, ``vmap``) over which
      gradients are sharded or replicated: the finite check is all-reduced over them
      so that every member skips or updates together and their scales stay equal.
      The gradients themselves are not reduced; average them first as usual.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScalingState`.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation, ``loss_scale`` not a
      jaxmp loss scale, or ``axis_name`` not hashable.

  Example:
    >>> import optax
    >>> tx = jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.DynamicLossScale())
    >>> state = tx.init({"w": jnp.zeros(3)})
    >>> jaxmp.get_loss_scale(state).loss_scale
    Array(32768., dtype=float32)
  """
  inner = _check_inner(inner)
  initial_loss_scale = _check_loss_scale(loss_scale)
  axis_name = _check_axis_name(axis_name)

  def init_fn(params):
    # Fresh copies: a state passed to a jit with donated arguments must not delete
    # the arrays the next init() (or another optimizer built from the same loss
    # scale) would hand out.
    return LossScalingState(
        loss_scale=jax.tree_util.tree_map(jnp.array, initial_loss_scale),
        inner_state=inner.init(params),
        skipped_steps=jnp.zeros((), jnp.int32),
        last_step_finite=jnp.ones((), jnp.bool_),
    )

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, LossScalingState):
      raise TypeError(
          "loss_scaling: state must be the LossScalingState its init returned, got "
          f"{type(state).__name__}.")
    loss_scale = state.loss_scale

    # Unscaled once, before the cond, and checked after unscaling (which also catches
    # gradients that overflow in the unscaling, with a scale below 1). Unscaling inside
    # the branch instead, fused into the inner update, saves writing the unscaled
    # gradients but measured 2-3% slower on CPU (benchmarks/bench_loss_scaling.py).
    grads = loss_scale.unscale(updates)
    finite = tree_lib.all_finite(grads)
    if axis_name is not None:
      num_nonfinite = jax.lax.psum(jnp.logical_not(finite).astype(jnp.int32), axis_name)
      finite = num_nonfinite == 0

    def run_inner():
      return inner.update(grads, state.inner_state, params, **extra_args)

    # Zero updates in the exact shapes and dtypes the inner optimizer returns, which
    # may differ from the gradients' (lax.cond needs both branches to agree).
    update_shapes, state_shapes = jax.eval_shape(run_inner)
    zero_updates = lambda: jax.tree_util.tree_map(
        lambda s: jnp.zeros(s.shape, s.dtype), update_shapes)
    # Inside shard_map both branches must also vary over the same mesh axes.
    varying = jax.tree_util.tree_map(
        lambda a, b: sharding.varying_axes(a) | sharding.varying_axes(b),
        (update_shapes, state_shapes), (update_shapes, state.inner_state))

    new_updates, new_inner_state = jax.lax.cond(
        finite,
        lambda: _make_varying(run_inner(), varying),
        lambda: _make_varying((zero_updates(), state.inner_state), varying),
    )
    new_state = LossScalingState(
        loss_scale=loss_scale.adjust(finite),
        inner_state=new_inner_state,
        skipped_steps=jnp.where(
            finite, state.skipped_steps, optax.safe_increment(state.skipped_steps)),
        last_step_finite=finite,
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _unwrap_nnx_variables(tree: Any) -> Any:
  # flax.nnx.Optimizer keeps its opt_state with every array leaf wrapped in an NNX
  # variable (OptArray / OptVariable); the loss scale's users want plain arrays. If
  # flax.nnx was never imported, no such variables can exist.
  nnx = sys.modules.get("flax.nnx")
  if nnx is None or not hasattr(nnx, "as_pure"):
    return tree
  return nnx.as_pure(tree)


def _find_states(tree: Any, found: list) -> None:
  is_state = lambda x: isinstance(x, LossScalingState)
  for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_state):
    if is_state(leaf):
      found.append(leaf)
      _find_states(leaf.inner_state, found)  # a wrapper inside a wrapper is ambiguous


def find_state(opt_state: Any, caller: str) -> Optional[LossScalingState]:
  """The one :class:`LossScalingState` in ``opt_state``, or ``None`` if there is none.

  NNX variable wrappers (``nnx.Optimizer``'s ``opt_state``) are removed.

  Raises:
    ValueError: if ``opt_state`` holds more than one (``caller`` names who asked).
  """
  found: list = []
  _find_states(opt_state, found)
  if not found:
    return None
  if len(found) > 1:
    raise ValueError(
        f"{caller}: the optimizer state holds {len(found)} LossScalingStates, expected "
        "exactly one; wrap the optimizer in jaxmp.loss_scaling once.")
  return _unwrap_nnx_variables(found[0])


def _require_state(opt_state: Any, caller: str) -> LossScalingState:
  state = find_state(opt_state, caller)
  if state is None:
    raise ValueError(
        f"{caller}: no LossScalingState in the optimizer state of type "
        f"{type(opt_state).__name__}; was the optimizer wrapped in jaxmp.loss_scaling?")
  return state


def get_loss_scale(opt_state: Any) -> loss_scale_lib.LossScale:
  """The current loss scale, found anywhere in a (nested) optimizer state.

  Looks through tuples, lists, dicts, NamedTuples and every pytree (``optax.chain``,
  ``optax.MultiSteps``, ``optax.inject_hyperparams`` states, ``flax.nnx.Optimizer``'s
  ``opt_state``, whose NNX variable wrappers are removed) for the one
  :class:`LossScalingState`. Works inside ``jit``.

  Args:
    opt_state: an optimizer state containing exactly one ``LossScalingState``.

  Returns:
    Its loss scale; multiply the next loss by it, e.g. with
    ``get_loss_scale(opt_state).value_and_grad(loss_fn)``.

  Raises:
    ValueError: if the state holds no ``LossScalingState`` or more than one.

  Example:
    >>> import optax
    >>> tx = optax.chain(jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.StaticLossScale(8.0)))
    >>> jaxmp.get_loss_scale(tx.init(jnp.zeros(2))).loss_scale
    Array(8., dtype=float32)
  """
  return _require_state(opt_state, "get_loss_scale").loss_scale


def loss_scaling_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Scalars a training loop can log, read from the state without leaving ``jit``.

  Args:
    opt_state: an optimizer state containing exactly one ``LossScalingState``
      (found as by :func:`get_loss_scale`).

  Returns:
    A dict with ``"loss_scale"`` (float32, the scale for the next step),
    ``"skipped_steps"`` (int32, steps skipped so far) and ``"last_step_finite"``
    (bool, whether the last step updated the parameters).

  Raises:
    ValueError: if the state holds no ``LossScalingState`` or more than one.

  Example:
    >>> import optax
    >>> state = jaxmp.loss_scaling(optax.sgd(1.0)).init(jnp.zeros(2))
    >>> jax.jit(jaxmp.loss_scaling_metrics)(state)["loss_scale"]
    Array(32768., dtype=float32)
  """
  state = _require_state(opt_state, "loss_scaling_metrics")
  return {
      "loss_scale": jnp.asarray(state.loss_scale.loss_scale, jnp.float32),
      "skipped_steps": jnp.asarray(state.skipped_steps),
      "last_step_finite": jnp.asarray(state.last_step_finite),
  }


__all__ = (
    "LossScalingState",
    "find_state",
    "get_loss_scale",
    "loss_scaling",
    "loss_scaling_metrics",
)
