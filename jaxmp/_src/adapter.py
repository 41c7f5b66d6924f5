"""The adapter contract: what a framework adapter (linen, NNX) provides, stated once.

The engine (:mod:`jaxmp._src.engine`) decides every per-call precision question; an
*adapter* connects it to one framework's modules. Both adapters implement
:class:`Adapter`, and the tools reach a model's adapter through :func:`for_model`
rather than by testing the model's class, so nothing below the adapters (the core, the
fp8 core, the engine) imports or names Flax. An adapter must:

1. **find modules**: recognise its framework's models and jaxmp wrappers
   (:meth:`Adapter.owns`), and give a wrapper's module classes by path
   (:meth:`Adapter.module_types`);
2. **run one call**: wrap a model under rules (:meth:`Adapter.mixed_precision`), whose
   calls go through :class:`jaxmp._src.engine.Call`, as a pure function of its state
   (:meth:`Adapter.functional`, for :func:`jaxmp.tools.sensitivity`), and trace one
   call abstractly with every module call annotated (:meth:`Adapter.trace_abstract`,
   for :func:`jaxmp.tools.summary`);
3. **name fp8 layers**: the layer classes an fp8 rule applies to
   (:attr:`Adapter.fp8_layer_types`, :meth:`Adapter.supports_fp8`), refusing a layer
   that already has its own product with :func:`refuse_custom_product`;
4. **thread state**: train steps (:attr:`Adapter.value_and_grad`,
   :attr:`Adapter.apply_gradients`) that move params, fp8 state and every other
   collection together, reading and creating the fp8 state with
   :func:`jaxmp._src.fp8.state.read_state` (its initial value:
   :func:`jaxmp._src.fp8.state.init_state`), and, on a skipped step, keeping every
   collection as it was before the step (:func:`jaxmp._src.step.keep_on_skip`; what it
   was: ``Gradients.state_before``).

Adapters register themselves (:func:`register`) when their ``adapter`` module is
imported; :func:`adapters` lists them in that order.

Example:
  >>> from jaxmp._src import adapter
  >>> from jaxmp._src.linen import adapter as linen_adapter
  >>> import flax.linen as nn
  >>> adapter.for_model(nn.Dense(2), "example").name
  'linen'
  >>> isinstance(linen_adapter.ADAPTER, adapter.Adapter)
  True
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any
from typing import NoReturn
from typing import Protocol
from typing import runtime_checkable

from jaxmp._src import engine
from jaxmp._src import paths as paths_lib
from jaxmp._src import rules as rules_lib


@runtime_checkable
class Adapter(Protocol):
  """What a framework adapter provides (the module docstring lists the four duties).

  Attributes:
    name: the framework, as messages name it (``"linen"``, ``"nnx"``).
    model_kind: what a model of the framework is, for messages (``"an NNX Module"``).
    fp8_layer_types: the framework's layer classes a rule's fp8 recipe applies to.
    holds_variables: whether the framework's models hold their variables (NNX) rather
      than take them as an argument (linen); tools ask for ``variables=`` accordingly.
    value_and_grad: the adapter's ``value_and_grad``: the loss scaled, the params and
      the fp8 state differentiated together, ``Gradients.state_before`` recorded.
    apply_gradients: the adapter's ``apply_gradients``: params through the optimizer,
      fp8 state merged, and on a skipped step every collection kept as it was.
  """

  # Read-only (properties in the Protocol): an adapter may compute them lazily.
  @property
  def name(self) -> str: ...

  @property
  def model_kind(self) -> str: ...

  @property
  def fp8_layer_types(self) -> tuple[type, ...]: ...

  @property
  def holds_variables(self) -> bool: ...

  @property
  def value_and_grad(self) -> Callable[..., Any]: ...

  @property
  def apply_gradients(self) -> Callable[..., Any]: ...

  def owns(self, model: Any) -> bool:
    """Whether ``model`` is this framework's module or a wrapper this adapter made."""
    ...

  def supports_fp8(self, module_type: type) -> bool:
    """Whether a rule's fp8 recipe can turn ``module_type``'s matmuls into fp8."""
    ...

  def mixed_precision(self, model: Any, policy_or_rules: rules_lib.PolicyOrRules
                      ) -> engine.Wrapper:
    """``model`` wrapped so that each module call runs through :class:`engine.Call`."""
    ...

  def module_types(self, wrapper: engine.Wrapper) -> dict[str, type]:
    """The class of every module of the wrapped model, by '/'-joined path."""
    ...

  def functional(self, model: Any, rules: rules_lib.PolicyRules, variables: Any
                 ) -> tuple[Any, Callable[..., Any]]:
    """``model`` under ``rules`` as a pure function: ``(state, apply)``.

    ``apply(state, *args, **kwargs)`` runs one call of the wrapped model (another
    method with ``method=``) and is jit-safe; ``state`` is ``variables`` (linen) or the
    wrapper's split state (NNX, on a copy: ``model`` is not changed).
    """
    ...

  def trace_abstract(self, model_or_wrapper: Any, rules: rules_lib.PolicyOrRules | None,
                     args: tuple, kwargs: dict, *, variables: Any = None, rngs: Any = None
                     ) -> tuple[rules_lib.PolicyRules, list[engine.CallRecord], Any]:
    """Traces one call abstractly, every module call annotated: rules, records, jaxpr.

    Raises:
      TypeError: for ``variables``/``rngs`` where the framework takes none.
      ValueError: for ``rules=None`` with an unwrapped model.
    """
    ...


_ADAPTERS: list[Adapter] = []

MEMBERS = ("name", "model_kind", "fp8_layer_types", "holds_variables", "value_and_grad",
           "apply_gradients", "owns", "supports_fp8", "mixed_precision", "module_types",
           "functional", "trace_abstract")
"""The members of :class:`Adapter`."""

_MISSING = object()


def missing_members(candidate: Any) -> list[str]:
  """The members of :class:`Adapter` that ``candidate`` lacks (``[]`` for an adapter).

  Looked up statically, so an adapter's lazily computed members (NNX imports its layers
  on first use) are not evaluated.
  """
  return [name for name in MEMBERS
          if inspect.getattr_static(candidate, name, _MISSING) is _MISSING]


def register(adapter: Adapter) -> Adapter:
  """Adds ``adapter`` to :func:`adapters` (once); returns it.

  Raises:
    TypeError: if ``adapter`` does not implement :class:`Adapter`.
  """
  missing = missing_members(adapter)
  if missing:
    raise TypeError(f"register expects a jaxmp adapter (the Adapter protocol), got "
                    f"{adapter!r} of type {type(adapter).__name__}, which lacks "
                    f"{', '.join(missing)}.")
  if all(a.name != adapter.name for a in _ADAPTERS):
    _ADAPTERS.append(adapter)
  return adapter


def adapters() -> tuple[Adapter, ...]:
  """The registered adapters, in the order they registered."""
  return tuple(_ADAPTERS)


def for_model(model: Any, where: str) -> Adapter:
  """The registered adapter that owns ``model`` (a module or a jaxmp wrapper).

  Raises:
    TypeError: naming ``where``, if no adapter owns it.
  """
  for adapter in _ADAPTERS:
    if adapter.owns(model):
      return adapter
  kinds = ", ".join(a.model_kind for a in _ADAPTERS)
  raise TypeError(f"{where} expects {kinds} or a jaxmp mixed_precision wrapper, got "
                  f"{model!r:.200} of type {type(model).__name__}.")


def refuse_custom_product(layer_type: type, path: str, attribute: str,
                          value: Any) -> NoReturn:
  """Refuses an fp8 rule on a layer that already computes its product its own way.

  The one statement of the rule for both adapters: a layer the user gave a
  dot_general (or an einsum_op) of their own is not overridden by an fp8 rule, since
  one of the two choices would be lost silently.

  Args:
    layer_type: the layer's class.
    path: the layer's '/'-joined path (``""`` for the root).
    attribute: the field that holds the custom product (``dot_general_cls``, ...).
    value: what it holds.

  Raises:
    ValueError: always, naming the layer, the field and the way out.
  """
  raise ValueError(
      f"An fp8 rule matches {layer_type.__name__} at {paths_lib.describe_path(path)!r}, which "
      f"already has a custom {attribute}={value!r}; remove one of the two (exclude the layer "
      f"with an earlier Rule({path!r}) without fp8).")


__all__ = ("MEMBERS", "Adapter", "adapters", "for_model", "missing_members",
           "refuse_custom_product", "register")
