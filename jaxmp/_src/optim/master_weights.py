"""Master weights: 16-bit params in the model, an exact float32 master in the optimizer.

:func:`master_weights` wraps any Optax optimizer. The model's params stay in their
16-bit param dtype (bfloat16 or float16, the policy's ``param_dtype``); the
optimizer state holds a float32 master of each, either

* a full float32 copy (4 bytes per param; bfloat16 or float16 params), or
* with ``remainders=True``, Megatron-LM's ``store_param_remainders``: only the low
  16 bits, an int16 beside the bfloat16 param, which together are the float32 master
  bit for bit (2 bytes per param; bfloat16 params only; :func:`jaxmp.optim.split_remainder`).

Each ``update`` casts the gradients to float32 and runs the inner optimizer on them
over the float32 masters (the inner state, Adam's moments say, is as it would be for
float32 params), adds its updates to the masters exactly as ``optax.apply_updates``
adds them to float32 params, and rounds the new masters to the param dtype: to
nearest even (``astype``) for a full copy, to nearest with ties away from zero with
remainders (the one rounding 16 bits can undo). It returns float32 updates
``round(new_master) - param``, so the usual ``params = optax.apply_updates(params,
updates)`` gives exactly the rounded master (see :mod:`jaxmp._src.optim.base` for the
one exception: a param shrinking more than ``2**15``-fold in one step). The masters
therefore follow, bit for bit, the trajectory float32 params would follow under the
same gradients.

A full copy is the source of truth: the params passed to ``update`` are only
compared with it, so even a param that missed its target is set right at the next
step. With remainders the param *is* the master's top half, so the params passed to
``update`` must be the ones the last update produced (a checkpoint must save both).

Params that are not 16-bit (float32 layers kept wide by a ``jaxmp.Rule``) are their
own master: the inner optimizer updates them directly and their state entry is
``None``.

Loss scaling goes outside: ``jaxmp.loss_scaling(jaxmp.optim.master_weights(inner))``.
A non-finite step then never reaches this transform: its state (masters and inner
state) stays bit for bit, and the updates are ``-0.0``, so the params stay bit for bit
too. Inside, ``master_weights(jaxmp.loss_scaling(inner))``, also works: a skip adds
``-0.0`` to the masters, which keeps them, but loss scaling then unscales float32
copies of the gradients and checks those.

Example:
  >>> import optax
  >>> tx = jaxmp.optim.master_weights(optax.sgd(1e-3))
  >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
  >>> state = tx.init(params)
  >>> for _ in range(10):  # steps of 1e-3, each below half a bfloat16 ulp at 1.0
  ...   updates, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
  ...   params = optax.apply_updates(params, updates)
  >>> state.master["w"], params["w"]  # bfloat16 params alone would have stayed at 1.0
  (Array([0.9900001, 0.9900001], dtype=float32), Array([0.988281, 0.988281], dtype=bfloat16))
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import numpy as np
import optax

from jaxmp._src import checks
from jaxmp._src.optim import base
from jaxmp._src.optim import remainders as remainders_lib

_WHERE = "master_weights"
_NOTHING_TO_DO = (
    "Params already in float32 are their own master: use the optimizer directly, or "
    "store the params in 16 bits (a policy such as "
    "'params=bfloat16,compute=bfloat16,output=float32').")


class MasterWeightsState(NamedTuple):
  """The state of :func:`master_weights`.

  Attributes:
    master: a tree like the params. For each 16-bit param: its float32 master (a full
      copy), or with ``remainders=True`` the int16 low half of the master, whose
      high half is the bfloat16 param itself. ``None`` for a param that is not
      16-bit. Every array has its param's shape, so it shards like the param.
    inner_state: the inner optimizer's state, built and updated over the float32
      masters.

  Example:
    >>> import optax
    >>> state = jaxmp.optim.master_weights(optax.adam(1e-3), remainders=True).init(
    ...     {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.zeros(1)})
    >>> state.master
    {'b': None, 'w': Array([0, 0, 0], dtype=int16)}
  """

  master: Any
  inner_state: optax.OptState


_NESTED = (
    "{where}: {inner} is nested inside master_weights, which hands its inner optimizer "
    "the float32 masters, so {inner} has no 16-bit params to write. Use one of the two, "
    "not both: master_weights(opt) keeps exact float32 masters and writes the 16-bit "
    "params from them; stochastic_rounding(opt, key) and kahan_summation(opt) write the "
    "16-bit params without masters.")


def _run_inner(fn: Any, *args: Any, **kwargs: Any) -> Any:
  """``fn(*args, **kwargs)`` of the inner optimizer, naming a 16-bit writer nested in it."""
  try:
    return fn(*args, **kwargs)
  except base.NoParamsToWrite as error:
    # The inner one refuses the float32 masters this transform gave it: the cause is
    # the nesting, not the user's params.
    raise ValueError(_NESTED.format(where=_WHERE, inner=error.where)) from error


def _check_remainders(remainders: Any) -> bool:
  return checks.flag(remainders, "remainders", where=_WHERE)


def _select(params: Any, remainders: bool) -> Any:
  if remainders:
    return base.select_leaves(
        params, (remainders_lib.PARAM_DTYPE,), _WHERE, "with remainders=True keeps masters "
        "for", _NOTHING_TO_DO, refused=(np.dtype("float16"),))
  return base.select_leaves(params, base.HALF_DTYPES, _WHERE, "keeps float32 masters for",
                            _NOTHING_TO_DO)


def _upcast(x: jax.Array) -> jax.Array:
  return x.astype(base.ARITHMETIC)


def _keep(x: Any, *_: Any) -> Any:
  return x


def _none(*_: Any) -> None:
  return None


def master_weights(inner: optax.GradientTransformation, *,
                   remainders: bool = False) -> optax.GradientTransformationExtraArgs:
  """Keeps an exact float32 master of 16-bit params and optimizes it with ``inner``.

  See the module docstring for the algorithm, the two ways to store the master, and
  where loss scaling goes.

  Args:
    inner: the optimizer of the float32 masters: any ``optax.GradientTransformation``
      (or ``optax.MultiSteps``), e.g. ``optax.adamw(1e-3)`` or
      ``jaxmp.optim.state_dtypes(optax.adamw(1e-3), "bfloat16")``.
    remainders: ``False`` keeps a full float32 copy of each 16-bit param;
      ``True`` keeps only the 16 low bits beside a bfloat16 param.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`MasterWeightsState`. Its ``update(grads, state, params, **extra_args)``
    needs ``params`` and returns float32 updates for the 16-bit params.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation or ``remainders`` not a
      bool.
    ValueError: from ``init``/``update``, if no param is 16-bit (float32 params are
      their own master) or, with ``remainders=True``, a param is float16; from
      ``update``, if ``params`` is ``None``.

  Example:
    >>> import optax
    >>> tx = jaxmp.optim.master_weights(optax.adam(1e-3), remainders=True)
    >>> params = {"w": jnp.array([1.0, -2.0], jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.array([1.0, 1.0], jnp.bfloat16)}, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> jaxmp.optim.master_params(state, params)["w"]  # exactly float32 Adam's first step
    Array([ 0.999, -2.001], dtype=float32)
  """
  inner = checks.gradient_transformation(inner, "inner", where=_WHERE)
  remainders = _check_remainders(remainders)

  def init_fn(params):
    mask = _select(params, remainders)
    masters = base.map_selected(_upcast, mask, params, otherwise=_keep)
    if remainders:
      # A bfloat16 param is its float32 master's top half, exactly: remainder zero.
      stored = base.map_selected(lambda p: remainders_lib.split_remainder(_upcast(p))[1],
                                 mask, params, otherwise=_none)
    else:
      stored = base.map_selected(_keep, mask, masters, otherwise=_none)
    return MasterWeightsState(master=stored, inner_state=_run_inner(inner.init, masters))

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, MasterWeightsState):
      raise TypeError(f"{_WHERE}: state must be the MasterWeightsState its init returned, "
                      f"got {type(state).__name__}.")
    params = base.require_params(params, _WHERE)
    mask = _select(params, remainders)
    masters = _masters(mask, state.master, params, remainders)
    updates = base.map_selected(_upcast, mask, updates, otherwise=_keep)
    inner_updates, inner_state = _run_inner(inner.update, updates, state.inner_state, masters,
                                            **extra_args)
    # Exactly what optax.apply_updates does to float32 params.
    new_masters = optax.apply_updates(masters, inner_updates)
    if remainders:
      split = base.map_selected(remainders_lib.split_remainder, mask, new_masters,
                                otherwise=_none)
      targets = base.map_selected(lambda s: s[0], mask, split, otherwise=_none)
      stored = base.map_selected(lambda s: s[1], mask, split, otherwise=_none)
    else:
      targets = base.map_selected(lambda m, p: m.astype(p.dtype), mask, new_masters, params,
                                  otherwise=_none)
      stored = base.map_selected(_keep, mask, new_masters, otherwise=_none)
    updates = base.map_selected(lambda p, t, u: base.update_to(p, t), mask, params, targets,
                                inner_updates, otherwise=lambda p, t, u: u)
    return updates, MasterWeightsState(master=stored, inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _masters(mask: Any, stored: Any, params: Any, remainders: bool) -> Any:
  """The float32 masters (and the params that are their own master)."""
  if remainders:
    return base.map_selected(lambda r, p: remainders_lib.join_remainder(p, r), mask, stored,
                             params, otherwise=lambda r, p: p)
  return base.map_selected(_keep, mask, stored, params, otherwise=lambda r, p: p)


def _check_param_of_master(name: str, param: Any, master: Any, remainders: bool) -> None:
  """Refuses a param that cannot be the one ``master`` was kept for."""
  if np.shape(param) != np.shape(master):
    raise ValueError(
        f"master_params: param {name} has shape {np.shape(param)} where its master has "
        f"shape {np.shape(master)}. Pass the params the optimizer updates (for an "
        f"nnx.Optimizer, nnx.state(model, nnx.Param) of the model it was built on).")
  dtype = np.dtype(getattr(param, "dtype", type(param)))
  if remainders and dtype != remainders_lib.PARAM_DTYPE:
    raise TypeError(
        f"master_params: param {name} has dtype {dtype.name}; with remainders=True the "
        f"master is the {remainders_lib.PARAM_DTYPE.name} param plus the stored remainder, "
        f"so pass the {remainders_lib.PARAM_DTYPE.name} params the optimizer updates, not "
        f"the float32 masters.")


def master_params(opt_state: optax.OptState, params: optax.Params) -> optax.Params:
  """The float32 masters held by the :func:`master_weights` state in ``opt_state``.

  The masters are matched to the params leaf by leaf, by key path: the state of an
  ``nnx.Optimizer`` (``optimizer.opt_state``) holds them as ``OptVariable`` nodes
  where the model's state has ``Param`` ones, at the same paths.

  Args:
    opt_state: an optimizer state holding exactly one :class:`MasterWeightsState`
      (anywhere: inside ``jaxmp.loss_scaling``, ``optax.chain``, an
      ``nnx.Optimizer``'s ``opt_state``...).
    params: the current params (with remainders, the masters' top halves): the tree
      the optimizer updates, ``nnx.state(model, nnx.Param)`` for an ``nnx.Optimizer``
      built on ``model``.

  Returns:
    A tree like ``params`` (an ``nnx.State`` of ``Param`` for NNX): the float32
    master of each 16-bit param, and the params that are their own master as they
    are. Works inside ``jit``.

  Raises:
    ValueError: if ``opt_state`` holds no ``MasterWeightsState`` or more than one, or
      if the params' leaves are not at the masters' key paths or differ from their
      masters in shape.
    TypeError: with remainders, for a param that is not bfloat16 (the masters'
      top halves are).

  Example:
    >>> import optax
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = jaxmp.loss_scaling(jaxmp.optim.master_weights(optax.sgd(0.1))).init(params)
    >>> jaxmp.optim.master_params(state, params)["w"].dtype
    dtype('float32')
    >>> from flax import nnx
    >>> model = jaxmp.nnx.mixed_precision(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "bfloat16")
    >>> optimizer = nnx.Optimizer(model, jaxmp.optim.master_weights(optax.sgd(0.1)),
    ...                           wrt=nnx.Param)
    >>> masters = jaxmp.optim.master_params(optimizer.opt_state, nnx.state(model, nnx.Param))
    >>> masters["model"]["kernel"][...].dtype
    dtype('float32')
  """
  found = base.find_states(opt_state, MasterWeightsState)
  if len(found) != 1:
    raise ValueError(f"master_params: expected exactly one MasterWeightsState in the "
                     f"optimizer state of type {type(opt_state).__name__}, found "
                     f"{len(found)}; was the optimizer wrapped in jaxmp.optim.master_weights "
                     "once?")
  is_none = lambda x: x is None
  by_path, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_none)
  stored_by_path = jax.tree_util.tree_flatten_with_path(found[0].master, is_leaf=is_none)[0]
  paths = [path for path, _ in by_path]
  stored_paths = [path for path, _ in stored_by_path]
  if paths != stored_paths:
    i = next((i for i, (a, b) in enumerate(zip(paths, stored_paths)) if a != b),
             min(len(paths), len(stored_paths)))
    at = lambda ps: jax.tree_util.keystr(ps[i]) if i < len(ps) else "no more leaves"
    raise ValueError(
        f"master_params: the params do not match the master weights: the params have "
        f"{at(paths)} where the master weights have {at(stored_paths)}. Pass the "
        f"params the optimizer updates (for an nnx.Optimizer, nnx.state(model, "
        f"nnx.Param) of the model it was built on).")
  leaves = [x for _, x in by_path]
  stored = [x for _, x in stored_by_path]
  remainders = any(np.dtype(x.dtype) == remainders_lib.REMAINDER_DTYPE
                   for x in stored if x is not None)
  for path, param, master in zip(paths, leaves, stored):
    if master is not None:
      _check_param_of_master(jax.tree_util.keystr(path), param, master, remainders)
  mask = [x is not None for x in stored]
  return jax.tree_util.tree_unflatten(treedef, _masters(mask, stored, leaves, remainders))


__all__ = (
    "MasterWeightsState",
    "master_params",
    "master_weights",
)
