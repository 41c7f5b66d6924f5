"""Quantize, dequantize, scales and amax histories: the arithmetic of fp8 scaling.

Conventions (Flax's, so that state migrates between the two):

- a *scale* is the dequantization multiplier: ``x ~= dequantize(quantize(x, s), s)``
  with ``quantize(x, s) = clip(x / s, -fp8_max, fp8_max)`` cast to fp8, and
  ``dequantize(q, s) = q * s``. A tensor whose amax is ``a`` gets
  ``s = 1 / ((fp8_max / a) / 2**margin)``, which maps ``a`` to ``fp8_max / 2**margin``;
- an *amax history* is a float32 vector whose entry 0 is the most recent amax:
  a new amax is recorded with ``roll(history, -1)`` followed by ``history[0] = amax``.

Everything here computes in float32, whatever the dtype of the tensor being quantized:
a bfloat16 tensor is divided by its float32 scale in float32 (Flax rounds the scale
and the quotient to bfloat16 first), and the result is rounded once, to fp8.

Soundness rules that every function here keeps:

- a scale is always finite and > 0: where the arithmetic would give 0, inf or NaN (an
  empty history, an overflowed amax, an amax so small that ``fp8_max / amax``
  overflows) the previous scale is kept, and a previous scale that is itself not
  finite and > 0 (e.g. a state zeroed by a zero cotangent) is replaced by 1;
- a history never holds inf, NaN or a negative value: a non-finite amax is recorded
  as 0 (neutral for ``max``), and such entries in an incoming history read as 0.

Example:
  >>> from jaxmp._src.fp8 import quantize as q
  >>> s = q.scale_from_amax(jnp.float32(10.0), jnp.float32(1.0), q.E4M3)
  >>> bool(s == jnp.float32(10) / 448)
  True
  >>> x = jnp.array([10.0, -5.0, 0.1])
  >>> q.dequantize(q.quantize(x, q.E4M3, s), s)
  Array([10.        , -5.        ,  0.10044643], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import dtypes as dtypes_lib

E4M3 = np.dtype(jnp.float8_e4m3fn)
"""float8_e4m3fn: forward operands (inputs and kernels). Max 448, no infinities."""

E5M2 = np.dtype(jnp.float8_e5m2)
"""float8_e5m2: output gradients. Max 57344."""

F32 = np.dtype(np.float32)

FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
"""The fp8 dtype of each format name a recipe's ``gradient_format`` may give."""


def role_format(role: str, gradient_format: str) -> np.dtype:
  """E4M3 for a GEMM's input and kernel, ``gradient_format`` for its output gradient.

  Example:
    >>> from jaxmp._src.fp8 import quantize as q
    >>> q.role_format("kernel", "e5m2"), q.role_format("output_grad", "e5m2")
    (dtype(float8_e4m3fn), dtype(float8_e5m2))
  """
  return FORMATS[gradient_format] if role == "output_grad" else E4M3


def fp8_max(fp8_dtype: Any) -> float:
  """The largest finite value of an fp8 dtype (448 for E4M3, 57344 for E5M2).

  Example:
    >>> from jaxmp._src.fp8 import quantize as q
    >>> q.fp8_max(q.E4M3), q.fp8_max("e5m2")
    (448.0, 57344.0)
  """
  fmt = dtypes_lib.float_format(fp8_dtype)
  if fmt.dtype.itemsize != 1:
    raise ValueError(f"Expected an fp8 dtype, got {fmt.dtype.name}.")
  return fmt.max


def quantize(x: jax.Array, fp8_dtype: Any, scale: jax.Array) -> jax.Array:
  """Quantizes ``x`` to ``fp8_dtype`` with the dequantization multiplier ``scale``.

  ``clip(float32(x) / scale, -fp8_max, fp8_max)`` cast to ``fp8_dtype``: the division
  is float32 for every input dtype, and clipping saturates finite values beyond the
  range (E4M3 has no infinity; an unclipped overflow would become NaN). Non-finite
  inputs stay non-finite (inf becomes NaN in E4M3, inf in E5M2; Flax saturates inf to
  the fp8 max), so that an overflow upstream reaches the gradients and loss scaling
  skips the step instead of applying saturated gradients. So does, in E4M3, a finite
  value whose quotient overflows float32 (:func:`saturate`).

  Compiled for a CPU, XLA may turn the division by a scalar into a multiplication by
  its reciprocal (it does for ``jax.jit(lambda x, s: x / s)``; compiled for an H100
  or a TPU v5e that function keeps its division), depending on how the scale reaches
  it in the program; the two can differ in the quotient's last bit, so on a CPU a
  compiled train step's fp8 codes, and its losses, can move slightly when the program
  around the quantization changes (seen in ``make demo``'s fp8 run).

  Args:
    x: a floating-point array of any dtype.
    fp8_dtype: ``E4M3`` or ``E5M2``.
    scale: a scalar float32 scale, > 0.

  Returns:
    An array of ``x``'s shape in ``fp8_dtype``.

  Example:
    >>> from jaxmp._src.fp8 import quantize as q
    >>> q.quantize(jnp.array([1.0, 500.0, -1000.0, jnp.inf]), q.E4M3, jnp.float32(1.0))
    Array([1, 448, -448, nan], dtype=float8_e4m3fn)
  """
  x = x.astype(F32)
  return saturate(x / jnp.asarray(scale, F32), x, fp8_dtype)


def saturate(scaled: jax.Array, x: jax.Array, fp8_dtype: Any) -> jax.Array:
  """``scaled`` (float32) clipped to the fp8 range and rounded, keeping ``x``'s inf/NaN.

  The last step of every quantization: ``scaled`` is ``x`` (float32) divided or
  multiplied by its scale; values beyond ``fp8_max`` saturate, and where ``x`` is
  inf or NaN the result is not finite (NaN in E4M3, inf or NaN in E5M2). In E4M3 a
  finite ``x`` whose quotient overflows float32 (more than 2**128 times its scale)
  becomes NaN too: an overflow, kept visible like an inf.

  Clipping alone would turn an inf into a finite number, and an overflow upstream
  (e.g. a loss-scaled backward pass in float16) has to stay visible so that loss
  scaling skips the step; NaN stays NaN through the clip. The inf comes back by
  arithmetic rather than a select on ``isfinite``, because XLA fuses arithmetic into
  the quantization kernel, where a select (or ``x - x``, which reads ``x`` again)
  split a transposed operand's quantization into several kernels with float32 and
  bool intermediates in memory:

  - E4M3 (no inf; inf becomes NaN): ``clipped - (scaled - scaled)``. The difference
    is +0 for a finite quotient and NaN otherwise, and subtracting +0 leaves every
    value bit for bit, -0 included. (Adding ``x * 0`` would do the same, but on
    GPUs it makes XLA lay a weight-gradient GEMM out transposed wherever the
    gradient is checked for finiteness: the GEMM's scale no longer folds into it and
    the optimizer update runs transposed, seen in compiled H100 HLO.)
  - E5M2 (keeps inf): ``clipped + x * 2**-126`` (the smallest normal float32, so
    that no backend flushes it to zero). ``inf * 2**-126`` is inf; for finite ``x``
    the product is at most ``|x / scale| * scale * 2**-126``, below half a float32
    ulp of the quotient whenever ``scale < 2**101`` (and at most 4 where the
    quotient is clipped, which the conversion to fp8 rounds away), so the sum rounds
    back to the quotient. A scale of 2**101 or more would mean gradients near 1e35.

  Example:
    >>> from jaxmp._src.fp8 import quantize as q
    >>> x = jnp.array([1.0, 1000.0, jnp.inf])
    >>> q.saturate(x * 2, x, q.E4M3)
    Array([2, 448, nan], dtype=float8_e4m3fn)
  """
  bound = fp8_max(fp8_dtype)
  clipped = jnp.clip(scaled, -bound, bound)
  if dtypes_lib.float_format(fp8_dtype).has_inf:
    return (clipped + x * np.float32(2.0**-126)).astype(fp8_dtype)
  return (clipped - (scaled - scaled)).astype(fp8_dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any = F32) -> jax.Array:
  """``float32(q) * scale``, cast to ``dtype``.

  Example:
    >>> from jaxmp._src.fp8 import quantize as q
    >>> x = q.quantize(jnp.array([0.3, 100.0]), q.E4M3, jnp.float32(0.5))
    >>> x
    Array([0.625, 192], dtype=float8_e4m3fn)
    >>> q.dequantize(x, jnp.float32(0.5), jnp.bfloat16)
    Array([0.3125, 96], dtype=bfloat16)
  """
  return (q.astype(F32) * jnp.asarray(scale, F32)).astype(dtype)


def amax(x: jax.Array) -> jax.Array:
  """``max|x|`` as a float32 scalar (0 for an empty array).

  Example:
    >>> from jaxmp._src.fp8 import quantize as q
    >>> q.amax(jnp.array([[1.0, -3.0], [2.0, 0.5]], jnp.bfloat16)), q.amax(jnp.zeros((0,)))
    (Array(3., dtype=float32), Array(0., dtype=float32))
  """
  if x.dtype.itemsize == 1:
    x = x.astype(F32)  # fp8 has no arithmetic of its own on some backends.
  if x.size == 0:
    return jnp.zeros((), F32)
  # abs and max are exact in every float format, so reducing in x's own dtype and
  # widening the scalar afterwards gives the float32 answer without a float32 copy.
  return jnp.max(jnp.abs(x)).astype(F32)


def valid_scale(scale: jax.Array) -> jax.Array:
  """``scale`` where it is finite and > 0, else 1: the scale an fp8 op may trust.

  Example:
    >>> from jaxmp._src.fp8 import quantize as q
    >>> q.valid_scale(jnp.array([0.5, 0.0, jnp.inf, -1.0, jnp.nan]))
    Array([0.5, 1. , 1. , 1. , 1. ], dtype=float32)
  """
  scale = jnp.asarray(scale, F32)
  return jnp.where(jnp.isfinite(scale) & (scale > 0), scale, jnp.ones_like(scale))


def valid_history(history: jax.Array) -> jax.Array:
  """``history`` with every inf, NaN or negative entry read as 0.

  Example:
    >>> from jaxmp._src.fp8 import quantize as q
    >>> q.valid_history(jnp.array([3.0, jnp.inf, -1.0, jnp.nan]))
    Array([3., 0., 0., 0.], dtype=float32)
  """
  history = jnp.asarray(history, F32)
  return jnp.where(jnp.isfinite(history) & (history > 0), history, jnp.zeros_like(history))


def round_down_to_power_of_two(x: jax.Array) -> jax.Array:
  """``2**floor(log2(x))`` for positive normal float32 ``x``, exactly (the mantissa cleared).

  Zero stays zero and inf stays inf; callers only pass finite positive values.

  Example:
    >>> from jaxmp._src.fp8 import quantize as q
    >>> q.round_down_to_power_of_two(jnp.array([448 / 3.0, 1.0, 0.75], jnp.float32))
    Array([128. ,   1. ,   0.5], dtype=float32)
  """
  bits = jax.lax.bitcast_convert_type(jnp.asarray(x, F32), np.uint32)
  return jax.lax.bitcast_convert_type(bits & np.uint32(0xFF800000), F32)


def scale_from_amax(amax_value: jax.Array, previous_scale: jax.Array, fp8_dtype: Any,
                    margin: int = 0, power_of_two: bool = False) -> jax.Array:
  """The scale that maps ``amax_value`` to ``fp8_max / 2**margin``.

  Computed as TransformerEngine and Flax do, ``1 / ((fp8_max / amax) / 2**margin)``
  in float32, so the stored scales are bit-identical to theirs. With
  ``power_of_two`` the quantization multiplier ``(fp8_max / amax) / 2**margin`` is
  first rounded down to a power of two (torchao's rounding), so the scale is the
  power of two at or above ``amax * 2**margin / fp8_max`` and every multiplication by
  it is exact. Where the result is not a finite positive number (amax 0, inf or NaN,
  or so small that ``fp8_max / amax`` overflows) it is ``previous_scale``, itself
  replaced by 1 when it is not finite and > 0. Works element-wise on arrays of
  amaxes (one scale per row or block).

  Args:
    amax_value: a float32 scalar or array.
    previous_scale: the scale to fall back on, a float32 scalar (or an array of the
      amaxes' shape).
    fp8_dtype: the format the scale is for, or a tuple of formats, one per element
      of ``amax_value`` (the scales of several tensors in one computation).
    margin: headroom in powers of two.
    power_of_two: round the scale up to a power of two.

  Returns:
    Finite, positive float32 scales of ``amax_value``'s shape.

  Example:
    >>> from jaxmp._src.fp8 import quantize as q
    >>> float(q.scale_from_amax(jnp.float32(0.0), jnp.float32(0.0), q.E4M3))
    1.0
    >>> float(q.scale_from_amax(jnp.float32(3.0), jnp.float32(1.0), q.E4M3, power_of_two=True))
    0.0078125
  """
  amax_value = jnp.asarray(amax_value, F32)
  fallback = valid_scale(previous_scale)
  one = jnp.asarray(1.0, F32)
  if isinstance(fp8_dtype, (tuple, list)):
    largest = jnp.asarray([fp8_max(d) for d in fp8_dtype], F32)
  else:
    largest = jnp.asarray(fp8_max(fp8_dtype), F32)
  inverse = (largest / amax_value) / jnp.asarray(2.0**margin, F32)
  ok = (amax_value > 0) & jnp.isfinite(amax_value) & (inverse > 0) & jnp.isfinite(inverse)
  if power_of_two:
    inverse = round_down_to_power_of_two(inverse)
  # Select on the inverse and take one reciprocal of the selection, as Flax and
  # TransformerEngine do: besides giving their rounding (1 / (448 / a) is not always
  # a / 448 in float32), the select keeps XLA from rewriting 1 / (m / a) into a / m
  # in some programs and not in others.
  scale = one / jnp.where(ok, inverse, one / fallback)
  return jnp.where(jnp.isfinite(scale) & (scale > 0), scale, fallback)


def amax_from_history(history: jax.Array, amax_compute: str = "max") -> jax.Array:
  """The amax a delayed-scaling step scales by: ``max(history)`` or ``history[0]``.

  Args:
    history: a float32 amax history, or several stacked (one per row, along the
      last axis); inf, NaN and negative entries read as 0.
    amax_compute: ``"max"`` or ``"most_recent"``.

  Returns:
    A float32 scalar (one per stacked history).

  Raises:
    ValueError: for another ``amax_compute``.

  Example:
    >>> from jaxmp._src.fp8 import quantize as q
    >>> history = jnp.array([1.0, 4.0, 2.0])
    >>> q.amax_from_history(history), q.amax_from_history(history, "most_recent")
    (Array(4., dtype=float32), Array(1., dtype=float32))
  """
  history = valid_history(history)
  if amax_compute == "max":
    return jnp.max(history, axis=-1)
  if amax_compute == "most_recent":
    return history[..., 0]
  raise ValueError(
      f"Unknown amax_compute {amax_compute!r}; accepted values are 'max', 'most_recent'.")


def record_amax(history: jax.Array, amax_value: jax.Array) -> jax.Array:
  """Records ``amax_value`` as the most recent entry of ``history``.

  ``roll(history, -1)`` then ``history[0] = amax``; a non-finite amax (an overflowed
  step) is recorded as 0, so inf and NaN never enter a history, and the history keeps
  its shape and rotation, so histories recorded from the same old one can be combined
  entry by entry with ``max``.

  Args:
    history: a float32 amax history.
    amax_value: a float32 scalar.

  Returns:
    The new history.

  Example:
    >>> from jaxmp._src.fp8 import quantize as q
    >>> history = jnp.array([1.0, 4.0, 2.0])
    >>> q.record_amax(history, jnp.float32(3.0))
    Array([3., 2., 1.], dtype=float32)
    >>> q.record_amax(history, jnp.float32(jnp.inf))  # an overflow records 0
    Array([0., 2., 1.], dtype=float32)
  """
  history = valid_history(history)
  amax_value = jnp.asarray(amax_value, F32)
  amax_value = jnp.where(jnp.isfinite(amax_value) & (amax_value > 0), amax_value, 0.0)
  return jnp.roll(history, -1, axis=0).at[0].set(amax_value)


@jax.custom_batching.custom_vmap
def shared_amax(x: jax.Array, history: jax.Array) -> jax.Array:
  """``max|x|`` over everything that shares the amax ``history``.

  Outside ``vmap`` this is :func:`amax` (``history`` only says who shares it). Under
  ``vmap`` the answer follows the history: when the history is not batched (one set
  of fp8 state shared by every example, as in ``nn.vmap`` with broadcast variables or
  ``jax.vmap`` of a layer over a batch) the amax is taken over the whole batch and is
  not batched, because that state gets a single next value; when the history is
  batched (an ensemble, one state per member) each member gets its own amax. Plain
  batching would instead give one amax per example, which reverse mode then *adds*
  into the shared state.

  Args:
    x: the tensor, any float dtype.
    history: the amax history this amax will be recorded in (only its batching is
      used).

  Returns:
    A float32 scalar.

  Example:
    >>> from jaxmp._src.fp8 import quantize as q
    >>> xs = jnp.array([[1.0, -2.0], [5.0, 0.5]])
    >>> jax.vmap(q.shared_amax, in_axes=(0, None))(xs, jnp.zeros(2))  # one shared state
    Array([5., 5.], dtype=float32)
    >>> jax.vmap(q.shared_amax)(xs, jnp.zeros((2, 2)))  # one state per member
    Array([2., 5.], dtype=float32)
  """
  del history
  return amax(x)


@shared_amax.def_vmap
def _shared_amax_vmap(axis_size, in_batched, x, history):
  x_batched, history_batched = in_batched
  if not history_batched:
    # One state for the whole batch: reduce the batch axis away, then ask again at
    # this level with nothing batched, so enclosing vmaps apply this rule too.
    x = jnp.max(jnp.abs(x.astype(F32) if x.dtype.itemsize == 1 else x), axis=0)
    return shared_amax(x, history), False
  # One state per member: one amax per member, each computed by a call that enclosing
  # vmaps see (lax.map over the members), again so that their batching is respected.
  if x_batched:
    per_member = jax.vmap(amax)(x)
  else:
    per_member = jnp.broadcast_to(amax(x), (axis_size,))
  return jax.lax.map(lambda args: shared_amax(*args), (per_member, history)), True


__all__ = (
    "FORMATS",
    "role_format",
    "E4M3",
    "E5M2",
    "amax",
    "amax_from_history",
    "dequantize",
    "fp8_max",
    "quantize",
    "record_amax",
    "round_down_to_power_of_two",
    "saturate",
    "scale_from_amax",
    "shared_amax",
    "valid_history",
    "valid_scale",
)
