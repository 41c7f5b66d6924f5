"""Stochastic rounding of float32 to bfloat16, and the Optax transform that writes with it.

Round-to-nearest loses every update smaller than half a bfloat16 ulp of the param
(``2**-9`` of it): ``round(p + u) == p``. Stochastic rounding rounds up with
probability equal to the distance from the value below, in ulps, so that
``E[round(x)] == x`` and small updates survive on average (Zamirai et al.,
"Revisiting BFloat16 Training", arXiv 2010.06192).

The algorithm (:func:`stochastic_round`): add a uniformly random 16-bit integer ``r``
to the float32 bit pattern and clear the low 16 bits. With ``low`` the value's low
16 bits, the carry into the kept bits happens exactly when ``r >= 2**16 - low``, with
probability ``low / 2**16``: the distance to the value below, in ulps. Signs need no
care (the bit pattern is sign and magnitude); subnormals round the same way; a value
within an ulp of float32's largest may round up to infinity. Infinities and NaNs are
left alone (cast, not rounded: a NaN's payload may sit in the low bits only).

:func:`stochastic_rounding` is the Optax transform. It wraps the optimizer,
``stochastic_rounding(inner, key)``, and turns ``inner``'s update ``u`` of each
bfloat16 param ``p`` into the one that ``optax.apply_updates`` turns ``p`` into
``stochastic_round(p + u)`` by (see :mod:`jaxmp._src.optim.base`, and there why it
wraps rather than chains). Its state holds the key, a step count and ``inner``'s
state; the random bits of a step come from ``fold_in(fold_in(key, count), leaf index)``,
so a restored checkpoint continues with the same bits and a sharded param gets the
same bits as on one device (JAX's partitionable threefry, the default).

Put it outside loss scaling: ``stochastic_rounding(jaxmp.loss_scaling(inner, scale),
key)``. A skipped step's zero updates (``-0.0``) then round to the params exactly (their
low 16 bits are zero, so no random addend carries), and the step's other work stays
cheap. Inside loss scaling the rounding, random bits and all, sits in the skip's
``lax.cond`` branch, which XLA then keeps as a conditional: float32 update buffers and
layout copies, about 7 bytes of temporaries per param more than round-to-nearest in a
train step compiled for an H100 (the outside order: 0.01;
``tests/test_benchmarks.py``). Inside, a skipped step is retried with the same bits;
outside, its count advances (new bits, harmless).

Example:
  >>> x = jnp.full((10000,), 1.0 + 2.0**-10)  # 1/8 of the way from 1 to the next bfloat16
  >>> rounded = jaxmp.optim.stochastic_round(x, jax.random.key(0))
  >>> x.astype(jnp.bfloat16)[0], round(float(jnp.mean(rounded.astype(jnp.float32))), 4)
  (Array(1, dtype=bfloat16), 1.001)
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from jaxmp._src import checks
from jaxmp._src.optim import base

_BF16 = np.dtype(jnp.bfloat16)
_F32 = np.dtype(jnp.float32)
_HIGH_MASK = np.uint32(0xFFFF0000)


def _key_data(key: Any, where: str) -> tuple[jax.Array, Any]:
  """Raw key data and the key implementation, for a typed or a raw uint32 key.

  Raises:
    TypeError: if ``key`` is missing or not a PRNG key.
    ValueError: for an array of keys where one key goes.
  """
  if key is None:
    raise TypeError(f"{where}: key must be a JAX PRNG key (e.g. jax.random.key(0)), got "
                    "None; stochastic rounding draws random bits and never picks a key "
                    "of its own.")
  dtype = getattr(key, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    if np.shape(key) != ():
      raise ValueError(f"{where}: key must be a single PRNG key, got an array of keys of "
                       f"shape {np.shape(key)}.")
    return jax.random.key_data(key), jax.random.key_impl(key)
  if dtype is not None and np.dtype(dtype) == np.uint32 and np.shape(key) == (2,):
    return jnp.asarray(key), None  # a raw jax.random.PRNGKey
  shown = f"dtype {np.dtype(dtype).name} and shape {np.shape(key)}" if dtype is not None else (
      f"{key!r} of type {type(key).__name__}")
  raise TypeError(f"{where}: key must be a JAX PRNG key (jax.random.key(0), or a raw "
                  f"uint32[2] jax.random.PRNGKey(0)), got {shown}.")


def stochastic_round(x: jax.Array, key: jax.Array,
                     dtype: DTypeLike = jnp.bfloat16) -> jax.Array:
  """Rounds float32 values to bfloat16 up or down at random, unbiased.

  See the module docstring for the algorithm.

  Args:
    x: a float32 array.
    key: a JAX PRNG key; the same key gives the same rounding.
    dtype: the dtype to round to; only bfloat16 is accepted.

  Returns:
    A bfloat16 array of ``x``'s shape: each value is one of the two bfloat16 numbers
    around ``x``, the upper one with probability proportional to the distance from
    the lower one, so that its expectation is ``x`` exactly.

  Raises:
    TypeError: if ``key`` is missing or not a PRNG key, or ``x`` not float32.
    ValueError: if ``dtype`` is not bfloat16.

  Example:
    >>> jaxmp.optim.stochastic_round(jnp.array([1.0, jnp.inf]), jax.random.key(1))
    Array([1, inf], dtype=bfloat16)
  """
  raw, impl = _key_data(key, "stochastic_round")
  if jnp.dtype(dtype) != _BF16:
    raise ValueError(f"stochastic_round: dtype must be bfloat16 (the format whose bits are "
                     f"float32's top half), got {jnp.dtype(dtype).name}.")
  if getattr(x, "dtype", None) != _F32:
    shown = f"dtype {np.dtype(x.dtype).name}" if hasattr(x, "dtype") else repr(x)
    raise TypeError(f"stochastic_round: x must be a float32 array, got {shown}.")
  return _round(x, raw if impl is None else jax.random.wrap_key_data(raw, impl=impl))


def _round(x: jax.Array, key: jax.Array) -> jax.Array:
  noise = jax.random.bits(key, x.shape, jnp.uint16).astype(jnp.uint32)
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  rounded = jax.lax.bitcast_convert_type((bits + noise) & _HIGH_MASK, jnp.float32)
  # The low 16 bits are zero now, so this cast is exact.
  return jnp.where(jnp.isfinite(x), rounded, x).astype(jnp.bfloat16)


class StochasticRoundingState(NamedTuple):
  """The state of :func:`stochastic_rounding`.

  Attributes:
    key: the key's raw data (``jax.random.key_data``), uint32, so that any
      checkpointer saves it.
    count: the steps taken so far, int32; each step's bits depend on it.
    inner_state: the wrapped optimizer's state.

  Example:
    >>> import optax
    >>> tx = jaxmp.optim.stochastic_rounding(optax.sgd(0.1), jax.random.key(0))
    >>> tx.init({"w": jnp.ones(2, jnp.bfloat16)}).count
    Array(0, dtype=int32)
  """

  key: jax.Array
  count: jax.Array
  inner_state: optax.OptState


def _is_key(value: Any) -> bool:
  """Whether ``value`` is a typed PRNG key or a raw ``uint32[2]`` one."""
  dtype = getattr(value, "dtype", None)
  if dtype is None:
    return False
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return True
  return np.dtype(dtype) == np.uint32 and np.shape(value) == (2,)


def stochastic_rounding(inner: optax.GradientTransformation,
                        key: jax.Array | None = None) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` and writes its updates into bfloat16 params with stochastic rounding.

  Each ``update`` runs ``inner`` on the gradients and the bfloat16 params as they
  are, then turns its update ``u`` of each bfloat16 param ``p`` into the one that
  makes ``optax.apply_updates`` land on ``stochastic_round(p + u)``. See the module
  docstring for where the randomness comes from. Pass the updates straight to
  ``optax.apply_updates``: a transform that rescaled them (one chained after this,
  say) would land elsewhere, which is why this wraps the optimizer instead of being
  chained after it.

  Args:
    inner: the optimizer whose updates are rounded: any
      ``optax.GradientTransformation`` (or ``optax.MultiSteps``), e.g.
      ``jaxmp.optim.state_dtypes(optax.adamw(1e-3), "bfloat16")``.
    key: a JAX PRNG key.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`StochasticRoundingState`. ``update(updates, state, params, **extra_args)``
    needs the params; it returns float32 updates for the bfloat16 params and
    ``inner``'s updates of the others.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation (a key alone is the form
      this replaced, chained after the optimizer) or ``key`` is missing or not a PRNG
      key.
    ValueError: from ``init``/``update``, if no param is bfloat16 or one is float16;
      from ``update``, if ``params`` is ``None``.

  Example:
    >>> import optax
    >>> tx = jaxmp.optim.stochastic_rounding(optax.sgd(1e-3), jax.random.key(0))
    >>> params = {"w": jnp.ones(1000, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> for _ in range(100):  # steps of 1e-3: round-to-nearest would stay at 1.0
    ...   updates, state = tx.update({"w": jnp.ones(1000, jnp.bfloat16)}, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> round(float(jnp.mean(params["w"].astype(jnp.float32))), 2)  # 1 - 100 * 1e-3, on average
    0.9
  """
  where = "stochastic_rounding"
  if _is_key(inner):
    raise TypeError(
        f"{where}: inner must be the optimizer, got a PRNG key ({inner!r}); "
        "stochastic_rounding wraps the optimizer, stochastic_rounding(inner, key): "
        "chained after it, any transform in between would undo the rounding.")
  inner = checks.gradient_transformation(inner, "inner", where=where)
  raw, impl = _key_data(key, where)
  raw = jnp.array(raw)  # a private copy: donating a state must not delete the caller's key

  def select(params):
    return base.select_leaves(
        params, (_BF16,), where, "rounds", "Stochastic rounding writes bfloat16 params; "
        "float32 params need no rounding.", refused=(np.dtype(jnp.float16),))

  def init_fn(params):
    select(params)
    return StochasticRoundingState(key=jnp.array(raw), count=jnp.zeros((), jnp.int32),
                                   inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    params = base.require_params(params, where)
    mask = select(params)
    updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    key = state.key if impl is None else jax.random.wrap_key_data(state.key, impl=impl)
    step_key = jax.random.fold_in(key, state.count)
    flat_mask, treedef = jax.tree_util.tree_flatten(mask)
    flat_params = treedef.flatten_up_to(params)
    flat_updates = treedef.flatten_up_to(updates)
    new = [base.update_to(p, _round(p.astype(_F32) + u.astype(_F32),
                                    jax.random.fold_in(step_key, i))) if m else u
           for i, (m, p, u) in enumerate(zip(flat_mask, flat_params, flat_updates))]
    return (jax.tree_util.tree_unflatten(treedef, new),
            # optax types safe_increment's result as any ArrayLike; it is an array.
            StochasticRoundingState(key=state.key,
                                    count=optax.safe_increment(state.count),  # pyright: ignore[reportArgumentType]
                                    inner_state=inner_state))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


__all__ = (
    "StochasticRoundingState",
    "stochastic_round",
    "stochastic_rounding",
)
