"""Canonical GEMM operands: any ``dot_general`` operand as a ``(batch, rows, contracted)`` array.

Scaling granularities are defined along a GEMM's contracted dimension ("one scale per
row of the operand along the contracted dimension", "32 consecutive elements along
the contracted dimension"). For a ``dot_general`` with several batch, free or
contracting dimensions that means: transpose the operand to ``batch + free +
contracting`` (batch and contracting dimensions in the order the dimension numbers
list them, free dimensions in their own order) and flatten each group, giving
``(B, R, C)``. Both operands of one GEMM then contract their last axis, which is also
the layout fp8 GEMMs want (cuBLASLt's fp8 GEMM reads both operands K-major), and the
product ``(B, M, N)`` reshapes to ``dot_general``'s output (batch, lhs free, rhs free).

The transposed products of the backward pass are the same canonical arrays with their
last two axes swapped: the input gradient contracts the output gradient ``(B, M, N)``
with the kernel as ``(B, K, N)``, the weight gradient the output gradient as ``(B, N,
M)`` with the input as ``(B, K, M)``; each result maps back to its operand's layout
with :meth:`Layout.from_canonical`.

Example:
  >>> from jaxmp._src.fp8 import layout
  >>> lhs = layout.Layout.of((2, 3, 4), contract=(2,), batch=(0,))
  >>> lhs.to_canonical(jnp.zeros((2, 3, 4))).shape, lhs.rows, lhs.contracted
  ((2, 3, 4), 3, 4)
  >>> rhs = layout.Layout.of((4, 5, 6), contract=(0, 2), batch=())
  >>> rhs.to_canonical(jnp.zeros((4, 5, 6))).shape
  (1, 5, 24)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Layout(NamedTuple):
  """How one ``dot_general`` operand maps to and from ``(B, R, C)``.

  Attributes:
    shape: the operand's shape.
    perm: the transpose to ``batch + free + contracting`` order.
    batch_shape: the batch dimensions' sizes, in dimension-number order.
    free_shape: the free dimensions' sizes, in their own order.
    contract_shape: the contracting dimensions' sizes, in dimension-number order.
  """

  shape: tuple
  perm: tuple
  batch_shape: tuple
  free_shape: tuple
  contract_shape: tuple

  @classmethod
  def of(cls, shape: Sequence[int], contract: Sequence[int], batch: Sequence[int]) -> Layout:
    """The layout of an operand of ``shape`` with these contracting and batch dimensions."""
    shape = tuple(int(d) for d in shape)
    free = tuple(i for i in range(len(shape)) if i not in contract and i not in batch)
    perm = tuple(batch) + free + tuple(contract)
    return cls(shape, perm, tuple(shape[i] for i in batch), tuple(shape[i] for i in free),
               tuple(shape[i] for i in contract))

  @property
  def batch(self) -> int:
    return math.prod(self.batch_shape)

  @property
  def rows(self) -> int:
    return math.prod(self.free_shape)

  @property
  def contracted(self) -> int:
    return math.prod(self.contract_shape)

  def to_canonical(self, x: jax.Array) -> jax.Array:
    """``x`` as ``(B, R, C)``."""
    return jnp.reshape(jnp.transpose(x, self.perm), (self.batch, self.rows, self.contracted))

  def from_canonical(self, x: jax.Array) -> jax.Array:
    """A ``(B, R, C)`` array (say a gradient) back in the operand's own layout."""
    x = jnp.reshape(x, self.batch_shape + self.free_shape + self.contract_shape)
    return jnp.transpose(x, tuple(int(i) for i in np.argsort(self.perm)))


def output_shape(lhs: Layout, rhs: Layout) -> tuple:
  """The shape of ``dot_general(lhs, rhs)``: batch, lhs free, rhs free."""
  return lhs.batch_shape + lhs.free_shape + rhs.free_shape


def swap(x: jax.Array) -> jax.Array:
  """``(B, R, C)`` -> ``(B, C, R)``: the operand as the other GEMM of the backward pass reads it."""
  return jnp.swapaxes(x, 1, 2)


__all__ = ("Layout", "output_shape", "swap")
