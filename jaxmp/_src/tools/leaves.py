"""Named floating-point leaves of a pytree, for reports that list values by path.

Example:
  >>> from jaxmp._src.tools import leaves
  >>> [(path, x.shape) for path, x in leaves.float_leaves({"a": {"w": jnp.ones(2)}, "n": 3})]
  [(('a', 'w'), (2,))]
"""

from __future__ import annotations

from typing import Any

import jax

from jaxmp._src import paths as paths_lib
from jaxmp._src import tree as tree_lib

ROOT = paths_lib.ROOT


def _key_name(key: Any) -> str:
  for attribute in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def float_leaves(tree: Any) -> list[tuple[tuple[str, ...], jax.Array]]:
  """The floating-point array leaves of ``tree`` with their paths as name tuples.

  A box around one value (:func:`jaxmp._src.tree.is_box`: an ``nnx.Variable``) counts
  as one leaf (its value), so an ``nnx.State`` of gradients gives paths such as
  ``("linear", "kernel")``, not ``(..., "value")``. Integer, bool, PRNG-key and
  non-array leaves are left out.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=tree_lib.is_box)
  leaves = []
  for path, leaf in flat:
    leaf = tree_lib.unbox(leaf)
    if tree_lib.is_float_array(leaf):
      leaves.append((tuple(_key_name(k) for k in path), leaf))
  return leaves


def path_names(leaves: list[tuple[tuple[str, ...], Any]]) -> list[str]:
  """'/'-joined, unique names: ``ROOT`` for a bare array, an index for clashes."""
  names: list[str] = []
  seen: set[str] = set()
  for path, _ in leaves:
    name = "/".join(path) or ROOT
    if name in seen:  # e.g. dict keys 1 and "1"
      name = f"{name}#{len(names)}"
    seen.add(name)
    names.append(name)
  return names



__all__ = ("ROOT", "float_leaves", "path_names")
