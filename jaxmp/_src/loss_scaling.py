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

Loss scaling wraps the whole optimizer: clipping, weight decay, schedules,
``optax.MultiSteps``, ``optax.masked``... go *inside* it, where they see the unscaled
gradients and a skipped step skips them too. Wherever jaxmp reads the state
(:func:`get_loss_scale`, :func:`loss_scaling_metrics`, every train step) it refuses a
``LossScalingState`` that is not outermost, naming the fix:

* chained with other transforms (``optax.chain``, ``optax.named_chain``): one before it
  gets the gradients of the scaled loss (a clip sees norms multiplied by the scale, so
  ``chain(clip_by_global_norm(1.0), loss_scaling(sgd))`` takes steps smaller by up to the
  scale); one after it runs on skipped steps too (Adam after it would step on its
  momentum, weight decay would shrink the params). A chain of one is fine.
* inside an Optax wrapper: ``MultiSteps`` (it would accumulate scaled gradients),
  ``masked`` and ``multi_transform`` (the other params get scaled gradients as updates),
  ``apply_if_finite`` (it would skip an overflow before the scale sees it), and any other
  Optax wrapper's state. ``inject_hyperparams`` around it is accepted: it passes the
  gradients on untouched (its count, and so an injected schedule, advances on skipped
  steps; inject inside to count applied steps only). Containers of one's own (a dict, a
  list) and :mod:`jaxmp.optim`'s wrappers, which write the params from the updates
  loss_scaling returns (``docs/guides/memory.md`` says which order suits each), are
  accepted too.

An ``optax.chain``'s state is a plain tuple, so a tuple of one's own holding the state
beside something else reads as a chain: pass the optimizer state itself. A
transform of one's own whose state is not an Optax one (a bare array, say) cannot be
recognised around it.

Gradient accumulation: ``loss_scaling(optax.MultiSteps(opt, k))``, never the other way
round. Each micro-batch is one ``update``. A non-finite micro-batch is dropped (the
accumulator does not see it, as Keras does) and the scale backs off at once, since the
next micro-batch needs the smaller scale; the accumulated gradients are already
unscaled, so micro-batches scaled differently add up correctly. The growth counter
counts *optimizer steps* (the updates on which MultiSteps emits), as
``torch.amp.GradScaler`` does with one ``scaler.update()`` per optimizer step. Wrapped
the other way round, ``MultiSteps(loss_scaling(opt), k)`` would accumulate the scaled
gradients before they are checked (one overflow makes the accumulator NaN for good):
refused as above.

A non-finite micro-batch does not count towards the window: MultiSteps emits on the
``k``-th *finite* micro-batch, so each window averages exactly ``k`` micro-batches and
every later window ends one micro-batch later per dropped one (Keras's semantics). To
count windows by micro-batches instead, as torch's recipe does (an overflow anywhere
skips the whole window), accumulate in the step (``jaxmp.linen.accumulate_gradients``)
and update once per window.

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

import collections
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
  # A host callback; under vmap both branches of the cond run (for every member), so
  # look again.
  if np.any(reached):
    raise FloatingPointError(
        f"loss_scaling: {int(np.max(count))} consecutive steps skipped for non-finite "
        f"gradients (max_consecutive_skips={cap}); the loss scale is now "
        f"{float(np.min(scale)):g}. Training has stopped making progress: find the layer "
        f"that overflows (jaxmp.tools.training_metrics counts non-finite gradients per "
        f"module), or raise max_consecutive_skips if this is expected.")


def _checked_skip_count(count: jax.Array, scale: jax.Array, cap: int) -> jax.Array:
  """``count``, out of a ``lax.cond`` whose branch taken when it reaches ``cap`` raises.

  The host callback's error fails the computation that runs it. Outside ``jit`` the
  cond is a computation of its own, and on a GPU, where dispatch is asynchronous, one
  with no output reported its error nowhere but at ``jax.effects_barrier``: the count
  the state returns comes out of this cond, so reading the state raises the error.
  """
  reached = count >= cap

  def check():
    jax.debug.callback(functools.partial(_raise_skip_cap, cap=cap), reached, count, scale)
    # count itself here (count >= cap), but computed in the branch: a branch returning
    # its operand would be forwarded around the cond (by JAX, or XLA), leaving the cond
    # with no output again.
    return jnp.maximum(count, cap)
  # Only the branch taken runs: a finite step pays one scalar compare and no callback.
  return jax.lax.cond(reached, check, lambda: count)


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
  one is dropped (it does not count towards the window) and backs the scale off at
  once; the growth counter counts optimizer steps (module docstring).

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
      callback, which reaches the caller as a ``jax.errors.JaxRuntimeError`` quoting it
      when the returned state is read, with or without ``jit``) instead of training
      nothing, optax's ``max_consecutive_errors`` idea.
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
      new_state = new_state._replace(consecutive_skips=_checked_skip_count(
          consecutive_skips, new_state.loss_scale.loss_scale, max_consecutive_skips))
    return new_updates, new_state

  # optax types a state as an ArrayTree, which has no room for a loss scale (a
  # registered pytree class) in LossScalingState.
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


# Where a LossScalingState may not sit: see "Loss scaling wraps the whole optimizer" in
# the module docstring. What these name as the fix is the same optimizer with
# loss_scaling moved outside.
_CHAINED_BEFORE = (
    "{caller}: a transform is chained before jaxmp.loss_scaling ({chain}(..., "
    "loss_scaling(opt))): it gets the gradients of the *scaled* loss, so a clip sees norms "
    "multiplied by the loss scale (and clips far too much), weight decay added there is "
    "divided by it, and a finite check runs before the unscaling. Put it inside, where the "
    "gradients are unscaled: jaxmp.loss_scaling({chain}(..., opt)).")
_CHAINED_AFTER = (
    "{caller}: a transform is chained after jaxmp.loss_scaling ({chain}(loss_scaling(opt), "
    "...)): it runs on every update, skipped ones too, so on a skipped step one with state "
    "(Adam's moments, a schedule's count) steps anyway and one that adds a term of its own "
    "(weight decay) moves the params. Put it inside, where a skipped step skips it: "
    "jaxmp.loss_scaling({chain}(opt, ...)).")
_OWN_CONTAINER = (" (If this {kind} is a container of your own rather than the state of an "
                  "{chain}, pass the optimizer state alone.)")
_WRAPPED = (
    "{caller}: {wrapper} wraps jaxmp.loss_scaling ({wrapper}(loss_scaling(opt), ...)): {why} "
    "Put loss_scaling outside, around the whole optimizer: {fix}.")
_WRAPPERS = {
    optax.MultiStepsState: (
        "optax.MultiSteps",
        "MultiSteps would accumulate the *scaled* gradients before loss_scaling checks them, "
        "so one non-finite micro-batch makes its accumulator NaN for good, and the scale "
        "would adjust on accumulated sums.",
        "jaxmp.loss_scaling(optax.MultiSteps(opt, k)), which drops a non-finite micro-batch, "
        "backs off at once and grows per optimizer step"),
    optax.MaskedState: (
        "optax.masked",
        "the params outside the mask get the scaled gradients as their updates, unchecked.",
        "jaxmp.loss_scaling(optax.masked(opt, mask))"),
    optax.MultiTransformState: (
        "optax.multi_transform",
        "the other partitions get the scaled gradients, unchecked.",
        "jaxmp.loss_scaling(optax.multi_transform(transforms, labels))"),
    optax.ApplyIfFiniteState: (
        "optax.apply_if_finite",
        "it checks the scaled gradients and skips an overflow before loss_scaling sees it, so "
        "the scale never backs off.",
        "jaxmp.loss_scaling(opt), which skips non-finite steps itself (max_consecutive_skips= "
        "bounds a run of them)"),
}
# Wrappers that hand the gradients to loss_scaling untouched and add no update of
# their own (their count does advance on skipped steps).
_PASS_THROUGH = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _chain_position(node: Any, key: Any) -> tuple[str, str, int, int] | None:
  """The chain, kind, index and length of ``key`` in an Optax chain's state, else None.

  ``optax.chain``'s state is a plain tuple, ``optax.named_chain``'s an ``OrderedDict``
  (whose order JAX keeps, unlike a dict's).
  """
  if type(node) is tuple:
    return "optax.chain", "tuple", key.idx, len(node)
  if type(node) is collections.OrderedDict:
    return "optax.named_chain", "OrderedDict", list(node).index(key.key), len(node)
  return None


def _chain_error(node: Any, key: Any, caller: str) -> str | None:
  """Why a LossScalingState may not sit at ``key`` of a chain's ``node``, if it may not."""
  position = _chain_position(node, key)
  if position is None:
    return None
  chain, kind, index, length = position
  if length == 1:
    return None
  message = _CHAINED_BEFORE if index > 0 else _CHAINED_AFTER
  return message.format(caller=caller, chain=chain) + _OWN_CONTAINER.format(kind=kind, chain=chain)


def _wrapper_error(node: Any, caller: str) -> str | None:
  """Why a LossScalingState may not sit inside ``node``, if ``node`` is an Optax wrapper's state."""
  if isinstance(node, _PASS_THROUGH) or not type(node).__module__.startswith("optax"):
    return None  # a container (a dict, a list, jaxmp.optim's wrappers, NNX's boxes)
  wrapper, why, fix = _WRAPPERS.get(type(node), (
      f"an optax transform (state {type(node).__name__})",
      "it sees the gradients before loss_scaling unscales them, or acts on the updates "
      "loss_scaling skips.",
      "jaxmp.loss_scaling(transform(opt, ...))"))
  return _WRAPPED.format(caller=caller, wrapper=wrapper, why=why, fix=fix)


def _child(node: Any, key: Any) -> Any:
  """The child of pytree node ``node`` at ``key``, one entry of a key path."""
  children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
  return next(child for path, child in children if path[0] == key)


def _check_outermost(opt_state: Any, path: Any, caller: str) -> None:
  """Raises if what holds the LossScalingState at ``path`` is more than containers."""
  nodes = [opt_state]
  for key in path[:-1]:
    nodes.append(_child(nodes[-1], key))
  # Wrappers first, outermost first: multi_transform masks each of its partitions, and
  # its own message is the one that explains.
  errors = ([_wrapper_error(node, caller) for node in nodes]
            + [_chain_error(node, key, caller) for node, key in zip(nodes, path)])
  error = next((e for e in errors if e is not None), None)
  if error is not None:
    raise ValueError(error)


def _located_states(tree: Any) -> list[tuple[Any, LossScalingState]]:
  """The outermost LossScalingStates in ``tree``, with their key paths."""
  is_state = lambda x: isinstance(x, LossScalingState)
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)[0]
  return [(path, x) for path, x in flat if is_state(x)]


def _count_states(tree: Any) -> int:
  return sum(1 + _count_states(state.inner_state) for _, state in _located_states(tree))


def find_state(opt_state: Any, caller: str) -> LossScalingState | None:
  """The one :class:`LossScalingState` in ``opt_state``, or ``None`` if there is none.

  Boxes around its arrays (NNX variables: ``nnx.Optimizer``'s ``opt_state``) are
  removed (:func:`jaxmp._src.tree.unboxed`).

  Raises:
    ValueError: if ``opt_state`` holds more than one (``caller`` names who asked), or
      one that is not outermost: chained with other transforms, or inside an Optax
      wrapper other than ``inject_hyperparams`` (see the module docstring).
  """
  located = _located_states(opt_state)
  if not located:
    return None
  count = _count_states(opt_state)
  if count > 1:
    raise ValueError(
        f"{caller}: the optimizer state holds {count} LossScalingStates, expected "
        "exactly one; wrap the optimizer in jaxmp.loss_scaling once.")
  path, state = located[0]
  _check_outermost(opt_state, path, caller)
  # flax.nnx.Optimizer keeps its opt_state with every array leaf in an NNX variable
  # (OptArray), a box around an array; the loss scale's users want plain arrays.
  return tree_lib.unboxed(state)


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

  Looks through tuples, lists, dicts, NamedTuples and every pytree (an
  ``optax.inject_hyperparams`` state, :mod:`jaxmp.optim`'s wrappers,
  ``flax.nnx.Optimizer``'s ``opt_state``, whose NNX variable wrappers are removed) for
  the one :class:`LossScalingState`, and refuses it where it is not the outermost
  transform (chained with others, or inside an Optax wrapper: see the module
  docstring). Works inside ``jit``.

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
      given, more than one, or one that is not outermost: chained with other
      transforms (wrap them: ``loss_scaling(optax.chain(...))``) or inside an Optax
      wrapper such as ``optax.MultiSteps`` (nest ``loss_scaling(MultiSteps(opt, k))``).

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
