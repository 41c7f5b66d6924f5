"""Mesh-axis bookkeeping for code that runs inside ``shard_map``.

Inside ``shard_map`` every value's type says over which mesh axes it varies from
device to device. ``lax.cond`` needs both branches to vary over the same axes, and a
custom VJP must hand back a cotangent varying over exactly the axes of its primal.
These helpers are the only place jaxmp reads or changes that type (the abstract
value's ``manual_axis_type`` and ``jax.lax.pcast``, named so from jax 0.9; jaxmp needs
jax >= 0.10.2). Outside ``shard_map`` every set is empty and they are no-ops.

Example:
  >>> from jaxmp._src import sharding
  >>> sharding.varying_axes(jnp.ones(2))
  frozenset()
  >>> sharding.varying_axes(jax.eval_shape(lambda: jnp.ones(2)))  # a ShapeDtypeStruct
  frozenset()
"""

from __future__ import annotations

from typing import Any

import jax


def varying_axes(x: Any) -> frozenset:
  """The ``shard_map`` mesh axes ``x`` (an array, tracer or ShapeDtypeStruct) varies over."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  manual = aval.manual_axis_type  # None: a ShapeDtypeStruct that names no mesh axes
  return frozenset() if manual is None else frozenset(manual.varying)


def make_varying(x: jax.Array, axes: Any) -> jax.Array:
  """``x`` marked as varying over ``axes`` too (those it does not vary over yet)."""
  missing = tuple(sorted(frozenset(axes) - varying_axes(x), key=str))
  if not missing:
    return x
  return jax.lax.pcast(x, missing, to="varying")


def like_primal(ct: jax.Array, primal_axes: frozenset, reduce: Any) -> jax.Array:
  """``ct`` made to vary over exactly the mesh axes its primal varies over.

  Inside ``shard_map`` an operand replicated over an axis (a kernel, the fp8 state)
  meets per-device data, so its cotangent comes out per device; a custom VJP must
  hand back a cotangent of its primal's type. ``reduce`` combines it over the extra
  axes: ``psum`` for the operand gradients, as JAX's own transpose of the implicit
  broadcast does for a plain ``dot_general``, and ``pmax`` for the fp8 state, whose
  new amaxes are maxima (the amax of the whole global batch). Axes the primal varies
  over and the cotangent does not are added (:func:`make_varying`).
  """
  extra = tuple(sorted(varying_axes(ct) - primal_axes, key=str))
  if extra:
    ct = reduce(ct, extra)
  return make_varying(ct, primal_axes)


__all__ = ("like_primal", "make_varying", "varying_axes")
