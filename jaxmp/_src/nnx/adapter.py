"""The NNX adapter as the engine's :class:`~jaxmp._src.adapter.Adapter`.

Registered when this module is imported (the tools import it). It imports the rest of
the NNX adapter (the wrapper, the fp8 layers, the steps) on first use, so that
importing the tools defines no NNX module class until an NNX model is given.

Example:
  >>> from flax import nnx
  >>> from jaxmp._src.nnx import adapter
  >>> adapter.ADAPTER.owns(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
  True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from jaxmp._src import adapter as adapter_lib
from jaxmp._src import engine
from jaxmp._src import rules as rules_lib


def _wrapper() -> Any:
  from jaxmp._src.nnx import wrapper  # pylint: disable=g-import-not-at-top
  return wrapper


def _train() -> Any:
  from jaxmp._src.nnx import train  # pylint: disable=g-import-not-at-top
  return train


def _fp8() -> Any:
  from jaxmp._src.nnx import fp8  # pylint: disable=g-import-not-at-top
  return fp8


class NnxAdapter:
  """Flax NNX: modules found in the module graph, variables held by the model."""

  name = "nnx"
  model_kind = "an NNX Module"
  holds_variables = True

  @property
  def fp8_layer_types(self) -> tuple[type, ...]:
    return _fp8().FP8_LAYER_TYPES

  @property
  def value_and_grad(self) -> Callable[..., Any]:
    return _train().value_and_grad

  @property
  def apply_gradients(self) -> Callable[..., Any]:
    return _train().apply_gradients

  def owns(self, model: Any) -> bool:
    return isinstance(model, nnx.Module)  # the NNX wrapper is an nnx.Module too

  def supports_fp8(self, module_type: type) -> bool:
    return _fp8().supports_fp8(module_type)

  def mixed_precision(self, model: Any, policy_or_rules: rules_lib.PolicyOrRules
                      ) -> engine.Wrapper:
    return _wrapper().mixed_precision(model, policy_or_rules)

  def module_types(self, wrapper: engine.Wrapper) -> dict[str, type]:
    return wrapper.module_types()

  def functional(self, model: Any, rules: rules_lib.PolicyRules, variables: Any
                 ) -> tuple[Any, Callable[..., Any]]:
    del variables  # the model holds them
    graphdef, state = nnx.split(_wrapper().mixed_precision(nnx.clone(model), rules))

    def apply(state, *args, method: str = "__call__", **kwargs):
      wrapped = nnx.merge(graphdef, state)
      return (wrapped if method == "__call__" else getattr(wrapped, method))(*args, **kwargs)

    return state, apply

  def trace_abstract(self, model_or_wrapper: Any, rules: rules_lib.PolicyOrRules | None,
                     args: tuple, kwargs: dict, *, variables: Any = None, rngs: Any = None
                     ) -> tuple[rules_lib.PolicyRules, list[engine.CallRecord], Any]:
    if variables is not None or rngs is not None:
      raise TypeError("jaxmp.tools.summary: an NNX model holds its own variables and RNGs; "
                      "variables= and rngs= are for linen models.")
    kwargs = dict(kwargs)
    method = kwargs.pop("method", "__call__")
    return _wrapper().trace_abstract(model_or_wrapper, rules, method, args, kwargs)


ADAPTER = adapter_lib.register(NnxAdapter())
"""The NNX adapter."""

__all__ = ("ADAPTER", "NnxAdapter")
