"""Flax NNX fp8 layers: delayed-scaling state as NNX Variables, and rule injection.

NNX modules own their state, so an fp8 matmul is a small module that holds its
delayed-scaling state as :class:`Fp8State` variables under Flax's names
(``input_scale``, ``input_amax_history``, ``kernel_scale``, ``kernel_amax_history``,
``output_grad_scale``, ``output_grad_amax_history``; scales ``(1,)``, histories
``(amax_history_length,)``, float32):

* :class:`Fp8DotGeneral` is a drop-in ``dot_general`` for ``nnx.Linear(dot_general=...)``
  and ``nnx.LinearGeneral(dot_general=...)``;
* :class:`Fp8Einsum` is a drop-in ``einsum_op`` for ``nnx.Einsum(einsum_op=...)``.

Both compute :func:`~jaxmp.fp8.fp8_dot_general` / :func:`~jaxmp.fp8.fp8_einsum`; with any recipe
but :class:`~jaxmp.fp8.DelayedScaling` they hold no variables. ``Rule(nnx.Linear,
fp8=...)`` under :func:`jaxmp.nnx.mixed_precision` creates them for an unchanged model
(:func:`fp8_layers`, :func:`new_fp8_module`, :func:`install`).

As in linen, the op cannot write its state: the new scale and history come back as
the *gradient* of the old ones. :class:`Fp8State` is registered as the NNX type of
linen's ``_overwrite_with_gradient`` collection, so ``nnx.bridge`` maps the two onto
each other. To train soundly, differentiate with respect to ``nnx.Param`` and
:class:`Fp8State` together, read the state through :func:`for_grad` inside the
differentiated function (repeated uses then take the max, not the sum), and merge the
state "gradient" with :func:`jaxmp.fp8.state.merge` rather than applying it;
:func:`jaxmp.nnx.value_and_grad` and :func:`jaxmp.nnx.apply_gradients` do all of it.

Example:
  >>> from flax import nnx
  >>> from jaxmp import fp8
  >>> layer = nnx.Linear(3, 2, dot_general=jaxmp.nnx.Fp8DotGeneral(), rngs=nnx.Rngs(0))
  >>> layer(jnp.ones((4, 3))).shape
  (4, 2)
  >>> sorted(nnx.state(layer, jaxmp.nnx.Fp8State)["dot_general"])
  ['input_amax_history', 'input_scale', 'kernel_amax_history', 'kernel_scale',
   'output_grad_amax_history', 'output_grad_scale']
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmp._src import adapter as adapter_lib
from jaxmp._src.fp8 import dot_general as dot_general_lib
from jaxmp._src.fp8 import ops
from jaxmp._src.fp8 import recipes as recipes_lib
from jaxmp._src.fp8 import state as state_lib


class Fp8State(nnx.Variable):
  """The delayed-scaling state of an fp8 matmul (a scale or an amax history).

  Its "gradient" under ``nnx.grad`` is its next value, to be merged with
  :func:`jaxmp.fp8.state.merge`, never applied by an optimizer: keep optimizers on
  ``wrt=nnx.Param``. jaxmp's precision policies never cast it.
  """


def register_collection_name() -> None:
  """Maps linen's fp8 collection name onto :class:`Fp8State` for ``nnx.bridge`` (once)."""
  # nnx.bridge names NNX variable types after linen collections; map linen's fp8
  # collection onto Fp8State so bridged linen fp8 layers and these share one type.
  # Done when jaxmp.nnx is imported or the first fp8 state is created, never by
  # `import jaxmp` (which changes nothing in Flax).
  if state_lib.OVERWRITE_WITH_GRADIENT not in nnx.variablelib.VariableTypeCache:
    nnx.register_variable_name(state_lib.OVERWRITE_WITH_GRADIENT, Fp8State)


def _init_variables(module: nnx.Module, recipe: recipes_lib.Recipe,
                    layers: tuple[int, ...] = (), layer_sharding: tuple | None = None) -> None:
  """Creates the op's state: one layer's, or a stack's (leading ``layers`` axes).

  ``layer_sharding``: the names the kernel's layer axes are sharded by (its
  ``out_sharding`` metadata, which ``nnx.vmap(transform_metadata=...)`` writes), given
  to the stacked state's layer axes so that ``nnx.get_partition_spec`` shards it as
  the kernel is sharded along the stack.
  """
  state = state_lib.initial_state(recipe)
  if state is None:
    return
  register_collection_name()
  metadata: dict[str, Any] = (
      {} if layer_sharding is None else {"out_sharding": (*layer_sharding, None)})
  for name, value in state._asdict().items():
    # A fresh array per variable: one buffer in two variables cannot be donated.
    stacked = jnp.array(jnp.broadcast_to(value, (*layers, *value.shape))) if layers else (
        jnp.array(value))
    setattr(module, name, Fp8State(stacked, **metadata))


_TRAIN_HINT = ("Train NNX fp8 models with jaxmp.nnx.value_and_grad (it differentiates the "
               "params and the Fp8State variables together) and jaxmp.nnx.apply_gradients (it "
               "merges the new fp8 state), not a plain nnx.grad + optimizer.update.")


_STACKED_HINT = (
    "Give the state the params' axes: an nnx.scan or nnx.vmap over the whole layer (its "
    "default axes, or a StateAxes that gives jaxmp.nnx.Fp8State the nnx.Param axis), or, "
    "where you scan the layers yourself with jax.lax.scan, split the stack with "
    "nnx.split(stack, nnx.Any(nnx.Param, jaxmp.nnx.Fp8State), ...) and scan both.")


def _read_state(module: Fp8Module) -> state_lib.DelayedScalingState | None:
  """The op's state from its variables, which ``_init_variables`` created (fp8 core's rule)."""
  return state_lib.read_state(module.recipe,
                              lambda name, _: getattr(module, name).get_value(),
                              layer=module.layer_path,
                              stacked_hint=_STACKED_HINT)


def _guarded(rhs: jax.Array, state: state_lib.DelayedScalingState | None) -> jax.Array:
  """The kernel, refused under a derivative that leaves the fp8 state out."""
  return state_lib.require_state_gradient(rhs, state, hint=_TRAIN_HINT)


class _Fp8Op(nnx.Module):
  """What both fp8 modules hold: the recipe, its delayed-scaling variables, the layer's path."""

  # The path of the layer that holds it, for messages; new_fp8_module sets it for the
  # layers a rule makes fp8, and an instance the user passes keeps "" (no path known).
  layer_path: str = ""

  def __init__(self, recipe: recipes_lib.Recipe = recipes_lib.DelayedScaling()):
    self.recipe = ops.check(recipe, type(self).__name__)
    _init_variables(self, self.recipe)


class Fp8DotGeneral(_Fp8Op):
  """An fp8 ``dot_general`` with its delayed-scaling state, for NNX dense layers.

  Pass an instance as ``nnx.Linear(..., dot_general=Fp8DotGeneral())`` or
  ``nnx.LinearGeneral(..., dot_general=...)``: the layer calls it with the input
  first and the kernel second, and its state appears under the layer's
  ``dot_general`` attribute. One instance per layer (an instance shared by two layers
  shares their state: its amaxes are the max over both).

  Train it with :func:`jaxmp.nnx.value_and_grad` and :func:`jaxmp.nnx.apply_gradients`:
  differentiating the kernel without the state (a plain ``nnx.grad`` loop) would drop
  every state update, and is refused while tracing.

  Args:
    recipe: any jaxmp fp8 recipe; :class:`~jaxmp.fp8.DelayedScaling` (history length
      1024) by default, the only one with variables.

  Raises:
    TypeError: if ``recipe`` is not a jaxmp fp8 recipe.

  Example:
    >>> from jaxmp import fp8
    >>> op = jaxmp.nnx.Fp8DotGeneral(fp8.DelayedScaling(amax_history_length=4))
    >>> op(jnp.ones((2, 3)), jnp.ones((3, 1)), (((1,), (0,)), ((), ()))).ravel()
    Array([3., 3.], dtype=float32)
    >>> op.input_amax_history.shape
    (4,)
  """

  def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
               precision: Any = None, preferred_element_type: Any = None,
               out_sharding: Any = None) -> jax.Array:
    """``fp8_dot_general(lhs, rhs, ...)`` with this module's state; same arguments.

    Raises:
      ValueError: while ``rhs`` (the kernel) is differentiated and the state is not
        (a plain ``nnx.grad`` training loop, whose fp8 state would never update).
    """
    del precision  # fp8 products have one precision
    state = _read_state(self)
    return dot_general_lib.dot_general(lhs, _guarded(rhs, state), dimension_numbers,
                                       preferred_element_type, out_sharding, state=state,
                                       recipe=self.recipe)


class Fp8Einsum(_Fp8Op):
  """A two-operand fp8 einsum with its delayed-scaling state, for ``nnx.Einsum``.

  Pass an instance as ``nnx.Einsum(..., einsum_op=Fp8Einsum())``; it is called like
  ``jnp.einsum(eqn, input, kernel, ...)`` and computes :func:`~jaxmp.fp8.fp8_einsum`,
  which keeps the input and kernel roles fixed.

  Args:
    recipe: any jaxmp fp8 recipe; :class:`~jaxmp.fp8.DelayedScaling` by default.

  Raises:
    TypeError: if ``recipe`` is not a jaxmp fp8 recipe.

  Example:
    >>> from jaxmp import fp8
    >>> op = jaxmp.nnx.Fp8Einsum(fp8.CurrentScaling())
    >>> op("btd,dh->bth", jnp.ones((2, 3, 4)), jnp.ones((4, 5))).shape
    (2, 3, 5)
  """

  def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array, precision: Any = None,
               preferred_element_type: Any = None, out_sharding: Any = None) -> jax.Array:
    """``fp8_einsum(eqn, lhs, rhs)`` with this module's state.

    Raises:
      ValueError: for an ``out_sharding`` (:func:`~jaxmp.fp8.fp8_einsum` lays its output
        out itself), and while the kernel is differentiated and the state is not.
    """
    del precision  # fp8 products have one precision
    state = _read_state(self)
    return dot_general_lib.einsum(eqn, lhs, _guarded(rhs, state), state=state,
                                  recipe=self.recipe,
                                  preferred_element_type=preferred_element_type,
                                  out_sharding=out_sharding)


FP8_LAYER_TYPES: tuple[type, ...] = (
    nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nnx.MultiHeadAttention)
"""The NNX layers a rule's fp8 recipe applies to."""

FP8_MODULE_TYPES: tuple[type, ...] = (Fp8DotGeneral, Fp8Einsum)
"""jaxmp's own NNX fp8 modules, which precision policies leave alone."""

Fp8Module = Fp8DotGeneral | Fp8Einsum
"""The fp8 module (with its state) that computes an fp8 layer's product."""

_PROJECTIONS = ("query", "key", "value", "out")


def supports_fp8(module_type: type) -> bool:
  """Whether a rule's fp8 recipe can turn ``module_type``'s matmuls into fp8."""
  return issubclass(module_type, FP8_LAYER_TYPES)


def _hook(layer: nnx.Module) -> tuple[str, Any]:
  """The (attribute, value) through which ``layer`` computes its product."""
  if isinstance(layer, nnx.Einsum):
    return "einsum_op", layer.einsum_op
  if isinstance(layer, nnx.LinearGeneral) and layer.dot_general_cls is not None:
    return "dot_general_cls", layer.dot_general_cls
  assert isinstance(layer, (nnx.Linear, nnx.LinearGeneral))  # the other FP8_LAYER_TYPES
  return "dot_general", layer.dot_general


def _is_default(layer: nnx.Module, value: Any) -> bool:
  if isinstance(layer, nnx.Einsum):
    return value is jnp.einsum
  if isinstance(layer, nnx.LinearGeneral):
    return value is None
  return value is jax.lax.dot_general


def fp8_layers(path: str, module: nnx.Module) -> list[tuple[str, nnx.Module]]:
  """The ``(path, layer)`` pairs whose product a rule's fp8 recipe on ``module`` replaces.

  A ``nnx.Linear``, ``nnx.LinearGeneral`` or ``nnx.Einsum`` is its own layer; a
  ``nnx.MultiHeadAttention`` contributes its ``query``, ``key``, ``value`` and ``out``
  projections (the attention-score einsums keep the compute dtype). Layers that
  already compute with a jaxmp fp8 module are left out.

  Args:
    path: ``module``'s '/'-joined path.
    module: a module :func:`supports_fp8` accepts.

  Returns:
    The layers to give an fp8 module, with their paths.

  Raises:
    ValueError: if a layer already has a custom dot_general or einsum_op of its own.
  """
  if isinstance(module, nnx.MultiHeadAttention):
    candidates = [(f"{path}/{name}" if path else name, getattr(module, name))
                  for name in _PROJECTIONS]
  else:
    candidates = [(path, module)]
  layers = []
  for layer_path, layer in candidates:
    attribute, value = _hook(layer)
    if isinstance(value, FP8_MODULE_TYPES):
      continue
    if not _is_default(layer, value):
      adapter_lib.refuse_custom_product(type(layer), layer_path, attribute, value)
    layers.append((layer_path, layer))
  return layers


def _one_layer_kernel_ndim(layer: nnx.Module) -> int:
  """The number of axes one layer's kernel has, from the layer's own configuration."""
  if isinstance(layer, nnx.Einsum):
    return len(layer.kernel_shape)
  if isinstance(layer, nnx.LinearGeneral):
    return len(layer.batch_axis) + len(layer.in_features) + len(layer.out_features)
  return 2  # nnx.Linear: (in_features, out_features)


def _kernel(layer: nnx.Module) -> nnx.Variable:
  """The ``kernel`` variable of an fp8 layer (a Linear, LinearGeneral or Einsum)."""
  # nnx.Module declares no kernel; the layers fp8_layers selects all have one.
  return layer.kernel  # pyright: ignore[reportAttributeAccessIssue]


def layer_axes(layer: nnx.Module) -> tuple[int, ...]:
  """The stack a layer is: its kernel's axes before one layer's (``()`` for one layer).

  A stack of layers built by ``nnx.vmap`` (and applied by ``nnx.scan`` or ``nnx.vmap``)
  is one module whose variables carry the layer axes first: a ``(layers, in, out)``
  kernel on an ``nnx.Linear(in, out)``.
  """
  shape = jnp.shape(_kernel(layer).get_value())
  return tuple(shape[:len(shape) - _one_layer_kernel_ndim(layer)])


def _layer_sharding(layer: nnx.Module, layers: tuple[int, ...]) -> tuple | None:
  """The names the kernel's layer axes are sharded by, if its metadata has them."""
  names = _kernel(layer).get_metadata("out_sharding", None)
  if not layers or not isinstance(names, (tuple, list)) or len(names) < len(layers):
    return None
  return tuple(names[:len(layers)])


def new_fp8_module(layer: nnx.Module, recipe: recipes_lib.Recipe, path: str = ""
                   ) -> Fp8Module:
  """A fresh :class:`Fp8Einsum` for an ``nnx.Einsum``, else a :class:`Fp8DotGeneral`.

  For a stack of layers (:func:`layer_axes`) the state is stacked the same way, one
  scale and history per layer, so that the transform that runs the stack slices each
  layer its own; ``path`` (the layer's) names it in messages.
  """
  fp8_module = Fp8Einsum(recipe) if isinstance(layer, nnx.Einsum) else Fp8DotGeneral(recipe)
  layers = layer_axes(layer)
  if layers:
    _init_variables(fp8_module, fp8_module.recipe, layers, _layer_sharding(layer, layers))
  fp8_module.layer_path = path
  return fp8_module


def install(layer: nnx.Module, fp8_module: Fp8Module) -> None:
  """Makes ``layer`` compute its product with ``fp8_module``, held as its child.

  Only for a private copy of a layer (``jaxmp.nnx.mixed_precision`` runs each call on
  one): nothing is restored. As a child, the module's state is part of the layer's:
  an NNX transform inside the model that splits the layer (``nnx.scan`` or
  ``nnx.vmap`` over a stack, ``nnx.remat``) handles it as it handles the layer's
  params, so a stack's state reaches each layer sliced.
  """
  attribute = "einsum_op" if isinstance(layer, nnx.Einsum) else "dot_general"
  setattr(layer, attribute, nnx.data(fp8_module))


@contextlib.contextmanager
def for_grad(model: Any) -> Iterator[None]:
  """Makes repeated reads of the model's fp8 state accumulate cotangents by max.

  Use it *inside* the function ``nnx.grad`` differentiates, around everything that
  calls the model: for its duration every :class:`Fp8State` in ``model`` holds its
  value converted to ``jaxmp._src.fp8.maxgrad.max_float32`` (see
  :func:`jaxmp.fp8.state.for_grad`), so a layer called several times, or inside
  ``nnx.scan``, gets the max of its uses' new states, not their sum. The float32
  values are put back in ``finally``; the state's gradient comes back as float32.

  Args:
    model: an NNX graph node (a module, or a pytree of them).

  Example:
    >>> from flax import nnx
    >>> from jaxmp import fp8
    >>> op = jaxmp.nnx.Fp8DotGeneral(fp8.DelayedScaling(amax_history_length=2))
    >>> def loss(op, x):
    ...   with jaxmp.nnx.fp8_for_grad(op):
    ...     dot = lambda a: op(a, jnp.ones((1, 1)), (((1,), (0,)), ((), ())))
    ...     return jnp.sum(dot(dot(x)))   # used twice
    >>> grads = nnx.grad(loss, argnums=nnx.DiffState(0, jaxmp.nnx.Fp8State))(
    ...     op, jnp.full((1, 1), 2.0))
    >>> grads["input_amax_history"][...]   # max of [2, 0] and [2, 0], not the sum
    Array([2., 0.], dtype=float32)
  """
  variables = [v for _, v in nnx.iter_graph(model) if isinstance(v, Fp8State)]
  originals = [v.get_raw_value() for v in variables]
  converted = []
  try:
    for variable, value in zip(variables, originals):
      variable.set_raw_value(state_lib.for_grad(value))
      converted.append(variable)
    yield
  finally:
    for variable, value in zip(converted, originals):
      variable.set_raw_value(value)


__all__ = (
    "FP8_LAYER_TYPES",
    "FP8_MODULE_TYPES",
    "Fp8DotGeneral",
    "Fp8Einsum",
    "Fp8State",
    "fp8_layers",
    "for_grad",
    "install",
    "layer_axes",
    "new_fp8_module",
    "supports_fp8",
)
