"""What a dtype would do to a tree's values: flushed to zero, subnormal, overflowed.

:func:`underflow_report` counts, for every floating-point leaf of a tree (gradients,
activations, params), how many nonzero values a dtype would flush to zero, make
subnormal or overflow at a given loss scale, and which power-of-two loss scale brings
them into range. :func:`underflow_stats` is its jit-able core.

Example:
  >>> report = jaxmp.tools.underflow_report({"g": jnp.array([1e-8, 2.0**-20, 1.0, 7e4])},
  ...                                       "float16")
  >>> report.underflow_fraction, report.subnormal_fraction, report.overflow_fraction
  (0.25, 0.25, 0.25)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxmp._src import checks
from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src.tools import leaves as leaves_lib
from jaxmp._src.tools import table

ROOT = leaves_lib.ROOT
_TOTAL = "<all>"


class LeafStats(NamedTuple):
  """What a dtype would do to one leaf's values; arrays, so it can be returned from jit.

  Counts are over the leaf's *nonzero finite* values ``x``, classified by where
  ``|x| * loss_scale`` rounds in the dtype (see :func:`jaxmp.tools.underflow_stats`).

  Attributes:
    nonzero: nonzero finite values (int32).
    nonfinite: inf and NaN values, not counted anywhere else (int32).
    underflow: values that round to zero (int32).
    subnormal: values that round to a nonzero subnormal (int32).
    overflow: values that round past the largest finite value (int32).
    max_abs: the largest finite ``|x|``, unscaled (0 if none).
    min_abs: the smallest nonzero finite ``|x|``, unscaled (inf if none).
  """

  nonzero: jax.Array
  nonfinite: jax.Array
  underflow: jax.Array
  subnormal: jax.Array
  overflow: jax.Array
  max_abs: jax.Array
  min_abs: jax.Array


@dataclasses.dataclass(frozen=True)
class _Boundaries:
  """Where values round to zero, to a normal number, and past the largest finite one."""

  zero: float       # |y| <= zero rounds to 0
  normal: float     # |y| >= normal rounds to a normal number (min_normal or more)
  overflow: float   # |y| > overflow (or >= with infinities) overflows
  inclusive_overflow: bool


def _boundaries(fmt: dtypes_lib.FloatFormat) -> _Boundaries:
  # Round to nearest, ties to even, as XLA converts on CPU and GPU:
  # - min_subnormal/2 is the midpoint between 0 and the smallest subnormal: the tie
  #   goes to 0 (even), so values up to and including it flush to zero.
  # - min_normal - min_subnormal/2 is the midpoint between the largest subnormal (odd
  #   mantissa) and min_normal (even): it and everything above round to a normal number.
  # - max + ulp(max)/2 is the midpoint between max and the next binade. With
  #   infinities max's mantissa is all ones (odd), so the tie rounds up to inf. In
  #   float8_e4m3fn max = 448 has mantissa 110 (even; 111 at that exponent is NaN), so
  #   the tie rounds down to 448 and only larger values overflow (to NaN).
  ulp_max = 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits)
  return _Boundaries(
      zero=fmt.min_subnormal / 2,
      normal=fmt.min_normal - fmt.min_subnormal / 2,
      overflow=fmt.max + ulp_max / 2,
      inclusive_overflow=fmt.has_inf,
  )


def _concrete_scale(loss_scale: Any, where: str) -> float:
  """A loss scale (number, scalar array or jaxmp.LossScale) as a positive finite float."""
  return float(loss_scale_lib.loss_scale_array(loss_scale, where=where, allow_traced=False))


def _leaf_stats(x: jax.Array, bounds: _Boundaries, target: np.dtype, scale: Any) -> LeafStats:
  wide = dtypes_lib.arithmetic_dtype(x.dtype, target)
  magnitude = jnp.abs(jnp.asarray(x).astype(wide))
  finite = jnp.isfinite(magnitude)
  nonzero = finite & (magnitude > 0)
  scaled = magnitude * jnp.asarray(scale, wide)
  over = scaled >= bounds.overflow if bounds.inclusive_overflow else scaled > bounds.overflow
  count = lambda mask: jnp.sum(mask, dtype=jnp.int32)
  return LeafStats(
      nonzero=count(nonzero),
      nonfinite=count(~finite),
      underflow=count(nonzero & (scaled <= bounds.zero)),
      subnormal=count(nonzero & (scaled > bounds.zero) & (scaled < bounds.normal)),
      overflow=count(nonzero & over),
      max_abs=jnp.max(jnp.where(finite, magnitude, 0), initial=0).astype(jnp.float32),
      min_abs=jnp.min(jnp.where(nonzero, magnitude, jnp.inf), initial=jnp.inf).astype(
          jnp.float32),
  )


def underflow_stats(tree: Any, dtype: dtypes_lib.DTypeLike,
                    loss_scale: loss_scale_lib.LossScale | ArrayLike = 1.0
                    ) -> dict[str, LeafStats]:
  """Per-leaf counts of values ``dtype`` would flush, make subnormal or overflow; jit-able.

  Each nonzero finite value ``x`` of every floating-point leaf is multiplied by
  ``loss_scale`` in float32 (float64 for float64 data) and classified by where
  ``y = |x| * loss_scale`` rounds in ``dtype`` under round-to-nearest-even, the rounding
  of XLA's conversions on CPU and GPU:

  * underflow: ``y <= min_subnormal / 2`` rounds to zero (the midpoint goes to the
    even neighbour, zero);
  * subnormal: ``min_subnormal / 2 < y < min_normal - min_subnormal / 2`` rounds to a
    nonzero subnormal (from the midpoint up, values round to ``min_normal``);
  * overflow: ``y >= max + ulp(max) / 2`` rounds to inf; for float8_e4m3fn, which has
    no inf, ``y > max + ulp(max) / 2 = 464`` becomes NaN (464 itself rounds to 448).
    Values that round to ``max`` do not overflow.

  Zeros, infs and NaNs are in no class (infs and NaNs are counted in ``nonfinite``).
  XLA flushes float32 subnormals (below 2**-126) to zero on CPUs and GPUs, so there
  float32 data cannot show bfloat16 underflow, which needs values that small.
  Hardware that flushes subnormal results to zero turns the ``subnormal`` class into
  underflow too.

  Args:
    tree: any pytree; its floating-point array leaves (fp8 included; ``nnx.Variable``
      values too) are counted, every other leaf is skipped.
    dtype: the dtype to measure against, any name or dtype
      :func:`jaxmp.tools.parse_dtype` accepts with fp8 allowed (``"float16"``, ``"bf16"``,
      ``"e4m3"``, ``"e5m2"``, ...). Static under jit.
    loss_scale: the factor values are multiplied by first: a number, a scalar array
      (may be traced) or a :class:`jaxmp.LossScale`.

  Returns:
    A dict from each float leaf's '/'-joined path (``"<root>"`` for a bare array) to
    its :class:`~jaxmp._src.tools.underflow.LeafStats`.

  Raises:
    ValueError: for an unknown dtype, or a concrete ``loss_scale`` that is not
      positive and finite.
    TypeError: for a ``loss_scale`` that is not a real scalar.

  Example:
    >>> stats = jax.jit(jaxmp.tools.underflow_stats, static_argnums=1)(
    ...     {"g": jnp.array([1e-8, 3e-5, 1.0])}, "float16", 1024.0)
    >>> int(stats["g"].underflow), int(stats["g"].subnormal)
    (0, 1)
  """
  target = dtypes_lib.parse_dtype(dtype, allow_fp8=True)
  bounds = _boundaries(dtypes_lib.float_format(target))
  if isinstance(loss_scale, loss_scale_lib.LossScale):
    loss_scale = loss_scale.loss_scale
  if not checks.is_traced(loss_scale):
    loss_scale = _concrete_scale(loss_scale, "underflow_stats")
  elif np.shape(loss_scale) != ():
    raise TypeError(f"underflow_stats: loss_scale must be a scalar, got shape "
                    f"{np.shape(loss_scale)}.")
  leaves = leaves_lib.float_leaves(tree)
  return {name: _leaf_stats(x, bounds, target, loss_scale)
          for name, (_, x) in zip(leaves_lib.path_names(leaves), leaves)}


_underflow_stats_jit = jax.jit(underflow_stats, static_argnums=1)


class UnderflowRow(NamedTuple):
  """One leaf of an :class:`UnderflowReport` (or the total, path ``"<all>"``).

  Fractions are of the nonzero finite values (0.0 where there are none).
  """

  path: str
  dtype: str
  size: int
  nonzero: int
  nonfinite: int
  underflow: int
  subnormal: int
  overflow: int
  max_abs: float
  min_abs: float

  @property
  def underflow_fraction(self) -> float:
    return self.underflow / self.nonzero if self.nonzero else 0.0

  @property
  def subnormal_fraction(self) -> float:
    return self.subnormal / self.nonzero if self.nonzero else 0.0

  @property
  def overflow_fraction(self) -> float:
    return self.overflow / self.nonzero if self.nonzero else 0.0


def _total_row(rows: Sequence[UnderflowRow]) -> UnderflowRow:
  finite_min = [r.min_abs for r in rows if r.nonzero]
  return UnderflowRow(
      path=_TOTAL, dtype="", size=sum(r.size for r in rows),
      nonzero=sum(r.nonzero for r in rows), nonfinite=sum(r.nonfinite for r in rows),
      underflow=sum(r.underflow for r in rows), subnormal=sum(r.subnormal for r in rows),
      overflow=sum(r.overflow for r in rows),
      max_abs=max((r.max_abs for r in rows), default=0.0),
      min_abs=min(finite_min, default=math.inf))


def _rows(stats: dict[str, LeafStats], leaves: list) -> tuple[UnderflowRow, ...]:
  stats = jax.device_get(stats)
  return tuple(
      UnderflowRow(path=name, dtype=np.dtype(x.dtype).name, size=int(np.size(x)),
                   nonzero=int(s.nonzero), nonfinite=int(s.nonfinite),
                   underflow=int(s.underflow), subnormal=int(s.subnormal),
                   overflow=int(s.overflow), max_abs=float(s.max_abs), min_abs=float(s.min_abs))
      for (name, s), (_, x) in zip(stats.items(), leaves))


def _percent(count: int, total: int) -> str:
  if count == 0:
    return "0"
  text = f"{100 * count / total:.2f}"
  return "<0.01" if text == "0.00" else text


def _scale_text(scale: float) -> str:
  exponent = math.log2(scale)
  if exponent == int(exponent):
    return f"2**{int(exponent)} = {scale:g}"
  return f"{scale:g}"


@dataclasses.dataclass(frozen=True)
class UnderflowReport:
  """What a dtype would do to a tree's values; built by :func:`underflow_report`.

  Attributes:
    dtype: the dtype measured against.
    loss_scale: the scale the values were multiplied by.
    rows: one :class:`~jaxmp._src.tools.underflow.UnderflowRow` per floating-point leaf,
      in tree order.
    total: the counts over all leaves (path ``"<all>"``).
    suggested_scale: the power-of-two loss scale :func:`suggest_scale` picks from
      the smallest and largest ``|x|``: just large enough to make every nonzero value
      normal, but no larger than keeps the largest at or below ``max / 2``; ``None``
      when every value is zero or non-finite.
    at_suggested: the total counts at ``suggested_scale``: the underflow that no
      loss scale removes (``None`` with no suggestion).
  """

  dtype: np.dtype
  loss_scale: float
  rows: tuple[UnderflowRow, ...]
  total: UnderflowRow
  suggested_scale: float | None
  at_suggested: UnderflowRow | None

  @property
  def underflow_fraction(self) -> float:
    """The fraction of all nonzero finite values that flush to zero."""
    return self.total.underflow_fraction

  @property
  def subnormal_fraction(self) -> float:
    """The fraction of all nonzero finite values that become subnormal."""
    return self.total.subnormal_fraction

  @property
  def overflow_fraction(self) -> float:
    """The fraction of all nonzero finite values that overflow."""
    return self.total.overflow_fraction

  def row(self, path: str) -> UnderflowRow:
    """The row of the leaf at ``path`` ('/'-joined); KeyError if there is none."""
    for r in self.rows:
      if r.path == path:
        return r
    raise KeyError(f"no float leaf {path!r}; the leaves are {[r.path for r in self.rows]}")

  def __str__(self) -> str:
    t = self.total
    name = self.dtype.name
    lines = [f"{name} at loss scale {_scale_text(self.loss_scale)}: of {t.nonzero:,} nonzero "
             f"finite values, {_percent(t.underflow, t.nonzero)}% flush to zero, "
             f"{_percent(t.subnormal, t.nonzero)}% become subnormal, "
             f"{_percent(t.overflow, t.nonzero)}% overflow"
             + (f" ({t.nonfinite:,} values already inf/NaN)" if t.nonfinite else "")]
    header = ("path", "dtype", "nonzero", "flush %", "subnormal %", "overflow %", "max |x|",
              "min |x|")
    body = [(r.path, r.dtype, f"{r.nonzero:,}", _percent(r.underflow, r.nonzero),
             _percent(r.subnormal, r.nonzero), _percent(r.overflow, r.nonzero),
             f"{r.max_abs:.2e}" if r.nonzero else "-",
             f"{r.min_abs:.2e}" if r.nonzero else "-") for r in (*self.rows, t)]
    lines.append(table.text_table(header, body, (False, False, True, True, True, True, True, True)))
    if self.suggested_scale is None:
      lines.append("no suggested loss scale: no nonzero finite values")
    else:
      s = self.at_suggested
      assert s is not None  # set with suggested_scale
      need, cap = _power_of_two_bounds(t.max_abs, t.min_abs, dtypes_lib.float_format(self.dtype))
      if need > cap:
        why = ("the largest with max |x| x scale <= max / 2: the values span more than "
               f"{name}'s range")
      elif self.suggested_scale == 1.0 and need <= 1.0:
        why = "no scaling needed"
      elif self.suggested_scale == need:
        why = "the smallest that makes every nonzero |x| normal"
      else:
        why = "the largest with max |x| x scale <= max / 2"
      lines.append(
          f"suggested loss scale {_scale_text(self.suggested_scale)} ({why}): "
          f"{_percent(s.underflow, s.nonzero)}% flush to zero, "
          f"{_percent(s.subnormal, s.nonzero)}% subnormal, "
          f"{_percent(s.overflow, s.nonzero)}% overflow")
    return "\n".join(lines)


def _power_of_two_bounds(max_abs: float, min_abs: float,
                         fmt: dtypes_lib.FloatFormat) -> tuple[float, float]:
  """(need, cap): the smallest power of two making ``min_abs`` normal, and the largest
  keeping ``max_abs`` at or below ``max / 2``; exact, in float64."""
  limit = fmt.max / 2
  cap = math.floor(math.log2(limit / max_abs))
  # log2 of a quotient can be off by one at exact powers of two; settle it exactly.
  while max_abs * 2.0 ** cap > limit:
    cap -= 1
  while max_abs * 2.0 ** (cap + 1) <= limit:
    cap += 1
  need = math.ceil(math.log2(fmt.min_normal / min_abs))
  while min_abs * 2.0 ** need < fmt.min_normal:
    need += 1
  while min_abs * 2.0 ** (need - 1) >= fmt.min_normal:
    need -= 1
  return 2.0 ** need, 2.0 ** cap


def _magnitude(value: Any, name: str) -> float:
  value = checks.real_number(value, name, where="suggest_scale")
  if not value >= 0:  # NaN too: a magnitude is never NaN
    raise ValueError(f"suggest_scale: {name} must be a magnitude: >= 0 (inf when there is "
                     f"none), got {value!r}.")
  return value


def suggest_scale(max_abs: float, min_abs: float,
                  dtype: dtypes_lib.DTypeLike) -> float | None:
  """A power-of-two loss scale that brings values in ``[min_abs, max_abs]`` into range.

  The smallest power of two that makes ``min_abs`` a normal number of ``dtype`` (1 if
  it already is: no scaling needed), capped by the largest one that keeps
  ``max_abs * scale <= max / 2``. The cap leaves one binade of headroom, so the next
  step's values may double before they overflow (a :class:`jaxmp.DynamicLossScale`
  backs off by the same factor); it wins, and some values stay subnormal or flush,
  when the values span more binades than the dtype has. A scale below 1 is suggested
  only when ``max_abs`` itself would overflow. Clamped to ``[2**-126, 2**126]``.

  Args:
    max_abs: the largest finite magnitude; >= 0 (0 or inf: nothing to scale).
    min_abs: the smallest nonzero finite magnitude; >= 0, at most ``max_abs`` (0 or
      inf: nothing to scale; :func:`underflow_report` passes inf when no value is
      nonzero and finite).
    dtype: the dtype, as for :func:`underflow_report`.

  Returns:
    The scale, or ``None`` when either magnitude is 0 or inf (nothing to scale).

  Raises:
    TypeError: for a magnitude that is not a real number.
    ValueError: for a negative or NaN magnitude, ``min_abs`` above a finite
      ``max_abs`` (the two swapped), or an unknown dtype.

  Example:
    >>> jaxmp.tools.suggest_scale(1e-3, 1e-6, "float16")  # 1e-6 * 64 >= 2**-14
    64.0
    >>> jaxmp.tools.suggest_scale(1.0, 1e-12, "float16")  # capped: 16384 <= 65504 / 2
    16384.0
  """
  max_abs, min_abs = _magnitude(max_abs, "max_abs"), _magnitude(min_abs, "min_abs")
  if math.isfinite(max_abs) and math.isfinite(min_abs) and min_abs > max_abs:
    raise ValueError(f"suggest_scale: min_abs ({min_abs!r}) is larger than max_abs "
                     f"({max_abs!r}): the arguments are (max_abs, min_abs).")
  if not all(math.isfinite(v) and v > 0 for v in (max_abs, min_abs)):
    return None
  need, cap = _power_of_two_bounds(max_abs, min_abs, dtypes_lib.float_format(dtype))
  return min(max(min(max(need, 1.0), cap), 2.0**-126), 2.0**126)


def underflow_report(grads_or_tree: Any, dtype: dtypes_lib.DTypeLike,
                     loss_scale: loss_scale_lib.LossScale | ArrayLike = 1.0
                     ) -> UnderflowReport:
  """Reports, per leaf and overall, the values ``dtype`` would lose at a loss scale.

  For gradients computed in float32 (say from a float32 run of the model), it answers
  "in float16, how many of these would flush to zero, and what loss scale fixes it?".
  Values are classified exactly as by :func:`underflow_stats` (round to nearest even;
  counts are over nonzero finite values; non-float leaves are skipped); the counting
  runs jitted. Then the smallest and largest ``|x|`` give a suggested power-of-two
  loss scale (:func:`suggest_scale`) and the values are counted again at that scale,
  to show the underflow no loss scale can remove, where the values span more than the
  dtype's range.

  Args:
    grads_or_tree: a pytree of arrays, e.g. gradients (pass them unscaled and say the
      scale in ``loss_scale``) or intermediate activations.
    dtype: ``"float16"``, ``"bfloat16"``, ``"e4m3"``/``"float8_e4m3fn"``,
      ``"e5m2"``/``"float8_e5m2"`` or any dtype :func:`jaxmp.tools.parse_dtype` accepts.
    loss_scale: the factor the values are multiplied by: a positive finite number,
      a concrete scalar array, or a :class:`jaxmp.LossScale` (its current scale).

  Returns:
    An :class:`UnderflowReport`; ``print`` it for the table.

  Raises:
    ValueError: for an unknown dtype, a ``loss_scale`` that is not positive and
      finite, or a tree with no floating-point array leaves.
    TypeError: for a ``loss_scale`` that is not a real scalar.

  Example:
    >>> report = jaxmp.tools.underflow_report(
    ...     {"w": jnp.array([1e-8, 1e-3]), "b": jnp.array([70000.0])}, "float16")
    >>> report.row("w").underflow, report.row("b").overflow
    (1, 1)
    >>> report.suggested_scale, report.at_suggested.overflow
    (0.25, 0)
  """
  target = dtypes_lib.parse_dtype(dtype, allow_fp8=True)
  scale = _concrete_scale(loss_scale, "underflow_report")
  leaves = leaves_lib.float_leaves(grads_or_tree)
  if not leaves:
    types = sorted({type(x).__name__ for x in jax.tree_util.tree_leaves(grads_or_tree)})
    raise ValueError(f"underflow_report: the tree has no floating-point array leaves (got "
                     f"{type(grads_or_tree).__name__} with leaves of types {types}).")
  arrays = [x for _, x in leaves]
  stats = _underflow_stats_jit(_named_tree(leaves, arrays), target, jnp.float32(scale))
  rows = _rows(stats, leaves)
  total = _total_row(rows)
  suggested = suggest_scale(total.max_abs, total.min_abs, target)
  at_suggested = None
  if suggested is not None:
    again = _underflow_stats_jit(_named_tree(leaves, arrays), target, jnp.float32(suggested))
    at_suggested = _total_row(_rows(again, leaves))
  return UnderflowReport(target, scale, rows, total, suggested, at_suggested)


def _named_tree(leaves: list, arrays: list) -> dict[str, jax.Array]:
  # A flat dict keyed by the unique names: what the jitted core sees, so that its
  # keys are exactly the report's paths and nnx/variable wrappers are gone.
  return dict(zip(leaves_lib.path_names(leaves), arrays))



__all__ = (
    "LeafStats",
    "UnderflowReport",
    "UnderflowRow",
    "suggest_scale",
    "underflow_report",
    "underflow_stats",
)
