"""Argument checks shared by every public function: one rule for each kind of mistake.

A value of the wrong *type* (a string where a number goes, an integer array where a
bool goes) raises ``TypeError``; a value of the right type but a wrong *value or
shape* (a negative scale, an array where a scalar goes) raises ``ValueError``. Every
message names the function, the argument, what it got and what is accepted.

Example:
  >>> from jaxmp._src import checks
  >>> checks.real_number(2, "growth_factor", where="DynamicLossScale")
  2.0
  >>> checks.real_number("2", "growth_factor", where="DynamicLossScale")
  Traceback (most recent call last):
  ...
  TypeError: DynamicLossScale: growth_factor must be a real number, got '2'.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.core
import numpy as np
import optax

from jaxmp._src import dtypes as dtypes_lib


def is_traced(value: Any) -> bool:
  """Whether ``value`` is a tracer (inside ``jit``, ``grad``, ``vmap``...)."""
  return isinstance(value, jax.core.Tracer)


def scalar_shape(value: Any, name: str, *, where: str) -> None:
  """Raises ``ValueError`` unless ``value`` has shape ``()``."""
  shape = np.shape(value)
  if shape != ():
    raise ValueError(f"{where}: {name} must be a scalar, got an array of shape {shape}.")


def is_real_dtype(dtype: Any) -> bool:
  """Whether ``dtype`` is a floating-point or integer dtype (not bool)."""
  return dtypes_lib.is_float_dtype(dtype) or (
      np.issubdtype(np.dtype(dtype), np.integer) if _is_numpy_dtype(dtype) else False)


def _is_numpy_dtype(dtype: Any) -> bool:
  try:
    np.dtype(dtype)
  except TypeError:
    return False
  return True


def real_number(value: Any, name: str, *, where: str) -> float:
  """``value`` as a Python float, for a concrete real scalar.

  Raises:
    TypeError: for a bool, ``None``, a string, a traced value or a non-real dtype.
    ValueError: for an array that is not a scalar.
  """
  if isinstance(value, (bool, np.bool_)) or value is None or isinstance(value, str):
    raise TypeError(f"{where}: {name} must be a real number, got {value!r}.")
  if is_traced(value):
    raise TypeError(
        f"{where}: {name} must be a concrete number (it is a static hyperparameter), "
        f"got a traced value {value!r}.")
  try:
    array = np.asarray(value)
  except (TypeError, ValueError) as e:
    raise TypeError(f"{where}: {name} must be a real number, got {value!r}.") from e
  scalar_shape(array, name, where=where)
  if array.dtype == object or not is_real_dtype(array.dtype):
    raise TypeError(f"{where}: {name} must be a real number, got {value!r} of dtype "
                    f"{array.dtype}.")
  return float(array)


def real_scalar_array(value: Any, name: str, *, where: str) -> Any:
  """``value`` unchanged if it is a real scalar: a number or a scalar array, maybe traced.

  Raises:
    TypeError: for a bool, ``None``, a string, another object or a non-real dtype.
    ValueError: for an array that is not a scalar.
  """
  if (value is None or isinstance(value, (bool, np.bool_, str))
      or not (isinstance(value, (int, float, np.number)) or hasattr(value, "dtype"))):
    raise TypeError(f"{where}: {name} must be a real number or a scalar array, got "
                    f"{value!r} of type {type(value).__name__}.")
  dtype = getattr(value, "dtype", None)
  if dtype is None:
    dtype = np.result_type(value)
  if not is_real_dtype(dtype):
    raise TypeError(f"{where}: {name} must be real, got dtype {dtype}.")
  scalar_shape(value, name, where=where)
  return value


def bool_scalar(value: Any, name: str, *, where: str) -> Any:
  """``value`` if it is a Python/NumPy bool or a ``bool[]`` array (maybe traced).

  Raises:
    TypeError: for an integer 0/1, a float or anything not boolean (say
      ``jnp.asarray(x, bool)`` if that is what you mean).
    ValueError: for a boolean array that is not a scalar.
  """
  if isinstance(value, (bool, np.bool_)):
    return value
  dtype = getattr(value, "dtype", None)
  if dtype is None or np.dtype(dtype) != np.dtype(bool):
    described = f"dtype {dtype}" if dtype is not None else f"type {type(value).__name__}"
    raise TypeError(f"{where}: {name} must be a scalar bool (e.g. jaxmp.all_finite(grads)), "
                    f"got {described}.")
  if np.shape(value) != ():
    raise ValueError(f"{where}: {name} must be a scalar bool, got an array of shape "
                     f"{np.shape(value)}; reduce it first, e.g. with jnp.all.")
  return value


def flag(value: Any, name: str, *, where: str) -> bool:
  """``value`` as a bool, for a Python or NumPy bool.

  Raises:
    TypeError: for anything else (``1``, ``"yes"``): a flag is never guessed at.
  """
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{where}: {name} must be True or False, got {value!r} of type "
                    f"{type(value).__name__}.")
  return bool(value)


def positive_int(value: Any, name: str, *, where: str, minimum: int = 1,
                 maximum: int | None = None) -> int:
  """``value`` as an int in ``[minimum, maximum]``.

  Raises:
    TypeError: for a bool or a non-integer.
    ValueError: for an integer out of range.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{where}: {name} must be an integer >= {minimum}, got {value!r} of type "
                    f"{type(value).__name__}.")
  value = int(value)
  if value < minimum or (maximum is not None and value > maximum):
    bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
    raise ValueError(f"{where}: {name} must be an integer {bound}, got {value}.")
  return value


def host_values(tree: Any, name: str, *, where: str, fix: str) -> None:
  """Raises ``TypeError`` if a leaf of ``tree`` is traced: ``where`` reads values on the host.

  Args:
    tree: what ``where`` was given (any pytree).
    name: what it is, for the message (``"the trace"``).
    where: the host-side function.
    fix: what to return from the jitted step instead, for the message.
  """
  if any(is_traced(leaf) for leaf in jax.tree_util.tree_leaves(tree)):
    raise TypeError(
        f"{where} reads {name} on the host, after the step: it cannot run inside jit (or "
        f"grad, vmap), and got traced values. Return {fix} from the jitted step and call "
        f"{where} on what the step returned.")


class CheckedRecord:
  """A mixin for a ``NamedTuple`` subclass whose ``__new__`` checks its fields.

  ``NamedTuple``'s ``_make`` (and so ``_replace``) builds the tuple without calling the
  class, which would let a record be changed into one its constructor refuses; with
  this mixin first among the bases, both go through the constructor.

  Example:
    >>> from typing import NamedTuple
    >>> from jaxmp._src import checks
    >>> class _Fields(NamedTuple):
    ...   count: int
    >>> class Count(checks.CheckedRecord, _Fields):
    ...   def __new__(cls, count):
    ...     return super().__new__(cls, checks.positive_int(count, "count", where="Count"))
    >>> Count(2)._replace(count=0)
    Traceback (most recent call last):
    ...
    ValueError: Count: count must be an integer >= 1, got 0.
  """

  __slots__ = ()

  @classmethod
  def _make(cls, iterable: Any) -> Any:
    return cls(*iterable)


def gradient_transformation(inner: Any, name: str, *,
                            where: str) -> optax.GradientTransformationExtraArgs:
  """``inner`` with extra-args support, for an optimizer a jaxmp transform wraps.

  An ``optax.MultiSteps`` is unwrapped into its gradient transformation.

  Raises:
    TypeError: if ``inner`` is not an ``optax.GradientTransformation``; for an
      uncalled optimizer factory (``optax.adam``) the message names the call meant.
  """
  if isinstance(inner, optax.MultiSteps):
    inner = inner.gradient_transformation()
  if isinstance(inner, optax.GradientTransformation):
    return optax.with_extra_args_support(inner)
  hint = ""
  if callable(inner):
    factory = getattr(inner, "__name__", type(inner).__name__)
    hint = f" (did you mean to call {factory}, e.g. optax.adam(1e-3) rather than optax.adam?)"
  raise TypeError(f"{where}: {name} must be an optax.GradientTransformation (or "
                  f"optax.MultiSteps), got {inner!r} of type {type(inner).__name__}{hint}.")


__all__ = (
    "CheckedRecord",
    "bool_scalar",
    "flag",
    "gradient_transformation",
    "host_values",
    "is_real_dtype",
    "is_traced",
    "positive_int",
    "real_number",
    "real_scalar_array",
    "scalar_shape",
)
