"""Floating-point dtype names, parsing and formats.

jaxmp speaks about dtypes in three places: precision policies (float16, bfloat16,
float32, float64), fp8 matmuls (float8_e4m3fn, float8_e5m2) and diagnostics that ask
how many values a format can represent. This module is the single place that turns
names into dtypes and dtypes into the numbers that describe them.

Names follow jmp's grammar: ``bf16|bfloat16``, ``f16|float16``, ``full|f32|float32``,
``f64|float64`` and ``half``. ``half`` is :func:`half_dtype`: bfloat16 on TPUs and on
GPUs that compute natively in it (compute capability >= 8.0), float16 elsewhere,
which is what jmp picks on CPUs and older GPUs.

Example:
  >>> import jaxmp
  >>> jaxmp.tools.parse_dtype("bf16")
  dtype(bfloat16)
  >>> jaxmp.tools.float_format("float8_e4m3fn").max
  448.0
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# What the dtype arguments accept: a name ("bf16"), a scalar type (jnp.bfloat16,
# np.float32) or an np.dtype; JAX's own alias.
DTypeLike = jax.typing.DTypeLike

# Names exactly as jmp spells them; the first name of each dtype is jmp's canonical one.
POLICY_DTYPE_ALIASES: dict[str, np.dtype] = {
    "bf16": np.dtype(jnp.bfloat16),
    "bfloat16": np.dtype(jnp.bfloat16),
    "f16": np.dtype(jnp.float16),
    "float16": np.dtype(jnp.float16),
    "full": np.dtype(jnp.float32),
    "f32": np.dtype(jnp.float32),
    "float32": np.dtype(jnp.float32),
    "f64": np.dtype(jnp.float64),
    "float64": np.dtype(jnp.float64),
}

FP8_DTYPE_ALIASES: dict[str, np.dtype] = {
    "e4m3": np.dtype(jnp.float8_e4m3fn),
    "float8_e4m3fn": np.dtype(jnp.float8_e4m3fn),
    "e5m2": np.dtype(jnp.float8_e5m2),
    "float8_e5m2": np.dtype(jnp.float8_e5m2),
}

HALF = "half"

POLICY_DTYPES: frozenset[np.dtype] = frozenset(POLICY_DTYPE_ALIASES.values())
FP8_DTYPES: frozenset[np.dtype] = frozenset(FP8_DTYPE_ALIASES.values())

BF16_MIN_COMPUTE_CAPABILITY = (8, 0)   # CUDA Ampere: bfloat16 tensor cores


def default_device() -> jax.Device:  # pyright: ignore[reportInvalidTypeForm]
  """The device JAX computes on when nothing else says: ``jax.default_device``'s.

  The device (or the first device of the platform) that ``with jax.default_device(...)``
  or the ``jax_default_device`` option names, else the default backend's first device.
  What jaxmp decides per chip at trace time (the fp8 target, the half dtype, the chip
  ``audit`` describes) follows it, so that a step run under ``with
  jax.default_device(jax.devices("cpu")[0]):`` on a machine with a GPU is traced for
  the CPU it runs on.

  Example:
    >>> from jaxmp._src import dtypes
    >>> with jax.default_device(jax.devices("cpu")[0]):
    ...   dtypes.default_device().platform
    'cpu'
  """
  # The documented way to read an option that has a context manager; JAX's Config
  # declares its options at run time, where pyright does not see them.
  chosen = jax.config.jax_default_device  # pyright: ignore[reportAttributeAccessIssue]
  if chosen is None:
    return jax.devices()[0]
  return jax.devices(chosen)[0] if isinstance(chosen, str) else chosen


def check_device(device: Any, where: str) -> Any:
  """``device``, or :func:`default_device` for ``None``; duck-typed on ``platform``.

  Any object with a ``platform`` string is accepted, so that descriptions of devices
  other than a local ``jax.Device`` (a remote one, a test double) work too.

  Raises:
    TypeError: if ``device`` has no ``platform`` string (a device's name, say), naming
      ``where`` and the descriptions accepted.
  """
  if device is None:
    return default_device()
  if not isinstance(getattr(device, "platform", None), str):
    raise TypeError(
        f"{where}: device must be a jax.Device (e.g. jax.devices()[0]), a description of one "
        f"(any object with a `platform` string, 'cpu', 'gpu' or 'tpu', and its `device_kind`; "
        f"a CUDA GPU's also with its `compute_capability`), e.g. "
        f"types.SimpleNamespace(platform='gpu', device_kind='NVIDIA H100 80GB HBM3', "
        f"compute_capability='9.0') or types.SimpleNamespace(platform='tpu', "
        f"device_kind='TPU v5 lite'), or None for the first local device; got {device!r} of "
        f"type {type(device).__name__}.")
  return device


def gpu_compute_capability(device: Any, where: str) -> tuple[int, int] | None:
  """A CUDA device's compute capability as ``(major, minor)``; ``None`` if it has none.

  CUDA devices report e.g. ``"9.0"``; ROCm devices report no such attribute.

  Raises:
    ValueError: if the reported capability is not ``major[.minor]``, naming ``where``.
  """
  value = getattr(device, "compute_capability", None)
  if value is None:
    return None
  major, _, minor = str(value).strip().partition(".")
  if not (major.isdigit() and (minor.isdigit() or minor == "")):
    raise ValueError(f"{where}: cannot read the compute capability {value!r} of "
                     f"{device!r}; expected 'major.minor', e.g. '8.9'.")
  return int(major), int(minor or 0)


# pyright reads ``jax.Device`` as an unknown variable (JAX assigns it from its compiled
# extension), though it is the class of every device.
def half_dtype(device: jax.Device | None = None) -> np.dtype:  # pyright: ignore[reportInvalidTypeForm]
  """Returns the 16-bit float dtype that ``device`` computes in best.

  bfloat16 on TPUs and on GPUs with compute capability >= 8.0 (Ampere and later) or
  none reported (ROCm: all current ones compute natively in bfloat16); float16 on
  CPUs and older GPUs, as jmp does.

  Args:
    device: the device to ask about (a ``jax.Device``, or any object with a
      ``platform`` string); the first local device when omitted.

  Returns:
    ``np.dtype(bfloat16)`` or ``np.dtype(float16)``.

  Raises:
    TypeError: if ``device`` is not a ``jax.Device``.

  Example:
    >>> jaxmp.half_dtype() in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
    True
    >>> jaxmp.half_dtype(jax.devices("cpu")[0])
    dtype('float16')
  """
  checked = check_device(device, "half_dtype")
  if checked.platform == "tpu":
    return np.dtype(jnp.bfloat16)
  if checked.platform == "gpu":
    capability = gpu_compute_capability(checked, "half_dtype")
    if capability is None or capability >= BF16_MIN_COMPUTE_CAPABILITY:
      return np.dtype(jnp.bfloat16)
  return np.dtype(jnp.float16)


def _accepted_names(allow_fp8: bool) -> str:
  names = [*POLICY_DTYPE_ALIASES, HALF]
  if allow_fp8:
    names += list(FP8_DTYPE_ALIASES)
  return ", ".join(names)


def parse_dtype(value: DTypeLike, *, allow_fp8: bool = False) -> np.dtype:
  """Turns a dtype name or dtype-like object into a floating-point ``np.dtype``.

  Args:
    value: a name from jmp's grammar (``"bf16"``, ``"float32"``, ``"half"``, ...),
      with ``allow_fp8`` also ``"e4m3"``/``"float8_e4m3fn"``/``"e5m2"``/``"float8_e5m2"``;
      or a dtype object such as ``jnp.bfloat16`` or ``np.dtype("float32")``.
    allow_fp8: whether fp8 dtypes are accepted. Policies do not accept them: fp8 is a
      matmul recipe (``jaxmp.fp8``), not a dtype a module computes in.

  Returns:
    The ``np.dtype``.

  Raises:
    ValueError: for an unknown name or a dtype that is not an accepted float type.
    TypeError: for a value that is neither a string nor a dtype.

  Example:
    >>> jaxmp.tools.parse_dtype("f32"), jaxmp.tools.parse_dtype(jnp.bfloat16)
    (dtype('float32'), dtype(bfloat16))
    >>> jaxmp.tools.parse_dtype("e4m3", allow_fp8=True)
    dtype(float8_e4m3fn)
    >>> jaxmp.tools.parse_dtype("half") == jaxmp.half_dtype()
    True
  """
  if isinstance(value, str):
    if value == HALF:
      return half_dtype()
    if value in POLICY_DTYPE_ALIASES:
      return POLICY_DTYPE_ALIASES[value]
    if allow_fp8 and value in FP8_DTYPE_ALIASES:
      return FP8_DTYPE_ALIASES[value]
    raise ValueError(
        f"Unknown dtype {value!r}: accepted names are {_accepted_names(allow_fp8)}.")
  dtype = _to_numpy_dtype(value)
  accepted = POLICY_DTYPES | FP8_DTYPES if allow_fp8 else POLICY_DTYPES
  if dtype not in accepted:
    hint = (" fp8 is not a compute dtype: turn fp8 matmuls on with a jaxmp.fp8 recipe."
            if dtype in FP8_DTYPES else "")
    raise ValueError(
        f"Unsupported dtype {dtype.name!r}: accepted dtypes are "
        f"{', '.join(sorted(d.name for d in accepted))} (or the names "
        f"{_accepted_names(allow_fp8)}).{hint}")
  return dtype


def _to_numpy_dtype(value: Any) -> np.dtype:
  if value is None or isinstance(value, (bool, int, float)):
    raise TypeError(f"Expected a dtype or dtype name, got {value!r} of type "
                    f"{type(value).__name__}.")
  try:
    return np.dtype(value)
  except TypeError as e:
    raise TypeError(f"Expected a dtype or dtype name, got {value!r} of type "
                    f"{type(value).__name__}.") from e


def dtype_name(dtype: DTypeLike) -> str:
  """The canonical (numpy) name of a float dtype, e.g. ``"bfloat16"``."""
  return parse_dtype(dtype, allow_fp8=True).name


def is_float_dtype(dtype: Any) -> bool:
  """Whether ``dtype`` is a floating-point dtype (fp8 included, PRNG keys excluded)."""
  try:
    return jnp.issubdtype(dtype, jnp.floating)
  except TypeError:
    return False


def arithmetic_dtype(*dtypes: Any) -> np.dtype:
  """The dtype jaxmp does scaling and statistics arithmetic in: float32, or float64.

  float32 holds every float16, bfloat16 and fp8 value exactly, so half-precision
  values are widened to it; float64 values (with ``jax_enable_x64``) stay float64.

  Example:
    >>> from jaxmp._src import dtypes
    >>> dtypes.arithmetic_dtype(jnp.bfloat16), dtypes.arithmetic_dtype("float16", "float32")
    (dtype('float32'), dtype('float32'))
  """
  if any(np.dtype(d) == np.dtype(np.float64) for d in dtypes):
    return np.dtype(jax.dtypes.canonicalize_dtype(np.float64))
  return np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class FloatFormat:
  """The numbers that describe a floating-point format.

  Attributes:
    dtype: the dtype.
    max: the largest finite value.
    min_normal: the smallest positive normal value.
    min_subnormal: the smallest positive subnormal value; values below half of it
      round to zero.
    eps: the distance from 1.0 to the next larger value.
    mantissa_bits: explicitly stored mantissa bits.
    exponent_bits: exponent bits.
    has_inf: whether the format has infinities (float8_e4m3fn has none: it saturates
      to NaN instead).

  Example:
    >>> fmt = jaxmp.tools.float_format("bf16")
    >>> fmt.mantissa_bits, fmt.exponent_bits, fmt.eps, fmt.has_inf
    (7, 8, 0.0078125, True)
  """

  dtype: np.dtype
  max: float
  min_normal: float
  min_subnormal: float
  eps: float
  mantissa_bits: int
  exponent_bits: int
  has_inf: bool


def float_format(dtype: DTypeLike) -> FloatFormat:
  """Describes a float format: range, precision and whether it has infinities.

  Args:
    dtype: any float dtype or name :func:`parse_dtype` accepts, fp8 included.

  Returns:
    A :class:`FloatFormat`.

  Example:
    >>> fmt = jaxmp.tools.float_format("f16")
    >>> fmt.max, fmt.min_normal
    (65504.0, 6.103515625e-05)
  """
  dtype = parse_dtype(dtype, allow_fp8=True)
  info = jnp.finfo(dtype)
  return FloatFormat(
      dtype=dtype,
      max=float(info.max),
      min_normal=float(info.smallest_normal),
      min_subnormal=float(info.smallest_subnormal),
      eps=float(info.eps),
      mantissa_bits=int(info.nmant),
      exponent_bits=int(info.nexp),
      has_inf=dtype != np.dtype(jnp.float8_e4m3fn),
  )



def rounded_to(x: jax.Array, dtype: Any) -> jax.Array:
  """``x.astype(dtype).astype(x.dtype)``, with the rounding kept on every backend.

  XLA's GPU compiler may delete a round trip through a narrower float inside one
  program (its "excess precision", on by default): on an H100 ``x.astype(bfloat16)
  .astype(float32) - x`` came out all zeros. Code whose result *is* the rounding
  error (Kahan summation's compensation) must round for real. For bfloat16 this is
  ``lax.reduce_precision`` (exponent 8 bits, mantissa 7), which XLA keeps and which
  equals the cast bit for bit, inf, NaN and subnormals included. ``reduce_precision``
  flushes float16's subnormals to zero, so other dtypes round by the cast itself,
  behind an optimization barrier that the simplification cannot see through.

  Args:
    x: a float array wider than ``dtype``.
    dtype: the format to round to.

  Returns:
    ``x`` rounded to ``dtype``, in ``x``'s dtype.

  Example:
    >>> from jaxmp._src import dtypes
    >>> x = jnp.float32(1.0 + 2.0**-10)
    >>> float(dtypes.rounded_to(x, jnp.bfloat16)), float(dtypes.rounded_to(x, jnp.float16))
    (1.0, 1.0009765625)
  """
  dtype = np.dtype(dtype)
  if dtype == np.dtype(jnp.bfloat16):
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
  return jax.lax.optimization_barrier(x.astype(dtype)).astype(x.dtype)

__all__ = (
    "DTypeLike",
    "FloatFormat",
    "arithmetic_dtype",
    "dtype_name",
    "float_format",
    "half_dtype",
    "is_float_dtype",
    "parse_dtype",
    "rounded_to",
)
