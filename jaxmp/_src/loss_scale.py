"""Loss scales: immutable pytrees that scale a loss up and its gradients back down.

In float16 small gradients underflow to zero. Multiplying the loss by a large factor
(the *loss scale*) before differentiating shifts every gradient up by the same factor;
dividing the gradients by it afterwards (*unscaling*) gives the true gradients back.
Too large a scale overflows instead, so a :class:`DynamicLossScale` backs off when a
step's gradients are not finite and grows again after a run of finite steps.

Three loss scales share one interface (:class:`LossScale`):

* :class:`NoOpLossScale`: scale 1, nothing is multiplied (bfloat16 and fp8 training).
* :class:`StaticLossScale`: a fixed scale.
* :class:`~jaxmp.DynamicLossScale` (in :mod:`jaxmp._src.dynamic_loss_scale`):
  ``torch.amp.GradScaler``'s rule, clamped to ``[min_scale, max_scale]``.

Each is a registered pytree. The scale (a float32 array) and the dynamic counter (an
int32 array) are leaves; the hyperparameters are static, hashable aux data, so
every field survives ``jax.tree_util`` flatten/unflatten, ``jit`` and checkpointing.
``adjust`` returns a new object and is safe inside ``jit``, ``vmap`` and ``scan``.

Scaling arithmetic is done in float32 (float64 for float64 leaves) whatever dtype the
scale or the tree is in, and each leaf is cast back to its own dtype: unscaling a
float16 gradient multiplies it by ``1/scale`` in float32, where ``1/scale`` is exact
for power-of-two scales and cannot overflow, and the result fits float16 again because
``|g/scale| <= |g|`` for ``scale >= 1``. Keeping the leaf dtype keeps the gradient tree
matching the parameters it is applied to; keep master parameters in float32 (so that
their gradients are float32) when unscaled gradients would underflow float16.

Example:
  >>> ls = jaxmp.StaticLossScale(2.0**15)
  >>> grads = ls.scale({"w": jnp.array([1.0, -2.0])})
  >>> grads["w"]
  Array([ 32768., -65536.], dtype=float32)
  >>> ls.unscale(grads)["w"]
  Array([ 1., -2.], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxmp._src import checks
from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src import pytree as pytree_lib
from jaxmp._src import tree as tree_lib

T = TypeVar("T")

_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).smallest_normal)


# --------------------------------------------------------------------------------------
# Argument checking.


def check_scale(scale: Any, *, where: str, name: str = "scale") -> jax.Array:
  """The one definition of a valid loss scale value, as a float32 scalar array.

  A real scalar (Python, NumPy or JAX; any float or integer dtype, float16 included)
  that is positive, finite and normal in float32, where scaling arithmetic happens
  (XLA flushes float32 subnormals to zero). A traced value's shape and dtype are
  checked when it is traced; its value cannot raise under ``jit``, so a traced value
  outside that range becomes NaN (:func:`poison_unless`): every gradient the scale
  then scales or unscales is NaN, ``jaxmp.loss_scaling`` skips every step, and the
  NaN stays (backing off or growing NaN gives NaN).

  Raises:
    TypeError: for a value that is not a real number.
    ValueError: for an array that is not a scalar, or a value out of that range.
  """
  if checks.is_traced(scale):
    checks.scalar_shape(scale, name, where=where)
    if not checks.is_real_dtype(scale.dtype):
      raise TypeError(f"{where}: {name} must be a real number, got dtype {scale.dtype}.")
    scale = jnp.asarray(scale, jnp.float32)
    return poison_unless((scale >= _F32_TINY) & (scale <= _F32_MAX), scale)
  value = checks.real_number(scale, name, where=where)
  # Compared before rounding to float32, so that 1e39 is not an overflow warning;
  # a value that rounds into the range but lies below it is a subnormal here.
  if not _F32_TINY <= value <= _F32_MAX:  # nan fails too
    raise ValueError(
        f"{where}: {name} must be positive and finite in float32 (values are scaled in "
        f"float32), got {scale!r}; accepted: a normal float32 in [{_F32_TINY:g}, "
        f"{_F32_MAX:g}].")
  return jnp.asarray(value, jnp.float32)


def poison_unless(valid: jax.Array, scale: jax.Array) -> jax.Array:
  """``scale`` where the traced check ``valid`` holds, else NaN: the deterministic
  stand-in for a refusal that ``jit`` cannot raise (see :func:`check_scale`)."""
  return jnp.where(valid, scale, jnp.float32(jnp.nan))


def as_loss_scale(loss_scale: Any, *, where: str) -> LossScale:
  """``loss_scale`` if it is a jaxmp loss scale; ``None`` means no loss scaling.

  The one check of a loss-scale argument. ``None`` has one meaning wherever jaxmp
  takes a loss scale: no scaling, :class:`NoOpLossScale` (a scale of 1). The only
  default that is not ``None``, ``loss_scaling``'s (``DynamicLossScale()``), is
  spelled out in its signature.

  Args:
    loss_scale: the argument.
    where: the function taking it, for the message.

  Returns:
    ``loss_scale``, or ``NoOpLossScale()`` for ``None``.

  Raises:
    TypeError: for anything else (a plain number: the message names the
      ``StaticLossScale`` meant).

  Example:
    >>> from jaxmp._src import loss_scale
    >>> loss_scale.as_loss_scale(None, where="example")
    NoOpLossScale()
  """
  if loss_scale is None:
    return NoOpLossScale()
  if isinstance(loss_scale, LossScale):
    return loss_scale
  hint = ""
  if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
    hint = f"; for a fixed scale pass jaxmp.StaticLossScale({loss_scale!r})"
  raise TypeError(
      f"{where}: loss_scale must be a jaxmp loss scale (NoOpLossScale, StaticLossScale, "
      f"DynamicLossScale, or jaxmp.get_loss_scale(opt_state)) or None for no scaling, "
      f"got {loss_scale!r} of type {type(loss_scale).__name__}{hint}.")


def loss_scale_array(loss_scale: Any, *, where: str, allow_traced: bool = True) -> jax.Array:
  """A :class:`LossScale`'s scale, or a number or scalar array checked as one.

  For the tools, which take a scale as a number too; ``None`` is no scaling (scale 1),
  as for :func:`as_loss_scale`.

  Raises:
    TypeError: for anything that is not a loss scale, ``None`` or a real scalar, or a
      traced value where ``allow_traced`` is False.
    ValueError: as :func:`check_scale`.
  """
  if loss_scale is None or isinstance(loss_scale, LossScale):
    return as_loss_scale(loss_scale, where=where).loss_scale
  checks.real_scalar_array(loss_scale, "loss_scale", where=where)
  if checks.is_traced(loss_scale) and not allow_traced:
    raise TypeError(f"{where}: loss_scale must be concrete here (call it outside jit), got a "
                    f"traced value.")
  return check_scale(loss_scale, where=where, name="loss_scale")


def check_grads_finite(grads_finite: Any, *, owner: str = "adjust") -> jax.Array:
  """``grads_finite`` as a ``bool[]`` array, checked by :func:`jaxmp._src.checks.bool_scalar`."""
  return jnp.asarray(checks.bool_scalar(grads_finite, "grads_finite", where=owner))


# --------------------------------------------------------------------------------------
# Scaling arithmetic.


def _multiply_tree(tree: T, factor: jax.Array) -> T:
  """Multiplies the floating-point leaves by the float32 ``factor``, each keeping its dtype.

  NumPy float scalars and Python floats count (``tree.is_float_leaf``) and come back as
  scalar arrays of their dtype (float32 for a Python float).
  """

  def multiply(x):
    if not tree_lib.is_float_leaf(x):
      return x
    dtype = tree_lib.float_leaf_dtype(x)
    wide = dtypes_lib.arithmetic_dtype(dtype)
    return (jnp.asarray(x, wide) * factor.astype(wide)).astype(dtype)

  return jax.tree_util.tree_map(multiply, tree)


def _loss_and_aux(out: Any, has_aux: bool) -> tuple[Any, Any]:
  if not has_aux:
    return out, None
  if not (isinstance(out, tuple) and len(out) == 2):
    raise TypeError("value_and_grad(has_aux=True): fun must return a pair (loss, aux), got "
                    f"{type(out).__name__}.")
  return out


# --------------------------------------------------------------------------------------
# The loss scales.


class LossScale(pytree_lib.Immutable):
  """The interface every loss scale implements (not instantiated itself).

  Loss scales are immutable values (``jaxmp._src.pytree.Immutable``): they copy,
  deep-copy and pickle, and compare equal by value (same class, same
  hyperparameters, equal scale and counter), with a hash of the class and the
  hyperparameters.

  Attributes:
    loss_scale: the current scale, a float32 scalar array.

  Example:
    >>> scales = (jaxmp.NoOpLossScale(), jaxmp.StaticLossScale(4.0),
    ...           jaxmp.DynamicLossScale(8.0))
    >>> all(isinstance(ls, jaxmp.LossScale) for ls in scales)
    True
    >>> [float(ls.unscale(jnp.float32(8.0))) for ls in scales]
    [8.0, 2.0, 1.0]
  """

  __slots__ = ()

  _IMMUTABLE_HINT = "adjust() and the constructor return new ones"

  @property
  def loss_scale(self) -> jax.Array:
    raise NotImplementedError

  def scale(self, tree: T) -> T:
    """Multiplies the floating-point leaves of ``tree`` by the loss scale.

    The product is computed in float32 (float64 for float64 leaves) and cast back to
    each leaf's dtype. NumPy float scalars and Python floats are scaled too, returned
    as scalar arrays of their dtype (a Python float as float32); integer, bool, key
    and other leaves pass through.
    """
    return _multiply_tree(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Multiplies the floating-point leaves of ``tree`` by ``1 / loss_scale``.

    Like ``torch.amp.GradScaler.unscale_``, the reciprocal is taken once in float32
    and every leaf is multiplied by it in float32 (float64 for float64 leaves), then
    cast back to its own dtype. For power-of-two scales this is exact. The same
    leaves count as for :meth:`scale`, NumPy float scalars and Python floats included.
    """
    return _multiply_tree(tree, jnp.float32(1.0) / self.loss_scale)

  def adjust(self, grads_finite: ArrayLike) -> LossScale:
    """The loss scale for the next step, given whether this step's grads were finite."""
    raise NotImplementedError

  def scaled_fun(self, fun: Callable[..., Any], *,
                 has_aux: bool = False) -> Callable[..., tuple[jax.Array, tuple[Any, Any]]]:
    """``fun`` made to return ``(loss * loss_scale, (loss, aux))``, for ``jax.grad(has_aux=True)``.

    The loss is cast to float32 (float64 kept) before it is multiplied; ``aux`` is
    ``None`` without ``has_aux``. Every jaxmp ``value_and_grad`` differentiates this.

    Raises:
      TypeError: if ``fun`` is not callable, or returns no ``(loss, aux)`` pair with
        ``has_aux``.
    """
    if not callable(fun):
      raise TypeError(f"value_and_grad: fun must be callable, got {fun!r}.")

    def scaled(*args, **kwargs):
      loss, aux = _loss_and_aux(fun(*args, **kwargs), has_aux)
      loss_array = jnp.asarray(loss)
      wide = dtypes_lib.arithmetic_dtype(loss_array.dtype)
      return self._scale_loss(loss_array.astype(wide)), (loss, aux)

    return scaled

  def _scale_loss(self, loss: jax.Array) -> jax.Array:
    return loss * self.loss_scale.astype(loss.dtype)

  def value_and_grad(self, fun: Callable[..., Any], *, has_aux: bool = False,
                     argnums: int | Sequence[int] = 0) -> Callable[..., Any]:
    """Like ``jax.value_and_grad``, but differentiates the scaled loss.

    The returned function computes ``fun(*args, **kwargs)`` once and differentiates
    ``loss * loss_scale`` (the loss cast to float32 first, or kept in float64), so it
    returns the *unscaled* loss and the *scaled* gradients: exactly what the update
    of :func:`jaxmp.loss_scaling` expects.

    Args:
      fun: a function returning a scalar loss, or ``(loss, aux)`` with ``has_aux``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      argnums: which positional argument(s) to differentiate, as in ``jax.grad``.

    Returns:
      A function returning ``(loss, scaled_grads)``, or ``((loss, aux),
      scaled_grads)`` with ``has_aux``; ``loss`` is in the dtype ``fun`` returned it in.

    Example:
      >>> ls = jaxmp.StaticLossScale(8.0)
      >>> loss, grads = ls.value_and_grad(lambda w: jnp.sum(w ** 2))(jnp.array([1.0, 2.0]))
      >>> loss, grads
      (Array(5., dtype=float32), Array([16., 32.], dtype=float32))
    """
    grad_fn = jax.grad(self.scaled_fun(fun, has_aux=has_aux), argnums=argnums, has_aux=True)

    def value_and_scaled_grad(*args, **kwargs):
      grads, (loss, aux) = grad_fn(*args, **kwargs)
      return ((loss, aux) if has_aux else loss), grads

    return value_and_scaled_grad


class NoOpLossScale(LossScale):
  """No loss scaling: a scale of 1 that multiplies nothing (bfloat16 / fp8 training).

  A pytree without leaves. ``scale``/``unscale`` return the tree unchanged and
  ``adjust`` returns ``self``.

  Example:
    >>> ls = jaxmp.NoOpLossScale()
    >>> float(ls.loss_scale), ls.unscale({"g": 1.0})
    (1.0, {'g': 1.0})
  """

  __slots__ = ()

  @property
  def loss_scale(self) -> jax.Array:
    return jnp.ones((), jnp.float32)

  def scale(self, tree: T) -> T:
    """Returns ``tree`` itself: nothing is scaled."""
    return tree

  def unscale(self, tree: T) -> T:
    """Returns ``tree`` itself: nothing is unscaled."""
    return tree

  def adjust(self, grads_finite: ArrayLike) -> NoOpLossScale:
    """Returns ``self`` (after checking that ``grads_finite`` is a scalar bool)."""
    check_grads_finite(grads_finite, owner="NoOpLossScale.adjust")
    return self

  def _scale_loss(self, loss: jax.Array) -> jax.Array:
    return loss

  def value_and_grad(self, fun, *, has_aux=False, argnums=0):
    """``jax.value_and_grad(fun, argnums, has_aux)``: there is nothing to scale."""
    if not callable(fun):
      raise TypeError(f"value_and_grad: fun must be callable, got {fun!r}.")
    return jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

  def __repr__(self) -> str:
    return "NoOpLossScale()"

  def _tree_flatten_with_keys(self):
    return (), None

  def _tree_flatten(self):
    return (), None

  @classmethod
  def _tree_unflatten(cls, aux, children):
    del aux, children
    return cls()


class StaticLossScale(LossScale):
  """A fixed loss scale.

  Args:
    scale: a positive, finite number: Python number, numpy or jax scalar of any float
      or integer dtype (float16 included). Stored as a float32 scalar array, the only
      leaf of this pytree. May be traced: a traced value outside that range is
      stored as NaN (see ``check_scale``).

  Raises:
    ValueError: if ``scale`` is not positive and finite in float32.
    TypeError: if ``scale`` is not a real number.

  Example:
    >>> ls = jaxmp.StaticLossScale(jnp.float16(1024))
    >>> ls.loss_scale, ls.adjust(False).loss_scale
    (Array(1024., dtype=float32), Array(1024., dtype=float32))
  """

  __slots__ = ("_loss_scale",)

  def __init__(self, scale: ArrayLike):
    object.__setattr__(self, "_loss_scale", check_scale(scale, where="StaticLossScale"))

  @property
  def loss_scale(self) -> jax.Array:
    return self._loss_scale

  def adjust(self, grads_finite: ArrayLike) -> StaticLossScale:
    """Returns ``self`` (after checking that ``grads_finite`` is a scalar bool)."""
    check_grads_finite(grads_finite, owner="StaticLossScale.adjust")
    return self

  def __repr__(self) -> str:
    return f"StaticLossScale(scale={self._loss_scale!r})"

  def _tree_flatten_with_keys(self):
    return ((jax.tree_util.GetAttrKey("loss_scale"), self._loss_scale),), None

  def _tree_flatten(self):
    return (self._loss_scale,), None

  @classmethod
  def _tree_unflatten(cls, aux, children):
    del aux
    # Unflatten takes leaves as they come (tracers, ShapeDtypeStructs, shardings,
    # NNX variables, None, ...) without checking them: they are not user input.
    out = object.__new__(cls)
    object.__setattr__(out, "_loss_scale", children[0])
    return out


jax.tree_util.register_pytree_with_keys(
    NoOpLossScale, NoOpLossScale._tree_flatten_with_keys, NoOpLossScale._tree_unflatten,
    NoOpLossScale._tree_flatten)
jax.tree_util.register_pytree_with_keys(
    StaticLossScale, StaticLossScale._tree_flatten_with_keys, StaticLossScale._tree_unflatten,
    StaticLossScale._tree_flatten)


__all__ = (
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "as_loss_scale",
    "check_grads_finite",
    "check_scale",
    "loss_scale_array",
    "poison_unless",
)
