"""fp8 delayed-scaling state: its layout, its creation, and how a trainer updates it.

A delayed-scaling matmul keeps, per operand (input, kernel, output gradient), a scale
and an amax history. The op cannot write state (it is a pure function), so, as in
Flax and TransformerEngine, its custom VJP returns the *new* scale and history as the
cotangent ("gradient") of the old ones, and the trainer replaces the state with that
cotangent. Done naively that has four known failure modes; the functions here are
the sound replacements:

1. **Zero cotangent.** A layer whose output is unused or behind ``stop_gradient``
   gets a symbolic-zero cotangent, its backward pass never runs, and its state
   "gradient" is all zeros (or ``-inf`` under :func:`for_grad`). Overwriting writes
   scale 0, and Flax's layer then outputs 0/NaN forever. :func:`merge` recognises
   such a cotangent (a scale that is not finite and > 0, a history that is all zero
   or not finite) and keeps the old state. The op itself also reads a scale that is
   not finite and > 0 as 1 and inf/NaN history entries as 0, so even state that was
   overwritten with zeros by Flax's ``TrainState.apply_gradients`` recovers: the
   layer behaves as freshly initialised (scale 1) for a step and then scales from
   the amaxes it records again.
2. **Max, not sum.** State read several times in one step (a layer called twice,
   ``lax.scan``/``nn.scan`` over shared weights) gets the *sum* of the per-read
   cotangents from JAX's reverse mode. Call :func:`for_grad` on the state inside the
   differentiated function: it converts the state to
   :data:`~jaxmp._src.fp8.maxgrad.max_float32`, whose autodiff accumulation is ``max``,
   and the cotangent comes back as float32.
3. **Gradient accumulation.** Micro-batches of one step all start from the same
   state; combine their state cotangents with :func:`accumulate` (element-wise max),
   never with the ``+`` or mean used for parameter gradients. Likewise across
   data-parallel replicas under ``shard_map``/``pmap``: :func:`all_reduce` (``pmax``),
   not ``pmean``.
4. **Skipped steps.** On a step whose gradients are not finite (and that loss scaling
   therefore skips), :func:`merge` with ``grads_finite=False`` returns the old state
   unchanged. Independently, a non-finite amax is never recorded in a history.

All functions work leaf by leaf on any pytree of fp8 state: a
:class:`~jaxmp.fp8.DelayedScalingState`, one module's variables, or a model's whole
``_overwrite_with_gradient`` collection. They are pure and jit-safe.

Example:
  A training step over a Flax model with fp8 layers, where ``loss_fn(params,
  fp8_state, batch)`` applies the model to ``{"params": params,
  "_overwrite_with_gradient": fp8_state}``:

  >>> from jaxmp import fp8
  >>> old = fp8.init_state(fp8.DelayedScaling(amax_history_length=4))
  >>> stale = jax.tree_util.tree_map(jnp.zeros_like, old)  # a zero cotangent
  >>> fp8.state.merge(old, stale, grads_finite=True).input_scale
  Array([1.], dtype=float32)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Hashable
from typing import Any
from typing import NamedTuple
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxmp._src import dtypes
from jaxmp._src import paths
from jaxmp._src import tree as tree_lib
from jaxmp._src.fp8 import delayed
from jaxmp._src.fp8 import maxgrad
from jaxmp._src.fp8 import ops
from jaxmp._src.fp8 import recipes as recipes_lib

T = TypeVar("T")

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"
"""The Flax collection fp8 state lives in; Flax's ``TrainState`` overwrites it."""

TENSORS = delayed.TENSORS
DelayedScalingState = delayed.DelayedScalingState

F32 = np.dtype(np.float32)


def init_state(recipe: recipes_lib.Recipe) -> DelayedScalingState | None:
  """The initial state of one fp8 matmul under ``recipe``.

  Scales start at 1 and histories at 0, as in Flax and TransformerEngine: the first
  step quantizes with scale 1 and records the first amaxes.

  Args:
    recipe: any jaxmp fp8 recipe.

  Returns:
    A :class:`DelayedScalingState` for delayed scaling; ``None`` for every other
    recipe (current scaling, per tensor, row, block or MX, keeps no state).

  Raises:
    TypeError: if ``recipe`` is not a jaxmp fp8 recipe.

  Example:
    >>> from jaxmp import fp8
    >>> s = fp8.init_state(fp8.DelayedScaling(amax_history_length=3))
    >>> s.input_scale, s.input_amax_history
    (Array([1.], dtype=float32), Array([0., 0., 0.], dtype=float32))
  """
  recipe = recipes_lib.check_recipe(recipe, "init_state")
  return initial_state(ops.check_registered(recipe, "init_state"))


def initial_state(recipe: recipes_lib.Recipe) -> Any:
  """:func:`init_state` of a recipe checked where it was given (a rule, a layer)."""
  scaling = ops.per_tensor(recipe)
  if scaling is None or scaling.init_state is None:
    return None
  return scaling.init_state(recipe)


def read_state(recipe: recipes_lib.Recipe, read: Callable[[str, Callable[[], jax.Array]], Any],
               *, layer: str = "", stacked_hint: str = "") -> DelayedScalingState | None:
  """An fp8 op's state, each variable read through its framework; ``None`` without state.

  The one place that says which variables an fp8 op keeps and what they start as, for
  both adapters: for a :class:`~jaxmp.fp8.DelayedScaling` recipe, ``read(name,
  initial)`` is called for each of the six variables (Flax's names, in
  :class:`DelayedScalingState`'s order) with a function that builds its initial value
  (:func:`init_state`'s), for a framework that creates the variable on first use (linen);
  one whose variables exist already (NNX) ignores it.

  An op computes one layer, so it reads one layer's state: the state of a stack of
  layers (scanned or vmapped: each leaf with leading layer axes, see :func:`merge`)
  reaches it one layer at a time, sliced by the transform that runs the stack. State
  read whole, with its layer axes, means the stack runs where nothing slices it (a
  hand-written ``jax.lax.scan`` that passes the params but not the state): refused,
  never quantized with another layer's scales.

  Args:
    recipe: the op's fp8 recipe.
    read: ``read(name, initial) -> value``.
    layer: the path of the layer the op computes, for the refusal.
    stacked_hint: how to hand this layer its own state, for the refusal.

  Returns:
    The :class:`DelayedScalingState` read, or ``None`` for a recipe without state.

  Raises:
    ValueError: if a variable read does not have the shape of one layer's.

  Example:
    >>> from jaxmp._src.fp8 import state
    >>> recipe = jaxmp.fp8.DelayedScaling(amax_history_length=2)
    >>> state.read_state(recipe, lambda name, initial: initial()).kernel_amax_history
    Array([0., 0.], dtype=float32)
    >>> state.read_state(jaxmp.fp8.CurrentScaling(), lambda name, initial: initial()) is None
    True
  """
  state_type = ops.state_type(recipe)
  if state_type is None:
    return None
  state = state_type(*(
      read(name, lambda name=name: getattr(initial_state(recipe), name))
      for name in state_type._fields))
  _refuse_stacked(state, jax.eval_shape(lambda: initial_state(recipe)), layer, stacked_hint)
  return state


def _refuse_stacked(state: Any, one_layer: Any, layer: str, hint: str) -> None:
  """Refuses state that is not one layer's, naming the layer and how to slice it."""
  for name, value, expected in zip(state._fields, state, one_layer):
    shape = tuple(np.shape(value))
    if shape == expected.shape:
      continue
    layers = shape[:len(shape) - len(expected.shape)]
    what = (f"the state of a stack of {'x'.join(map(str, layers))} layers"
            if len(shape) > len(expected.shape) and shape[len(layers):] == expected.shape
            else "not one layer's state")
    raise ValueError(
        f"fp8: the layer at {layer or paths.ROOT!r} reads its delayed-scaling variable "
        f"{name!r} with shape {shape}, {what}: one layer's is {expected.shape}. A stack's "
        f"state reaches each layer sliced, by the transform that runs the stack with the "
        f"layer's params. {hint}".strip())


def for_grad(state: T) -> T:
  """Converts fp8 state so that repeated reads accumulate cotangents by ``max``.

  Call it *inside* the function you differentiate, on the state argument, before the
  model reads it. Every cotangent accumulation JAX inserts downstream of the
  conversion (repeated calls, ``lax.scan``/``nn.scan`` over shared weights, remat)
  is then an element-wise max, and the cotangent of the state argument comes back as
  ordinary float32. (Calling it outside ``jax.grad`` does not work: ``jax.grad``
  only differentiates float inputs.)

  Args:
    state: a pytree of float32 fp8 state (a :class:`~jaxmp.fp8.DelayedScalingState`, or a
      model's ``_overwrite_with_gradient`` collection). Not the parameters.

  Returns:
    The same tree with ``jaxmp._src.fp8.maxgrad.max_float32`` leaves.

  Raises:
    TypeError: if a leaf is not float32.

  Example:
    >>> from jaxmp import fp8
    >>> recipe = fp8.DelayedScaling(amax_history_length=3)
    >>> def loss(fp8_state, x):
    ...   fp8_state = fp8.state.for_grad(fp8_state)
    ...   dot = lambda a: fp8.fp8_dot_general(
    ...       a, jnp.ones((1, 1)), (((1,), (0,)), ((), ())), state=fp8_state, recipe=recipe)
    ...   return jnp.sum(dot(dot(x)))  # the layer is used twice
    >>> new = jax.grad(loss)(fp8.init_state(recipe), jnp.full((1, 1), 2.0))
    >>> new.input_amax_history  # max of the two uses' [2, 0, 0], not their sum
    Array([2., 0., 0.], dtype=float32)
  """
  return jax.tree_util.tree_map(maxgrad.to_max_float32, state)


def from_grad(tree: T) -> T:
  """Converts ``jaxmp._src.fp8.maxgrad.max_float32`` leaves back to float32.

  Not needed after the pattern :func:`for_grad` documents (the cotangent already
  comes back as float32); useful when ``max_float32`` values were differentiated
  directly with ``jax.vjp``. Other leaves come back unchanged.

  Example:
    >>> from jaxmp._src.fp8 import maxgrad
    >>> def f(h):  # two reads, whose cotangents [3, 1] and [1, 4] combine by max
    ...   a = maxgrad.from_max_float32(h) * jnp.array([3.0, 1.0])
    ...   b = maxgrad.from_max_float32(h) * jnp.array([1.0, 4.0])
    ...   return jnp.sum(a) + jnp.sum(b)
    >>> _, f_vjp = jax.vjp(f, maxgrad.to_max_float32(jnp.ones(2)))
    >>> (ct,) = f_vjp(jnp.float32(1.0))
    >>> maxgrad.is_max_float32(ct)
    True
    >>> jaxmp.fp8.state.from_grad({"history": ct, "step": 3})
    {'history': Array([3., 4.], dtype=float32), 'step': 3}
  """
  return jax.tree_util.tree_map(maxgrad.from_max_float32, tree)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _guard(operand: jax.Array, params: tuple, state_leaf: jax.Array, message: str) -> jax.Array:
  del params, state_leaf, message
  return operand


@functools.partial(_guard.defjvp, symbolic_zeros=True)
def _guard_jvp(message, primals, tangents):
  operand = primals[0]
  operand_tangent, params_tangents, state_tangent = tangents
  # Runs only when something is differentiated; a symbolic zero marks an input that
  # is not (jax.custom_jvp's public way to tell). Only a derivative with respect to
  # the params trains anything: one with respect to the operand alone (an input
  # gradient: saliency, adversarial examples, tests) drops no state update.
  zero = jax.custom_derivatives.SymbolicZero
  trained = any(not isinstance(t, zero) for t in params_tangents)
  if trained and isinstance(state_tangent, zero):
    raise ValueError(message)
  if isinstance(operand_tangent, zero):
    # A SymbolicZero forwards ``dtype`` to its aval through __getattr__, which pyright
    # reads as a method.
    operand_tangent = jnp.zeros(jnp.shape(operand), operand_tangent.dtype)  # pyright: ignore[reportArgumentType]
  return operand, operand_tangent


def require_state_gradient(operand: jax.Array, state: DelayedScalingState | None, *,
                           hint: str, params: Any = None) -> jax.Array:
  """``operand``, refusing a derivative with respect to ``params`` without one for ``state``.

  A delayed-scaling layer hands its new state back as the *gradient* of the old one,
  so a training step that differentiates the params but not the fp8 state (a plain
  ``jax.grad`` of the params, ``nnx.grad`` with its default ``wrt=nnx.Param``) drops
  every update: the state would never change and the layer would quantize with its
  initial scales forever. An fp8 layer passes an operand through this identity, with
  the parameters that a training step would differentiate; when ``jax.grad`` (or
  ``jax.jvp``) differentiates one of them and not the state, it raises while
  tracing. Evaluation, and derivatives with respect to the inputs alone (both
  operands of an einsum of two activations included), train nothing and are not
  affected; it costs nothing at run time.

  Args:
    operand: the operand to pass through (an fp8 layer's kernel operand).
    state: the layer's delayed-scaling state as the layer reads it (``None`` for
      current scaling, which keeps no state: ``operand`` is returned as is).
    hint: how to train the layer instead, for the message.
    params: the parameters whose derivative means the layer is trained (any pytree;
      its float leaves count): those of the module that owns the fp8 op. ``None``
      takes ``operand`` itself to be the layer's kernel; an empty tree refuses
      nothing.

  Returns:
    ``operand``.

  Raises:
    ValueError: while differentiating ``params`` and not the state.

  Example:
    >>> from jaxmp import fp8
    >>> state = fp8.init_state(fp8.DelayedScaling(amax_history_length=2))
    >>> guarded = lambda k: jaxmp.fp8.state.require_state_gradient(k, state, hint="")
    >>> try:
    ...   jax.grad(lambda k: jnp.sum(guarded(k)))(jnp.ones(2))  # the kernel alone
    ... except ValueError as e:
    ...   print(str(e)[:71])
    fp8: the params of an fp8 layer are differentiated but its fp8 state is
    >>> jax.grad(lambda k, s: jnp.sum(jaxmp.fp8.state.require_state_gradient(k, s, hint="")),
    ...          argnums=(0, 1))(jnp.ones(2), state)[0]  # both: fine
    Array([1., 1.], dtype=float32)
    >>> w = jnp.ones(2)  # an operand that is no parameter: its derivative trains nothing
    >>> jax.grad(lambda x: jnp.sum(jaxmp.fp8.state.require_state_gradient(
    ...     x, state, hint="", params={"w": w})))(jnp.ones(2))
    Array([1., 1.], dtype=float32)
  """
  if state is None:
    return operand
  leaves = (operand,) if params is None else tuple(
      x for x in jax.tree_util.tree_leaves(params) if dtypes.is_float_dtype(jnp.result_type(x)))
  if not leaves:
    return operand
  message = ("fp8: the params of an fp8 layer are differentiated but its fp8 state is not, so "
             "the state would never update (its new value comes back as its gradient, and "
             f"would be dropped). {hint}").strip()
  return _guard(operand, leaves, state.input_scale, message)


def _informative(cotangent: jax.Array) -> jax.Array:
  # A real scale or history is finite, >= 0, and (scales always, histories unless
  # every amax so far was 0) somewhere > 0. A zero or -inf cotangent fails this.
  # An all-zero history that was real is the old history rolled with amax 0, which
  # only happens when the old history was all zero too: keeping the old one is then
  # the same thing.
  # ``cotangent`` is [leaves, elements]: one answer per leaf.
  finite = jnp.all(jnp.isfinite(cotangent), axis=-1)
  non_negative = jnp.all(cotangent >= 0, axis=-1)
  positive = jnp.any(cotangent > 0, axis=-1)
  return finite & non_negative & positive


def _check_predicate(grads_finite: Any) -> jax.Array:
  if np.shape(grads_finite) != ():
    raise ValueError(
        f"merge needs a scalar grads_finite, got one of shape {np.shape(grads_finite)}.")
  dtype = grads_finite.dtype if hasattr(grads_finite, "dtype") else np.result_type(grads_finite)
  if dtype != np.dtype(bool):
    raise TypeError(f"merge needs a boolean grads_finite, got dtype {dtype}.")
  return jnp.asarray(grads_finite)


def _refuse_a_cotangent_of_another_state(old_state: Any, state_cotangent: Any) -> None:
  """Refuses a cotangent of another tree, saying what each holds and where it comes from."""
  if jax.tree_util.tree_structure(old_state) == jax.tree_util.tree_structure(state_cotangent):
    return
  paths = lambda tree: [jax.tree_util.keystr(p)
                        for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  old, new = paths(old_state), paths(state_cotangent)
  old_set, new_set = frozenset(old), frozenset(new)
  missing = [p for p in old if p not in new_set]
  extra = [p for p in new if p not in old_set]
  listed = lambda ps: ", ".join(ps[:3]) + (f" and {len(ps) - 3} more" if len(ps) > 3 else "")
  differences = ([f"the gradients lack {listed(missing)}"] if missing else []) + (
      [f"they hold {listed(extra)}, which the state does not"] if extra else [])
  raise ValueError(
      f"the fp8 state after a step (jaxmp.fp8.state.merge): the gradients' next fp8 state "
      f"(Gradients.fp8, the cotangent of the state the step read) has {len(new)} leaves, "
      f"the state {len(old)}: {'; '.join(differences) or 'the trees differ in structure'}. "
      f"They are gradients of another model, or of a state with other fp8 rules: take "
      f"them from value_and_grad of this state or model (state.value_and_grad(...) with a "
      f"TrainState), and step that same state.")


def merge(old_state: T, state_cotangent: T, grads_finite: ArrayLike = True) -> T:
  """The next fp8 state from the old one and the state cotangent of a step.

  Leaf by leaf: the cotangent where the step was finite and the cotangent carries
  information, the old value otherwise. A cotangent carries no information when it
  is not finite, has a negative entry, or is all zero: what an unused or
  ``stop_gradient``-ed layer (a symbolic-zero cotangent: 0, or ``-inf`` under
  :func:`for_grad`) gets. The state of a stack of layers (``nn.scan``, ``nnx.vmap``:
  leaves with leading layer axes, ``(layers, 1)`` scales and ``(layers, length)``
  histories) is decided layer by layer: a layer whose row carries no information
  keeps its own old row while the others move on.

  Args:
    old_state: the state the step read.
    state_cotangent: its cotangent from ``jax.grad`` (after :func:`accumulate` when
      there were micro-batches); same structure and shapes.
    grads_finite: a scalar bool, e.g. ``jaxmp.all_finite(grads)``; ``False`` (a step
      loss scaling skips) keeps the whole old state.

  Returns:
    The new state, same structure and dtypes as ``old_state``.

  Raises:
    ValueError: if the trees differ in structure or a pair of leaves in shape, or
      ``grads_finite`` is not a scalar.
    TypeError: if ``grads_finite`` is not boolean.

  Example:
    >>> from jaxmp import fp8
    >>> old = fp8.init_state(fp8.DelayedScaling(amax_history_length=2))
    >>> ct = old._replace(input_scale=jnp.array([0.5]))
    >>> fp8.state.merge(old, ct, grads_finite=jnp.array(True)).input_scale
    Array([0.5], dtype=float32)
    >>> fp8.state.merge(old, ct, grads_finite=jnp.array(False)).input_scale
    Array([1.], dtype=float32)
    >>> stack = {"scale": jnp.ones((2, 1))}   # two scanned layers; the second got nothing
    >>> fp8.state.merge(stack, {"scale": jnp.array([[0.5], [-jnp.inf]])})["scale"]
    Array([[0.5],
           [1. ]], dtype=float32)
  """
  ok_step = _check_predicate(grads_finite)
  state_cotangent = from_grad(state_cotangent)
  _refuse_a_cotangent_of_another_state(old_state, state_cotangent)
  pairs = tree_lib.map_pairs(lambda _, old, ct: _Pair(old, ct), old_state, state_cotangent,
                             where="merge", names=("the state", "the cotangent"))
  is_pair = lambda x: isinstance(x, _Pair)
  leaves, treedef = jax.tree_util.tree_flatten(pairs, is_leaf=is_pair)
  # The decisions as a few reductions over all leaves, not one per leaf: a model's
  # state is dozens of tiny arrays, and each reduction of its own became a kernel on
  # GPUs, the largest share of the kernels fp8 added to a train step (seen in compiled
  # H100 HLO). Leaves of one shape are stacked to be decided together; each row is
  # decided alone, so every decision is the leaf-by-leaf one.
  take: list[Any] = [None] * len(leaves)
  new: list[Any] = [pair.cotangent for pair in leaves]
  for shape, group in _group(leaves, lambda pair: pair.old.shape).items():
    for start in range(0, len(group), _LEAVES_PER_REDUCTION):
      members = group[start:start + _LEAVES_PER_REDUCTION]
      dtype = jnp.result_type(F32, *(leaves[i].cotangent.dtype for i in members))
      stacked = jnp.stack([leaves[i].cotangent.astype(dtype).reshape(-1) for i in members])
      if stacked.shape[1] > 1:
        # A new history is its old one rolled, which is not elementwise in the old
        # leaf: computed inside the select below, the select could not write a donated
        # history in place, and every history was copied after it (21 copies, 163
        # kernels on a Llama-3-8B layer's fp8 step; 143 this way, compiled H100 HLO).
        # Behind a barrier the new histories are computed once, stacked, into a buffer
        # of their own, and each select reads its row. Scales (one element) need not.
        stacked = jax.lax.optimization_barrier(stacked)
        for row, i in enumerate(members):
          new[i] = stacked[row].reshape(leaves[i].old.shape)
      decided = ok_step & _informative(_layer_rows(stacked, shape))
      for row, i in enumerate(members):
        take[i] = decided[row]
  # The selects leaf by leaf: each is elementwise in its old leaf, so a step whose
  # state is donated writes every new leaf in place. Selected together (the leaves
  # laid end to end and sliced apart again) each new leaf became a copy of its old
  # one: 288 copies on the demo's step, 1568 kernels against 1424 (compiled H100 HLO).
  merged = [jnp.where(take[i], new[i].astype(pair.old.dtype), pair.old)
            for i, pair in enumerate(leaves)]
  return jax.tree_util.tree_unflatten(treedef, merged)


# Leaves per reduction in merge. XLA computes the new histories a reduction stacks
# (each the amax pushed into its rolled old one) in one kernel only while a fusion's
# operands and outputs stay within its limit (about 96 on GPUs); beyond it they split
# into more kernels. 32 gave the fewest kernels in compiled H100 HLO of a Llama layer
# (42 state leaves) and of the demo's step (288 leaves: 1400 kernels; 64: 1540; all
# 144 histories at once: 1648).
_LEAVES_PER_REDUCTION = 32


def _group(items: list, key: Callable[[Any], Hashable]) -> dict[Any, list[int]]:
  """The indices of ``items``, grouped by ``key`` (groups and members in order)."""
  groups: dict[Hashable, list[int]] = {}
  for i, item in enumerate(items):
    groups.setdefault(key(item), []).append(i)
  return groups


def _layer_rows(stacked: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """``stacked`` leaves of ``shape``, one row per layer: ``[leaves, (layers...,) elements]``.

  A leaf with more than one axis is the state of a stack of layers (``nn.scan``,
  ``nnx.vmap``): its leading axes are the layers, its last one the layer's own scale or
  history. :func:`_informative` reduces the last axis, so each layer is decided alone
  and broadcast back over its row (a trailing axis of one).
  """
  if len(shape) <= 1:
    return stacked
  return stacked.reshape(stacked.shape[0], *shape[:-1], 1, shape[-1])


class _Pair(NamedTuple):
  """A state leaf and its cotangent, paired for :func:`merge`."""
  old: jax.Array
  cotangent: jax.Array


def accumulate(a: T, b: T) -> T:
  """Combines the state cotangents of two micro-batches of one step: element-wise max.

  Every micro-batch of a step reads the same old state, so their cotangents agree
  everywhere except in the amaxes they recorded; the max of those is the amax of the
  whole batch, which is what one step over the whole batch would have recorded. A
  micro-batch that carried no information (zeros, ``-inf``: see :func:`merge`) or
  recorded nothing finite does not change the result; NaN is ignored.

  Args:
    a: a state cotangent, or :func:`empty_like` to start an accumulation.
    b: another one, same structure and shapes.

  Returns:
    The combined cotangent, float32.

  Example:
    >>> from jaxmp import fp8
    >>> s = fp8.init_state(fp8.DelayedScaling(amax_history_length=2))
    >>> a = s._replace(input_amax_history=jnp.array([3.0, 1.0]))
    >>> b = s._replace(input_amax_history=jnp.array([5.0, 1.0]))
    >>> fp8.state.accumulate(a, b).input_amax_history
    Array([5., 1.], dtype=float32)
  """
  a, b = from_grad(a), from_grad(b)
  return jax.tree_util.tree_map(
      lambda x, y: jnp.fmax(jnp.asarray(x, F32), jnp.asarray(y, F32)), a, b)


def all_reduce(state_cotangent: T, axis_name: Hashable) -> T:
  """Combines the state cotangents of data-parallel replicas: max over ``axis_name``.

  Under ``jit`` with sharded arrays nothing is needed (the amax of a sharded tensor is
  already global). Under ``shard_map`` or ``pmap`` each replica records the amaxes of
  its own shard; take their max here, where parameter gradients take a mean, so that
  every replica continues with the same state. Same rules as :func:`accumulate`.

  Args:
    state_cotangent: this replica's state cotangent.
    axis_name: the mapped axis (or tuple of axes) the replicas run over.

  Returns:
    The combined cotangent, float32, equal on every replica.

  Example:
    >>> from jaxmp import fp8
    >>> s = fp8.init_state(fp8.DelayedScaling(amax_history_length=2))
    >>> per_replica = s._replace(input_amax_history=jnp.array([[3.0, 1.0], [5.0, 1.0]]))
    >>> per_replica = jax.tree_util.tree_map(
    ...     lambda x: x if x.ndim == 2 else jnp.stack([x, x]), per_replica)
    >>> out = jax.vmap(lambda c: fp8.state.all_reduce(c, "replicas"),
    ...                axis_name="replicas")(per_replica)
    >>> out.input_amax_history
    Array([[5., 1.],
           [5., 1.]], dtype=float32)
  """
  def reduce(x):
    x = jnp.asarray(x, F32)
    # NaN never comes out of the fp8 ops; read one as "no information" like -inf.
    x = jnp.where(jnp.isnan(x), -jnp.inf, x)
    return jax.lax.pmax(x, axis_name)

  return jax.tree_util.tree_map(reduce, from_grad(state_cotangent))


def empty_like(state: T) -> T:
  """A cotangent that carries no information: the identity of :func:`accumulate`.

  ``-inf`` everywhere, which :func:`merge` never takes. Start a gradient-accumulation
  carry with it.

  Example:
    >>> from jaxmp import fp8
    >>> s = fp8.init_state(fp8.DelayedScaling(amax_history_length=2))
    >>> fp8.state.merge(s, fp8.state.empty_like(s)).kernel_scale
    Array([1.], dtype=float32)
  """
  return jax.tree_util.tree_map(
      lambda x: jnp.full(jnp.shape(x), -jnp.inf, F32), from_grad(state))


__all__ = (
    "OVERWRITE_WITH_GRADIENT",
    "TENSORS",
    "DelayedScalingState",
    "accumulate",
    "all_reduce",
    "empty_like",
    "for_grad",
    "from_grad",
    "init_state",
    "initial_state",
    "merge",
    "read_state",
    "require_state_gradient",
)
