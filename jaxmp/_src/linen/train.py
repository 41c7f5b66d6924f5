"""Train steps for linen models that keep params, loss scaling and fp8 state together.

:func:`value_and_grad` differentiates a loss with respect to the params and the fp8
state (the ``_overwrite_with_gradient`` collection) together, scaling the loss by the
optimizer's current loss scale and making repeated uses of a layer take the max of
their amaxes. :func:`apply_gradients` then updates the params through the optimizer
and merges the fp8 state with the step's finiteness. :class:`TrainState` packages
both for a Flax-style loop. The framework-neutral pieces live in
:mod:`jaxmp._src.step`.

Example:
  >>> import flax.linen as nn, optax
  >>> model = jaxmp.linen.mixed_precision(nn.Dense(2), jaxmp.PolicyRules(
  ...     "p=f32,c=bf16,o=f32", [jaxmp.Rule(nn.Dense, fp8=jaxmp.fp8.DelayedScaling())]))
  >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 2))
  >>> state = jaxmp.linen.TrainState.create(
  ...     apply_fn=model.apply, variables=model.init(jax.random.key(0), x),
  ...     tx=jaxmp.loss_scaling(optax.adam(1e-3)))
  >>> loss_fn = lambda variables: jnp.mean((state.apply_fn(variables, x) - y) ** 2)
  >>> loss, grads = state.value_and_grad(loss_fn)()
  >>> state = state.apply_gradients(grads)
  >>> int(state.step)
  1
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import flax
import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src import loss_scaling as loss_scaling_lib
from jaxmp._src import nonfinite
from jaxmp._src import step as step_lib
from jaxmp._src.fp8 import state as fp8_state_lib
from jaxmp._src.linen import wrapper as wrapper_lib

FP8_COLLECTION = fp8_state_lib.OVERWRITE_WITH_GRADIENT
NONFINITE = wrapper_lib.NONFINITE_COLLECTION
PARAMS = "params"
Gradients = step_lib.Gradients


def _short_repr(x: Any, limit: int = 80) -> str:
  text = repr(x)
  return text if len(text) <= limit else text[:limit] + "..."


def wrapper_of(apply_fn: Any, where: str) -> wrapper_lib.MixedPrecision:
  """The :class:`jaxmp.linen.MixedPrecision` whose ``apply`` ``apply_fn`` is.

  Raises:
    TypeError: for any other function.
  """
  wrapper = getattr(apply_fn, "__self__", None)
  if not isinstance(wrapper, wrapper_lib.MixedPrecision) or (
      getattr(apply_fn, "__func__", None) is not wrapper_lib.MixedPrecision.apply):
    raise TypeError(f"{where}: apply_fn must be the apply of a jaxmp.linen wrapper "
                    f"(model.apply of model = jaxmp.linen.mixed_precision(...)), got "
                    f"{_short_repr(apply_fn)}.")
  return wrapper


def split_variables(variables: Any) -> tuple[Any, Any, dict]:
  """Splits a linen variables dict into (params, fp8 state, other collections).

  Raises:
    TypeError: if ``variables`` is not a mapping of collection names to trees.

  Example:
    >>> jaxmp.linen.split_variables({"params": {"w": 1.0}, "batch_stats": {"mean": 0.0},
    ...                              "_overwrite_with_gradient": {"input_scale": 1.0}})
    ({'w': 1.0}, {'input_scale': 1.0}, {'batch_stats': {'mean': 0.0}})
  """
  if not isinstance(variables, Mapping):
    raise TypeError(
        f"variables must be a mapping of collections (what model.init returns, e.g. "
        f"{{'params': ...}}), got {type(variables).__name__}: {_short_repr(variables)}.")
  variables = dict(variables)
  params = variables.pop(PARAMS, {})
  fp8 = variables.pop(FP8_COLLECTION, {})
  return params, fp8, variables


def join_variables(params: Any, fp8: Any, collections: dict | None = None) -> dict:
  """The inverse of :func:`split_variables`; an empty fp8 state is left out.

  Example:
    >>> jaxmp.linen.join_variables({"w": 1.0}, {}, {"batch_stats": {"mean": 0.0}})
    {'batch_stats': {'mean': 0.0}, 'params': {'w': 1.0}}
  """
  variables = dict(collections or {})
  variables[PARAMS] = params
  if fp8:
    variables[FP8_COLLECTION] = fp8
  return variables


def value_and_grad(fun: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., Any]:
  """Differentiates ``fun(variables, *args, **kwargs)`` w.r.t. the params and fp8 state.

  The returned function takes ``(variables, *args, loss_scale=None, **kwargs)``
  (``None``: no scaling); ``args`` and ``kwargs`` go to ``fun`` undifferentiated. It
  calls ``fun`` with the fp8 state converted so that repeated uses of a layer
  accumulate their state cotangents by max (:func:`jaxmp.fp8.state.for_grad`), and
  differentiates ``loss * loss_scale``. The variables' other collections (batch
  statistics, ...) are returned as ``Gradients.state_before``, what a skipped step
  keeps (:func:`apply_gradients`). When ``variables`` holds a non-finite probe
  (the ``jaxmp_nonfinite`` collection of a wrapper built with
  ``PolicyRules(trace_nonfinite=True)``), it is differentiated too, and
  ``Gradients.nonfinite`` is the step's per-module statistics, with each module's
  parameter-gradient amax filled in.

  Args:
    fun: ``fun(variables, *args, **kwargs) -> loss`` (or ``(loss, aux)`` with
      ``has_aux``), where ``variables`` is the linen variables dict to pass to
      ``apply``.
    has_aux: whether ``fun`` returns ``(loss, aux)``.

  Returns:
    A function returning ``(loss, Gradients)`` or ``((loss, aux), Gradients)``; the
    loss is unscaled, the params gradients scaled.

  Raises:
    TypeError: if ``fun`` is not callable.

  Example:
    >>> import flax.linen as nn
    >>> model = jaxmp.linen.mixed_precision(nn.Dense(2), jaxmp.PolicyRules(
    ...     "float32", [jaxmp.Rule(nn.Dense, fp8=jaxmp.fp8.DelayedScaling(amax_history_length=4))]))
    >>> x = jnp.full((4, 3), 2.0)
    >>> variables = model.init(jax.random.key(0), x)
    >>> loss_fn = lambda variables, x: jnp.mean(model.apply(variables, x))
    >>> loss, grads = jaxmp.linen.value_and_grad(loss_fn)(
    ...     variables, x, loss_scale=jaxmp.StaticLossScale(8.0))
    >>> grads.params["bias"]  # gradients of 8 * loss
    Array([4., 4.], dtype=float32)
    >>> grads.fp8["Fp8DotGeneral_0"]["input_amax_history"]  # the proposed next state
    Array([2., 0., 0., 0.], dtype=float32)
  """
  if not callable(fun):
    raise TypeError(f"value_and_grad: fun must be callable, got {fun!r}.")

  def differentiable(params, fp8, collections, *args, **kwargs):
    variables = join_variables(params, fp8_state_lib.for_grad(fp8), collections)
    return fun(variables, *args, **kwargs)

  def traced(params, fp8, probe, collections, *args, **kwargs):
    return differentiable(params, fp8, {**collections, NONFINITE: probe}, *args, **kwargs)

  def value_and_grads(variables, *args, loss_scale: loss_scale_lib.LossScale | None = None,
                      **kwargs):
    loss_scale = loss_scale_lib.as_loss_scale(loss_scale, where="value_and_grad")
    params, fp8, collections = split_variables(variables)
    if NONFINITE not in collections:
      out, (g_params, g_fp8) = loss_scale.value_and_grad(
          differentiable, has_aux=has_aux, argnums=(0, 1))(params, fp8, collections, *args,
                                                           **kwargs)
      return out, Gradients(g_params, g_fp8, collections)
    probe = collections.pop(NONFINITE)
    out, (g_params, g_fp8, g_probe) = loss_scale.value_and_grad(
        traced, has_aux=has_aux, argnums=(0, 1, 2))(params, fp8, probe, collections, *args,
                                                    **kwargs)
    trace = nonfinite.with_param_grads(nonfinite.check_trace(g_probe, NONFINITE),
                                       _named_leaves(g_params))
    return out, Gradients(g_params, g_fp8, collections, trace)

  return value_and_grads


def _named_leaves(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
  """The leaves of a params tree, each with its path of dict keys."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(tuple(str(getattr(k, "key", k)) for k in path), leaf) for path, leaf in flat]


def apply_gradients(tx: optax.GradientTransformation, params: Any, fp8: Any, opt_state: Any,
                    grads: Gradients, *, collections: Any = None,
                    **extra_args) -> tuple[Any, ...]:
  """One optimizer step for params, fp8 state and the other collections together.

  The params go through ``tx`` (which, wrapped in :func:`jaxmp.loss_scaling`, unscales
  and skips a non-finite step). The fp8 state is merged with
  :func:`jaxmp.fp8.state.merge`: it keeps its old value on a skipped step (the loss
  scaling state's ``last_step_finite``, or the finiteness of the gradients when
  ``tx`` has no loss scaling), and wherever a layer got no cotangent. The other
  collections the forward pass wrote, given as ``collections=``, are kept as they
  were before the step (``grads.state_before``, recorded by :func:`value_and_grad`)
  on a skipped step, bit for bit (``jaxmp._src.step.keep_on_skip``), as
  :meth:`TrainState.apply_gradients` keeps them.

  Args:
    tx: the optimizer.
    params: the params.
    fp8: the fp8 state (``{}`` for none).
    opt_state: ``tx``'s state.
    grads: from :func:`value_and_grad`.
    collections: the collections after the forward pass (``{**collections,
      **updates}`` with the ``updates`` that ``apply(..., mutable=[...])`` returned),
      with the structure of ``grads.state_before``; ``None`` (the default) for none.
    **extra_args: passed on to ``tx.update`` (optax ExtraArgs).

  Returns:
    ``(new_params, new_fp8, new_opt_state)``, and the new collections as a fourth
    element when ``collections`` is given.

  Raises:
    ValueError: if ``collections`` is given and ``grads.state_before`` is ``None``
      (gradients not from :func:`value_and_grad`) or differs from it in structure; if
      ``tx``'s ``jaxmp.loss_scaling`` is not its outermost transform
      (:func:`jaxmp.get_loss_scale` says why).

  Example:
    >>> import flax.linen as nn, optax
    >>> model, x = nn.Dense(2), jnp.ones((4, 3))
    >>> params, fp8, _ = jaxmp.linen.split_variables(model.init(jax.random.key(0), x))
    >>> tx = jaxmp.loss_scaling(optax.sgd(0.1))
    >>> opt_state = tx.init(params)
    >>> loss_fn = lambda variables: jnp.mean(model.apply(variables, x))
    >>> _, grads = jaxmp.linen.value_and_grad(loss_fn)(
    ...     jaxmp.linen.join_variables(params, fp8), loss_scale=jaxmp.get_loss_scale(opt_state))
    >>> params, fp8, opt_state = jaxmp.linen.apply_gradients(tx, params, fp8, opt_state, grads)
    >>> params["bias"]  # -0.1 * the unscaled gradient 0.5
    Array([-0.05, -0.05], dtype=float32)
  """
  params, fp8, opt_state, finite = _step(tx, params, fp8, opt_state, grads, extra_args)
  if collections is None:
    return params, fp8, opt_state
  where = "jaxmp.linen.apply_gradients: collections="
  if grads.state_before is None:
    raise ValueError(f"{where} needs the collections before the step, which a skipped step "
                     f"keeps: pass gradients from jaxmp.linen.value_and_grad (their "
                     f"state_before), got Gradients with state_before=None.")
  return (params, fp8, opt_state,
          step_lib.keep_on_skip(grads.state_before, collections, finite, what=where))


def _step(tx, params, fp8, opt_state, grads, extra_args):
  """:func:`apply_gradients`, also returning whether the step was applied."""
  if extra_args:
    updates, opt_state = tx.update(grads.params, opt_state, params, **extra_args)
  else:
    updates, opt_state = tx.update(grads.params, opt_state, params)
  params = optax.apply_updates(params, updates)
  finite = step_lib.step_was_finite(opt_state, grads.params)
  return params, step_lib.merge_fp8(fp8, grads.fp8, finite), opt_state, finite


class TrainState(flax.struct.PyTreeNode):
  """A Flax-style train state for mixed precision: params, fp8 state, collections.

  Attributes:
    step: how many times :meth:`apply_gradients` ran (skipped steps included; the
      optimizer's own count does not advance on them).
    params: the params, in their param dtypes.
    fp8: the fp8 delayed-scaling state (the ``_overwrite_with_gradient`` collection);
      ``{}`` for a model without fp8 layers.
    collections: the other variable collections (``batch_stats``, ...).
    opt_state: the optimizer's state.
    apply_fn: the model's apply function (static).
    tx: the optimizer (static).

  Example:
    >>> import flax.linen as nn, optax
    >>> model, y = nn.Dense(1), jnp.ones((4, 1))
    >>> state = jaxmp.linen.TrainState.create(
    ...     apply_fn=model.apply, variables=model.init(jax.random.key(0), jnp.ones((4, 3))),
    ...     tx=jaxmp.loss_scaling(optax.adam(1e-2)))
    >>> @jax.jit
    ... def train_step(state, x):
    ...   loss_fn = lambda variables: jnp.mean((state.apply_fn(variables, x) - y) ** 2)
    ...   loss, grads = state.value_and_grad(loss_fn)()
    ...   return state.apply_gradients(grads), loss
    >>> state, _ = train_step(state, jnp.ones((4, 3)))
    >>> state, _ = train_step(state, jnp.full((4, 3), jnp.inf))  # skipped
    >>> int(state.step), int(state.opt_state.inner_state[0].count)
    (2, 1)
  """

  step: jax.Array
  params: Any
  fp8: Any
  collections: Any
  opt_state: Any
  apply_fn: Callable[..., Any] = flax.struct.field(pytree_node=False)
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)

  @classmethod
  def create(cls, *, apply_fn: Callable[..., Any], variables: Any = None,
             tx: optax.GradientTransformation | None = None, **fields) -> TrainState:
    """Builds the state from a model's ``apply``, its ``init`` variables and ``tx``.

    Args:
      apply_fn: the model's apply function.
      variables: everything ``model.init`` returned: the ``params`` collection, the
        fp8 state and other collections (``batch_stats``). Flax's ``params=``
        spelling is refused rather than guessed at (Flax passes either the params
        collection or the whole dict there): pass ``variables={"params": params}``.
      tx: the optimizer.
      **fields: values for the fields of a subclass.

    Raises:
      TypeError: for a non-callable ``apply_fn``, a ``tx`` that is not a gradient
        transformation, ``params=`` or a missing ``variables``.
      ValueError: for ``variables`` without a ``params`` collection.
    """
    where = "TrainState.create"
    if "params" in fields:
      raise TypeError(
          f"{where} takes variables= (everything model.init returns: params, fp8 state, "
          f"batch_stats), not Flax's params=; pass variables=model.init(...), or "
          f"variables={{'params': params}} for a params collection alone.")
    if not callable(apply_fn):
      raise TypeError(f"{where}: apply_fn must be callable (e.g. model.apply), got {apply_fn!r}.")
    if isinstance(tx, optax.MultiSteps):
      raise TypeError(
          f"{where}: tx must be an optax.GradientTransformation, got an optax.MultiSteps "
          f"object; pass tx.gradient_transformation(), or with loss scaling "
          f"jaxmp.loss_scaling(optax.MultiSteps(opt, k)), which is one.")
    if not isinstance(tx, optax.GradientTransformation):
      raise TypeError(f"{where}: tx must be an optax.GradientTransformation, got {tx!r}.")
    if variables is None:
      raise TypeError(f"{where}: variables= is required (what model.init returns).")
    params, fp8, collections = split_variables(variables)
    if PARAMS not in variables:
      raise ValueError(
          f"{where}: variables must hold a 'params' collection (what model.init returns), "
          f"got the keys {sorted(map(str, variables))}; for a params dict alone pass "
          f"variables={{'params': params}}.")
    return cls(step=jnp.zeros((), jnp.int32), params=params, fp8=fp8,
               collections=collections, opt_state=tx.init(params), apply_fn=apply_fn, tx=tx,
               **fields)

  def __deepcopy__(self, memo: dict) -> TrainState:
    """A copy with every array copied and ``apply_fn`` and ``tx`` shared.

    They are the program, not its data (static pytree fields), so a deep copy keeps
    the same tree structure and a jitted step accepts it without tracing again.
    ``copy.copy`` shares everything; pickling works when ``apply_fn`` and ``tx`` pickle
    (Optax's transforms are closures and do not): checkpoint the pytree instead.
    """
    return jax.tree_util.tree_map(lambda leaf: copy.deepcopy(leaf, memo), self)

  def with_rules(self, rules: Any) -> TrainState:
    """This state with ``apply_fn`` under other precision rules, every array kept.

    ``apply_fn`` must be the ``apply`` of a :func:`jaxmp.linen.mixed_precision`
    wrapper; it becomes the ``apply`` of ``wrapper.with_rules(rules)``
    (:meth:`jaxmp.linen.MixedPrecision.with_rules`). Params, fp8 state, collections,
    the optimizer state and its loss scale are the same arrays: nothing is
    re-initialised. ``apply_fn`` is a static field, so a jitted step traces once more
    for the new rules.

    Args:
      rules: the new :class:`jaxmp.PolicyRules`.

    Raises:
      TypeError: if ``apply_fn`` is not a jaxmp wrapper's ``apply``, or ``rules`` not
        :class:`jaxmp.PolicyRules`.
    """
    return self.replace(apply_fn=wrapper_of(self.apply_fn, "TrainState.with_rules")
                        .with_rules(rules).apply)

  @property
  def variables(self) -> dict:
    """The variables dict for ``apply_fn``."""
    return join_variables(self.params, self.fp8, self.collections)

  @property
  def loss_scale(self) -> loss_scale_lib.LossScale:
    """The loss scale the next loss is multiplied by (NoOp without loss scaling)."""
    return loss_scaling_lib.get_loss_scale(self.opt_state, default=loss_scale_lib.NoOpLossScale())

  def value_and_grad(self, fun: Callable[..., Any], *,
                     has_aux: bool = False) -> Callable[..., Any]:
    """:func:`value_and_grad` at this state's variables and loss scale.

    Returns a function of ``(*args, **kwargs)``: what ``fun`` takes after the
    variables, passed on undifferentiated.
    """
    grad_fn = value_and_grad(fun, has_aux=has_aux)
    return lambda *args, **kwargs: grad_fn(self.variables, *args, loss_scale=self.loss_scale,
                                           **kwargs)

  def apply_gradients(self, grads: Gradients, *, extra_args: Mapping[str, Any] | None = None,
                      collections: Any = None, **changes) -> TrainState:
    """One step: params through ``tx``, fp8 state merged; ``changes`` replace fields.

    Pass the model's updated collections as ``collections=...`` (e.g. the
    ``batch_stats`` that ``apply(..., mutable=["batch_stats"])`` returned): they
    replace the state's collections on an applied step, and on a step the optimizer
    skipped (non-finite gradients) the old collections are kept bit for bit
    (``jaxmp._src.step.keep_on_skip``), so an overflowing forward pass cannot put
    inf into the running statistics. They must have the same structure as
    ``state.collections`` (pass ``{**state.collections, **updates}`` when ``apply``
    returned only some). Optax extra arguments for ``tx.update`` (such as
    ``value=loss`` for ``optax.contrib.reduce_on_plateau``) go in ``extra_args={...}``.

    Raises:
      TypeError: if ``grads`` is not :class:`Gradients`.
      ValueError: if ``collections`` differs in structure from ``state.collections``,
        or ``tx``'s ``jaxmp.loss_scaling`` is not its outermost transform.
    """
    if not isinstance(grads, Gradients):
      raise TypeError(f"apply_gradients expects jaxmp.linen.Gradients (from "
                      f"value_and_grad), got {type(grads).__name__}.")
    params, fp8, opt_state, finite = _step(self.tx, self.params, self.fp8, self.opt_state,
                                           grads, extra_args or {})
    if collections is not None:
      changes["collections"] = step_lib.keep_on_skip(
          self.collections, collections, finite,
          what="TrainState.apply_gradients: collections=")
    return self.replace(step=self.step + 1, params=params, fp8=fp8, opt_state=opt_state,
                        **changes)

__all__ = (
    "Gradients",
    "TrainState",
    "apply_gradients",
    "join_variables",
    "split_variables",
    "value_and_grad",
)
