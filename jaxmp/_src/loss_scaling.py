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

Gradient accumulation: ``loss_scaling(optax.MultiSteps(opt, k))``, never the other way
round. Each micro-batch is one ``update``. A non-finite micro-batch is dropped (the
accumulator does not see it, as Keras does) and the scale backs off at once, since the
next micro-batch needs the smaller scale; the accumulated gradients are already
unscaled, so micro-batches scaled differently add up correctly. The growth counter
counts *optimizer steps* (the updates on which MultiSteps emits), as
``torch.amp.GradScaler`` does with one ``scaler.update()`` per optimizer step. Wrapped
the other way round, ``MultiSteps(loss_scaling(opt), k)`` would accumulate the scaled
gradients before they are checked (one overflow makes the accumulator NaN for good):
:func:`find_state` refuses that state wherever it is read.

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
  ({'w': Array([-0.], dtype=float32)},
   {'loss_scale': 2.0, 'skipped_steps': 1, 'last_step_finite': False, 'consecutive_skips': 1})
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._src import checks
from jaxmp._src import dynamic_loss_scale
from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src import sharding
from jaxmp._src import tree as tree_lib

_INT32_MAX = int(np.iinfo(np.int32).max)


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
    consecutive_skips: how many updates in a row, up to the last, were skipped, an
      int32 scalar (0 after a finite one); ``max_consecutive_skips`` bounds it.

  Equality: a NamedTuple compares field by field with ``==``, which is element-wise
  for the arrays of ``inner_state`` (ambiguous as a bool), as for every Optax state.
  Two states are equal by value when their pytree structures are equal (that
  includes the loss scale's hyperparameters) and every pair of leaves is
  ``np.array_equal``; the loss scale alone compares with ``==``.

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
  consecutive_skips: jax.Array


def _check_axis_name(axis_name: Any) -> Hashable | None:
  if axis_name is None:
    return None
  try:
    hash(axis_name)
  except TypeError:
    raise TypeError(
        "loss_scaling: axis_name must be None, an axis name (e.g. 'batch') or a tuple of "
        f"axis names, got {axis_name!r} of type {type(axis_name).__name__}.") from None
  return axis_name


def _check_max_skips(value: Any) -> int | None:
  if value is None:
    return None
  return checks.positive_int(value, "max_consecutive_skips", where="loss_scaling",
                             maximum=_INT32_MAX)


def _make_varying(tree: Any, axes: Any) -> Any:
  return jax.tree_util.tree_map(sharding.make_varying, tree, axes)


def _gradient_steps(inner_state: Any) -> list:
  """The ``gradient_step`` counters of the ``optax.MultiSteps`` states in ``inner_state``."""
  is_multi = lambda x: isinstance(x, optax.MultiStepsState)
  return [leaf.gradient_step for leaf in jax.tree_util.tree_leaves(inner_state, is_leaf=is_multi)
          if is_multi(leaf)]


def _optimizer_step_completed(old_inner: Any, new_inner: Any) -> jax.Array | None:
  """Whether the update completed an optimizer step: an accumulating MultiSteps emitted.

  ``None`` without a MultiSteps inside: then every update is an optimizer step.
  """
  emitted = [new != old for old, new in zip(_gradient_steps(old_inner),
                                            _gradient_steps(new_inner))]
  return functools.reduce(jnp.logical_or, emitted) if emitted else None


def _adjust(loss_scale: loss_scale_lib.LossScale, finite: jax.Array,
            completed: jax.Array | None) -> loss_scale_lib.LossScale:
  """``loss_scale.adjust(finite)``, held on a finite micro-batch that completes no step."""
  adjusted = loss_scale.adjust(finite)
  if completed is None:
    return adjusted
  return tree_lib.select_tree(finite & ~completed, loss_scale, adjusted)


def _raise_skip_cap(reached, count, scale, *, cap):
  # A host callback; under vmap both branches of the cond run, so look again.
  if np.any(reached):
    raise FloatingPointError(
        f"loss_scaling: {int(np.max(count))} consecutive steps skipped for non-finite "
        f"gradients (max_consecutive_skips={cap}); the loss scale is now "
        f"{float(np.min(scale)):g}. Training has stopped making progress: find the layer "
        f"that overflows (jaxmp.tools.training_metrics counts non-finite gradients per "
        f"module), or raise max_consecutive_skips if this is expected.")


def _check_skip_cap(count: jax.Array, scale: jax.Array, cap: int) -> None:
  """Raises (from a host callback, inside ``jit`` too) when ``count`` reaches ``cap``."""
  reached = count >= cap
  # Only the branch taken runs: a finite step pays one scalar compare and no callback.
  jax.lax.cond(
      reached,
      lambda: jax.debug.callback(functools.partial(_raise_skip_cap, cap=cap),
                                 reached, count, scale),
      lambda: None)


class _DynamicByDefault:
  """``loss_scaling``'s default loss scale: a fresh ``DynamicLossScale()`` per call.

  A sentinel, not an instance: building one at import would create JAX arrays, and
  ``None`` means no scaling (``loss_scale.as_loss_scale``).
  """

  def __repr__(self) -> str:
    return "DynamicLossScale()"


_DYNAMIC_BY_DEFAULT = _DynamicByDefault()


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: loss_scale_lib.LossScale | _DynamicByDefault | None = _DYNAMIC_BY_DEFAULT,
    *,
    axis_name: Hashable | None = None,
    max_consecutive_skips: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps an optimizer to take gradients of a scaled loss and skip non-finite steps.

  ``update(scaled_grads, state, params=None, **extra_args)`` unscales the gradients
  with ``state.loss_scale``, checks that they are all finite inside ``jit``, runs
  ``inner.update`` on them (forwarding ``params`` and the extra arguments) only if
  they are, and otherwise returns zero updates (``-0.0``, in the dtypes ``inner``
  returns updates in, so ``optax.apply_updates`` leaves every param bit for bit, a
  ``-0.0`` included) with ``inner_state`` untouched. Then it adjusts the loss scale and
  counts the step in ``skipped_steps`` if it was skipped. See the module docstring
  for how the skip is formulated.

  With an ``optax.MultiSteps`` inside, each update is one micro-batch: a non-finite
  one is dropped and backs the scale off at once; the growth counter counts
  optimizer steps (module docstring).

  Args:
    inner: the optimizer to wrap: any ``optax.GradientTransformation`` (with or
      without extra-args support) or an ``optax.MultiSteps``.
    loss_scale: the initial loss scale; ``jaxmp.DynamicLossScale()`` when left out.
      ``None`` (as everywhere in jaxmp) or ``jaxmp.NoOpLossScale()`` means no
      scaling: only skip non-finite steps (bfloat16 / fp8).
    axis_name: the mapped axis name(s) (``shard_map``, ``pmap``, ``vmap``) over which
      gradients are sharded or replicated: the finite check is all-reduced over them
      so that every member skips or updates together and their scales stay equal.
      The gradients themselves are not reduced; average them first as usual.
    max_consecutive_skips: ``None`` (no limit), or the number of consecutive skipped
      updates at which ``update`` raises (a ``FloatingPointError`` from a host
      callback; under ``jit`` it reaches the caller as a ``jax.errors.JaxRuntimeError``
      quoting it) instead of training nothing, optax's ``max_consecutive_errors`` idea.
      A finite update resets the count (``LossScalingState.consecutive_skips``). The
      callback sits in a ``lax.cond`` branch taken only then: other steps pay one scalar
      comparison.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScalingState`.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation, ``loss_scale`` not a
      jaxmp loss scale, ``axis_name`` not hashable, or ``max_consecutive_skips`` not an
      integer.
    ValueError: if ``max_consecutive_skips`` is below 1.

  Example:
    >>> import optax
    >>> tx = jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.DynamicLossScale())
    >>> state = tx.init({"w": jnp.zeros(3)})
    >>> jaxmp.get_loss_scale(state).loss_scale
    Array(32768., dtype=float32)
  """
  inner = checks.gradient_transformation(inner, "inner", where="loss_scaling")
  initial_loss_scale = (
      dynamic_loss_scale.DynamicLossScale() if loss_scale is _DYNAMIC_BY_DEFAULT
      else loss_scale_lib.as_loss_scale(loss_scale, where="loss_scaling"))
  axis_name = _check_axis_name(axis_name)
  max_consecutive_skips = _check_max_skips(max_consecutive_skips)

  def init_fn(params):
    # Fresh copies: a state passed to a jit with donated arguments must not delete
    # the arrays the next init() (or another optimizer built from the same loss
    # scale) would hand out.
    return LossScalingState(
        loss_scale=jax.tree_util.tree_map(jnp.array, initial_loss_scale),
        inner_state=inner.init(params),
        skipped_steps=jnp.zeros((), jnp.int32),
        last_step_finite=jnp.ones((), jnp.bool_),
        consecutive_skips=jnp.zeros((), jnp.int32),
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
    # -0.0 rather than +0.0: p + (-0.0) is p for every p, -0.0 included, so
    # optax.apply_updates leaves the params bit for bit as they were.
    zero_updates = lambda: jax.tree_util.tree_map(
        lambda s: jnp.full(s.shape, -0.0, s.dtype), update_shapes)
    # Inside shard_map both branches must also vary over the same mesh axes.
    varying = jax.tree_util.tree_map(
        lambda a, b: sharding.varying_axes(a) | sharding.varying_axes(b),
        (update_shapes, state_shapes), (update_shapes, state.inner_state))

    new_updates, new_inner_state = jax.lax.cond(
        finite,
        lambda: _make_varying(run_inner(), varying),
        lambda: _make_varying((zero_updates(), state.inner_state), varying),
    )
    consecutive_skips = jnp.where(
        finite, 0, optax.safe_increment(state.consecutive_skips)).astype(jnp.int32)
    new_state = LossScalingState(
        loss_scale=_adjust(loss_scale, finite,
                           _optimizer_step_completed(state.inner_state, new_inner_state)),
        inner_state=new_inner_state,
        skipped_steps=jnp.where(
            finite, state.skipped_steps, optax.safe_increment(state.skipped_steps)),
        last_step_finite=finite,
        consecutive_skips=consecutive_skips,
    )
    if max_consecutive_skips is not None:
      _check_skip_cap(consecutive_skips, new_state.loss_scale.loss_scale, max_consecutive_skips)
    return new_updates, new_state

  # optax types a state as an ArrayTree, which has no room for a loss scale (a
  # registered pytree class) in LossScalingState.
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


_WRONG_NESTING = (
    "{caller}: optax.MultiSteps wraps jaxmp.loss_scaling (MultiSteps(loss_scaling(opt), k)): "
    "MultiSteps would accumulate the *scaled* gradients before loss_scaling checks them, so "
    "one non-finite micro-batch makes its accumulator NaN for good, and the scale would "
    "adjust on accumulated sums. Put loss_scaling outside: "
    "jaxmp.loss_scaling(optax.MultiSteps(opt, k)), which drops a non-finite micro-batch, "
    "backs off at once and grows per optimizer step.")


def _find_states(tree: Any, found: list, caller: str) -> None:
  is_node = lambda x: isinstance(x, (LossScalingState, optax.MultiStepsState))
  for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_node):
    if isinstance(leaf, LossScalingState):
      found.append(leaf)
      _find_states(leaf.inner_state, found, caller)  # a wrapper inside a wrapper is ambiguous
    elif isinstance(leaf, optax.MultiStepsState):
      inside: list = []
      _find_states(leaf.inner_opt_state, inside, caller)
      if inside:
        raise ValueError(_WRONG_NESTING.format(caller=caller))


def find_state(opt_state: Any, caller: str) -> LossScalingState | None:
  """The one :class:`LossScalingState` in ``opt_state``, or ``None`` if there is none.

  Boxes around its arrays (NNX variables: ``nnx.Optimizer``'s ``opt_state``) are
  removed (:func:`jaxmp._src.tree.unboxed`).

  Raises:
    ValueError: if ``opt_state`` holds more than one (``caller`` names who asked), or
      one inside an ``optax.MultiSteps`` (the wrong nesting, see the module docstring).
  """
  found: list = []
  _find_states(opt_state, found, caller)
  if not found:
    return None
  if len(found) > 1:
    raise ValueError(
        f"{caller}: the optimizer state holds {len(found)} LossScalingStates, expected "
        "exactly one; wrap the optimizer in jaxmp.loss_scaling once.")
  # flax.nnx.Optimizer keeps its opt_state with every array leaf in an NNX variable
  # (OptArray), a box around an array; the loss scale's users want plain arrays.
  return tree_lib.unboxed(found[0])


def _require_state(opt_state: Any, caller: str) -> LossScalingState:
  state = find_state(opt_state, caller)
  if state is None:
    raise ValueError(
        f"{caller}: no LossScalingState in the optimizer state of type "
        f"{type(opt_state).__name__}; was the optimizer wrapped in jaxmp.loss_scaling?")
  return state


_REQUIRED = object()


def get_loss_scale(opt_state: optax.OptState,
                   default: Any = _REQUIRED) -> loss_scale_lib.LossScale:
  """The current loss scale, found anywhere in a (nested) optimizer state.

  Looks through tuples, lists, dicts, NamedTuples and every pytree (``optax.chain``,
  ``optax.MultiSteps``, ``optax.inject_hyperparams`` states, ``flax.nnx.Optimizer``'s
  ``opt_state``, whose NNX variable wrappers are removed) for the one
  :class:`LossScalingState`. Works inside ``jit``.

  Args:
    opt_state: an optimizer state containing exactly one ``LossScalingState``.
    default: what to return for a state with no ``LossScalingState`` (e.g.
      ``jaxmp.NoOpLossScale()`` for code that runs with and without loss scaling);
      without it, such a state is an error.

  Returns:
    Its loss scale; multiply the next loss by it, e.g. with
    ``get_loss_scale(opt_state).value_and_grad(loss_fn)``.

  Raises:
    ValueError: if the state holds no ``LossScalingState`` and no ``default`` is
      given, more than one, or one inside an ``optax.MultiSteps`` (nest
      ``loss_scaling(MultiSteps(opt, k))``).

  Example:
    >>> import optax
    >>> tx = optax.chain(jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.StaticLossScale(8.0)))
    >>> jaxmp.get_loss_scale(tx.init(jnp.zeros(2))).loss_scale
    Array(8., dtype=float32)
    >>> jaxmp.get_loss_scale(optax.sgd(1.0).init(jnp.zeros(2)), default=jaxmp.NoOpLossScale())
    NoOpLossScale()
  """
  if default is _REQUIRED:
    return _require_state(opt_state, "get_loss_scale").loss_scale
  state = find_state(opt_state, "get_loss_scale")
  return default if state is None else state.loss_scale


def loss_scaling_metrics(opt_state: optax.OptState) -> dict[str, jax.Array]:
  """Scalars a training loop can log, read from the state without leaving ``jit``.

  Args:
    opt_state: an optimizer state containing exactly one ``LossScalingState``
      (found as by :func:`get_loss_scale`).

  Returns:
    A dict with ``"loss_scale"`` (float32, the scale for the next step),
    ``"skipped_steps"`` (int32, steps skipped so far), ``"last_step_finite"``
    (bool, whether the last step updated the parameters) and
    ``"consecutive_skips"`` (int32, skipped steps in a row up to the last).

  Raises:
    ValueError: as :func:`get_loss_scale`.

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
      "consecutive_skips": jnp.asarray(state.consecutive_skips),
  }


__all__ = (
    "LossScalingState",
    "find_state",
    "get_loss_scale",
    "loss_scaling",
    "loss_scaling_metrics",
)
