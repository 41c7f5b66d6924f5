"""The 16-bit remainder scheme: a float32 master as a bfloat16 param plus 16 low bits.

A float32 number's top 16 bits are a bfloat16 number. Megatron-LM's and
TransformerEngine's ``store_param_remainders`` keep the bfloat16 param in the model
and only the other 16 bits in the optimizer, so the exact float32 master costs 2
bytes beyond the param instead of 4.

The split rounds to nearest: with ``b`` the master's 32-bit pattern as an unsigned
integer, the param is ``hi = (b + 0x8000) >> 16`` (modulo ``2**16``) and the
remainder ``lo = b - (hi << 16)``, a signed 16-bit integer in ``[-0x8000, 0x7fff]``.
The join is ``(hi << 16) + lo`` modulo ``2**32``, which gives ``b`` back for every
``b``: the pair is a bijection on 32-bit patterns. The param is the master rounded to
the nearest bfloat16, ties away from zero: round-half-to-even, what ``astype`` does,
cannot be undone with 16 bits (two masters tied on either side of an even bfloat16
would share a pair). A finite master above the largest bfloat16 (by half an ulp or
more) gives an infinite param, as ``astype`` does. A NaN master is first made the
canonical NaN ``0x7fc00000`` (the split of an arbitrary payload could wrap to a zero
param and hide the NaN), so its param is NaN and it joins back to the canonical NaN.

Example:
  >>> from jaxmp._src.optim import remainders
  >>> master = jnp.array([1.0 + 2.0**-12, -3.0e-5], jnp.float32)
  >>> param, rest = remainders.split_remainder(master)
  >>> param, rest.dtype
  (Array([1, -3.00407e-05], dtype=bfloat16), dtype('int16'))
  >>> bool(jnp.all(remainders.join_remainder(param, rest) == master))
  True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PARAM_DTYPE = np.dtype(jnp.bfloat16)
MASTER_DTYPE = np.dtype(jnp.float32)
REMAINDER_DTYPE = np.dtype(jnp.int16)
_HALF = np.uint32(0x8000)
_SHIFT = np.uint32(16)
_CANONICAL_NAN = np.uint32(0x7FC00000)


def _check_dtype(x: jax.Array, expected: np.dtype, name: str, where: str) -> None:
  dtype = getattr(x, "dtype", None)
  if dtype is None or np.dtype(dtype) != expected:
    raise TypeError(f"{where}: {name} must be a {expected.name} array, got "
                    f"{'dtype ' + np.dtype(dtype).name if dtype is not None else repr(x)}.")


def split_remainder(master: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Splits a float32 master into its bfloat16 param and its int16 remainder.

  The param is the master rounded to nearest, ties away from zero; see the module
  docstring for the algorithm and what happens to NaN and overflow.

  Args:
    master: a float32 array.

  Returns:
    ``(param, remainder)``: bfloat16 and int16 arrays of the master's shape, with
    ``join_remainder(param, remainder)`` equal to ``master`` bit for bit (a NaN as
    the canonical NaN).

  Raises:
    TypeError: if ``master`` is not a float32 array.

  Example:
    >>> from jaxmp._src.optim import remainders
    >>> remainders.split_remainder(jnp.float32(1.0 + 2.0**-8))  # a tie: away from zero
    (Array(1.00781, dtype=bfloat16), Array(-32768, dtype=int16))
  """
  _check_dtype(master, MASTER_DTYPE, "master", "split_remainder")
  bits = jax.lax.bitcast_convert_type(master, jnp.uint32)
  bits = jnp.where(jnp.isnan(master), _CANONICAL_NAN, bits)
  high = (bits + _HALF) >> _SHIFT  # uint32 arithmetic wraps modulo 2**32
  low = bits - (high << _SHIFT)
  param = jax.lax.bitcast_convert_type(high.astype(jnp.uint16), jnp.bfloat16)
  remainder = jax.lax.bitcast_convert_type(low.astype(jnp.uint16), jnp.int16)
  return param, remainder


def join_remainder(param: jax.Array, remainder: jax.Array) -> jax.Array:
  """The float32 master a bfloat16 param and its int16 remainder stand for.

  Args:
    param: a bfloat16 array.
    remainder: an int16 array of the same shape, from :func:`split_remainder`.

  Returns:
    The float32 master, ``(param_bits << 16) + remainder`` modulo ``2**32``.

  Raises:
    TypeError: if ``param`` is not bfloat16 or ``remainder`` not int16.
    ValueError: if their shapes differ.

  Example:
    >>> from jaxmp._src.optim import remainders
    >>> remainders.join_remainder(jnp.bfloat16(1.0), jnp.int16(1)) == jnp.float32(1.0) + 2.0**-23
    Array(True, dtype=bool)
  """
  _check_dtype(param, PARAM_DTYPE, "param", "join_remainder")
  _check_dtype(remainder, REMAINDER_DTYPE, "remainder", "join_remainder")
  if np.shape(param) != np.shape(remainder):
    raise ValueError(f"join_remainder: param has shape {np.shape(param)} but remainder has "
                     f"shape {np.shape(remainder)}; they must match.")
  high = jax.lax.bitcast_convert_type(param, jnp.uint16).astype(jnp.uint32) << _SHIFT
  # int16 -> int32 sign-extends; as uint32 the addition wraps modulo 2**32.
  low = jax.lax.bitcast_convert_type(remainder.astype(jnp.int32), jnp.uint32)
  return jax.lax.bitcast_convert_type(high + low, jnp.float32)


__all__ = (
    "MASTER_DTYPE",
    "PARAM_DTYPE",
    "REMAINDER_DTYPE",
    "join_remainder",
    "split_remainder",
)
