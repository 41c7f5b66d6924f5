"""Precision policies: which dtype parameters are stored in, computed in and returned in.

A :class:`Policy` is three dtypes. Parameters live in ``param_dtype`` (usually float32,
the "master weights"), a module computes in ``compute_dtype`` (bfloat16 or float16 for
speed) and hands its result back in ``output_dtype``. :func:`get_policy` builds one
from a string in jmp's grammar, a Keras policy name, a ``jmp.Policy`` or a Policy.

String grammar (jmp's, with jmp's meaning except for ``half``, which is
:func:`jaxmp.half_dtype`: bfloat16 on GPUs with compute capability >= 8.0, where jmp
picks float16):

* ``"key=value,key=value"`` with keys ``p|params``, ``c|compute``, ``o|output`` and
  values ``bf16|bfloat16``, ``f16|float16``, ``full|f32|float32``, ``f64|float64``,
  ``half``. Unset params default to float32, compute follows params and output
  follows compute: ``"c=f16"`` is params float32, compute and output float16.
* A bare value sets all three: ``"bf16"`` is bfloat16 everywhere.
* Keras names: ``"mixed_bfloat16"`` and ``"mixed_float16"`` keep params in float32,
  compute in the half type and hand the model's output back in float32 (Keras's own
  guide makes the last layer float32 so that the loss sees float32 logits; inner
  modules still hand back their caller's compute dtype); ``"float32"``,
  ``"bfloat16"`` and ``"float16"`` are bare values.

``str(policy)`` prints ``params=float32,compute=bfloat16,output=float32``, which
parses back to an equal policy.

Example:
  >>> import jaxmp, jax.numpy as jnp
  >>> policy = jaxmp.get_policy("p=f32,c=bf16,o=f32")
  >>> print(policy)
  params=float32,compute=bfloat16,output=float32
  >>> policy.cast_to_compute({"x": jnp.ones(2)})["x"].dtype
  dtype(bfloat16)
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import jax.numpy as jnp
import jmp
import numpy as np

from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src import tree as tree_lib

T = TypeVar("T")

_KEY_TO_FIELD = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}
_KERAS_MIXED = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}


def _policy_dtype(value: dtypes_lib.DTypeLike, field: str) -> np.dtype:
  try:
    return dtypes_lib.parse_dtype(value)
  except ValueError as e:
    raise ValueError(f"Policy {field}: {e}") from None
  except TypeError as e:
    raise TypeError(f"Policy {field}: {e}") from None


@dataclasses.dataclass(frozen=True, init=False)
class Policy:
  """The dtypes a module stores its parameters in, computes in and returns.

  Frozen and hashable, so it can be a static argument of ``jax.jit``; two policies are
  equal when their three dtypes are. Unset dtypes follow jmp's rule: compute follows
  params and output follows compute.

  Args:
    param_dtype: dtype of stored parameters (default float32).
    compute_dtype: dtype inputs and parameters are cast to for the computation.
    output_dtype: dtype the result is cast to.

  Each accepts a dtype (``jnp.bfloat16``) or a name (``"bf16"``, ``"half"``, ...).
  Only float16, bfloat16, float32 and float64 are policy dtypes; fp8 is turned on per
  matmul with a recipe (``jaxmp.fp8``) instead.

  Example:
    >>> policy = jaxmp.Policy("float32", "bfloat16", "float32")
    >>> policy.with_compute_dtype("f16").compute_dtype
    dtype('float16')
  """

  param_dtype: np.dtype
  compute_dtype: np.dtype
  output_dtype: np.dtype

  # The constructor takes any dtype-like and None for "follow"; the fields are always
  # resolved np.dtypes (``dataclasses.replace`` calls this too, with the field values).
  def __init__(self, param_dtype: dtypes_lib.DTypeLike = np.dtype(np.float32),
               compute_dtype: dtypes_lib.DTypeLike | None = None,
               output_dtype: dtypes_lib.DTypeLike | None = None):
    param = _policy_dtype(param_dtype, "param_dtype")
    compute = param if compute_dtype is None else _policy_dtype(
        compute_dtype, "compute_dtype")
    output = compute if output_dtype is None else _policy_dtype(
        output_dtype, "output_dtype")
    object.__setattr__(self, "param_dtype", param)
    object.__setattr__(self, "compute_dtype", compute)
    object.__setattr__(self, "output_dtype", output)

  def cast_to_param(self, tree: T) -> T:
    """Casts the floating-point leaves of ``tree`` to the param dtype."""
    return tree_lib.cast_tree(tree, self.param_dtype)

  def cast_to_compute(self, tree: T) -> T:
    """Casts the floating-point leaves of ``tree`` to the compute dtype."""
    return tree_lib.cast_tree(tree, self.compute_dtype)

  def cast_to_output(self, tree: T) -> T:
    """Casts the floating-point leaves of ``tree`` to the output dtype."""
    return tree_lib.cast_tree(tree, self.output_dtype)

  def with_param_dtype(self, dtype: dtypes_lib.DTypeLike) -> Policy:
    """A copy of this policy with another param dtype (the others unchanged)."""
    return dataclasses.replace(self, param_dtype=dtype)

  def with_compute_dtype(self, dtype: dtypes_lib.DTypeLike) -> Policy:
    """A copy of this policy with another compute dtype (the others unchanged)."""
    return dataclasses.replace(self, compute_dtype=dtype)

  def with_output_dtype(self, dtype: dtypes_lib.DTypeLike) -> Policy:
    """A copy of this policy with another output dtype (the others unchanged)."""
    return dataclasses.replace(self, output_dtype=dtype)

  def to_jmp(self) -> jmp.Policy:
    """The ``jmp.Policy`` with the same dtypes, for code written against jmp.

    Example:
      >>> print(jaxmp.get_policy("p=f32,c=bf16").to_jmp())
      p=full,c=bf16,o=bf16
    """
    # jmp keys its names by the jnp scalar types, not by np.dtype objects.
    return jmp.Policy(getattr(jnp, self.param_dtype.name),
                      getattr(jnp, self.compute_dtype.name),
                      getattr(jnp, self.output_dtype.name))

  def __str__(self) -> str:
    return (f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"output={self.output_dtype.name}")

  def __repr__(self) -> str:
    return (f"Policy(param_dtype={self.param_dtype.name}, compute_dtype="
            f"{self.compute_dtype.name}, output_dtype={self.output_dtype.name})")


PolicyLike = Policy | jmp.Policy | str


def _grammar_help() -> str:
  values = ", ".join([*dtypes_lib.POLICY_DTYPE_ALIASES, dtypes_lib.HALF])
  return (f"accepted: 'key=value,...' with keys {', '.join(_KEY_TO_FIELD)} and values "
          f"{values}; a bare value; or a Keras name ({', '.join(_KERAS_MIXED)}).")


def _parse_value(value: str, spec: str) -> np.dtype:
  try:
    return dtypes_lib.parse_dtype(value)
  except ValueError:
    raise ValueError(f"Unknown dtype {value!r} in policy {spec!r}; {_grammar_help()}") from None


def _parse_assignments(spec: str) -> Policy:
  fields: dict[str, np.dtype] = {}
  for part in spec.split(","):
    key, sep, value = (s.strip() for s in part.partition("="))
    if not sep or "=" in value:
      raise ValueError(f"Malformed part {part!r} in policy {spec!r}; {_grammar_help()}")
    if key not in _KEY_TO_FIELD:
      raise ValueError(f"Unknown key {key!r} in policy {spec!r}; {_grammar_help()}")
    field = _KEY_TO_FIELD[key]
    if field in fields:
      # jmp lets the last assignment win; two values for one dtype is a mistake.
      raise ValueError(f"Policy {spec!r} sets {field} twice; {_grammar_help()}")
    fields[field] = _parse_value(value, spec)
  return Policy(**fields)


def _parse_string(spec: str) -> Policy:
  stripped = spec.strip()
  if not stripped:
    raise ValueError(f"Empty policy string {spec!r}; {_grammar_help()}")
  if "=" in stripped:
    return _parse_assignments(stripped)
  if stripped in _KERAS_MIXED:
    return Policy("float32", _KERAS_MIXED[stripped], "float32")
  dtype = _parse_value(stripped, spec)
  return Policy(dtype, dtype, dtype)


def get_policy(spec: PolicyLike) -> Policy:
  """Builds a :class:`Policy` from a string, a ``jmp.Policy`` or a Policy.

  Args:
    spec: a policy string in jmp's grammar or a Keras name (see the module docstring),
      a ``jmp.Policy``, or a :class:`Policy` (returned as is).

  Returns:
    The :class:`Policy`.

  Raises:
    ValueError: for a string with an unknown key or dtype, a non-float dtype, a
      malformed or repeated assignment, or an empty string; the message names the bad
      part and lists what is accepted.
    TypeError: for anything that is not a string or a policy.

  Example:
    >>> print(jaxmp.get_policy("c=f16"))
    params=float32,compute=float16,output=float16
    >>> print(jaxmp.get_policy("mixed_bfloat16"))
    params=float32,compute=bfloat16,output=float32
  """
  if isinstance(spec, Policy):
    return spec
  if isinstance(spec, jmp.Policy):
    return Policy(spec.param_dtype, spec.compute_dtype, spec.output_dtype)
  if isinstance(spec, str):
    return _parse_string(spec)
  raise TypeError(
      f"get_policy expects a policy string, a jaxmp.Policy or a jmp.Policy, got {spec!r} "
      f"of type {type(spec).__name__}.")


__all__ = (
    "Policy",
    "PolicyLike",
    "get_policy",
)
