"""Module paths: how messages name a module, and which module owns a variable.

A module of a wrapped model is named by its path from the model, '/'-joined
(``"block_1/mlp/down"``); the model itself has the path ``""``, which messages show as
:data:`ROOT`. A variable's path continues its module's (``("block", "dense",
"kernel")``), so the module that owns it is the nearest one whose path is a proper
prefix of it (:func:`owner`). The engine, the non-finite trace, the adapters and the
tools all name modules this way; it lives here, below all of them.

Example:
  >>> from jaxmp._src import paths
  >>> paths.describe_path(""), paths.describe_path("block_1/mlp")
  ('<root>', 'block_1/mlp')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")

ROOT = "<root>"
"""How messages and tables name the root module, whose path is ``""``."""


def describe_path(path: str) -> str:
  """``path`` as messages show it: the root module is :data:`ROOT`."""
  return path or ROOT


def owner(path: tuple, by_path: Mapping[tuple, T]) -> T | None:
  """The entry of the nearest module strictly enclosing ``path`` (a variable's path).

  Example:
    >>> from jaxmp._src import paths
    >>> paths.owner(("block", "dense", "kernel"), {(): "root", ("block",): "block"})
    'block'
  """
  for end in range(len(path) - 1, -1, -1):
    if path[:end] in by_path:
      return by_path[path[:end]]
  return None


__all__ = ("ROOT", "describe_path", "owner")
