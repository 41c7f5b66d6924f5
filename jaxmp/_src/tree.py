"""Pytree utilities that mixed precision is built from: cast, check, select.

All three are pure, work inside and outside ``jit``, and leave alone every leaf that is
not a floating-point value: integer and bool arrays, PRNG keys (new-style typed keys
and raw ``uint32`` keys), ``None`` and, in :func:`cast_tree`, other objects
(:func:`all_finite` refuses a leaf that is not a number: a tree holding a string is
not one of gradients). A gradient tree may also hold floating-point *scalars* that
are not arrays (NumPy scalars such as ``np.float32(x)``, Python floats):
:func:`all_finite` checks them like arrays (see :func:`is_float_leaf`), while
:func:`cast_tree` leaves them alone (a Python number is not a parameter to store in
another dtype).

Example:
  >>> import jax.numpy as jnp, jaxmp
  >>> tree = {"w": jnp.ones(3), "step": jnp.array(7)}
  >>> jaxmp.cast_tree(tree, jnp.bfloat16)["w"].dtype
  dtype(bfloat16)
  >>> bool(jaxmp.all_finite(tree))
  True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxmp._src import dtypes as dtypes_lib

T = TypeVar("T")


def is_float_array(x: Any) -> bool:
  """Whether ``x`` is a JAX or NumPy array of a floating-point dtype (fp8 included)."""
  return isinstance(x, (jax.Array, np.ndarray)) and dtypes_lib.is_float_dtype(x.dtype)


def is_float_leaf(x: Any) -> bool:
  """Whether ``x`` is a floating-point value: a float array, a NumPy float scalar or a float.

  What gradient checks and loss scaling treat as a gradient. A NumPy scalar has its
  NumPy dtype (``np.float16(1)`` is float16); a Python float is what JAX reads it as,
  a (weakly typed) float32. Bools and integers are not floating-point values.

  Example:
    >>> from jaxmp._src import tree
    >>> [tree.is_float_leaf(x) for x in (jnp.ones(2), np.float16(1), 1.5, 1, True, None)]
    [True, True, True, False, False, False]
  """
  if isinstance(x, float):
    return True
  return (is_float_array(x) or isinstance(x, np.generic)) and dtypes_lib.is_float_dtype(x.dtype)


def float_leaf_dtype(x: Any) -> np.dtype:
  """The dtype of a :func:`is_float_leaf` value (float32 for a Python float)."""
  return np.dtype(jnp.float32) if isinstance(x, float) else np.dtype(x.dtype)


def cast_tree(tree: T, dtype: dtypes_lib.DTypeLike) -> T:
  """Casts the floating-point array leaves of ``tree`` to ``dtype``.

  Leaves already in ``dtype`` are returned as they are, so casting adds no ops to a
  jitted program where nothing changes. Every other leaf (integer, bool, unsigned,
  PRNG key, ``None``, Python scalars, arbitrary objects) comes back unchanged.

  Args:
    tree: any pytree.
    dtype: the target float dtype or its name (``"bf16"``, ``jnp.float32``,
      ``"float8_e4m3fn"``, ...).

  Returns:
    A pytree of the same structure.

  Raises:
    ValueError: if ``dtype`` is not a floating-point dtype.

  Example:
    >>> out = jaxmp.cast_tree({"x": jnp.ones(2), "ids": jnp.arange(2)}, "bf16")
    >>> out["x"].dtype, out["ids"].dtype
    (dtype(bfloat16), dtype('int32'))
  """
  dtype = dtypes_lib.parse_dtype(dtype, allow_fp8=True)

  def cast(x):
    if is_float_array(x) and x.dtype != dtype:
      return x.astype(dtype)
    return x

  return jax.tree_util.tree_map(cast, tree)


def _is_number_leaf(x: Any) -> bool:
  """Whether :func:`all_finite` accepts ``x``: a JAX array (keys included), a NumPy
  array or scalar of a numeric or bool dtype, or a Python number or bool."""
  if isinstance(x, jax.Array):
    return True
  if isinstance(x, (np.ndarray, np.generic)):
    return jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.bool_)
  return isinstance(x, (bool, int, float, complex))


def _check_number_leaves(tree: Any, leaves: list) -> None:
  if all(_is_number_leaf(x) for x in leaves):
    return
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not _is_number_leaf(x):
      where = jax.tree_util.keystr(path) if path else "(the tree itself)"
      shown = repr(x) if len(repr(x)) <= 80 else repr(x)[:80] + "..."
      raise TypeError(
          f"all_finite: leaf {where} is {shown} of type {type(x).__name__}; accepted "
          "leaves: JAX arrays (PRNG keys included), NumPy arrays and scalars of a "
          "numeric or bool dtype, Python numbers and bools, and None.")


def _exactly_all_finite(leaves: list) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _host_values_finite(leaves: list) -> bool:
  # NumPy arrays and scalars and Python floats are checked where they are, in their
  # own dtype: a float64 1e300 is finite although it would overflow float32.
  return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in leaves)


def all_finite(tree: Any) -> jax.Array:
  """Whether every floating-point value in ``tree`` is finite.

  Non-float leaves (integers, bools, keys, ``None``) are finite by definition, and an
  empty tree is finite; any other leaf (a string, an object) is refused. Floating-point
  NumPy arrays and scalars and Python floats count like arrays (``is_float_leaf``);
  being concrete, they are checked on the
  host, in their own dtype. For JAX arrays the check is one float32 reduction per
  leaf, chosen per backend when the computation is lowered:

  - on GPUs and TPUs, the sum of ``x * 0``: zero for finite values, NaN as soon as
    one value is inf or NaN, so it is exact on its own. It reads each gradient once,
    and XLA can fuse it into the kernel that produced the gradient;
  - on CPUs, where the multiply is not free, a plain sum (about 4x cheaper than a
    boolean ``all(isfinite)`` there): any inf or NaN makes it non-finite, and only
    when it is not finite, which finite values can also cause by overflowing the sum,
    does an exact element-wise check decide (a ``lax.cond``, so it costs nothing on
    the common path; under ``vmap`` both run). On a GPU that ``cond`` would make XLA
    write the gradients it takes as operands to memory, hence the other form there.

  No host round-trip, no temporary the size of the tree.

  Args:
    tree: any pytree, e.g. gradients.

  Returns:
    A scalar ``bool`` array.

  Raises:
    TypeError: for a leaf that is not a JAX array, a NumPy array or scalar of a
      numeric or bool dtype, or a Python number or bool.

  Example:
    >>> bool(jaxmp.all_finite({"g": jnp.array([1.0, jnp.inf])}))
    False
    >>> bool(jaxmp.all_finite({"g": jnp.array([3e38, 3e38])}))  # the sum overflows
    True
  """
  all_leaves = jax.tree_util.tree_leaves(tree)
  _check_number_leaves(tree, all_leaves)
  values = [x for x in all_leaves if is_float_leaf(x)]
  if not _host_values_finite([x for x in values if not isinstance(x, jax.Array)]):
    return jnp.array(False)
  leaves = [x for x in values if isinstance(x, jax.Array)]
  if not leaves:
    return jnp.array(True)
  return jax.lax.platform_dependent(*leaves, cpu=_finite_by_sum, default=_finite_by_zero_product)


def _with_arithmetic(x: jax.Array) -> jax.Array:
  # fp8 has no arithmetic of its own on some backends, so it is reduced as float32.
  return x.astype(jnp.float32) if x.dtype.itemsize == 1 else x


def _finite_by_sum(*leaves: jax.Array) -> jax.Array:
  """Plain sums, with an exact check only when they are not finite (for CPUs)."""
  sums_ok = jnp.isfinite(sum(jnp.sum(_with_arithmetic(x), dtype=jnp.float32) for x in leaves))
  # The fast branch returns sums_ok (True there) rather than a constant so that, inside
  # shard_map, both branches vary over the same mesh axes.
  return jax.lax.cond(sums_ok, lambda: sums_ok, lambda: _exactly_all_finite(list(leaves)))


def _finite_by_zero_product(*leaves: jax.Array) -> jax.Array:
  """Sums of ``x * 0``: exact in one pass (``inf * 0`` and ``nan * 0`` are NaN)."""
  return jnp.isfinite(sum(jnp.sum(_with_arithmetic(x) * 0, dtype=jnp.float32) for x in leaves))


def select_tree(pred: ArrayLike, on_true: T, on_false: T) -> T:
  """Picks ``on_true`` where ``pred`` is true, else ``on_false``, leaf by leaf.

  The jit-safe counterpart of ``on_true if pred else on_false`` for a traced scalar
  predicate, e.g. keeping the old optimizer state on a step whose gradients
  overflowed.

  Args:
    pred: a scalar boolean (Python ``bool`` or a ``bool[]`` array).
    on_true: a pytree.
    on_false: a pytree with the same structure, shapes and dtypes as ``on_true``.

  Returns:
    A pytree of the same structure.

  Raises:
    TypeError: if ``pred`` is not boolean, or two leaves differ in dtype.
    ValueError: if ``pred`` is not a scalar, or the trees differ in structure or a
      pair of leaves differs in shape.

  Example:
    >>> jaxmp.select_tree(jnp.array(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})
    {'a': Array([0., 0.], dtype=float32)}
  """
  pred_shape = np.shape(pred)
  if pred_shape != ():
    raise ValueError(f"select_tree needs a scalar predicate, got one of shape {pred_shape}.")
  pred_dtype = getattr(pred, "dtype", None)
  if pred_dtype is None:
    if not isinstance(pred, (bool, int, float, complex)):
      raise TypeError(f"select_tree needs a boolean predicate, got {pred!r} of type "
                      f"{type(pred).__name__}.")
    pred_dtype = np.result_type(pred)
  if pred_dtype != np.dtype(bool):
    raise TypeError(f"select_tree needs a boolean predicate, got dtype {pred_dtype}.")

  pred = jnp.asarray(pred)

  def select(path, a, b):
    if a.dtype != b.dtype:
      raise TypeError(
          f"select_tree: leaf {jax.tree_util.keystr(path)} has dtype {a.dtype} in on_true "
          f"and {b.dtype} in on_false.")
    return jax.lax.select(pred, a, b)

  return map_pairs(select, on_true, on_false, where="select_tree",
                   names=("on_true", "on_false"))


def is_box(x: Any) -> bool:
  """Whether ``x`` is a box around one value: a pytree node that converts to an array.

  JAX's array-like protocol (``__jax_array__``) says so; NNX's variables (``nnx.Param``,
  the ``OptArray`` leaves of ``nnx.Optimizer``'s state) are such boxes. Arrays and
  tracers are not.
  """
  # Tracers define the attribute as None.
  return callable(getattr(type(x), "__jax_array__", None))


def unbox(x: Any) -> Any:
  """The value in a box (:func:`is_box`), or ``x`` itself."""
  return x.__jax_array__() if is_box(x) else x


def unboxed(tree: T) -> T:
  """``tree`` with every box (:func:`is_box`) replaced by its value.

  What ``nnx.as_pure`` does to NNX variables, without knowing NNX: the core reads an
  ``nnx.Optimizer``'s state through it.

  Example:
    >>> from jaxmp._src import tree
    >>> class Box:
    ...   def __init__(self, value):
    ...     self.value = value
    ...   def __jax_array__(self):
    ...     return self.value
    >>> tree.unboxed({"a": Box(jnp.ones(1)), "b": 2})
    {'a': Array([1.], dtype=float32), 'b': 2}
  """
  return jax.tree_util.tree_map(unbox, tree, is_leaf=is_box)


def map_pairs(fn: Callable[[Any, jax.Array, jax.Array], Any], a: T, b: Any, *, where: str,
              names: tuple[str, str] = ("a", "b")) -> T:
  """``fn(path, a_leaf, b_leaf)`` over two trees of the same structure and leaf shapes.

  Leaves are passed as arrays; the result has ``a``'s structure.

  Raises:
    ValueError: if the trees differ in structure or a pair of leaves in shape; the
      message names ``where``, the leaf's path and the two trees by ``names``.

  Example:
    >>> from jaxmp._src import tree
    >>> tree.map_pairs(lambda path, x, y: x + y, {"a": 1.0}, {"a": 2.0}, where="example")
    {'a': Array(3., dtype=float32, weak_type=True)}
  """
  a_paths, a_def = jax.tree_util.tree_flatten_with_path(a)
  b_leaves, b_def = jax.tree_util.tree_flatten(b)
  if a_def != b_def:
    raise ValueError(
        f"{where} needs two trees of the same structure, got\n  {names[0]}: {a_def}\n"
        f"  {names[1]}: {b_def}")

  def pair(path, x, y):
    x, y = jnp.asarray(x), jnp.asarray(y)
    if x.shape != y.shape:
      raise ValueError(
          f"{where}: leaf {jax.tree_util.keystr(path)} has shape {x.shape} in {names[0]} and "
          f"{y.shape} in {names[1]}.")
    return fn(path, x, y)

  return jax.tree_util.tree_unflatten(
      a_def, [pair(path, x, y) for (path, x), y in zip(a_paths, b_leaves)])


__all__ = (
    "all_finite",
    "map_pairs",
    "cast_tree",
    "float_leaf_dtype",
    "is_float_array",
    "is_box",
    "is_float_leaf",
    "select_tree",
    "unbox",
    "unboxed",
)
