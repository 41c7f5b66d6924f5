"""A float32 dtype whose autodiff accumulation is ``max`` instead of ``+``.

Delayed scaling sends each fp8 layer's new scale and amax history back to the trainer
as the "gradient" of the old ones. When one set of state is read more than once in a
step (a layer called twice, a ``scan`` over time with shared weights, attention
projections sharing one module), JAX's reverse mode adds the cotangents of the reads:
an amax history of ``[2, 0, 0]`` seen three times comes back as ``[6, 0, 0]``. The
right combination is the element-wise maximum.

JAX accumulates cotangents with the ``add`` rule of their dtype, and extended dtypes
(``jax.dtypes.extended``, the mechanism behind typed PRNG keys) may define their own.
:data:`max_float32` is such a dtype: it is stored as float32, its autodiff ``add`` is
``max`` and its autodiff zero is ``-inf`` (the identity of ``max``, which also marks
"no use contributed anything"). Converting the fp8 state to it once, before the reads
(inside the differentiated function), makes every accumulation JAX inserts, whether
for repeated calls, ``lax.scan`` and ``nn.scan`` over shared weights, or ``remat``, a
max. The conversion's transpose hands the result back as plain float32.

Only :func:`_define_max_float32` touches JAX internals; everything else goes through
public ``jax.lax`` calls.

Example:
  >>> from jaxmp._src.fp8 import maxgrad
  >>> def f(h):
  ...   h = maxgrad.to_max_float32(h)
  ...   # Two reads whose cotangents are [1, 5] and [3, 2]: JAX would add them.
  ...   a = maxgrad.from_max_float32(h) * jnp.array([1.0, 5.0])
  ...   b = maxgrad.from_max_float32(h) * jnp.array([3.0, 2.0])
  ...   return jnp.sum(a) + jnp.sum(b)
  >>> jax.grad(f)(jnp.zeros(2))
  Array([3., 5.], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import jax_compat


def _define_max_float32() -> Any:
  """Builds the ``max_float32`` extended dtype from JAX's extended-dtype protocol.

  The protocol (``jax._src.dtypes.ExtendedDType`` and the ``_rules`` it points to)
  is not public API (reached through :func:`~jaxmp._src.jax_compat.extended_dtypes`).
  Flax's ``fp8_ops.fm32`` relies on the same protocol, so it is kept working across
  JAX releases, but its hooks have been renamed before (``convert_to``/``convert_from``
  became ``allow_conversion``). If JAX changes the protocol, this is the one place
  that fails, with an error that says so: no fallback, since adding repeated
  cotangents in its place would give wrong scales silently.

  Returns:
    The dtype object.

  Raises:
    ImportError: if this JAX no longer has the internals the dtype needs.
  """
  internals = jax_compat.extended_dtypes()
  if internals is None:
    raise ImportError(
        "jaxmp.fp8 needs JAX's extended-dtype protocol (jax._src.dtypes.ExtendedDType) "
        f"to take the max of repeated fp8 state cotangents, and {jax_compat.jax_version()} "
        "does not provide it; please report this with your JAX version.")
  extended_base, jax_core, ad_util, earray, pxla = internals

  f32 = np.dtype(np.float32)

  class MaxFloat32Rules:
    """What JAX asks of an extended dtype, answered for max-accumulating float32."""

    # convert_element_type between float32 and max_float32 is allowed both ways.
    allow_conversion = True

    @staticmethod
    def physical_element_aval(dtype):
      del dtype
      return jax_core.ShapedArray((), f32)

    @staticmethod
    def add(dtype, x, y):
      # The point of the dtype: autodiff's accumulation of cotangents.
      x = jax.lax.convert_element_type(x, f32)
      y = jax.lax.convert_element_type(y, f32)
      return jax.lax.convert_element_type(jax.lax.max(x, y), dtype)

    @staticmethod
    def zero(dtype):
      # The identity of max; also what an unused read contributes.
      return jax.lax.convert_element_type(np.array(-np.inf, f32), dtype)

    @staticmethod
    def tangent_dtype(dtype):
      return dtype

    @staticmethod
    def full(shape, fill_value, dtype):
      fill_value = jax.lax.convert_element_type(fill_value, f32)
      return jax.lax.convert_element_type(jax.lax.full(shape, fill_value, f32), dtype)

    @staticmethod
    def global_sharded_result_handler(aval, out_sharding, committed):
      # Only reached when a max_float32 array leaves a jitted computation (e.g. the
      # cotangent of a max_float32 argument of an eager jax.grad). The physical
      # float32 buffer is wrapped in an EArray that carries the logical dtype.
      phys_aval = jax_core.physical_aval(aval)
      phys_handler = pxla.global_result_handlers[jax_core.ShapedArray](
          phys_aval, out_sharding, committed)
      wrap = lambda buf: earray.EArray(aval, buf)
      if hasattr(phys_handler, "wrap"):
        return phys_handler.wrap(wrap)
      return lambda bufs: wrap(phys_handler(bufs))

    @staticmethod
    def make_sharded_array(aval, sharding, arrays, committed):
      phys_aval = jax_core.physical_aval(aval)
      phys_handler = pxla.global_result_handlers[jax_core.ShapedArray](
          phys_aval, sharding, committed)
      phys_arrays = [jax.lax.convert_element_type(a, f32) for a in arrays]
      return earray.EArray(aval, phys_handler(phys_arrays))

  # Outside jit, autodiff adds concrete cotangents through a per-Python-type table
  # that has no entry for EArray (the array type of concrete extended-dtype values).
  # Route EArrays of this dtype to the dtype's own rule.
  def add_earrays(x, y):
    if is_max_float32(x):
      return MaxFloat32Rules.add(x.dtype, x, y)
    raise TypeError(f"jaxmp cannot add concrete cotangents of dtype {x.dtype}.")

  ad_util.raw_jaxval_adders.setdefault(earray.EArray, add_earrays)

  class max_float32_scalar(jax.dtypes.extended):  # pylint: disable=invalid-name
    """Scalar type of :data:`max_float32`, for ``jnp.issubdtype``."""

  class MaxFloat32(extended_base):
    """float32 whose autodiff accumulation is ``max``."""
    _rules = MaxFloat32Rules
    # JAX's ExtendedDType declares ``type`` an abstract property; its own extended
    # dtypes (PRNG keys) define it as a class attribute, as here.
    type = max_float32_scalar
    name = "max_float32"
    itemsize = 4

    def __repr__(self) -> str:
      return "max_float32"

    def __eq__(self, other) -> bool:
      return isinstance(other, MaxFloat32)

    def __hash__(self) -> int:
      return hash(MaxFloat32)

  return MaxFloat32()


# Built on first use, not at import: importing jaxmp leaves JAX's tables as they were.
_DTYPE: Any = None


def max_float32_dtype() -> Any:
  """The max-accumulating float32 dtype, built (and registered with JAX) on first call.

  Raises:
    ImportError: if this JAX version lacks the internals the dtype needs.
  """
  global _DTYPE
  if _DTYPE is None:
    _DTYPE = _define_max_float32()
  return _DTYPE


def __getattr__(name: str) -> Any:
  # ``maxgrad.max_float32`` reads as a constant but is only built when asked for.
  if name == "max_float32":
    return max_float32_dtype()
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_max_float32(x: Any) -> bool:
  """Whether ``x`` (an array or a dtype) is of the :data:`max_float32` dtype.

  Example:
    >>> from jaxmp._src.fp8 import maxgrad
    >>> x = jnp.ones(2)
    >>> maxgrad.is_max_float32(maxgrad.to_max_float32(x)), maxgrad.is_max_float32(x)
    (True, False)
  """
  dtype = getattr(x, "dtype", x)
  # Nothing can have the dtype before it is built, so asking does not build it.
  return _DTYPE is not None and dtype == _DTYPE


def to_max_float32(x: jax.Array) -> jax.Array:
  """Converts a float32 array to :data:`max_float32`; ``max_float32`` passes through.

  Args:
    x: a float32 (or already ``max_float32``) array.

  Returns:
    The same values as ``max_float32``.

  Raises:
    TypeError: for any other dtype; the conversion is only defined from float32, so
      a bfloat16 or float16 state is refused rather than silently widened.
    ImportError: if this JAX version lacks the internals :data:`max_float32` needs.

  Example:
    >>> from jaxmp._src.fp8 import maxgrad
    >>> maxgrad.to_max_float32(jnp.array([1.0, 2.0])).dtype == maxgrad.max_float32
    True
  """
  if is_max_float32(x):
    return x
  x = jnp.asarray(x)
  if x.dtype != np.float32:
    raise TypeError(
        f"fp8 state must be float32 to accumulate by max, got an array of dtype {x.dtype}.")
  return jax.lax.convert_element_type(x, max_float32_dtype())


def from_max_float32(x: jax.Array) -> jax.Array:
  """Converts a :data:`max_float32` array back to float32; other arrays pass through.

  Differentiable: the cotangent of the float32 result goes back as ``max_float32``.

  Example:
    >>> from jaxmp._src.fp8 import maxgrad
    >>> maxgrad.from_max_float32(maxgrad.to_max_float32(jnp.array([1.0, 2.0])))
    Array([1., 2.], dtype=float32)
  """
  if is_max_float32(x):
    return _from_max_float32(x)
  return x


# JAX's own transpose rule for the conversion out of an extended dtype reads the
# dtype of an undefined primal and fails (jax 0.10), so the conversion carries its
# derivative itself.
@jax.custom_vjp
def _from_max_float32(x):
  return jax.lax.convert_element_type(x, np.float32)


def _from_max_float32_fwd(x):
  return _from_max_float32(x), None


def _from_max_float32_bwd(_, ct):
  return (jax.lax.convert_element_type(ct, max_float32_dtype()),)


_from_max_float32.defvjp(_from_max_float32_fwd, _from_max_float32_bwd)


__all__ = (
    "from_max_float32",
    "is_max_float32",
    "max_float32_dtype",
    "to_max_float32",
)
