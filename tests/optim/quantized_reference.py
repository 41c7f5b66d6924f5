"""Plain NumPy ports of 8-bit optimizer-state quantization and of Optax's AdamW.

Nothing here uses JAX. Each function follows its published source step by step, in
float32 where the source computes in float32:

* torchao's ``torchao/optim/quant_utils.py``: ``create_dynamic_map`` (the dynamic map
  of bitsandbytes' ``create_dynamic_map`` without its zero padding, built from
  ``torch.linspace(0.1, 1, n)``, which PyTorch's CPU kernel computes as
  ``start + step * i`` below the middle and ``end - step * (n - 1 - i)`` from it, each
  with one rounding: a fused multiply-add; here by exact rational arithmetic rounded
  once to nearest even), ``scale_tensor`` (block absmax, clipped below at ``1e-12``),
  ``quantize_8bit_with_qmap`` (the branchless binary search, then rounding up where
  the residual is at least half the gap) and ``dequant_with_qmap``.
* Optax's ``adamw`` (``scale_by_adam``, ``add_decayed_weights``,
  ``scale_by_learning_rate``) in the order of its operations, with the moments
  replaced by their 8-bit round trip after every step, as an 8-bit optimizer stores
  them.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

F32 = np.float32


def _round_to_float32(value: Fraction) -> np.float32:
  """The float32 nearest an exact rational (ties to even)."""
  guess = F32(float(value))
  candidates = (np.nextafter(guess, F32(-np.inf)), guess, np.nextafter(guess, F32(np.inf)))
  def distance(c):
    return abs(Fraction(float(c)) - value), int(np.array(c, F32).view(np.uint32)) & 1
  return min(candidates, key=distance)


def torch_linspace(start: float, end: float, steps: int) -> np.ndarray:
  """``torch.linspace(start, end, steps)`` in float32, as PyTorch's CPU kernel computes it."""
  start32, end32 = F32(start), F32(end)
  step = (end32 - start32) / F32(steps - 1)
  halfway = steps // 2
  out = []
  for idx in range(steps):
    if idx < halfway:
      exact = Fraction(float(start32)) + Fraction(float(step)) * idx
    else:
      exact = Fraction(float(end32)) - Fraction(float(step)) * (steps - idx - 1)
    out.append(_round_to_float32(exact))
  return np.array(out, F32)


def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8) -> np.ndarray:
  """torchao's ``create_dynamic_map``, as a sorted float32 array."""
  data = []
  non_sign_bits = total_bits - 1
  additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
  for i in range(max_exponent_bits):
    fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                         else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
    boundaries = torch_linspace(0.1, 1, fraction_items)
    means = (boundaries[:-1] + boundaries[1:]) / F32(2.0)
    # A Python float times a float32 tensor: the scalar is cast to float32 first.
    factor = F32(10 ** (-(max_exponent_bits - 1) + i))
    data += list(factor * means)
    if signed:
      data += list(-factor * means)
  assert additional_items == 0  # the 8-bit maps have none
  data.append(F32(0))
  data.append(F32(1.0))
  assert len(data) == 2**total_bits
  return np.sort(np.array(data, F32))


def scale_tensor(x: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
  """torchao's ``scale_tensor``: blocks of the flattened array divided by their absmax."""
  shape = x.shape
  blocks = x.astype(F32).reshape(-1, block_size)
  with np.errstate(invalid="ignore"):
    scale = np.maximum(np.max(np.abs(blocks), axis=-1), F32(1e-12))  # NaN propagates
    scaled = blocks / scale.reshape(-1, 1)
  return scaled.reshape(shape), scale


def quantize_8bit_with_qmap(x: np.ndarray, qmap: np.ndarray) -> np.ndarray:
  """torchao's ``quantize_8bit_with_qmap``: binary search, then round to nearest, ties up."""
  with np.errstate(invalid="ignore"):
    codes = np.where(x >= qmap[128], 128, 0)
    for step in (64, 32, 16, 8, 4, 2, 1):
      codes += np.where(x >= qmap[codes + step], step, 0)
    codes_up = np.minimum(codes + 1, 255)
    val_down = qmap[codes]
    val_up = qmap[codes_up]
    residual = x - val_down
    codes = np.where(residual >= (val_up - val_down) * F32(0.5), codes_up, codes)
  return codes.astype(np.uint8)


def dequant_with_qmap(codes: np.ndarray, qmap: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """torchao's ``dequant_with_qmap``: ``qmap[codes] * scale`` per block."""
  with np.errstate(invalid="ignore"):
    out = qmap[codes.astype(np.int64)].reshape(scale.shape[0], -1) * scale.reshape(-1, 1)
  return out.reshape(codes.shape)


QMAP = {True: create_dynamic_map(signed=True), False: create_dynamic_map(signed=False)}


def thresholds(signed: bool) -> np.ndarray:
  """For codes ``k = 1..255``: the smallest float32 whose code is ``k`` (``t[k - 1]``).

  Found by bisection over the float32 values between neighbouring map values, with
  :func:`quantize_8bit_with_qmap` itself deciding (its code never decreases as the
  value grows: within an interval the rounding test switches once).
  """
  qmap = QMAP[signed]
  ordered = lambda x: np.where(x.view(np.int32) >= 0, x.view(np.int32),
                               -(x.view(np.int32) & 0x7FFFFFFF)).astype(np.int64)
  as_float = lambda k: np.where(k >= 0, k, (-k) | 0x80000000).astype(np.uint32).view(F32)
  low, high = ordered(qmap[:-1].copy()), ordered(qmap[1:].copy())  # codes k - 1 and k
  while np.any(high - low > 1):
    mid = (low + high) // 2
    reaches = quantize_8bit_with_qmap(as_float(mid), qmap) == np.arange(1, 256)
    high, low = np.where(reaches, mid, high), np.where(reaches, low, mid)
  return as_float(high)


def quantize(x: np.ndarray, signed: bool, block_size: int) -> tuple[np.ndarray, np.ndarray]:
  """torchao's ``OptimState8bit`` copy: scale, then codes. Returns (codes, flat scales)."""
  scaled, scale = scale_tensor(x, block_size)
  return quantize_8bit_with_qmap(scaled, QMAP[signed]), scale


def dequantize(codes: np.ndarray, scale: np.ndarray, signed: bool) -> np.ndarray:
  return dequant_with_qmap(codes, QMAP[signed], scale.reshape(-1))


def round_trip(x: np.ndarray, signed: bool, block_size: int) -> np.ndarray:
  return dequantize(*quantize(x, signed, block_size), signed)


def adamw_8bit(params, grads_per_step, *, lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4,
               block_size=256, quantized=lambda name: True):
  """Optax's ``adamw`` over float32 params, moments stored in 8 bits between steps.

  Args:
    params: a dict of float32 arrays.
    grads_per_step: a list of dicts of float32 gradients, one per step.
    quantized: which params' moments are stored in 8 bits (the others in float32).

  Returns:
    ``(params, mu, nu, updates)`` after the last step: the params after
    ``optax.apply_updates``, the stored moments (``(codes, flat scales)`` where
    quantized, else float32 arrays), the last updates.
  """
  params = {k: v.astype(F32) for k, v in params.items()}
  mu = {k: np.zeros_like(v) for k, v in params.items()}
  nu = {k: np.zeros_like(v) for k, v in params.items()}
  stored_mu, stored_nu = dict(mu), dict(nu)
  updates = {}
  for count, grads in enumerate(grads_per_step, start=1):
    # optax's bias_correction: 1 - decay**count, in float32.
    correction1 = F32(1) - F32(b1) ** F32(count)
    correction2 = F32(1) - F32(b2) ** F32(count)
    for k, g in grads.items():
      g = g.astype(F32)
      m = F32(1 - b1) * g + F32(b1) * mu[k]
      v = F32(1 - b2) * (g * g) + F32(b2) * nu[k]
      u = (m / correction1) / (np.sqrt(v / correction2 + F32(0.0)) + F32(eps))
      u = u + F32(weight_decay) * params[k]
      updates[k] = F32(-lr) * u
      params[k] = params[k] + updates[k]
      if quantized(k):
        stored_mu[k], stored_nu[k] = quantize(m, True, block_size), quantize(v, False, block_size)
        m, v = dequantize(*stored_mu[k], True), dequantize(*stored_nu[k], False)
      else:
        stored_mu[k], stored_nu[k] = m, v
      mu[k], nu[k] = m, v
  return params, stored_mu, stored_nu, updates
