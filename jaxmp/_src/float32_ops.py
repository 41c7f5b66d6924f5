r"""The float32 op list: ops that compute in float32 inside wrapped modules.

torch.autocast keeps a list of ops that lose too much in half precision and runs them
in float32 whatever the surrounding dtype. jaxmp's list, by default, is the softmax
family, whose ``exp`` overflows float16 and whose normalising sum loses bfloat16's few
mantissa bits:

============== ==================================== =======================================
op             intercepted as                       result dtype
============== ==================================== =======================================
``softmax``    ``jax.nn.softmax``, ``flax.linen``'s  the input's (probabilities feed the next
               and ``flax.nnx``'s ``softmax``        matmul in the compute dtype)
``log_softmax`` ``jax.nn.log_softmax``, linen's and  float32 (log-probabilities feed losses)
               NNX's ``log_softmax``
``logsumexp``  ``jax.nn.logsumexp``,                float32
               ``jax.scipy.special.logsumexp``
============== ==================================== =======================================

This covers the attention softmax of ``flax.linen.MultiHeadDotProductAttention``,
``flax.nnx.MultiHeadAttention`` and every model that calls these functions through
their modules (``jax.nn.softmax(x)``, ``nn.softmax(x)``). A name bound at import time
(``from jax.nn import softmax``) is not seen. Normalization statistics compute in
float32 through the normalization rule instead (:mod:`jaxmp._src.rules`).

Other ops on autocast's float32 list (``exp``, ``log``, ``pow``, ``rsqrt``, ``softplus``,
``sum``, ``cumsum``, ...) are primitives used everywhere, including inside the ops
above and inside Flax's own layers; intercepting them would change far more than the
model's own arithmetic, so jaxmp does not. A rule, or ``PolicyRules``' model-wide
list, that names one warns with the paths of the modules it applies to
(:data:`UNINTERCEPTABLE`).

How: while a wrapped model runs (a :class:`jaxmp._src.engine.Call` is entered), the
functions above are replaced in their modules by wrappers that look up the float32 ops
of the module running now (a thread-local stack the engine pushes per module call)
and, for a half-precision input, compute in float32. ``softmax(x, axis)`` has its own
backward pass: it works, in float32, from the probabilities rounded to ``x``'s dtype
(the values the next matmul used), so the backward pass keeps no float32 copy of an
attention matrix. The originals are put back when
the outermost call returns, even when it raises; outside a wrapped model JAX and Flax
are untouched, and in another thread the wrappers call straight through.

Why the functions are swapped for the call, not something narrower. The op must be
found wherever a model calls it, in code jaxmp did not write, and each candidate that
is not process-wide finds less:

* Flax's ``force_fp32_for_softmax`` exists only on linen's ``dot_product_attention`` and
  ``MultiHeadDotProductAttention`` (not NNX's), is a field the model's author sets, and
  covers none of the softmaxes a model computes itself (every published LM's own
  attention, a classifier's ``log_softmax``).
* An interceptor on the module's attention function (linen's ``attention_fn``, NNX's
  ``MultiHeadAttention.attention_fn``) is a constructor argument of Flax's two attention
  modules only; and ``nn.intercept_methods``, which jaxmp's linen adapter already uses,
  sees module methods, not the free functions they call.
* Rewriting the traced call (trace the wrapped model to a jaxpr, compute the equations
  of ``jax.nn.softmax`` in float32, evaluate the rest as traced) was built and dropped:
  finding softmax in a jaxpr means matching JAX's private implementation of it (its
  ``custom_jvp`` name and body change between JAX versions), the model is traced twice,
  and an NNX model writes its state (batch statistics, caches, RNG counts) during the
  trace, so those writes would hold tracers of the discarded trace.
* Replacing JAX's private ``jax._src.nn.functions._softmax`` would also see names bound
  at import time, but patches JAX's internals instead of its public functions.

So the public functions are swapped, only while a wrapped model runs and only for the
thread running it; a test (``tests/test_engine.py``) checks that a name bound before
the call is indeed not seen, so this paragraph stays true.

Example:
  >>> import re
  >>> import flax.linen as nn
  >>> model = jaxmp.linen.mixed_precision(nn.MultiHeadDotProductAttention(num_heads=2),
  ...                                     "params=float32,compute=bfloat16,output=float32")
  >>> x = jnp.ones((1, 4, 8))
  >>> variables = model.init(jax.random.key(0), x)
  >>> jaxpr = str(jax.make_jaxpr(lambda v: model.apply(v, x))(variables))
  >>> sorted(set(re.findall(r":(\w+)\[[\d,]*\] = exp ", jaxpr)))  # the dtypes exp ran in
  ['f32']
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import swaps
from jaxmp._src import tree as tree_lib

DEFAULT: tuple[str, ...] = ("softmax", "log_softmax", "logsumexp")
"""The ops that compute in float32 unless a rule says otherwise."""

# op -> (the modules whose attribute of that name is the function, keep the input dtype?)
_TARGETS: dict[str, tuple[tuple[str, ...], bool]] = {
    "softmax": (("jax.nn", "flax.linen", "flax.linen.activation", "flax.nnx",
                 "flax.nnx.nn.activations"), True),
    "log_softmax": (("jax.nn", "flax.linen", "flax.linen.activation", "flax.nnx",
                     "flax.nnx.nn.activations"), False),
    "logsumexp": (("jax.nn", "jax.scipy.special"), False),
}

INTERCEPTABLE: tuple[str, ...] = tuple(_TARGETS)
"""Every op a rule may put on the float32 list."""

UNINTERCEPTABLE: tuple[str, ...] = (
    "exp", "log", "pow", "reciprocal", "rsqrt", "softplus", "sum", "prod", "cumsum",
    "norm", "cosine_similarity", "layer_norm", "rms_norm", "group_norm", "loss")
"""Ops on torch.autocast's float32 list that jaxmp cannot intercept cleanly (see above)."""

_F32 = np.dtype(np.float32)


class _State(threading.local):
  """Per thread: the float32 ops of each module call running now, innermost last."""

  def __init__(self):
    super().__init__()
    self.frames: list[frozenset] = []


_STATE = _State()


def check(ops: Any, where: str) -> frozenset:
  """Validates a float32 op list; returns it as a frozenset.

  Raises:
    TypeError: if ``ops`` is a bare string or not a collection of strings.
    ValueError: for a name on neither :data:`INTERCEPTABLE` nor :data:`UNINTERCEPTABLE`.
  """
  if isinstance(ops, str) or not isinstance(ops, (tuple, list, set, frozenset)):
    raise TypeError(f"{where}: float32_ops must be a tuple of op names, e.g. {DEFAULT!r} or () "
                    f"for none, got {ops!r} of type {type(ops).__name__}.")
  for op in ops:
    if not isinstance(op, str):
      raise TypeError(f"{where}: float32_ops must hold op names (str), got {op!r}.")
    if op not in INTERCEPTABLE and op not in UNINTERCEPTABLE:
      raise ValueError(f"{where}: unknown float32 op {op!r}; accepted: "
                       f"{', '.join(INTERCEPTABLE)} (and, with a warning that they run in "
                       f"the compute dtype, {', '.join(UNINTERCEPTABLE)}).")
  return frozenset(ops)


@contextlib.contextmanager
def module_ops(ops: frozenset) -> Iterator[None]:
  """Makes ``ops`` the float32 ops of the code running inside (one module call)."""
  _STATE.frames.append(ops)
  try:
    yield
  finally:
    _STATE.frames.pop()


def _active(op: str) -> bool:
  return bool(_STATE.frames) and op in _STATE.frames[-1]


def _is_half(x: Any) -> bool:
  return tree_lib.is_float_array(x) and np.dtype(x.dtype).itemsize < 4


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _softmax_in_float32(x: jax.Array, axis: Any) -> jax.Array:
  """``softmax(float32(x))`` rounded to ``x``'s dtype; see :func:`_softmax_residual`."""
  return jax.nn.softmax(x.astype(_F32), axis=axis).astype(x.dtype)


def _softmax_residual(x: jax.Array, axis: Any) -> tuple[jax.Array, jax.Array]:
  # The backward pass works from the rounded probabilities, the values the next matmul
  # used, in float32 arithmetic. Differentiating JAX's own softmax here would keep its
  # float32 result and intermediates for the backward pass: a second, wider copy of
  # every attention matrix (on a CPU, the bfloat16 demo step took ~40% longer for it).
  # jax.custom_vjp under functools.partial loses the wrapped function's return type.
  y = cast(jax.Array, _softmax_in_float32(x, axis))
  return y, y


def _softmax_backward(axis: Any, y: jax.Array, g: jax.Array) -> tuple[jax.Array]:
  y32, g32 = y.astype(_F32), g.astype(_F32)
  return ((y32 * (g32 - jnp.sum(g32 * y32, axis=axis, keepdims=True))).astype(y.dtype),)


_softmax_in_float32.defvjp(_softmax_residual, _softmax_backward)


def _in_float32(op: str, original: Callable[..., Any], keep_dtype: bool) -> Callable[..., Any]:
  def wrapper(x, *args, **kwargs):
    if not (_active(op) and _is_half(x)):
      return original(x, *args, **kwargs)
    axis = _plain_axis(args, kwargs) if op == "softmax" else None
    if axis is not None:
      return _softmax_in_float32(x, axis)
    out = original(x.astype(_F32), *args, **kwargs)
    return jax.tree_util.tree_map(lambda y: y.astype(x.dtype), out) if keep_dtype else out

  wrapper.__wrapped__ = original
  wrapper.__name__ = getattr(original, "__name__", op)
  wrapper.__doc__ = getattr(original, "__doc__", None)
  return wrapper


def _plain_axis(args: tuple, kwargs: dict) -> Any:
  """The axis of a ``softmax(x, axis)`` call with nothing else (no ``where``), or None."""
  if len(args) > 1 or set(kwargs) - {"axis"} or (args and "axis" in kwargs):
    return None
  axis = args[0] if args else kwargs.get("axis", -1)
  if isinstance(axis, (int, np.integer)):
    return int(axis)
  if isinstance(axis, (tuple, list)) and all(isinstance(a, (int, np.integer)) for a in axis):
    return tuple(int(a) for a in axis)
  return None


def _replacements() -> list[tuple[Any, str, Callable[..., Any]]]:
  found = []
  for op, (module_names, keep_dtype) in _TARGETS.items():
    replacements: dict[int, Callable[..., Any]] = {}  # one wrapper per original function
    for name in module_names:
      module = importlib.import_module(name)
      original = getattr(module, op, None)
      if original is None:
        continue
      wrapper = replacements.setdefault(id(original), _in_float32(op, original, keep_dtype))
      found.append((module, op, wrapper))
  return found


_SWAP = swaps.Swap(_replacements)


def installed() -> contextlib.AbstractContextManager[None]:
  """Puts the float32 wrappers in place for the duration (nested entries count)."""
  return _SWAP.installed()


__all__ = ("DEFAULT", "INTERCEPTABLE", "UNINTERCEPTABLE", "check", "installed", "module_ops")
