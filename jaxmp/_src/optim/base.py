"""What the :mod:`jaxmp.optim` transforms share: leaf selection, and landing on a target.

Every transform here writes 16-bit params (bfloat16, float16) more carefully than
``optax.apply_updates`` would on its own: it decides the *new* 16-bit value ``t`` of
each param itself (rounded from an fp32 master, stochastically rounded, or
Kahan-compensated) and returns the update ``u = float32(t) - float32(p)``, so that the
user's usual ``optax.apply_updates(params, updates)`` (``(p + u).astype(p.dtype)``,
computed in float32 because ``u`` is float32) lands on ``t``.

So the updates must reach ``optax.apply_updates`` as they are: a transform that
rescaled them afterwards would land each param elsewhere (``optax.chain(kahan,
optax.sgd(lr))`` would train exactly like round-to-nearest). That is why every
transform here wraps the optimizer whose updates it writes (``master_weights(inner)``,
``stochastic_rounding(inner, key)``, ``kahan_summation(inner)``) instead of being
chained after it; only wrappers that pass updates through or zero them
(``jaxmp.loss_scaling``, ``optax.MultiSteps``, ``optax.apply_if_finite``) belong
outside.

When is that exact? ``t - p`` is exact in float32 whenever ``t`` or ``p`` is zero or
their magnitudes are within a factor ``2**15`` of each other (``2**13`` for float16):
two 8-bit bfloat16 significands (11-bit float16 ones) then span at most 24 bits, and
``p + u == t`` exactly. When ``t`` is much *larger* than ``p`` the rounding error of
``u`` is below two float32 ulps of ``t``, far inside ``t``'s 16-bit rounding interval,
and the cast back still gives ``t``. So only a param that *shrinks* by more than
``2**15`` (``2**13``) in one step, but not to zero, can miss ``t``, by about a float32
ulp of its old value; :func:`landing_is_exact` tells which. Two limits of float32
itself also apply: XLA flushes subnormal results to zero, so values below about
``2**-118`` (``3e-36``, whose differences can be subnormal) may land on zero, and a
jump from near ``-3e38`` to near ``+3e38`` overflows.

Example:
  >>> from jaxmp._src.optim import base
  >>> p, t = jnp.bfloat16(1.0), jnp.bfloat16(-3.5)
  >>> u = base.update_to(p, t)
  >>> u.dtype, (p + u).astype(jnp.bfloat16)
  (dtype('float32'), Array(-3.5, dtype=bfloat16))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ARITHMETIC = np.dtype(np.float32)
HALF_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def require_params(params: Any, where: str) -> Any:
  """``params``, which the transform needs to know the values it writes over.

  Raises:
    ValueError: if ``params`` is ``None``.
  """
  if params is None:
    raise ValueError(f"{where}: update needs the current params, got params=None; call "
                     "tx.update(grads, opt_state, params).")
  return params


def path_name(path: Any) -> str:
  """A pytree key path as ``'/'``-joined names, e.g. ``'0/mu/dense/kernel'``."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def leaf_dtypes(tree: Any) -> list[str]:
  """The sorted names of the dtypes of ``tree``'s array leaves, for messages."""
  return sorted({np.dtype(x.dtype).name for x in jax.tree_util.tree_leaves(tree)
                 if hasattr(x, "dtype")})


class NoParamsToWrite(ValueError):
  """No param has a dtype the transform ``where`` writes (what :func:`select_leaves` raises).

  A transform that hands its inner optimizer float32 values (``master_weights``) catches
  it to name the nesting, the real cause there.
  """

  def __init__(self, message: str, where: str):
    super().__init__(message)
    self.where = where


def select_leaves(params: Any, accepted: tuple[np.dtype, ...], where: str, what: str,
                  hint: str, refused: tuple[np.dtype, ...] = ()) -> Any:
  """A tree of bools like ``params``: which leaves have one of the ``accepted`` dtypes.

  Leaves in other floating dtypes (float32 params in a tree otherwise bfloat16, say,
  kept wide by a ``jaxmp.Rule``) are left to the inner optimizer as they are.

  Raises:
    ValueError: if a leaf has a ``refused`` dtype (one the transform cannot handle and
      must not pass over silently); :class:`NoParamsToWrite` if no leaf has an
      accepted dtype: the transform would do nothing (``what`` says what it would have
      done, ``hint`` what to do instead).
  """
  names = ", ".join(d.name for d in accepted)
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  for path, x in flat:
    if np.dtype(x.dtype) in refused:
      raise ValueError(f"{where}: param {path_name(path) or '(root)'} has dtype "
                       f"{np.dtype(x.dtype).name}; accepted: {names} (and wider floats, "
                       "which are left alone).")
  mask = jax.tree_util.tree_map(lambda x: np.dtype(x.dtype) in accepted, params)
  if not any(jax.tree_util.tree_leaves(mask)):
    raise NoParamsToWrite(
        f"{where}: {what} params of dtype {names}, but the params have dtypes "
        f"{leaf_dtypes(params) or 'none (an empty tree)'}. {hint}", where)
  return mask


def find_states(tree: Any, state_type: type) -> list[Any]:
  """Every ``state_type`` instance in a (nested) optimizer state."""
  is_state = lambda x: isinstance(x, state_type)
  return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_state) if is_state(x)]


def map_selected(fn: Callable[..., Any], mask: Any, *trees: Any,
                 otherwise: Callable[..., Any]) -> Any:
  """``fn(*leaves)`` where ``mask`` is true, ``otherwise(*leaves)`` elsewhere."""
  return jax.tree_util.tree_map(lambda m, *xs: fn(*xs) if m else otherwise(*xs),
                                mask, *trees)


def update_to(param: jax.Array, target: jax.Array) -> jax.Array:
  """The float32 update that ``optax.apply_updates`` turns ``param`` into ``target`` by.

  Where the target equals the param (infinities included) the update is ``-0.0``,
  the one float that adds to every float (``-0.0`` included) without changing a bit.
  See the module docstring for when ``(param + update).astype(param.dtype)`` equals
  ``target`` exactly.
  """
  param, target = param.astype(ARITHMETIC), target.astype(ARITHMETIC)
  return jnp.where(target == param, jnp.array(-0.0, ARITHMETIC), target - param)


def landing_is_exact(param: jax.Array, target: jax.Array) -> jax.Array:
  """Whether ``optax.apply_updates`` lands ``param`` exactly on ``target`` (elementwise).

  Exactly: the same bits, or both NaN, or both zero (a ``-0.0`` target is reached
  only from a ``-0.0`` param: IEEE addition makes ``+0.0 + x == -0.0`` impossible).

  Example:
    >>> from jaxmp._src.optim import base
    >>> p = jnp.array([1.0, 1.0, 0.5], jnp.bfloat16)
    >>> t = jnp.array([1e-7, 0.0, 0.25], jnp.bfloat16)
    >>> base.landing_is_exact(p, t)  # 1 -> 1e-7 shrinks by more than 2**15
    Array([False,  True,  True], dtype=bool)
  """
  landed = (param + update_to(param, target)).astype(param.dtype)
  target = target.astype(param.dtype)
  same = bits(landed) == bits(target)
  return same | (jnp.isnan(landed) & jnp.isnan(target)) | ((landed == 0) & (target == 0))


def bits(x: jax.Array) -> jax.Array:
  """The bit pattern of a float array as unsigned integers of the same width."""
  unsigned = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[np.dtype(x.dtype).itemsize]
  return jax.lax.bitcast_convert_type(x, unsigned)


__all__ = (
    "ARITHMETIC",
    "HALF_DTYPES",
    "NoParamsToWrite",
    "bits",
    "find_states",
    "landing_is_exact",
    "leaf_dtypes",
    "map_selected",
    "path_name",
    "require_params",
    "select_leaves",
    "update_to",
)
