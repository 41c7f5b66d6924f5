"""fp8 state through Flax's lifted transforms: it goes where the layer's params go.

A linen layer inside a lifted transform (``nn.scan``, ``nn.vmap``, ``nn.jit``,
``nn.remat``, ``nn.remat_scan``, ``partitioning.scan_with_axes``, ``nn.cond``,
``nn.switch``, ``nn.while_loop``, and ``nn.RNN``, which scans its cell) sees only the
collections the transform lists; most list ``"params"`` and nothing more, so the
layer's delayed-scaling state (the ``_overwrite_with_gradient`` collection) could be
neither created on ``init`` nor read on ``apply``. Listing it changes the model. Here
the transform is told instead, while a wrapped model runs and with no change to its
code: every lifted transform of Flax's is built on ``flax.core.lift.pack``, which gets
the collection filters of the transform's variable groups, and the fp8 collection is
added to the group the params are in, unless a filter lists it already:

* params scanned or vmapped along an axis (``variable_axes={"params": 0}``: a stack
  of layers) stack the state too, one scale and history per layer, each from its own
  layer's amaxes: layer i's scales never depend on layer j's tensors. The state's layer
  axes always lead (``(layers, 1)`` scales, ``(layers, length)`` histories, nested
  stacks ``(outer, inner, ...)``) whatever the params' axis, so that
  :func:`jaxmp.fp8.state.merge` decides each layer alone and a ``PartitionSpec`` on
  axis 0 shards it;
* params broadcast (``nn.RNN``'s ``variable_broadcast="params"``, ``nn.vmap`` with
  ``variable_axes={"params": None}``: weights shared by the steps) broadcast the state:
  one state, whose new history records the max over the steps (under
  :func:`jaxmp.fp8.state.for_grad`, as :func:`jaxmp.linen.value_and_grad` reads it);
* transforms that pass every collection (``nn.jit``, ``nn.remat`` by default) pass it.

Transforms that hand variables to functions of the user's (``nn.map_variables``) or
differentiate them (``nn.vjp``, ``nn.jvp``, ``nn.custom_vjp``) are left as they are;
the state of a layer inside one that does not pass it, like that of a layer whose
``apply`` got no fp8 state (a ``jax.lax.scan`` written around ``apply`` with the params
alone), is refused by name (``jaxmp._src.linen.fp8._check_state_reachable``).

Example:
  >>> import flax.linen as nn
  >>> class Block(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x, _):
  ...     return nn.Dense(3)(x), None
  >>> class Stack(nn.Module):   # a published model's nn.scan, not listing the fp8 state
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     return nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
  ...                    length=4)()(x, None)[0]
  >>> model = jaxmp.linen.mixed_precision(Stack(), jaxmp.PolicyRules(
  ...     "float32", [jaxmp.Rule(nn.Dense, fp8=jaxmp.fp8.DelayedScaling(16))]))
  >>> variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
  >>> state = variables["_overwrite_with_gradient"]["ScanBlock_0"]["Dense_0"]
  >>> state["Fp8DotGeneral_0"]["input_amax_history"].shape   # one history per layer
  (4, 16)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax.core import lift
from flax.core import scope as flax_scope

from jaxmp._src import swaps
from jaxmp._src.fp8 import state as state_lib

_FP8 = state_lib.OVERWRITE_WITH_GRADIENT
_PARAMS = "params"

# The lifted transforms (flax.core.lift's names for pack) whose variable groups are
# structural: a group is stacked, broadcast, carried or passed whole. The others run
# functions of the user's on a group (map_variables) or differentiate it (vjp, jvp,
# value_and_grad, custom_vjp), where the fp8 state has no place.
CARRYING = frozenset({"scan", "vmap", "jit", "remat", "cond", "switch", "while_loop"})

# Where the transforms with axes keep the groups' axes: the index of a pack group in
# their axes (scan's first two groups are its broadcast and carry collections).
_FIRST_AXIS_GROUP = {"scan": 2, "vmap": 0}


class _Active(threading.local):
  """Per thread: how many wrapped linen calls are running."""

  def __init__(self):
    super().__init__()
    self.depth = 0


_ACTIVE = _Active()


def active() -> bool:
  """Whether a wrapped linen model runs in this thread (the state follows the params)."""
  return _ACTIVE.depth > 0


def _group_of_params(filters: Sequence[Any]) -> int | None:
  """The group the fp8 state joins: the params', unless a filter lists the state already.

  Flax puts a collection in the first group whose filter matches it, so the first
  filter that matches the params is their group.
  """
  if any(flax_scope.in_filter(f, _FP8) for f in filters):
    return None
  return next((i for i, f in enumerate(filters) if flax_scope.in_filter(f, _PARAMS)), None)


def _with_fp8(filters: Sequence[Any], group: int | None) -> tuple[Any, ...]:
  return tuple(flax_scope.union_filters(f, _FP8) if i == group else f
               for i, f in enumerate(filters))


def _closure(fn: Callable[..., Any]) -> dict[str, Any]:
  code = getattr(fn, "__code__", None)
  cells = getattr(fn, "__closure__", None) or ()
  return dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code else {}


def _axis(name: str, fn: Callable[..., Any], which: str, group: int | None) -> Any:
  """The axis a scan's or vmap's group ``group`` is stacked along (None: broadcast).

  Read from the transform's own function (``variable_in_axes``/``variable_out_axes``,
  aligned with its axis groups); 0 for a group without an axis (broadcast, carry) and
  for transforms without axes. Raises where a transform with axes no longer keeps them
  there, rather than stacking the state along an axis it cannot tell.
  """
  first = _FIRST_AXIS_GROUP.get(name)
  if first is None or group is None or group < first:
    return 0
  axes = _closure(fn).get(which)
  if not isinstance(axes, tuple) or group - first >= len(axes):
    raise NotImplementedError(
        f"jaxmp: Flax's lifted {name} keeps its variable axes in an unknown place in this "
        f"Flax version, so the fp8 state cannot follow the params through it; list "
        f"{_FP8!r} in the {name}'s variable_axes beside 'params'.")
  return axes[group - first]


def _moved(groups: Any, group: int | None, source: Any, destination: Any) -> Any:
  """``groups`` (per filter, per scope: collections) with the fp8 state's axis moved."""
  if group is None or source is None or destination is None or source == destination:
    return groups

  def move(collections):
    if _FP8 not in collections:
      return collections
    moved = jax.tree_util.tree_map(lambda x: jnp.moveaxis(x, source, destination),
                                   collections[_FP8])
    return {**collections, _FP8: moved}

  return tuple(tuple(move(c) for c in scopes) if i == group else scopes
               for i, scopes in enumerate(groups))


def _pack(original: Callable[..., Any]) -> Callable[..., Any]:
  """``flax.core.lift.pack``, adding the fp8 state to the params' group while active."""

  @functools.wraps(original)
  def pack(fn, in_variable_filters, out_variable_filters, rng_filters, name=None,
           enable_kwargs=False):
    if _ACTIVE.depth and name in CARRYING:
      in_group = _group_of_params(in_variable_filters)
      out_group = _group_of_params(out_variable_filters)
      if in_group is not None or out_group is not None:
        fn = _leading_layer_axes(fn, name, in_group, out_group)
        in_variable_filters = _with_fp8(in_variable_filters, in_group)
        out_variable_filters = _with_fp8(out_variable_filters, out_group)
    return original(fn, in_variable_filters, out_variable_filters, rng_filters, name=name,
                    enable_kwargs=enable_kwargs)

  return pack


def _leading_layer_axes(fn: Callable[..., Any], name: str, in_group: int | None,
                        out_group: int | None) -> Callable[..., Any]:
  """``fn`` (a transform's body over variable groups) seeing the state's layer axis
  where it stacks the params, while the state keeps it first outside."""
  in_axis = _axis(name, fn, "variable_in_axes", in_group)
  out_axis = _axis(name, fn, "variable_out_axes", out_group)
  if in_axis in (0, None) and out_axis in (0, None):
    return fn

  @functools.wraps(fn)
  def body(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
    variable_groups = _moved(variable_groups, in_group, 0, in_axis)
    y, out_groups = fn(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs)
    return y, _moved(out_groups, out_group, out_axis, 0)

  return body


_SWAP = swaps.Swap(lambda: [(lift, "pack", _pack(lift.pack))])


@contextlib.contextmanager
def fp8_state_follows_params() -> Iterator[None]:
  """While a wrapped linen model runs in this thread: the fp8 state goes where its params do."""
  with _SWAP.installed():
    _ACTIVE.depth += 1
    try:
      yield
    finally:
      _ACTIVE.depth -= 1


__all__ = ("CARRYING", "active", "fp8_state_follows_params")
