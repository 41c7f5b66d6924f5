"""Flax linen fp8 layers: ``Fp8DotGeneral`` for dense layers, ``Fp8Einsum`` for einsums.

Both keep delayed-scaling state in the ``_overwrite_with_gradient`` collection under
Flax's variable names (``input_scale``, ``input_amax_history``, ``kernel_scale``,
``kernel_amax_history``, ``output_grad_scale``, ``output_grad_amax_history``; scales
``(1,)``, histories ``(amax_history_length,)``, float32), so Flax's
``TrainState.apply_gradients`` works unchanged and checkpoints of Flax's
``nn.Fp8DotGeneral`` carry over (the module is named ``Fp8DotGeneral_0`` rather than
``Fp8DirectDotGeneralOp_0``). With any other recipe (current scaling per tensor, row,
block or MX, or a :class:`~jaxmp.fp8.GemmRecipes`) they create no variables at all.

For training that stays sound when a layer is reused, unused, or a step is skipped,
update the collection with :mod:`jaxmp.fp8.state` (``for_grad`` inside the loss,
``merge`` afterwards) rather than overwriting it. Differentiating the params without
the collection (a plain ``jax.grad`` of the params) would drop every state update, and
is refused while tracing (:func:`jaxmp.fp8.state.require_state_gradient`, given the
params of the module that creates the fp8 op: the layer whose kernel it multiplies).
Derivatives with respect to inputs alone train nothing and are not refused, also for
an einsum of two activations.

Example:
  >>> import flax.linen as nn
  >>> from jaxmp import fp8
  >>> dense = nn.Dense(4, dot_general_cls=jaxmp.linen.Fp8DotGeneral)
  >>> variables = dense.init(jax.random.key(0), jnp.ones((2, 3)))
  >>> sorted(variables["_overwrite_with_gradient"]["Fp8DotGeneral_0"])
  ['input_amax_history', 'input_scale', 'kernel_amax_history', 'kernel_scale',
   'output_grad_amax_history', 'output_grad_scale']
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from jaxmp._src import paths
from jaxmp._src.fp8 import dot_general as dot_general_lib
from jaxmp._src.fp8 import ops
from jaxmp._src.fp8 import recipes as recipes_lib
from jaxmp._src.fp8 import state as state_lib
from jaxmp._src.linen import lifted

_TRAIN_HINT = ("Train linen fp8 models with jaxmp.linen.value_and_grad and "
               "jaxmp.linen.apply_gradients (or jaxmp.linen.TrainState), or differentiate the "
               "whole variables dict as Flax's TrainState does, not the params alone.")


def _layer_path(module: nn.Module) -> str:
  """The path of the layer that owns the fp8 op ``module`` (its parent)."""
  return "/".join(module.path[:-1]) or paths.ROOT


def _lifted_transforms(module: nn.Module) -> list[str]:
  """The Flax lifted transforms ``module`` runs inside, outermost first, by their names.

  Flax names each scope a lifted transform makes ``name(module)`` in its debug path.
  """
  debug_path = module.scope.debug_path if module.scope is not None else ()
  return [part.split("(", 1)[0] for part in debug_path
          if isinstance(part, str) and part.endswith(")") and "(" in part]


def _check_state_reachable(module: nn.Module) -> None:
  """Refuses, by the layer's path, to run where the fp8 state can be neither read nor made."""
  owg = state_lib.OVERWRITE_WITH_GRADIENT
  if module.is_mutable_collection(owg) or module.has_variable(owg, "input_scale"):
    return
  transforms = _lifted_transforms(module)
  raise ValueError(
      f"fp8: the delayed-scaling fp8 state of the layer at {_layer_path(module)!r} "
      f"(collection {owg!r}) is not in the variables it can see. "
      f"{_where_it_is_lost(transforms)} Or use a recipe without state, "
      f"jaxmp.fp8.CurrentScaling().")


def _where_it_is_lost(transforms: list[str]) -> str:
  """Why a layer cannot see its fp8 state, and the fix, from where it runs."""
  owg = state_lib.OVERWRITE_WITH_GRADIENT
  if transforms and lifted.active():
    return (f"It runs inside Flax's lifted {' > '.join(transforms)}; jaxmp passes the state "
            f"through {', '.join(sorted(lifted.CARRYING))} wherever the params go, and a "
            f"transform that hands its variables to a function (map_variables) or "
            f"differentiates them (vjp, jvp, custom_vjp) without passing the state must "
            f"list {owg!r} itself.")
  if transforms:
    return (f"It runs inside Flax's lifted {' > '.join(transforms)}, which does not pass the "
            f"collection on: list it there, variable_broadcast=['params', {owg!r}] for "
            f"weights shared by the steps (one state, recording the max over the steps), "
            f"or variable_axes={{'params': 0, {owg!r}: 0}} for a stack of layers (one state "
            f"per layer); jaxmp.linen.mixed_precision with an fp8 rule does this for you.")
  return (f"Pass apply everything model.init returned (jaxmp.linen.TrainState.variables), "
          f"not the params alone; where you run the layers yourself (a jax.lax.scan around "
          f"apply over stacked params), scan their fp8 state with them, each step's "
          f"variables {{'params': params_i, {owg!r}: state_i}} sliced from the stacks, or "
          f"scan inside the model with nn.scan, which jaxmp.linen.mixed_precision carries.")


_STACKED_HINT = (
    "Run the stack with nn.scan or nn.vmap inside the model (jaxmp slices the state with "
    "the params), or, where you scan the layers yourself around apply, slice the state "
    f"with the params: each step's variables {{'params': params_i, "
    f"{state_lib.OVERWRITE_WITH_GRADIENT!r}: state_i}}.")


def _read_state(module: nn.Module, recipe: recipes_lib.Recipe
                ) -> state_lib.DelayedScalingState | None:
  """The op's state from its collection, created there on ``init`` (fp8 core's rule)."""
  if ops.state_type(recipe) is not None:
    _check_state_reachable(module)
  return state_lib.read_state(recipe, lambda name, initial: module.variable(
      state_lib.OVERWRITE_WITH_GRADIENT, name, initial).value,
      layer=_layer_path(module), stacked_hint=_STACKED_HINT)


def _guarded(module: nn.Module, rhs: jax.Array,
             state: state_lib.DelayedScalingState | None) -> jax.Array:
  """``rhs``, refused under a derivative that trains the owning module but not the state."""
  # The module that creates the fp8 op (the Dense whose kernel it multiplies, the
  # nn.Einsum, the user's block around an einsum of two activations) owns the params
  # a training step would differentiate. A root fp8 module (Flax's Fp8Test einsums of
  # two inputs) has none: any derivative of it is an input gradient, which trains
  # nothing.
  parent = module.parent
  params = parent.variables.get("params", {}) if isinstance(parent, nn.Module) else {}
  return state_lib.require_state_gradient(rhs, state, hint=_TRAIN_HINT, params=params)


class Fp8DotGeneral(nn.Module):
  """An fp8 ``dot_general`` with its scaling state, for Flax's dense layers.

  Use it as ``nn.Dense(features, dot_general_cls=Fp8DotGeneral)``, also in
  ``nn.DenseGeneral`` and in ``nn.MultiHeadDotProductAttention`` (its
  ``qkv_dot_general_cls`` and ``out_dot_general_cls``, which reach the projections'
  ``DenseGeneral``); choose the recipe with ``functools.partial(Fp8DotGeneral,
  recipe=...)``. The first operand is the input, the second the kernel.

  Attributes:
    recipe: any jaxmp fp8 recipe; :class:`~jaxmp.fp8.DelayedScaling` (history length
      1024) by default.

  Raises:
    TypeError: at construction, if ``recipe`` is not a jaxmp fp8 recipe.

  Example:
    >>> import functools
    >>> import flax.linen as nn
    >>> from jaxmp import fp8
    >>> layer = nn.Dense(2, dot_general_cls=functools.partial(
    ...     jaxmp.linen.Fp8DotGeneral, recipe=fp8.DelayedScaling(amax_history_length=16)))
    >>> v = layer.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> v["_overwrite_with_gradient"]["Fp8DotGeneral_0"]["input_amax_history"].shape
    (16,)
  """

  recipe: Any = recipes_lib.DelayedScaling()

  def __post_init__(self):
    ops.check(self.recipe, type(self).__name__)
    super().__post_init__()

  @nn.compact
  def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
               precision: Any = None, preferred_element_type: Any = None,
               out_sharding: Any = None) -> jax.Array:
    """``fp8_dot_general(lhs, rhs, ...)`` with this module's state; same arguments."""
    state = _read_state(self, self.recipe)
    rhs = _guarded(self, rhs, state)
    del precision  # fp8 products have one precision
    return dot_general_lib.dot_general(lhs, rhs, dimension_numbers, preferred_element_type,
                                       out_sharding, state=state, recipe=self.recipe)


class Fp8Einsum(nn.Module):
  """A two-operand einsum in fp8 with its scaling state (input first, kernel second).

  Called like Flax's ``nn.Fp8Einsum``: ``Fp8Einsum()(eqn, lhs, rhs)``. It computes
  :func:`~jaxmp.fp8.fp8_einsum`, which keeps the operands' roles fixed (passing an fp8
  dot_general as ``jnp.einsum``'s ``_dot_general`` does not: einsum may swap them).
  To put a learnable kernel behind it, use it inside a module that creates the kernel,
  as ``nn.Einsum`` does; ``Rule(nn.Einsum, fp8=...)`` does that for existing models.

  Attributes:
    recipe: any jaxmp fp8 recipe; :class:`~jaxmp.fp8.DelayedScaling` by default.

  Raises:
    TypeError: at construction, if ``recipe`` is not a jaxmp fp8 recipe.

  Example:
    >>> from jaxmp import fp8
    >>> layer = jaxmp.linen.Fp8Einsum(recipe=fp8.CurrentScaling())
    >>> x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
    >>> y, variables = layer.init_with_output(jax.random.key(0), "btd,dh->bth", x, w)
    >>> y.shape, variables
    ((2, 3, 5), {})
  """

  recipe: Any = recipes_lib.DelayedScaling()

  def __post_init__(self):
    ops.check(self.recipe, type(self).__name__)
    super().__post_init__()

  @nn.compact
  def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array, precision: Any = None,
               preferred_element_type: Any = None, out_sharding: Any = None) -> jax.Array:
    """``fp8_einsum(eqn, lhs, rhs)`` with this module's state; the arguments of
    :func:`~jaxmp.fp8.fp8_einsum` (an ``out_sharding`` other than ``None`` is refused
    there)."""
    state = _read_state(self, self.recipe)
    rhs = _guarded(self, rhs, state)
    del precision  # fp8 products have one precision
    return dot_general_lib.einsum(eqn, lhs, rhs, state=state, recipe=self.recipe,
                                  preferred_element_type=preferred_element_type,
                                  out_sharding=out_sharding)


__all__ = (
    "Fp8DotGeneral",
    "Fp8Einsum",
)
