"""The linen adapter as the engine's :class:`~jaxmp._src.adapter.Adapter`.

Registered when this module is imported (the tools import it).

Example:
  >>> import flax.linen as nn
  >>> from jaxmp._src.linen import adapter
  >>> adapter.ADAPTER.owns(nn.Dense(2)), adapter.ADAPTER.supports_fp8(nn.Conv)
  (True, False)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn

from jaxmp._src import adapter as adapter_lib
from jaxmp._src import engine
from jaxmp._src import rules as rules_lib
from jaxmp._src.linen import injection
from jaxmp._src.linen import train
from jaxmp._src.linen import wrapper


class LinenAdapter:
  """Flax linen: modules found by a method interceptor, variables passed to ``apply``."""

  name = "linen"
  model_kind = "a flax linen Module"
  fp8_layer_types = injection.FP8_LAYER_TYPES
  holds_variables = False
  value_and_grad = staticmethod(train.value_and_grad)
  apply_gradients = staticmethod(train.apply_gradients)

  def owns(self, model: Any) -> bool:
    return isinstance(model, (nn.Module, wrapper.MixedPrecision))

  def supports_fp8(self, module_type: type) -> bool:
    return injection.supports_fp8(module_type)

  def mixed_precision(self, model: Any, policy_or_rules: rules_lib.PolicyOrRules
                      ) -> wrapper.MixedPrecision:
    return wrapper.mixed_precision(model, policy_or_rules)

  def module_types(self, wrapper: engine.Wrapper) -> dict[str, type]:
    return wrapper.module_types()

  def functional(self, model: Any, rules: rules_lib.PolicyRules, variables: Any
                 ) -> tuple[Any, Callable[..., Any]]:
    wrapped = wrapper.mixed_precision(model, rules)
    return variables, wrapped.apply

  def trace_abstract(self, model_or_wrapper: Any, rules: rules_lib.PolicyOrRules | None,
                     args: tuple, kwargs: dict, *, variables: Any = None, rngs: Any = None
                     ) -> tuple[rules_lib.PolicyRules, list[engine.CallRecord], Any]:
    return wrapper.trace_abstract(model_or_wrapper, rules, args, kwargs, variables=variables,
                                  rngs=rngs)


ADAPTER = adapter_lib.register(LinenAdapter())
"""The linen adapter."""

__all__ = ("ADAPTER", "LinenAdapter")
