"""Optimizer-state storage dtypes: any Optax optimizer's state kept in 16 bits, math in fp32.

Optax's ``adam`` takes a ``mu_dtype`` only (optax#1552 asks for ``nu``), and most
optimizers none. :func:`state_dtypes` wraps any optimizer and chooses, leaf by leaf,
the dtype its state is *stored* in between steps. Each ``update``:

1. casts the stored state back up to the dtypes the inner optimizer builds it in
   (float32 for float32 params: read from ``jax.eval_shape(inner.init, ...)``), and
   the gradients and params to float32 (a bfloat16 param's value is exact in
   float32);
2. runs ``inner.update`` in those dtypes;
3. casts the new state down to its storage dtypes (round to nearest even).

Rounding happens only where the state is stored; every step computes in float32 from
the rounded values, so the result equals running the inner optimizer and rounding
its state after each step (what the tests check). (``optax.adam(mu_dtype=...)``
differs: it multiplies the stored ``mu`` by ``b1`` in the storage dtype.) The
updates are what ``inner`` returns: float32.

Which leaves: a single dtype applies to every floating state leaf that is an array
(``ndim >= 1``: moments, accumulators, EMAs); scalars (step sizes and other injected
hyperparameters, loss scales) and integer leaves (step counts) keep their dtype. A
function ``dtype(path, leaf)`` chooses per leaf: it gets each floating leaf's
``'/'``-joined path in the inner state (``'0/nu/dense/kernel'`` for Adam in a chain)
and its shape and dtype (a ``jax.ShapeDtypeStruct``), and returns a dtype or ``None``
to keep the inner optimizer's own.

Storage dtypes: ``bfloat16`` (float32's range: Adam's ``nu``, a square, neither
underflows nor overflows), ``float16`` and ``float32``. float16's range is about
float32's square root, so a state that holds *squared* gradients underflows it long
before the gradients do: a gradient of ``1e-4`` gives Adam a ``nu`` of ``1e-11``,
below float16's smallest subnormal (``6e-8``), stored as zero, and the next update
``mu / (sqrt(nu) + eps)`` becomes ``mu / eps``. float16 is therefore refused (a
``ValueError`` from ``init``, naming the leaf) for the fields in which Optax's
optimizers keep squares (:data:`SQUARED_FIELDS`: Adam's, AdamW's, LAMB's... ``nu``,
RMSProp's ``nu``, Adagrad's ``sum_of_squares``, Adafactor's ``v_row``/``v_col``/``v``,
SM3's ``mu``, ...), whether a plain dtype or a function chose it; keep those in
bfloat16 and store the first moments in float16 if you like. A custom optimizer's
squares are not recognised: keep them out of float16 yourself. Block-scaled 8-bit
states: ``jaxmp.optim.quantized_moments``.

Example:
  >>> import optax
  >>> tx = jaxmp.optim.state_dtypes(optax.adam(1e-3), "bfloat16")
  >>> state = tx.init({"w": jnp.zeros(3)})
  >>> state[0].mu["w"].dtype, state[0].count.dtype
  (dtype(bfloat16), dtype('int32'))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._src import checks
from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src import tree as tree_lib
from jaxmp._src.optim import base

_WHERE = "state_dtypes"
STORAGE_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
DTypeChoice = Callable[[str, jax.ShapeDtypeStruct], dtypes_lib.DTypeLike | None]
_F16 = np.dtype(jnp.float16)

SQUARED_FIELDS: dict[str, tuple[str, ...]] = {
    # optax
    "ScaleByAdamState": ("nu",),
    "ScaleByAmsgradState": ("nu", "nu_max"),
    "ScaleByBeliefState": ("nu",),
    "ScaleByNovogradState": ("nu",),
    "ScaleByRmsState": ("nu",),
    "ScaleByRmsWithCountState": ("nu",),
    "ScaleByRStdDevState": ("nu",),
    "ScaleByRStdDevWithCountState": ("nu",),
    "ScaleByRssState": ("sum_of_squares",),
    "ScaleBySM3State": ("mu",),
    "ScaleByAdaDeltaState": ("e_g", "e_x"),
    "ScaleByAdanState": ("n",),
    "ScaleByDistanceOverGradientsState": ("grad_sum_of_squares",),
    "FactoredState": ("v_row", "v_col", "v"),
    # optax.contrib
    "ScaleByAdemamixState": ("nu",),
    "ScaleBySimplifiedAdEMAMixState": ("n",),
    "DAdaptAdamWState": ("exp_avg_sq",),
    "ProdigyState": ("exp_avg_sq",),
    "MomoAdamState": ("exp_avg_sq",),
    "MadgradState": ("grad_sum_sq",),
}
"""Optax's state classes and their fields that hold squared gradients (or squared
updates): float16 cannot store them (see the module docstring)."""


def _storage_dtype(value: Any, where: str) -> np.dtype:
  accepted = ", ".join(d.name for d in STORAGE_DTYPES)
  if isinstance(value, (bool, int, float)) or value is None:
    raise TypeError(f"{where}: a storage dtype must be a dtype or its name ({accepted}), "
                    f"got {value!r} of type {type(value).__name__}.")
  try:
    dtype = np.dtype(dtypes_lib.parse_dtype(value, allow_fp8=True))
  except ValueError:
    dtype = None
  except TypeError as e:
    raise TypeError(f"{where}: a storage dtype must be a dtype or its name ({accepted}), "
                    f"got {value!r} of type {type(value).__name__}.") from e
  if dtype is None or dtype not in STORAGE_DTYPES:
    shown = value if isinstance(value, str) else getattr(np.dtype(value), "name", value)
    raise ValueError(f"{where}: storage dtype {shown!r} is not accepted: a state is stored "
                     f"in a floating dtype, one of {accepted}.")
  return dtype


def _check_signature(choose: Callable[..., Any]) -> None:
  """Refuses a function that cannot be called as ``choose(path, leaf)``."""
  try:
    signature = inspect.signature(choose)
  except (TypeError, ValueError):  # no signature to read (some builtins): called as is
    return
  try:
    signature.bind("path", jax.ShapeDtypeStruct((1,), np.float32))
  except TypeError:
    name = getattr(choose, "__qualname__", type(choose).__name__)
    raise TypeError(
        f"{_WHERE}: dtype as a function is called dtype(path, leaf), with the state leaf's "
        f"'/'-joined path and a jax.ShapeDtypeStruct of it, but {name}{signature} does not "
        f"take those two arguments; e.g. dtype=lambda path, leaf: 'bfloat16' if '/nu/' in "
        f"f'/{{path}}/' else None.") from None


def _choice(dtype: dtypes_lib.DTypeLike | DTypeChoice) -> DTypeChoice:
  """``dtype`` as a function of (path, leaf); a plain dtype is checked right away."""
  if callable(dtype) and not isinstance(dtype, type) and not hasattr(dtype, "dtype"):
    _check_signature(dtype)
    return dtype
  fixed = _storage_dtype(dtype, _WHERE)
  return lambda path, leaf: fixed if leaf.ndim >= 1 else None


def _float_leaf(x: Any) -> bool:
  return hasattr(x, "dtype") and dtypes_lib.is_float_dtype(x.dtype)


def squared_leaves(natural: Any) -> dict[str, str]:
  """The paths of the leaves holding squares (:data:`SQUARED_FIELDS`), each to its field."""

  def holds_squares(x):
    return type(x).__module__.startswith("optax") and type(x).__name__ in SQUARED_FIELDS

  found = {}
  flat, _ = jax.tree_util.tree_flatten_with_path(natural, is_leaf=holds_squares)
  for path, node in flat:
    if not holds_squares(node):
      continue
    for field in SQUARED_FIELDS[type(node).__name__]:
      for sub, _ in jax.tree_util.tree_flatten_with_path(getattr(node, field))[0]:
        full = (*path, jax.tree_util.GetAttrKey(field), *sub)
        found[base.path_name(full)] = f"{type(node).__name__}.{field}"
  return found


def _storage(choose: DTypeChoice, natural: Any) -> Any:
  """The storage dtype of each leaf of the inner state (``None``: not a float).

  Raises:
    ValueError: for float16 chosen for a leaf that holds squares.
  """
  squared = squared_leaves(natural)

  def one(path, leaf):
    if not _float_leaf(leaf):
      return None
    name = base.path_name(path)
    chosen = choose(name, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    if chosen is None:
      return np.dtype(leaf.dtype)
    dtype = _storage_dtype(chosen, f"{_WHERE}: for the state leaf {name!r}")
    if dtype == _F16 and name in squared:
      raise ValueError(
          f"{_WHERE}: the state leaf {name!r} ({squared[name]}) holds squared gradients, "
          "which float16 cannot store: below its smallest subnormal (6e-8; a gradient "
          "of 1e-4 squares to 1e-8) they are stored as zero, and Adam-like updates then "
          "divide by eps alone. Store it in bfloat16 or float32, e.g. dtype=lambda path, "
          "leaf: 'bfloat16' if '/nu/' in f'/{path}/' else 'float16'.")
    return dtype

  return jax.tree_util.tree_map_with_path(one, natural)


def _cast(state: Any, dtypes: Any) -> Any:
  return jax.tree_util.tree_map(
      lambda x, d: x if d is None or x.dtype == d else x.astype(d), state, dtypes)


def _natural_dtypes(natural: Any) -> Any:
  return jax.tree_util.tree_map(lambda x: np.dtype(x.dtype) if _float_leaf(x) else None,
                                natural)


def state_dtypes(inner: optax.GradientTransformation,
                 dtype: dtypes_lib.DTypeLike | DTypeChoice
                 ) -> optax.GradientTransformationExtraArgs:
  """Stores ``inner``'s state in narrower dtypes and computes its update in float32.

  See the module docstring for the algorithm and which leaves a plain dtype covers.

  Args:
    inner: any ``optax.GradientTransformation`` (or ``optax.MultiSteps``).
    dtype: a storage dtype (``"bfloat16"``, ``jnp.float16``, ...) for every array
      leaf of the state, or a function ``dtype(path, leaf)`` returning one (or
      ``None`` to keep the leaf's own) for each floating leaf.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is ``inner``'s state
    with its leaves in their storage dtypes (same structure, so functions that look
    inside it, like ``jaxmp.get_loss_scale``, still work).

  Raises:
    TypeError: if ``inner`` is not a gradient transformation or ``dtype`` neither a
      dtype nor a function of ``(path, leaf)``.
    ValueError: if a storage dtype is not floating or not accepted (bfloat16,
      float16, float32); from ``init``, if the function returns one, or if float16
      is chosen for a leaf that holds squared gradients (``SQUARED_FIELDS``).

  Example:
    >>> import optax
    >>> nu_only = lambda path, leaf: "bfloat16" if "/nu/" in f"/{path}/" else None
    >>> state = jaxmp.optim.state_dtypes(optax.adam(1e-3), nu_only).init({"w": jnp.zeros(2)})
    >>> state[0].mu["w"].dtype, state[0].nu["w"].dtype
    (dtype('float32'), dtype(bfloat16))
  """
  inner = checks.gradient_transformation(inner, "inner", where=_WHERE)
  choose = _choice(dtype)

  def natural_state(params32):
    return jax.eval_shape(inner.init, params32)

  def init_fn(params):
    params32 = upcast(params)
    return _cast(inner.init(params32), _storage(choose, natural_state(params32)))

  def update_fn(updates, state, params=None, **extra_args):
    params32 = None if params is None else upcast(params)
    natural = natural_state(params32 if params is not None else upcast(updates))
    state = _cast(state, _natural_dtypes(natural))
    updates, state = inner.update(upcast(updates), state, params32, **extra_args)
    return updates, _cast(state, _storage(choose, natural))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def upcast(tree: Any) -> Any:
  """16-bit float leaves as float32 (exact); wider floats and the rest unchanged."""
  return jax.tree_util.tree_map(
      lambda x: x.astype(base.ARITHMETIC)
      if tree_lib.is_float_array(x) and np.dtype(x.dtype) in base.HALF_DTYPES else x, tree)


__all__ = (
    "DTypeChoice",
    "SQUARED_FIELDS",
    "STORAGE_DTYPES",
    "squared_leaves",
    "state_dtypes",
    "upcast",
)
