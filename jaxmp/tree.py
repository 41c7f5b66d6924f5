"""Pytree utilities that mixed precision is built from: cast, check, select.

All three are pure, work inside and outside ``jit``, and leave alone every leaf that is
not a floating-point array: integer and bool arrays, PRNG keys (new-style typed keys
and raw ``uint32`` keys), ``None`` and non-array leaves such as Python numbers.

Example:
  >>> import jax.numpy as jnp, jaxmp
  >>> tree = {"w": jnp.ones(3), "step": jnp.array(7)}
  >>> jaxmp.cast_tree(tree, jnp.bfloat16)["w"].dtype
  dtype(bfloat16)
  >>> bool(jaxmp.all_finite(tree))
  True
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp import dtypes as dtypes_lib

T = TypeVar("T")


def _is_float_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray)) and dtypes_lib.is_float_dtype(x.dtype)


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
    if _is_float_array(x) and x.dtype != dtype:
      return x.astype(dtype)
    return x

  return jax.tree_util.tree_map(cast, tree)


def _leaf_nonfinite_probe(x: jax.Array) -> jax.Array:
  # ``x * 0`` is 0 for every finite value and NaN for inf and NaN, so the sum of
  # the products is finite exactly when every element is. One add-reduction per
  # leaf is cheaper than a boolean all-reduction on every backend we measured, and
  # XLA fuses the multiply into it, so nothing of the leaf's size is materialized.
  if x.dtype.itemsize == 1:
    x = x.astype(jnp.float32)  # fp8 has no arithmetic of its own on some backends.
  return jnp.sum(x * jnp.zeros((), x.dtype), dtype=jnp.float32)


def all_finite(tree: Any) -> jax.Array:
  """Whether every floating-point value in ``tree`` is finite.

  Non-float leaves (integers, bools, keys, ``None``) are finite by definition, and an
  empty tree is finite. Inside ``jit`` the check is one reduction per leaf fused with
  the elementwise work, combined into one scalar on device: no host round-trip and
  no temporary the size of the tree.

  Args:
    tree: any pytree, e.g. gradients.

  Returns:
    A scalar ``bool`` array.

  Example:
    >>> bool(jaxmp.all_finite({"g": jnp.array([1.0, jnp.inf])}))
    False
  """
  leaves = [x for x in jax.tree_util.tree_leaves(tree) if _is_float_array(x)]
  if not leaves:
    return jnp.array(True)
  total = sum(_leaf_nonfinite_probe(jnp.asarray(x)) for x in leaves)
  return jnp.isfinite(total)


def select_tree(pred: Any, on_true: T, on_false: T) -> T:
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
  pred_dtype = pred.dtype if hasattr(pred, "dtype") else np.result_type(pred)
  if pred_dtype != np.dtype(bool):
    raise TypeError(f"select_tree needs a boolean predicate, got dtype {pred_dtype}.")

  true_paths, true_def = jax.tree_util.tree_flatten_with_path(on_true)
  false_leaves, false_def = jax.tree_util.tree_flatten(on_false)
  if true_def != false_def:
    raise ValueError(
        f"select_tree needs two trees of the same structure, got\n  on_true:  {true_def}\n"
        f"  on_false: {false_def}")

  pred = jnp.asarray(pred)

  def select(path, a, b):
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.shape != b.shape:
      raise ValueError(
          f"select_tree: leaf {jax.tree_util.keystr(path)} has shape {a.shape} in on_true "
          f"and {b.shape} in on_false.")
    if a.dtype != b.dtype:
      raise TypeError(
          f"select_tree: leaf {jax.tree_util.keystr(path)} has dtype {a.dtype} in on_true "
          f"and {b.dtype} in on_false.")
    return jax.lax.select(pred, a, b)

  selected = [select(path, a, b) for (path, a), b in zip(true_paths, false_leaves)]
  return jax.tree_util.tree_unflatten(true_def, selected)
