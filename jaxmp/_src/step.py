"""The train-step core shared by the linen and NNX steps.

A mixed-precision step has three kinds of state that must move together:

* the parameters, updated by an Optax optimizer (usually wrapped in
  :func:`jaxmp.loss_scaling`, which skips non-finite steps);
* the fp8 delayed-scaling state, whose new value arrives as its "gradient" and must
  be *merged*, not applied: kept on a skipped step, kept where a layer got no
  cotangent, max-combined (never summed) over repeated uses and micro-batches;
* other mutable state the forward pass writes (batch statistics, caches).

This module holds the framework-neutral pieces: what the gradients are
(:class:`Gradients`), how micro-batches combine (:func:`accumulate_gradients`),
whether a step was applied (:func:`step_was_finite`), and how the fp8 state and the
other state follow that decision (:func:`merge_fp8`, :func:`keep_on_skip`). The linen
``TrainState`` (:mod:`jaxmp.linen`) and the NNX steps (:mod:`jaxmp.nnx`) are thin
layers over it.

Example:
  >>> from jaxmp._src import step
  >>> a = step.Gradients({"w": jnp.array([1.0])}, {})
  >>> step.accumulate_gradients(a, a).params
  {'w': Array([2.], dtype=float32)}
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple
from typing import TypeVar

import jax
import jax.numpy as jnp

from jaxmp._src import loss_scaling as loss_scaling_lib
from jaxmp._src import nonfinite
from jaxmp._src import tree as tree_lib
from jaxmp._src.fp8 import state as fp8_state_lib

T = TypeVar("T")


class Gradients(NamedTuple):
  """What jaxmp's ``value_and_grad`` (linen and NNX) returns besides the loss.

  Transform ``params`` (sum, average, all-reduce); leave the other fields to
  :func:`accumulate_gradients` and ``apply_gradients``.

  Attributes:
    params: gradients of the params, multiplied by the loss scale the loss was scaled
      with (what :func:`jaxmp.loss_scaling`'s ``update`` expects).
    fp8: the fp8 state's cotangent: the proposed new fp8 state, float32, to be
      merged by ``apply_gradients`` (empty for a model without fp8 layers).
    state_before: the model's other state (batch statistics, caches, any mutable
      collection; not the params, the fp8 state, the non-finite probe or NNX's RNG
      streams) as it was before the forward pass wrote it: what a skipped step keeps
      (``keep_on_skip``). ``apply_gradients`` of either adapter uses it (linen's
      ``TrainState.apply_gradients`` keeps its own ``collections``, the same value);
      ``None`` in gradients built by hand.
    nonfinite: for a model wrapped with ``PolicyRules(trace_nonfinite=True)``, the
      step's per-module non-finite statistics (a
      :class:`~jaxmp._src.nonfinite.NonfiniteTrace`: read it with
      :func:`jaxmp.tools.nonfinite_report`, or pass it to
      :func:`jaxmp.tools.training_metrics`); ``None`` otherwise.

  Example:
    >>> import flax.linen as nn
    >>> model, x = nn.Dense(2), jnp.ones((1, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> _, grads = jaxmp.linen.value_and_grad(lambda v: model.apply(v, x).sum())(variables)
    >>> grads.params["bias"], grads.fp8
    (Array([1., 1.], dtype=float32), {})
  """

  params: Any
  fp8: Any
  state_before: Any = None
  nonfinite: Any = None


def _short_repr(x: Any, limit: int = 80) -> str:
  text = repr(x)
  return text if len(text) <= limit else text[:limit] + "..."


def accumulate_gradients(a: Gradients, b: Gradients) -> Gradients:
  """Combines two micro-batches' gradients: params summed, fp8 state and traces max-combined.

  Divide the params part by the number of micro-batches for a mean; the loss scale is
  the same for every micro-batch of a step, so sums of scaled gradients unscale
  correctly. ``a`` is the earlier micro-batch: its ``state_before`` (the state before
  the first forward pass) is what a skipped step restores.

  Raises:
    TypeError: if ``a`` or ``b`` is not a :class:`Gradients`.
    ValueError: if their fp8 states differ in structure (one has fp8 state and the
      other none, say): they are not gradients of the same model.

  Example:
    >>> s = jaxmp.fp8.init_state(jaxmp.fp8.DelayedScaling(amax_history_length=2))
    >>> a = jaxmp.linen.Gradients({"w": jnp.array([1.0])},
    ...                           s._replace(input_amax_history=jnp.array([3.0, 0.0])))
    >>> b = jaxmp.linen.Gradients({"w": jnp.array([3.0])},
    ...                           s._replace(input_amax_history=jnp.array([5.0, 0.0])))
    >>> total = jaxmp.linen.accumulate_gradients(a, b)
    >>> total.params["w"], total.fp8.input_amax_history  # sum, max
    (Array([4.], dtype=float32), Array([5., 0.], dtype=float32))
  """
  for name, g in (("a", a), ("b", b)):
    if not isinstance(g, Gradients):
      raise TypeError(f"accumulate_gradients: {name} must be jaxmp Gradients (from "
                      f"jaxmp.linen.value_and_grad or jaxmp.nnx.value_and_grad), got "
                      f"{type(g).__name__}: {_short_repr(g)}.")
  fp8_structures = [jax.tree_util.tree_structure(g.fp8) for g in (a, b)]
  if fp8_structures[0] != fp8_structures[1]:
    raise ValueError(
        "accumulate_gradients: a and b must be gradients of the same model, but their fp8 "
        f"states differ: {fp8_structures[0]} vs {fp8_structures[1]}.")
  params = jax.tree_util.tree_map(jnp.add, a.params, b.params)
  fp8 = fp8_state_lib.accumulate(a.fp8, b.fp8) if jax.tree_util.tree_leaves(a.fp8) else a.fp8
  state_before = b.state_before if a.state_before is None else a.state_before
  return Gradients(params, fp8, state_before, _accumulate_traces(a.nonfinite, b.nonfinite))


def _accumulate_traces(a: Any, b: Any) -> Any:
  if a is None or b is None:
    return b if a is None else a
  return nonfinite.accumulate(a, b)


def step_was_finite(opt_state: Any, scaled_grads: Any) -> jax.Array:
  """Whether the optimizer applied the step it just took.

  With :func:`jaxmp.loss_scaling` in ``opt_state`` (the state *after* the update) its
  ``last_step_finite`` decides; without, the gradients' finiteness.
  """
  state = loss_scaling_lib.find_state(opt_state, "apply_gradients")
  if state is not None:
    return jnp.asarray(state.last_step_finite)
  return tree_lib.all_finite(scaled_grads)


def merge_fp8(old: T, proposed: T, finite: jax.Array) -> T:
  """The fp8 state after a step: :func:`jaxmp.fp8.state.merge`, or ``old`` if empty."""
  if not jax.tree_util.tree_leaves(old):
    return old
  return fp8_state_lib.merge(old, proposed, finite)


def keep_on_skip(old: T, new: T, finite: Any, *, what: str = "state") -> T:
  """The state a step leaves: ``new`` if the step was applied, ``old`` if it was skipped.

  For every collection the forward pass writes besides the params and the fp8 state
  (batch statistics, caches, any mutable collection): a step whose gradients were
  not finite may have written inf/NaN into them (a float16 overflow puts inf into
  BatchNorm's running mean), and evaluation would read them. A leaf-wise select,
  jit-safe; both adapters (``jaxmp.linen.TrainState.apply_gradients`` and
  ``jaxmp.nnx.apply_gradients``) use it.

  Args:
    old: the state before the step.
    new: the state the step wrote: the same tree paths, shapes and dtypes (dict and
      ``FrozenDict`` nodes count as the same).
    finite: a scalar bool, :func:`step_was_finite`.
    what: what the trees are, for the error message.

  Returns:
    ``new`` or ``old``, with ``new``'s structure.

  Raises:
    ValueError: if the trees differ in their paths (naming the missing and the
      unexpected ones) or a pair of leaves in shape.
    TypeError: if a pair of leaves differs in dtype, or ``finite`` is not boolean.

  Example:
    >>> from jaxmp._src import step
    >>> step.keep_on_skip({"mean": jnp.zeros(2)}, {"mean": jnp.full(2, jnp.inf)},
    ...                   jnp.array(False))
    {'mean': Array([0., 0.], dtype=float32)}
  """
  old_paths, _ = jax.tree_util.tree_flatten_with_path(old)
  new_paths, new_def = jax.tree_util.tree_flatten_with_path(new)
  old_keys = [jax.tree_util.keystr(p) for p, _ in old_paths]
  new_keys = [jax.tree_util.keystr(p) for p, _ in new_paths]
  if old_keys != new_keys:
    missing = [k for k in old_keys if k not in set(new_keys)]
    unexpected = [k for k in new_keys if k not in set(old_keys)]
    raise ValueError(
        f"{what} must have the structure of the old value, which a skipped step keeps: "
        f"missing {', '.join(missing[:3]) or 'nothing'}, unexpected "
        f"{', '.join(unexpected[:3]) or 'nothing'} (old: {len(old_keys)} leaves, new: "
        f"{len(new_keys)}); pass every collection, e.g. {{**old, **updates}}.")
  if not new_keys:
    return new
  aligned_old = jax.tree_util.tree_unflatten(new_def, [leaf for _, leaf in old_paths])
  return tree_lib.select_tree(finite, new, aligned_old)


__all__ = (
    "Gradients",
    "accumulate_gradients",
    "keep_on_skip",
    "merge_fp8",
    "step_was_finite",
)
