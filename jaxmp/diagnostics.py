"""Where precision is lost: range reports for a tree, and per-module sensitivity.

Mixed precision fails quietly: small gradients flush to zero in float16, one layer's
output overflows, a module that subtracts nearly equal numbers loses every digit in
bfloat16. Two tools answer "what would this dtype do to my values?" and "which modules
can compute in half precision?":

* :func:`underflow_report` counts, for every floating-point leaf of a tree (gradients,
  activations, params), how many nonzero values a dtype would flush to zero, make
  subnormal or overflow at a given loss scale, and which power-of-two loss scale
  brings them into range. :func:`underflow_stats` is its jit-able core.
* :func:`sensitivity` runs each module of a Flax model (linen or NNX) alone in each
  candidate dtype, with the rest in float32, ranks the modules by how far the output
  moves, and recommends :class:`~jaxmp.PolicyRules` that keep only the sensitive ones
  in float32. :func:`deviation` measures any rules the same way.

Example:
  >>> report = jaxmp.underflow_report({"g": jnp.array([1e-8, 2.0**-20, 1.0, 7e4])},
  ...                                 "float16")
  >>> report.underflow_fraction, report.subnormal_fraction, report.overflow_fraction
  (0.25, 0.25, 0.25)
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp import dtypes as dtypes_lib
from jaxmp import linen as linen_lib
from jaxmp import loss_scale as loss_scale_lib
from jaxmp import nnx as nnx_lib
from jaxmp import policy as policy_lib
from jaxmp import rules as rules_lib
from jaxmp import tree as tree_lib
# From its module: once jaxmp is loaded, the attribute jaxmp.summary is this function.
from jaxmp.summary import summary as precision_summary
from jaxmp.summary import text_table

ROOT = "<root>"
_TOTAL = "<all>"

# ---- pytree paths ------------------------------------------------------------------------------


def _key_name(key: Any) -> str:
  for attribute in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def float_leaves(tree: Any) -> list[tuple[tuple[str, ...], jax.Array]]:
  """The floating-point array leaves of ``tree`` with their paths as name tuples.

  An ``nnx.Variable`` counts as one leaf (its value), so an ``nnx.State`` of
  gradients gives paths such as ``("linear", "kernel")``, not ``(..., "value")``.
  Integer, bool, PRNG-key and non-array leaves are left out.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)
  leaves = []
  for path, leaf in flat:
    if _is_variable(leaf):
      leaf = leaf.get_raw_value()
    if tree_lib.is_float_array(leaf):
      leaves.append((tuple(_key_name(k) for k in path), leaf))
  return leaves


def _path_names(leaves: list[tuple[tuple[str, ...], Any]]) -> list[str]:
  """'/'-joined, unique names: ``ROOT`` for a bare array, an index for clashes."""
  names: list[str] = []
  seen: set[str] = set()
  for path, _ in leaves:
    name = "/".join(path) or ROOT
    if name in seen:  # e.g. dict keys 1 and "1"
      name = f"{name}#{len(names)}"
    seen.add(name)
    names.append(name)
  return names


# ---- underflow / overflow ----------------------------------------------------------------------


class LeafStats(NamedTuple):
  """What a dtype would do to one leaf's values; arrays, so it can be returned from jit.

  Counts are over the leaf's *nonzero finite* values ``x``, classified by where
  ``|x| * loss_scale`` rounds in the dtype (see :func:`underflow_stats`).

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


def _is_traced(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def _concrete_scale(loss_scale: Any, where: str) -> float:
  """A loss scale (number, scalar array or jaxmp.LossScale) as a positive finite float."""
  value = loss_scale
  if isinstance(value, loss_scale_lib.LossScale):
    value = value.loss_scale
  if (value is None or isinstance(value, (bool, np.bool_, str))
      or not (isinstance(value, (int, float, np.number)) or hasattr(value, "dtype"))):
    raise TypeError(f"{where}: loss_scale must be a positive number, a scalar array or a "
                    f"jaxmp.LossScale, got {loss_scale!r} of type {type(loss_scale).__name__}.")
  if _is_traced(value):
    raise TypeError(f"{where}: loss_scale must be concrete here (call it outside jit, or use "
                    f"jaxmp.diagnostics.underflow_stats inside jit), got a traced value.")
  array = np.asarray(value)
  if array.shape != () or not (np.issubdtype(array.dtype, np.floating)
                               or np.issubdtype(array.dtype, np.integer)):
    raise TypeError(f"{where}: loss_scale must be a real scalar, got {loss_scale!r} "
                    f"(shape {array.shape}, dtype {array.dtype}).")
  number = float(array)
  f32 = np.finfo(np.float32)
  if not float(f32.smallest_normal) <= number <= float(f32.max):  # nan fails too
    raise ValueError(f"{where}: loss_scale must be positive and finite in float32 (values are "
                     f"scaled in float32), got {loss_scale!r}.")
  return number


def _wide_dtype(leaf_dtype: np.dtype, target: np.dtype) -> np.dtype:
  # float32 holds every float16/bfloat16/fp8 value and boundary exactly; float64 data
  # (or a float64 target) is measured in float64 where jax_enable_x64 allows it.
  if np.dtype(np.float64) in (np.dtype(leaf_dtype), np.dtype(target)):
    return jax.dtypes.canonicalize_dtype(np.float64)
  return np.dtype(np.float32)


def _leaf_stats(x: jax.Array, bounds: _Boundaries, target: np.dtype, scale: Any) -> LeafStats:
  wide = _wide_dtype(x.dtype, target)
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
                    loss_scale: Any = 1.0) -> dict[str, LeafStats]:
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
      :func:`jaxmp.parse_dtype` accepts with fp8 allowed (``"float16"``, ``"bf16"``,
      ``"e4m3"``, ``"e5m2"``, ...). Static under jit.
    loss_scale: the factor values are multiplied by first: a number, a scalar array
      (may be traced) or a :class:`jaxmp.LossScale`.

  Returns:
    A dict from each float leaf's '/'-joined path (``"<root>"`` for a bare array) to
    its :class:`LeafStats`.

  Raises:
    ValueError: for an unknown dtype, or a concrete ``loss_scale`` that is not
      positive and finite.
    TypeError: for a ``loss_scale`` that is not a real scalar.

  Example:
    >>> stats = jax.jit(jaxmp.diagnostics.underflow_stats, static_argnums=1)(
    ...     {"g": jnp.array([1e-8, 3e-5, 1.0])}, "float16", 1024.0)
    >>> int(stats["g"].underflow), int(stats["g"].subnormal)
    (0, 1)
  """
  target = dtypes_lib.parse_dtype(dtype, allow_fp8=True)
  bounds = _boundaries(dtypes_lib.float_format(target))
  if isinstance(loss_scale, loss_scale_lib.LossScale):
    loss_scale = loss_scale.loss_scale
  if not _is_traced(loss_scale):
    loss_scale = _concrete_scale(loss_scale, "underflow_stats")
  elif np.shape(loss_scale) != ():
    raise TypeError(f"underflow_stats: loss_scale must be a scalar, got shape "
                    f"{np.shape(loss_scale)}.")
  leaves = float_leaves(tree)
  return {name: _leaf_stats(x, bounds, target, loss_scale)
          for name, (_, x) in zip(_path_names(leaves), leaves)}


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
    rows: one :class:`UnderflowRow` per floating-point leaf, in tree order.
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
  suggested_scale: Optional[float]
  at_suggested: Optional[UnderflowRow]

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
    lines.append(text_table(header, body, (False, False, True, True, True, True, True, True)))
    if self.suggested_scale is None:
      lines.append("no suggested loss scale: no nonzero finite values")
    else:
      s = self.at_suggested
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


def suggest_scale(max_abs: float, min_abs: float,
                  dtype: dtypes_lib.DTypeLike) -> Optional[float]:
  """A power-of-two loss scale that brings values in ``[min_abs, max_abs]`` into range.

  The smallest power of two that makes ``min_abs`` a normal number of ``dtype`` (1 if
  it already is: no scaling needed), capped by the largest one that keeps
  ``max_abs * scale <= max / 2``. The cap leaves one binade of headroom, so the next
  step's values may double before they overflow (a :class:`jaxmp.DynamicLossScale`
  backs off by the same factor); it wins, and some values stay subnormal or flush,
  when the values span more binades than the dtype has. A scale below 1 is suggested
  only when ``max_abs`` itself would overflow. Clamped to ``[2**-126, 2**126]``.

  Args:
    max_abs: the largest magnitude; > 0 and finite.
    min_abs: the smallest nonzero magnitude; > 0 and finite.
    dtype: the dtype, as for :func:`underflow_report`.

  Returns:
    The scale, or ``None`` when either magnitude is 0 or not finite (nothing to scale).

  Example:
    >>> jaxmp.diagnostics.suggest_scale(1e-3, 1e-6, "float16")  # 1e-6 * 64 >= 2**-14
    64.0
    >>> jaxmp.diagnostics.suggest_scale(1.0, 1e-12, "float16")  # capped: 16384 <= 65504 / 2
    16384.0
  """
  if not all(math.isfinite(v) and v > 0 for v in (max_abs, min_abs)):
    return None
  need, cap = _power_of_two_bounds(max_abs, min_abs, dtypes_lib.float_format(dtype))
  return min(max(min(max(need, 1.0), cap), 2.0**-126), 2.0**126)


def underflow_report(grads_or_tree: Any, dtype: dtypes_lib.DTypeLike,
                     loss_scale: Any = 1.0) -> UnderflowReport:
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
      ``"e5m2"``/``"float8_e5m2"`` or any dtype :func:`jaxmp.parse_dtype` accepts.
    loss_scale: the factor the values are multiplied by: a positive finite number,
      a concrete scalar array, or a :class:`jaxmp.LossScale` (its current scale).

  Returns:
    An :class:`UnderflowReport`; ``print`` it for the table.

  Raises:
    ValueError: for an unknown dtype, a ``loss_scale`` that is not positive and
      finite, or a tree with no floating-point array leaves.
    TypeError: for a ``loss_scale`` that is not a real scalar.

  Example:
    >>> report = jaxmp.underflow_report({"w": jnp.array([1e-8, 1e-3]), "b": jnp.array([70000.0])},
    ...                                 "float16")
    >>> report.row("w").underflow, report.row("b").overflow
    (1, 1)
    >>> report.suggested_scale, report.at_suggested.overflow
    (0.25, 0)
  """
  target = dtypes_lib.parse_dtype(dtype, allow_fp8=True)
  scale = _concrete_scale(loss_scale, "underflow_report")
  leaves = float_leaves(grads_or_tree)
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
  return dict(zip(_path_names(leaves), arrays))


# ---- sensitivity ------------------------------------------------------------------------------

Metric = Callable[[Any, Any], Any]


def relative_error(reference: Any, output: Any) -> jax.Array:
  """``||output - reference|| / ||reference||`` over all float leaves, in float32.

  The L2 norms run over every floating-point leaf of the two trees (same structure).
  Where the reference is all zeros the absolute error ``||output||`` is returned. Any
  non-finite value in ``output`` makes the error ``inf``.

  Example:
    >>> float(jaxmp.diagnostics.relative_error(jnp.array([3.0, 4.0]), jnp.array([3.0, 6.5])))
    0.5
  """
  ref = [jnp.asarray(x, jnp.float32) for _, x in float_leaves(reference)]
  out = [jnp.asarray(x, jnp.float32) for _, x in float_leaves(output)]
  if len(ref) != len(out):
    raise ValueError(f"relative_error: the reference has {len(ref)} float leaves and the "
                     f"output {len(out)}.")
  diff = sum(jnp.sum(jnp.square(o - r)) for r, o in zip(ref, out))
  norm = sum(jnp.sum(jnp.square(r)) for r in ref)
  error = jnp.where(norm > 0, jnp.sqrt(diff / jnp.where(norm > 0, norm, 1)), jnp.sqrt(diff))
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(o)) for o in out]))
  return jnp.where(finite, error, jnp.inf)


class _Runner:
  """Runs one model under different rules, each configuration jitted once."""

  def __init__(self, model_or_wrapper: Any, variables: Any, args: tuple, kwargs: dict,
               metric: Metric, where: str):
    self.where = where
    if isinstance(model_or_wrapper, (nnx_lib.MixedPrecision, linen_lib.MixedPrecision)):
      model_or_wrapper = model_or_wrapper.model
    self.is_nnx = isinstance(model_or_wrapper, nnx.Module)
    if not self.is_nnx and not isinstance(model_or_wrapper, nn.Module):
      raise TypeError(f"{where} expects a flax linen Module, an NNX Module or a jaxmp "
                      f"mixed_precision wrapper, got {model_or_wrapper!r} of type "
                      f"{type(model_or_wrapper).__name__}.")
    if self.is_nnx and variables is not None:
      raise TypeError(f"{where}: an NNX model holds its own variables; pass variables=None, "
                      f"got {type(variables).__name__}.")
    if not self.is_nnx and variables is None:
      raise TypeError(f"{where}: a linen model needs its variables (what init returned), "
                      f"got None.")
    if not callable(metric):
      raise TypeError(f"{where}: metric must be a callable (reference, output) -> scalar, got "
                      f"{metric!r} of type {type(metric).__name__}.")
    self.model = model_or_wrapper
    self.variables = variables
    self.args, self.kwargs = args, kwargs
    self.metric = metric
    # Array leaves are traced; everything else (flags, method names) stays static.
    leaves, self.treedef = jax.tree_util.tree_flatten((args, kwargs))
    self.is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]
    self.static = [None if a else x for x, a in zip(leaves, self.is_array)]
    self.arrays = [x for x, a in zip(leaves, self.is_array) if a]
    self._reference = None

  def _call_args(self, arrays):
    it = iter(arrays)
    leaves = [next(it) if a else s for a, s in zip(self.is_array, self.static)]
    return jax.tree_util.tree_unflatten(self.treedef, leaves)

  def _state_and_call(self, rules: rules_lib.PolicyRules):
    """(state, f(state, arrays) -> output in float32) for ``rules``."""
    if self.is_nnx:
      wrapped = nnx_lib.mixed_precision(nnx.clone(self.model), rules)
      graphdef, state = nnx.split(wrapped)

      def call(state, arrays):
        args, kwargs = self._call_args(arrays)
        method = kwargs.pop("method", "__call__")
        model = nnx.merge(graphdef, state)
        fun = model if method == "__call__" else getattr(model, method)
        return tree_lib.cast_tree(fun(*args, **kwargs), jnp.float32)

      return state, call
    wrapper = linen_lib.mixed_precision(self.model, rules)

    def call(variables, arrays):
      args, kw = self._call_args(arrays)
      return tree_lib.cast_tree(wrapper.apply(variables, *args, **kw), jnp.float32)

    return self.variables, call

  def reference(self) -> Any:
    if self._reference is None:
      state, call = self._state_and_call(rules_lib.PolicyRules("float32"))
      self._reference = jax.jit(call)(state, self.arrays)
    return self._reference

  def deviation(self, rules: rules_lib.PolicyRules) -> float:
    state, call = self._state_and_call(rules)
    metric = self.metric
    value = jax.jit(lambda s, a, ref: metric(ref, call(s, a)))(
        state, self.arrays, self.reference())
    if np.shape(value) != ():
      raise ValueError(f"{self.where}: metric must return a scalar, got shape "
                       f"{np.shape(value)} from {metric!r}.")
    return float(value)

  def module_paths(self) -> list[tuple[str, str]]:
    """(path, class name) of every module a real call reaches, in call order."""
    kwargs = dict(self.kwargs)
    rngs = kwargs.pop("rngs", None)
    if self.is_nnx:
      table = precision_summary(self.model, "float32", *self.args, **kwargs)
    else:
      table = precision_summary(self.model, "float32", *self.args, variables=self.variables,
                                rngs=rngs, **kwargs)
    paths = {}
    for row in table.rows:
      path = "" if row.path == ROOT else row.path
      paths.setdefault(path, row.module)
    return list(paths.items())


def _candidates(candidates: Any) -> tuple[np.dtype, ...]:
  if isinstance(candidates, str) or not isinstance(candidates, Sequence) or not candidates:
    raise TypeError(f"sensitivity: candidates must be a non-empty sequence of dtypes, e.g. "
                    f"('bfloat16', 'float16'), got {candidates!r}.")
  parsed = tuple(dtypes_lib.parse_dtype(c) for c in candidates)
  names = [d.name for d in parsed]
  if len(set(names)) != len(names):
    raise ValueError(f"sensitivity: candidates {candidates!r} name a dtype twice ({names}).")
  return parsed


def _module_policy(dtype: np.dtype) -> policy_lib.Policy:
  # Output == compute names no output dtype, so the override is local: the module
  # hands its output back in its caller's dtype (float32 here).
  return policy_lib.Policy(np.float32, dtype, dtype)


class SensitivityRow(NamedTuple):
  """One module of a :class:`SensitivityReport`.

  Attributes:
    path: the module's '/'-joined path (``""`` for the root module).
    module: its class name.
    deviations: the metric with this module alone in each candidate dtype (in the
      report's ``candidates`` order), everything else in float32.
  """

  path: str
  module: str
  deviations: tuple[float, ...]

  @property
  def worst(self) -> float:
    """The largest deviation over the candidates (NaN counts as inf)."""
    return max(math.inf if math.isnan(d) else d for d in self.deviations)


def _format_value(value: float) -> str:
  return "nan" if math.isnan(value) else "inf" if math.isinf(value) else f"{value:.2e}"


@dataclasses.dataclass(frozen=True)
class SensitivityReport:
  """Modules ranked by how much computing them alone in half precision moves the output.

  Built by :func:`sensitivity`.

  Attributes:
    model: the model's class name.
    candidates: the dtype names measured, e.g. ``("bfloat16", "float16")``.
    metric: the metric's name.
    rows: one :class:`SensitivityRow` per module path, most sensitive first (by the
      worst deviation over the candidates; ties keep call order).
    whole_model: the metric with *every* module (normalization layers included) in
      each candidate dtype, for scale.
  """

  model: str
  candidates: tuple[str, ...]
  metric: str
  rows: tuple[SensitivityRow, ...]
  whole_model: tuple[float, ...]

  def deviation(self, path: str, candidate: dtypes_lib.DTypeLike) -> float:
    """The deviation of the module at ``path`` in ``candidate``."""
    index = self._index(candidate)
    for row in self.rows:
      if row.path == path:
        return row.deviations[index]
    raise KeyError(f"no module {path!r}; the modules are {[r.path for r in self.rows]}")

  def _index(self, candidate: dtypes_lib.DTypeLike) -> int:
    name = dtypes_lib.parse_dtype(candidate).name
    if name not in self.candidates:
      raise ValueError(f"{name!r} was not measured; the candidates are {self.candidates}.")
    return self.candidates.index(name)

  def sensitive(self, threshold: float, low: Optional[dtypes_lib.DTypeLike] = None
                ) -> tuple[str, ...]:
    """Paths whose deviation in ``low`` exceeds ``threshold`` or is not finite."""
    threshold = _check_threshold(threshold)
    index = self._index(self.candidates[0] if low is None else low)
    return tuple(r.path for r in self.rows
                 if not math.isfinite(r.deviations[index]) or r.deviations[index] > threshold)

  def recommended_rules(self, threshold: float = 0.01,
                        low: Optional[dtypes_lib.DTypeLike] = None, *,
                        float32_normalization: bool = True) -> rules_lib.PolicyRules:
    """Rules computing in ``low`` except the modules whose deviation exceeds ``threshold``.

    The default policy is ``params=float32,compute=<low>,output=float32``; each module
    whose deviation in ``low`` is above ``threshold`` (or not finite) gets a rule
    ``Rule(re.escape(path), "float32")``, most sensitive first. A rule is local: the
    module computes in float32 and hands its output back in its caller's dtype, and
    its children follow the default (each module was measured with its children in
    float32, so its deviation is its own operations').

    Args:
      threshold: the largest acceptable deviation (the metric's units; for the
        default relative error 0.01 is 1%). >= 0.
      low: the half-precision dtype, one of the candidates; the first by default.
      float32_normalization: passed to :class:`jaxmp.PolicyRules`: with ``True``
        (jaxmp's default) normalization layers also stay in float32; with ``False``
        only the measurements decide.

    Returns:
      A :class:`jaxmp.PolicyRules`.

    Raises:
      ValueError: for a negative or non-finite threshold, or ``low`` not measured.
    """
    low_name = self.candidates[self._index(self.candidates[0] if low is None else low)]
    keep = self.sensitive(threshold, low_name)
    default = policy_lib.Policy(np.float32, low_name, np.float32)
    return rules_lib.PolicyRules(
        default, [rules_lib.Rule(re.escape(path), "float32") for path in keep],
        float32_normalization=float32_normalization)

  @property
  def recommended(self) -> rules_lib.PolicyRules:
    """``recommended_rules()`` with its defaults (threshold 0.01, the first candidate)."""
    return self.recommended_rules()

  def __str__(self) -> str:
    lines = [f"{self.model}: {self.metric} of the output vs float32, each module alone in "
             f"each dtype (the rest in float32), most sensitive first"]
    header = ("rank", "path", "module", *self.candidates)
    body = [(str(i + 1), r.path or ROOT, r.module, *map(_format_value, r.deviations))
            for i, r in enumerate(self.rows)]
    body.append(("", "whole model", "", *map(_format_value, self.whole_model)))
    right = (True, False, False, *([True] * len(self.candidates)))
    lines.append(text_table(header, body, right))
    return "\n".join(lines)


def _check_threshold(threshold: Any) -> float:
  if isinstance(threshold, (bool, np.bool_)) or not isinstance(threshold, (int, float, np.number)):
    raise TypeError(f"threshold must be a number, got {threshold!r} of type "
                    f"{type(threshold).__name__}.")
  if not (math.isfinite(threshold) and threshold >= 0):
    raise ValueError(f"threshold must be finite and >= 0, got {threshold!r}.")
  return float(threshold)


def _metric_name(metric: Optional[Metric]) -> str:
  if metric is None:
    return "relative L2 error"
  return getattr(metric, "__name__", type(metric).__name__)


def _select_paths(paths: list[tuple[str, str]], modules: Optional[str]) -> list[tuple[str, str]]:
  if modules is None:
    return paths
  if not isinstance(modules, str):
    raise TypeError(f"sensitivity: modules must be a regex string over module paths or None, "
                    f"got {modules!r} of type {type(modules).__name__}.")
  try:
    regex = re.compile(modules)
  except re.error as e:
    raise ValueError(f"sensitivity: modules={modules!r} is not a valid regex: {e}.") from None
  chosen = [(p, m) for p, m in paths if regex.fullmatch(p)]
  if not chosen:
    raise ValueError(f"sensitivity: modules={modules!r} matches none of the module paths "
                     f"{[p or ROOT for p, _ in paths]}.")
  return chosen


def sensitivity(model_or_wrapper: Any, variables: Any, *args,
                candidates: Sequence[dtypes_lib.DTypeLike] = ("bfloat16", "float16"),
                metric: Optional[Metric] = None, modules: Optional[str] = None,
                **kwargs) -> SensitivityReport:
  """Ranks modules by how much computing each alone in half precision moves the output.

  First one abstract call (:func:`jaxmp.summary`'s tracing) lists every module path a
  real call reaches. Then, for each path and each candidate dtype, the model runs with
  ``PolicyRules("float32", [Rule(re.escape(path), Policy(float32, candidate,
  candidate))])``: that module alone computes in the candidate (its inputs and params
  cast, its output handed back in float32), its children and every other module in
  float32. ``metric(reference, output)`` compares the output to the all-float32
  output. Each configuration is jitted once: one compilation per (module, candidate)
  pair, plus the reference and one whole-model run per candidate (the demo
  transformer's 26 modules and two candidates take about 40 s on a 2-core CPU,
  nearly all of it compiling). Pick modules with ``modules=`` to measure fewer. The
  numbers are those of the compiled programs, as in a jitted training step: XLA
  may fuse or simplify operations (it removes ``(x + c) - c`` in float16 on a CPU).

  Measuring one module at a time isolates its own operations; effects that only show
  when several modules are in half precision together are not seen (the report's
  ``whole_model`` and :func:`deviation` show the total).

  Args:
    model_or_wrapper: a linen Module or :func:`jaxmp.linen.mixed_precision` wrapper
      (whose rules are ignored: the reference is float32), or an NNX Module or
      :func:`jaxmp.nnx.mixed_precision` wrapper (copied, never changed).
    variables: the linen model's variables; ``None`` for an NNX model.
    *args: the call's positional arguments (e.g. a batch). Array leaves are traced;
      other leaves are static.
    candidates: the dtypes to try, e.g. ``("bfloat16", "float16")``.
    metric: ``metric(reference_output, output) -> scalar``, traced under jit, on
      outputs cast to float32; by default :func:`relative_error`.
    modules: a regex ``re.fullmatch``-ed against the module paths to measure; all
      modules by default (the root module's path is ``""``).
    **kwargs: keyword arguments of the call (``train=False``, ``method=``, ``rngs=``).
      The call must be deterministic: the same inputs give the same output.

  Returns:
    A :class:`SensitivityReport`; ``print`` it, or get rules from
    ``recommended_rules(threshold, low)``.

  Raises:
    TypeError: for a model that is not a Flax module or wrapper, missing (linen) or
      extra (NNX) variables, a non-callable metric, or bad candidates.
    ValueError: for an unknown candidate dtype, a ``modules`` regex that matches no
      module, or a metric that does not return a scalar.

  Example:
    >>> import flax.linen as nn
    >>> class Fragile(nn.Module):  # E[x^2] - E[x]^2 of shifted data cancels in 16 bits
    ...   def __call__(self, x):
    ...     x = x + 100.0
    ...     return jnp.mean(jnp.square(x), -1) - jnp.square(jnp.mean(x, -1))
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return Fragile(name="fragile")(nn.Dense(4, name="dense")(x))
    >>> x = jnp.linspace(-1, 1, 12).reshape(4, 3)
    >>> variables = Net().init(jax.random.key(0), x)
    >>> report = jaxmp.sensitivity(Net(), variables, x, candidates=["bfloat16"])
    >>> report.rows[0].path, report.rows[0].deviations[0] > 0.5
    ('fragile', True)
    >>> [rule.match for rule in report.recommended_rules(threshold=0.05).rules]
    ['fragile']
  """
  parsed = _candidates(candidates)
  runner = _Runner(model_or_wrapper, variables, args, kwargs,
                   relative_error if metric is None else metric, "sensitivity")
  paths = _select_paths(runner.module_paths(), modules)
  rows = []
  for path, module in paths:
    deviations = tuple(runner.deviation(rules_lib.PolicyRules(
        "float32", [rules_lib.Rule(re.escape(path), _module_policy(d))])) for d in parsed)
    rows.append(SensitivityRow(path, module, deviations))
  rows.sort(key=lambda r: -r.worst)  # stable: ties keep call order
  whole = tuple(runner.deviation(rules_lib.PolicyRules(
      policy_lib.Policy(np.float32, d, np.float32), float32_normalization=False))
      for d in parsed)
  return SensitivityReport(type(runner.model).__name__, tuple(d.name for d in parsed),
                           _metric_name(metric), tuple(rows), whole)


def deviation(model_or_wrapper: Any, variables: Any, *args,
              rules: Union[rules_lib.PolicyOrRules, Sequence[rules_lib.PolicyOrRules]],
              metric: Optional[Metric] = None, **kwargs) -> Union[float, tuple[float, ...]]:
  """How far the output under ``rules`` is from the all-float32 output.

  The measurement :func:`sensitivity` makes, for any rules: e.g. to check that its
  recommendation is closer to float32 than computing everything in half precision.

  Args:
    model_or_wrapper, variables, *args, metric, **kwargs: as for :func:`sensitivity`.
    rules: a policy or :class:`jaxmp.PolicyRules`, or a list of them (the float32
      reference is then computed once).

  Returns:
    ``metric(reference, output)`` as a float, or a tuple of floats for a list of rules.

  Raises:
    TypeError, ValueError: as for :func:`sensitivity`, and for bad rules.

  Example:
    >>> import flax.linen as nn
    >>> model, x = nn.Dense(3), jnp.ones((2, 4))
    >>> variables = model.init(jax.random.key(0), x)
    >>> jaxmp.diagnostics.deviation(model, variables, x, rules=["float32", "bfloat16"])[0]
    0.0
  """
  runner = _Runner(model_or_wrapper, variables, args, kwargs,
                   relative_error if metric is None else metric, "deviation")
  if isinstance(rules, (list, tuple)):
    return tuple(runner.deviation(rules_lib.as_rules(r)) for r in rules)
  return runner.deviation(rules_lib.as_rules(rules))


__all__ = (
    "LeafStats",
    "SensitivityReport",
    "SensitivityRow",
    "UnderflowReport",
    "UnderflowRow",
    "deviation",
    "float_leaves",
    "relative_error",
    "sensitivity",
    "suggest_scale",
    "underflow_report",
    "underflow_stats",
)
