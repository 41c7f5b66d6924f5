"""Functions of JAX and Flax swapped for jaxmp's own while a wrapped model runs.

Some of what jaxmp does to a model it did not write can only be done where the model's
code looks a function up: the float32 op list replaces ``jax.nn.softmax`` and its kin
(:mod:`jaxmp._src.float32_ops`), the linen adapter Flax's ``flax.core.lift.pack``
(``jaxmp._src.linen.lifted``). A :class:`Swap` puts the replacements in place when the
first wrapped call starts and the originals back when the last one ends, even when it
raises; entries from several threads or nested calls count. The replacements
themselves decide, per thread, whether to act (a thread not running a wrapped model
gets the original behaviour), so outside a wrapped model JAX and Flax are untouched.

Example:
  >>> import types
  >>> host = types.SimpleNamespace(f=lambda: "original")
  >>> swap = Swap(lambda: [(host, "f", lambda: "replaced")])
  >>> with swap.installed():
  ...   print(host.f())
  replaced
  >>> host.f()
  'original'
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any


class Swap:
  """Attributes of modules replaced while any thread is inside :meth:`installed`.

  Args:
    replacements: called at each first entry, returns ``(module, attribute, new
      value)`` triples; the value there then is the original put back at the last exit.
  """

  def __init__(self, replacements: Callable[[], Iterable[tuple[Any, str, Any]]]):
    self._replacements = replacements
    self._lock = threading.Lock()
    self._depth = 0
    self._originals: list[tuple[Any, str, Any]] = []

  @contextlib.contextmanager
  def installed(self) -> Iterator[None]:
    """Puts the replacements in place for the duration (nested entries count)."""
    with self._lock:
      if self._depth == 0:
        for module, name, value in self._replacements():
          self._originals.append((module, name, getattr(module, name)))
          setattr(module, name, value)
      self._depth += 1
    try:
      yield
    finally:
      with self._lock:
        self._depth -= 1
        if self._depth == 0:
          while self._originals:
            module, name, original = self._originals.pop()
            setattr(module, name, original)


__all__ = ("Swap",)
