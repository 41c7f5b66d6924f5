"""Immutable pytree objects: frozen attributes, equality by value, copy and pickle.

jaxmp's loss scales are registered pytree classes whose attributes cannot be set (a
new object comes from ``adjust`` or the constructor). :class:`Immutable` gives such a
class the rest of what a value needs:

* ``copy.copy``, ``copy.deepcopy`` and ``pickle`` rebuild the object from its pytree
  children and aux data (the default protocol would set attributes one by one, which
  the frozen ``__setattr__`` refuses);
* ``==`` compares by value: the same class, equal aux data (the static
  hyperparameters) and equal leaves. Concrete leaves (JAX or NumPy arrays, numbers)
  are equal when their values are (``np.array_equal``, so the shapes must match and
  NaN is not equal to itself); a traced leaf equals only itself, since its value is
  unknown; other leaves (``None``, ``jax.ShapeDtypeStruct``) compare with ``==``;
* ``hash`` is of the class and the aux data alone, so it never reads a device value
  and equal objects always hash equally.

Only for pytrees whose public constructor checks and converts its arguments (the loss
scales, ``NonfiniteTrace``); any other immutable pytree is a NamedTuple or a frozen
dataclass registered with ``jax.tree_util.register_dataclass`` (CONTRIBUTING.md).
``register_dataclass`` and ``flax.struct`` unflatten by calling the class with its
fields as keywords, and JAX and Orbax unflatten with tracers, abstract values,
``None`` and shardings as leaves: a constructor that checks them would refuse them, and
one that takes them unchecked would change the public constructor (``scale=``, checked,
becomes ``loss_scale=``, unchecked; the field keeps its name, the key path Orbax
stores it under).

Example:
  >>> import copy, pickle
  >>> ls = jaxmp.DynamicLossScale(1024.0, growth_interval=4)
  >>> copy.deepcopy(ls) == ls, pickle.loads(pickle.dumps(ls)) == ls
  (True, True)
  >>> ls == ls.adjust(False), hash(ls) == hash(ls.adjust(False))
  (False, True)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.core
import numpy as np


def _rebuild(cls: type, aux: Any, children: tuple) -> Any:
  return cls._tree_unflatten(aux, children)


def _is_concrete(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex)) and not (
      isinstance(x, jax.core.Tracer))


def leaves_equal(a: Any, b: Any) -> bool:
  """Whether two pytree leaves are equal by value (see the module docstring).

  Example:
    >>> from jaxmp._src import pytree
    >>> pytree.leaves_equal(jnp.float32(2.0), np.array(2.0)), pytree.leaves_equal(None, None)
    (True, True)
  """
  if a is b:
    return True
  if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
    return False
  if _is_concrete(a) and _is_concrete(b):
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))
  if _is_concrete(a) or _is_concrete(b):
    return False
  return bool(a == b)


class Immutable:
  """A base for registered pytree classes whose instances are immutable values.

  A subclass implements ``_tree_flatten(self) -> (children, aux)`` and the classmethod
  ``_tree_unflatten(cls, aux, children)`` (the functions it registers with JAX), and
  sets its fields with ``object.__setattr__``.

  Example:
    >>> jaxmp.StaticLossScale(2.0) == jaxmp.StaticLossScale(np.float16(2.0))
    True
  """

  __slots__ = ()

  _IMMUTABLE_HINT = "build a new one instead"

  def __setattr__(self, name, value):
    raise AttributeError(f"{type(self).__name__} is immutable; {self._IMMUTABLE_HINT}.")

  def __delattr__(self, name):
    raise AttributeError(f"{type(self).__name__} is immutable.")

  def _tree_flatten(self) -> tuple[tuple, Any]:
    raise NotImplementedError

  @classmethod
  def _tree_unflatten(cls, aux: Any, children: Any) -> Any:
    raise NotImplementedError

  def __reduce__(self):
    children, aux = self._tree_flatten()
    return _rebuild, (type(self), aux, tuple(children))

  def __eq__(self, other: Any) -> bool:
    if type(self) is not type(other):
      return NotImplemented
    children, aux = self._tree_flatten()
    other_children, other_aux = other._tree_flatten()
    return aux == other_aux and len(children) == len(other_children) and all(
        leaves_equal(a, b) for a, b in zip(children, other_children))

  def __hash__(self) -> int:
    return hash((type(self), self._tree_flatten()[1]))


__all__ = ("Immutable", "leaves_equal")
