"""Kahan-compensated updates of 16-bit params: what rounding loses is added back later.

Round-to-nearest loses every update smaller than half an ulp of the param. Kahan
summation keeps what each addition lost in a compensation ``c`` (the same dtype and
shape as the param) and subtracts it from the next update (Zamirai et al.,
"Revisiting BFloat16 Training", arXiv 2010.06192). For a param ``p``, update ``u``:

  y = u - c;   t = round(p + y);   c = (t - p) - y;   p = t

``y`` and ``c`` are computed in float32 (``t - p`` of two bfloat16 values is exact
there) and ``c`` is stored rounded to the param's dtype. A run of updates too small
to move ``p`` accumulates in ``-c`` until their sum crosses half an ulp; then ``p``
moves by an ulp and ``c`` keeps the excess. 1000 updates of ``1e-4`` leave a
bfloat16 ``1.0`` at ``1.0`` with round-to-nearest and take it to about ``1.1`` with
compensation.

:func:`kahan_summation` is the Optax transform. It wraps the optimizer,
``kahan_summation(inner)``, takes ``inner``'s update ``u`` of each 16-bit param and
returns the float32 update that ``optax.apply_updates`` turns ``p`` into ``t`` by
(see :mod:`jaxmp._src.optim.base`, and there why it wraps rather than chains).
Params in other dtypes get ``inner``'s updates unchanged.

Example:
  >>> p, c = jnp.bfloat16(1.0), jnp.bfloat16(0.0)
  >>> for _ in range(1000):
  ...   p, c = jaxmp.optim.kahan_add(p, jnp.float32(1e-4), c)
  >>> p, (jnp.bfloat16(1.0) + jnp.float32(1e-4)).astype(jnp.bfloat16)
  (Array(1.10156, dtype=bfloat16), Array(1, dtype=bfloat16))
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._src import checks
from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src.optim import base

_WHERE = "kahan_summation"


def kahan_add(param: jax.Array, update: jax.Array,
              compensation: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Adds ``update`` to a 16-bit ``param`` with Kahan compensation.

  Args:
    param: a bfloat16 or float16 array.
    update: the update to add, in ``param``'s shape (any float dtype; used in float32).
    compensation: the compensation from the last call (zeros at first), in
      ``param``'s dtype and shape.

  Returns:
    ``(new_param, new_compensation)``, both in ``param``'s dtype: see the module
    docstring for the algorithm.

  Raises:
    TypeError: if ``param`` is not 16-bit float, ``compensation``'s dtype differs, or
      ``update`` is not a floating-point array.
    ValueError: if ``compensation``'s or ``update``'s shape differs from ``param``'s.

  Example:
    >>> jaxmp.optim.kahan_add(jnp.bfloat16(1.0), jnp.float32(1e-3), jnp.bfloat16(0.0))
    (Array(1, dtype=bfloat16), Array(-0.000999451, dtype=bfloat16))
  """
  dtype = getattr(param, "dtype", None)
  if dtype is None or np.dtype(dtype) not in base.HALF_DTYPES:
    raise TypeError(f"kahan_add: param must be a bfloat16 or float16 array, got "
                    f"{'dtype ' + np.dtype(dtype).name if dtype is not None else repr(param)}.")
  if getattr(compensation, "dtype", None) != dtype:
    raise TypeError(f"kahan_add: compensation must have the param's dtype {np.dtype(dtype).name},"
                    f" got {getattr(compensation, 'dtype', type(compensation).__name__)}.")
  if np.shape(compensation) != np.shape(param):
    raise ValueError(f"kahan_add: compensation has shape {np.shape(compensation)}, the param "
                     f"{np.shape(param)}; they must match.")
  update_dtype = getattr(update, "dtype", None)
  if update_dtype is None or not dtypes_lib.is_float_dtype(update_dtype):
    raise TypeError(f"kahan_add: update must be a floating-point array (any float dtype), "
                    f"got {update!r} of type {type(update).__name__}.")
  if np.shape(update) != np.shape(param):
    raise ValueError(f"kahan_add: update has shape {np.shape(update)}, the param "
                     f"{np.shape(param)}; they must match (one update per param element).")
  p32 = param.astype(base.ARITHMETIC)
  y = update.astype(base.ARITHMETIC) - compensation.astype(base.ARITHMETIC)
  # The rounding must really happen: XLA on GPUs may otherwise keep p32 + y in
  # float32, and the compensation, which is that rounding's error, would be lost.
  landed = dtypes_lib.rounded_to(p32 + y, dtype)
  return landed.astype(dtype), ((landed - p32) - y).astype(dtype)


class KahanState(NamedTuple):
  """The state of :func:`kahan_summation`.

  Attributes:
    compensation: a tree like the params: for each 16-bit param, what rounding has
      lost so far (negated), in the param's dtype and shape; ``None`` for the others.
    inner_state: the wrapped optimizer's state.

  Example:
    >>> import optax
    >>> state = jaxmp.optim.kahan_summation(optax.sgd(0.1)).init({"w": jnp.ones(2, jnp.bfloat16)})
    >>> state.compensation
    {'w': Array([0, 0], dtype=bfloat16)}
  """

  compensation: Any
  inner_state: optax.OptState


def kahan_summation(
    inner: optax.GradientTransformation | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` and adds its updates to 16-bit params with Kahan compensation.

  Each ``update`` runs ``inner`` on the gradients and the 16-bit params as they are,
  then turns its update of each 16-bit param into the one that makes
  ``optax.apply_updates`` land on the compensated sum (see the module docstring).
  Pass the updates straight to ``optax.apply_updates``: a transform that rescaled them
  (one chained after this, say) would undo the compensation, which is why this wraps
  the optimizer instead of being chained after it.

  Args:
    inner: the optimizer whose updates are added: any ``optax.GradientTransformation``
      (or ``optax.MultiSteps``), e.g. ``jaxmp.optim.state_dtypes(optax.adamw(1e-3),
      "bfloat16")``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`KahanState`.
    ``update(updates, state, params, **extra_args)`` needs the params; it returns
    float32 updates for the 16-bit params and ``inner``'s updates of the others.

  Raises:
    TypeError: if ``inner`` is missing (``kahan_summation()``, the form this replaced,
      chained after the optimizer) or not a gradient transformation.
    ValueError: from ``init``/``update``, if no param is bfloat16 or float16; from
      ``update``, if ``params`` is ``None``.

  Example:
    >>> import optax
    >>> tx = jaxmp.optim.kahan_summation(optax.sgd(1e-4))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> for _ in range(1000):
    ...   updates, state = tx.update({"w": -jnp.ones(2, jnp.bfloat16)}, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params["w"]
    Array([1.10156, 1.10156], dtype=bfloat16)
  """
  if inner is None:
    raise TypeError(
        f"{_WHERE}: inner, the optimizer, is missing; kahan_summation wraps the optimizer, "
        "kahan_summation(inner): chained after it, any transform in between would undo "
        "the compensation.")
  inner = checks.gradient_transformation(inner, "inner", where=_WHERE)

  def select(params):
    return base.select_leaves(params, base.HALF_DTYPES, _WHERE, "compensates updates of",
                              "Params already in float32 need no compensation here.")

  def init_fn(params):
    mask = select(params)
    return KahanState(compensation=base.map_selected(jnp.zeros_like, mask, params,
                                                     otherwise=lambda p: None),
                      inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    params = base.require_params(params, _WHERE)
    mask = select(params)
    updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    added = base.map_selected(kahan_add, mask, params, updates, state.compensation,
                              otherwise=lambda p, u, c: None)
    new_updates = base.map_selected(lambda p, a, u: base.update_to(p, a[0]), mask, params,
                                    added, updates, otherwise=lambda p, a, u: u)
    compensation = base.map_selected(lambda a: a[1], mask, added, otherwise=lambda a: None)
    return new_updates, KahanState(compensation=compensation, inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


__all__ = (
    "KahanState",
    "kahan_add",
    "kahan_summation",
)
