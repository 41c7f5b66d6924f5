"""The dynamic loss scale: back off on overflow, grow after a run of finite steps.

``torch.amp.GradScaler``'s rule as an immutable pytree, clamped to
``[min_scale, max_scale]``; the interface it implements, and the no-op and static
scales, are in :mod:`jaxmp._src.loss_scale`.

Example:
  >>> ls = jaxmp.DynamicLossScale(scale=2.0**15, growth_interval=2)
  >>> ls = ls.adjust(jnp.array(False))   # overflow: back off
  >>> float(ls.loss_scale), int(ls.counter)
  (16384.0, 0)
  >>> ls = ls.adjust(True).adjust(True)  # 2nd consecutive finite step: grow
  >>> float(ls.loss_scale), int(ls.counter)
  (32768.0, 0)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxmp._src import checks
from jaxmp._src.loss_scale import LossScale
from jaxmp._src.loss_scale import check_grads_finite
from jaxmp._src.loss_scale import check_scale
from jaxmp._src.loss_scale import poison_unless

_F32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = int(np.iinfo(np.int32).max)


def _f32_rounded(bound: float, *, up: bool) -> np.float32:
  """The float32 nearest ``bound`` on the side ``up`` says (for ``0 <= bound <= max``).

  For a float32 ``x``, ``x >= bound`` exactly when ``x >= _f32_rounded(bound, up=True)``,
  and ``x <= bound`` exactly when ``x <= _f32_rounded(bound, up=False)``.
  """
  rounded = np.float32(bound)
  if (float(rounded) < bound) if up else (float(rounded) > bound):
    rounded = np.nextafter(rounded, np.float32(np.inf if up else -np.inf))
  return rounded


def _float32_bounds(min_scale: float, max_scale: float) -> tuple[np.float32, np.float32]:
  """``[min_scale, max_scale]`` in float32: its ends hold exactly the float32 scales in it.

  A ``max_scale`` beyond float32 (``inf``) bounds at float32's largest number.
  """
  return _f32_rounded(min_scale, up=True), _f32_rounded(min(max_scale, _F32_MAX), up=False)


class DynamicLossScale(LossScale):
  """A loss scale that backs off on overflow and grows after a run of finite steps.

  The rule, applied by ``adjust(grads_finite)`` once per optimizer step, is
  ``torch.amp.GradScaler``'s clamped to ``[min_scale, max_scale]`` (with gradient
  accumulation, :func:`jaxmp.loss_scaling` adjusts on a non-finite micro-batch at once
  and on a finite one only when it completes an optimizer step)::

    if not grads_finite:
      scale = min(scale, clamp(scale * backoff_factor));  counter = 0   # never raised
    else:
      counter += 1
      if counter >= growth_interval:          # the growth_interval-th consecutive finite step
        s = scale * growth_factor
        if isfinite(s): scale = s             # growth that overflows float32 is skipped
        counter = 0                           # reset even when growth was skipped
      scale = clamp(scale)

  where ``clamp`` clips to ``[min_scale, max_scale]``.

  With ``min_scale=0`` and ``max_scale=inf`` the trajectory is torch's for any
  sequence of overflow flags (while the scale stays a normal float32 number: XLA
  flushes subnormals to zero); Keras 3 has the same rule for factors 2 and 0.5. With
  ``min_scale=1`` (the default) and ``max_scale=inf`` it is tf.keras's, and jmp's
  until jmp's scale overflows float32 (jmp does not check). Flax's ``DynamicScale``
  grows one step later (on the ``growth_interval + 1``-th finite step). All
  arithmetic is in float32, with the factors rounded to float32: for factors exactly
  representable in float32 (2.0, 0.5, ...) every value equals torch's bit for bit.

  A restored state may lie outside the bounds: a checkpoint restored into a loss scale
  with other hyperparameters (they are static, so they come from the restore target;
  Orbax and ``jit`` rebuild the state without the constructor, whose checks a restore
  therefore skips). It is clamped, not refused, by the next ``adjust``: a finite step
  brings the scale into the bounds, and an overflow backs off into them without ever
  raising it (a scale below ``min_scale`` stays until the next finite step lifts it to
  ``min_scale``; jmp's rule would raise it to the floor on the overflow). A counter
  at or past ``growth_interval`` grows the scale at the next finite step.

  Args:
    scale: the initial scale: a positive, finite number of any real dtype (Python,
      numpy or jax; float16 included) in ``[min_scale, max_scale]``. May be traced:
      where a concrete value out of range is refused, a traced one makes the scale
      NaN (every step it scales is then skipped by ``jaxmp.loss_scaling``; see
      ``check_scale`` in ``jaxmp._src.loss_scale``).
    growth_interval: the number of consecutive finite steps after which the scale
      grows; an integer >= 1.
    growth_factor: what the scale is multiplied by when it grows; > 1.
    backoff_factor: what the scale is multiplied by on overflow; in (0, 1).
    min_scale: the scale never backs off below this; >= 0 (0: no lower bound).
    max_scale: the scale never grows above this; >= min_scale, may be ``inf``.
    counter: the number of consecutive finite steps so far, for restoring a state by
      hand; in ``[0, growth_interval)``. May be traced: a traced counter out of
      range makes the scale NaN, as for ``scale``.

  Attributes:
    loss_scale: the current scale, a float32 scalar array (a pytree leaf).
    counter: consecutive finite steps since the last growth or overflow, an int32
      scalar array (a pytree leaf).
    growth_interval, growth_factor, backoff_factor, min_scale, max_scale: the
      hyperparameters, Python numbers kept as static pytree aux data.

  Raises:
    ValueError: for a hyperparameter outside the range given above.
    TypeError: for a hyperparameter that is not a number (or not an integer where
      one is needed).

  Example:
    >>> ls = jaxmp.DynamicLossScale(scale=4.0, growth_interval=1, max_scale=8.0)
    >>> [float((ls := ls.adjust(True)).loss_scale) for _ in range(3)]
    [8.0, 8.0, 8.0]
  """

  __slots__ = ("_loss_scale", "_counter", "_hparams")

  def __init__(
      self,
      scale: ArrayLike = 2.0**15,
      growth_interval: int = 2000,
      growth_factor: float = 2.0,
      backoff_factor: float = 0.5,
      min_scale: float = 1.0,
      max_scale: float = 2.0**24,
      *,
      counter: Any = 0,
  ):
    owner = "DynamicLossScale"
    if isinstance(growth_interval, (bool, np.bool_)) or not isinstance(
        growth_interval, (int, np.integer)):
      raise TypeError(
          f"{owner}: growth_interval must be an integer >= 1, got {growth_interval!r}.")
    growth_interval = int(growth_interval)
    if not 1 <= growth_interval <= _INT32_MAX:
      raise ValueError(
          f"{owner}: growth_interval must be an integer in [1, {_INT32_MAX}], got "
          f"{growth_interval}.")
    growth_factor = checks.real_number(growth_factor, "growth_factor", where=owner)
    if not (1.0 < growth_factor < math.inf):
      raise ValueError(
          f"{owner}: growth_factor must be finite and > 1 (the scale grows by it), got "
          f"{growth_factor}.")
    backoff_factor = checks.real_number(backoff_factor, "backoff_factor", where=owner)
    if not (0.0 < backoff_factor < 1.0):
      raise ValueError(
          f"{owner}: backoff_factor must be in the open interval (0, 1) (the scale "
          f"shrinks by it), got {backoff_factor}.")
    min_scale = checks.real_number(min_scale, "min_scale", where=owner)
    if not (0.0 <= min_scale <= _F32_MAX):
      raise ValueError(
          f"{owner}: min_scale must be >= 0 and finite in float32 (0: no lower bound), "
          f"got {min_scale}.")
    max_scale = checks.real_number(max_scale, "max_scale", where=owner)
    if not (max_scale > 0.0):
      raise ValueError(f"{owner}: max_scale must be > 0 (inf: no upper bound), got {max_scale}.")
    if min_scale > max_scale:
      raise ValueError(
          f"{owner}: min_scale must be <= max_scale, got min_scale={min_scale} > "
          f"max_scale={max_scale}.")
    loss_scale = check_scale(scale, where=owner)
    if checks.is_traced(scale):
      low, high = _float32_bounds(min_scale, max_scale)
      loss_scale = poison_unless((loss_scale >= low) & (loss_scale <= high), loss_scale)
    else:
      # From the concrete argument, not from ``loss_scale``: under ``jax.eval_shape`` or
      # ``jit`` (building a restore target, say) that array is a tracer.
      value = float(np.float32(checks.real_number(scale, "scale", where=owner)))
      if not min_scale <= value <= max_scale:
        raise ValueError(
            f"{owner}: scale must be in [min_scale, max_scale] = [{min_scale}, {max_scale}], "
            f"got {scale!r}; widen the bounds or change the scale.")
    if checks.is_traced(counter):
      if np.shape(counter) != () or not jnp.issubdtype(counter.dtype, jnp.integer):
        raise TypeError(f"{owner}: counter must be an integer scalar, got {counter!r}.")
      loss_scale = poison_unless((counter >= 0) & (counter < growth_interval), loss_scale)
    else:
      if isinstance(counter, (bool, np.bool_)) or not (
          isinstance(counter, (int, np.integer)) or (
              isinstance(counter, (np.ndarray, jax.Array)) and counter.shape == ()
              and jnp.issubdtype(counter.dtype, jnp.integer))):
        raise TypeError(f"{owner}: counter must be an integer, got {counter!r}.")
      if not 0 <= int(counter) < growth_interval:
        raise ValueError(
            f"{owner}: counter must be in [0, growth_interval) = [0, {growth_interval}), "
            f"got {int(counter)}.")
    hparams = (growth_interval, growth_factor, backoff_factor, min_scale, max_scale)
    object.__setattr__(self, "_loss_scale", loss_scale)
    object.__setattr__(self, "_counter", jnp.asarray(counter, jnp.int32))
    object.__setattr__(self, "_hparams", hparams)

  @property
  def loss_scale(self) -> jax.Array:
    return self._loss_scale

  @property
  def counter(self) -> jax.Array:
    return self._counter

  growth_interval = property(lambda self: self._hparams[0])
  growth_factor = property(lambda self: self._hparams[1])
  backoff_factor = property(lambda self: self._hparams[2])
  min_scale = property(lambda self: self._hparams[3])
  max_scale = property(lambda self: self._hparams[4])

  def adjust(self, grads_finite: ArrayLike) -> DynamicLossScale:
    """The loss scale after a step whose gradients were (not) finite; jit-safe.

    Args:
      grads_finite: a scalar bool (Python or array, traced or not), e.g.
        ``jaxmp.all_finite(unscaled_grads)``.

    Returns:
      A new ``DynamicLossScale`` with the same hyperparameters.

    Raises:
      TypeError: if ``grads_finite`` is not boolean.
      ValueError: if ``grads_finite`` is not a scalar.
    """
    finite = check_grads_finite(grads_finite, owner="DynamicLossScale.adjust")
    f32 = jnp.float32
    scale = jnp.asarray(self._loss_scale, f32)
    counter = jnp.asarray(self._counter, jnp.int32)
    low, high = _float32_bounds(self.min_scale, self.max_scale)

    # min(scale, ...): a scale below min_scale (restored into tighter bounds) stays
    # where it is; backing off must never raise it.
    backed_off = jnp.minimum(scale, jnp.clip(scale * f32(self.backoff_factor), low, high))
    next_counter = counter + 1
    grow = next_counter >= self.growth_interval
    grown = scale * f32(self.growth_factor)
    # Growth that overflows float32 is skipped, as torch skips it.
    kept = jnp.where(grow & jnp.isfinite(grown), grown, scale)

    new_scale = jnp.where(finite, jnp.clip(kept, low, high), backed_off)
    new_counter = jnp.where(finite & ~grow, next_counter, jnp.zeros((), jnp.int32))
    return self._replace_leaves(new_scale, new_counter)

  def _replace_leaves(self, loss_scale, counter) -> DynamicLossScale:
    return type(self)._tree_unflatten(self._hparams, (loss_scale, counter))

  def __repr__(self) -> str:
    return (f"DynamicLossScale(loss_scale={self._loss_scale!r}, counter={self._counter!r}, "
            f"growth_interval={self.growth_interval}, growth_factor={self.growth_factor}, "
            f"backoff_factor={self.backoff_factor}, min_scale={self.min_scale}, "
            f"max_scale={self.max_scale})")

  def _tree_flatten_with_keys(self):
    children = ((jax.tree_util.GetAttrKey("loss_scale"), self._loss_scale),
                (jax.tree_util.GetAttrKey("counter"), self._counter))
    return children, self._hparams

  def _tree_flatten(self):
    return (self._loss_scale, self._counter), self._hparams

  @classmethod
  def _tree_unflatten(cls, aux, children):
    out = object.__new__(cls)
    object.__setattr__(out, "_loss_scale", children[0])
    object.__setattr__(out, "_counter", children[1])
    object.__setattr__(out, "_hparams", aux)
    return out


jax.tree_util.register_pytree_with_keys(
    DynamicLossScale, DynamicLossScale._tree_flatten_with_keys,
    DynamicLossScale._tree_unflatten, DynamicLossScale._tree_flatten)


__all__ = ("DynamicLossScale",)
