"""Turning fp8 on inside existing Flax linen layers, with no change to their code.

:func:`jaxmp.linen.mixed_precision` calls :func:`fp8_call` for every module call whose
rule carries an fp8 recipe. What "fp8" means depends on the layer:

* ``nn.Dense`` and ``nn.DenseGeneral``: their ``dot_general_cls`` is set, for this call
  only, to :class:`~jaxmp.linen.Fp8DotGeneral` with the rule's recipe; the layer creates
  it as a child (``Fp8DotGeneral_0``) whose state lives in ``_overwrite_with_gradient``.
* ``nn.MultiHeadDotProductAttention`` (and ``nn.SelfAttention``): its
  ``qkv_dot_general_cls`` and ``out_dot_general_cls`` are set the same way, so the
  four projections run in fp8; the attention-score einsums keep the compute dtype.
* ``nn.Einsum``: it has no dot_general hook, so its computation is done here instead,
  exactly as ``nn.Einsum.__call__`` does it but with the product computed by a child
  :class:`~jaxmp.linen.Fp8Einsum` (``Fp8Einsum_0``).

Any other layer has no matmul jaxmp can put in fp8; :func:`supports_fp8` says which.
Flax's lifted transforms (``nn.scan``, ``nn.RNN``'s scan, ``nn.vmap``, ``nn.remat``...)
pass the fp8 state on wherever they pass the params (``jaxmp._src.linen.lifted``).
A layer the user already gave a custom dot_general is not overridden: that is an error.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax.linen import module as linen_module

from jaxmp._src import adapter as adapter_lib
from jaxmp._src.fp8 import recipes as recipes_lib
from jaxmp._src.linen import fp8 as fp8_linen

_MISSING = object()

# Per layer class: the (dot_general_cls field, dot_general field) pairs fp8 replaces.
_DOT_GENERAL_FIELDS = (
    (nn.MultiHeadDotProductAttention, (("qkv_dot_general_cls", "qkv_dot_general"),
                                       ("out_dot_general_cls", "out_dot_general"))),
    (nn.DenseGeneral, (("dot_general_cls", "dot_general"),)),
    (nn.Dense, (("dot_general_cls", "dot_general"),)),
)

FP8_LAYER_TYPES: tuple[type, ...] = (
    nn.Dense, nn.DenseGeneral, nn.MultiHeadDotProductAttention, nn.Einsum)
"""The linen layers a rule's fp8 recipe applies to."""

FP8_MODULE_TYPES: tuple[type, ...] = (fp8_linen.Fp8DotGeneral, fp8_linen.Fp8Einsum)
"""jaxmp's own fp8 modules, which the precision interceptor leaves alone."""


def supports_fp8(module_type: type) -> bool:
  """Whether a rule's fp8 recipe can turn ``module_type``'s matmuls into fp8."""
  return issubclass(module_type, FP8_LAYER_TYPES)


@contextlib.contextmanager
def instance_attribute(module: nn.Module, name: str, value: Any) -> Iterator[None]:
  """Shadows ``module.name`` on this instance only; restores what was there after.

  Flax modules are frozen dataclasses, so the attribute is written past their
  ``__setattr__``; the previous value (a dataclass field, or nothing) comes back in
  ``finally`` even when the call raises.
  """
  previous = module.__dict__.get(name, _MISSING)
  object.__setattr__(module, name, value)
  try:
    yield
  finally:
    if previous is _MISSING:
      object.__delattr__(module, name)
    else:
      object.__setattr__(module, name, previous)


def _is_jaxmp_fp8(cls: Any) -> bool:
  func = cls.func if isinstance(cls, functools.partial) else cls
  return isinstance(func, type) and issubclass(func, FP8_MODULE_TYPES)


def _dot_general_fields(module: nn.Module):
  for layer_type, fields in _DOT_GENERAL_FIELDS:
    if isinstance(module, layer_type):
      return fields
  return ()


def _check_no_custom_dot_general(module: nn.Module, cls_field: str, fn_field: str) -> bool:
  """False where the layer already runs jaxmp fp8; raises where it has its own."""
  cls, fn = getattr(module, cls_field), getattr(module, fn_field)
  if cls is not None and _is_jaxmp_fp8(cls):
    return False
  if cls is not None or fn is not None:
    adapter_lib.refuse_custom_product(type(module), "/".join(module.path),
                                      cls_field if cls is not None else fn_field, cls or fn)
  return True


def _fp8_einsum_call(module: nn.Einsum, recipe: recipes_lib.Recipe, inputs,
                     einsum_str=None):
  # nn.Einsum.__call__, step for step, with the product computed in fp8.
  einsum_str = linen_module.merge_param("einsum_str", module.einsum_str, einsum_str)
  einsum_str = einsum_str.replace(" ", "")
  if "->" not in einsum_str:
    raise ValueError('`einsum_str` equation must be explicit and include "->".')
  if einsum_str.count(",") != 1:
    raise ValueError("`einsum_str` equation must have exactly two operands and therefore, "
                     f"exactly one comma character, instead of {einsum_str.count(',')}")
  kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
  bias = broadcast_shape = None
  if module.use_bias:
    bias_shape, broadcast_shape = module._get_bias_shape(einsum_str, inputs, kernel)  # pylint: disable=protected-access
    bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
  inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
  # Flax types promote_dtype's results as Optional (for the bias); these two are arrays.
  y = fp8_linen.Fp8Einsum(recipe=recipe)(
      einsum_str, inputs, kernel,  # pyright: ignore[reportArgumentType]
      preferred_element_type=module.preferred_element_type)
  if bias is not None:
    y += jnp.reshape(bias, broadcast_shape)
  return y


def fp8_call(module: nn.Module, recipe: recipes_lib.Recipe,
             next_fun: Callable[..., Any]) -> Callable[..., Any]:
  """``next_fun`` (the layer's method) made to compute its matmuls in fp8.

  Args:
    module: the bound layer being called; :func:`supports_fp8` must hold for its type.
    recipe: the fp8 recipe.
    next_fun: the layer's method as the interceptor received it.

  Returns:
    A function with ``next_fun``'s signature.

  Raises:
    ValueError: if the layer already has a custom dot_general of its own.
  """
  if isinstance(module, nn.Einsum):
    return functools.partial(_fp8_einsum_call, module, recipe)
  fp8_cls = functools.partial(fp8_linen.Fp8DotGeneral, recipe=recipe)
  fields = [cls_field for cls_field, fn_field in _dot_general_fields(module)
            if _check_no_custom_dot_general(module, cls_field, fn_field)]

  def call(*args, **kwargs):
    with contextlib.ExitStack() as stack:
      for field in fields:
        stack.enter_context(instance_attribute(module, field, fp8_cls))
      return next_fun(*args, **kwargs)

  return call


__all__ = (
    "FP8_LAYER_TYPES",
    "FP8_MODULE_TYPES",
    "fp8_call",
    "instance_attribute",
    "supports_fp8",
)
