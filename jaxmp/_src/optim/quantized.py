"""8-bit optimizer state: any Optax optimizer's moments stored as block-scaled 8-bit codes.

:func:`quantized_moments` wraps an optimizer and stores each of its large float32
state leaves (Adam's ``mu`` and ``nu``, any optimizer's moments and accumulators) as
one byte per value plus one float32 scale per block of ``block_size`` values
(:class:`QuantizedMoment`): bitsandbytes' and torchao's 8-bit optimizers (Dettmers
et al., "8-bit Optimizers via Block-wise Quantization", 2021), with torchao's
arithmetic bit for bit (:mod:`jaxmp._src.optim.dynamic_map`). Each ``update``:

1. dequantizes the stored codes to float32 (``map[code] * scale``), and widens 16-bit
   gradients and params to float32 (exact);
2. runs ``inner.update`` on them in float32: its updates use the new moments before
   they are quantized, as torchao's and bitsandbytes' do;
3. quantizes the new state leaves: block absmax scales, codes of the nearest map value.

So the result equals running the inner optimizer and replacing its chosen state
leaves by their 8-bit round trip after each step (what the tests check against a
NumPy port of torchao's code). The inner arithmetic is the inner optimizer's own:
with ``optax.adamw``, Optax's (moments ``(1 - b) * g + b * m``, not torchao's
``lerp``; bias corrections and weight decay in Optax's order), so a run differs from
torchao's ``AdamW8bit`` by those roundings only.

Which leaves, and which map: by default every float32 state leaf with at least
``min_size`` values (torchao and bitsandbytes: 4096) whose size is a multiple of
``block_size``. Smaller leaves (biases, norm scales) and leaves of other sizes stay in
the inner optimizer's float32, as do scalars, integer leaves (step counts) and leaves
in other dtypes (``optax.adam(mu_dtype=...)``'s). Leaves that hold squared gradients
(``state_dtypes.SQUARED_FIELDS``: Adam's ``nu``, ...) use the unsigned map, the others
the signed one. A function ``quantize(path, leaf)`` chooses instead, per state leaf
(its ``'/'``-joined path, ``'0/nu/dense/kernel'``, and a ``jax.ShapeDtypeStruct``):
``"signed"``, ``"unsigned"`` (for non-negative values only: a negative value is stored
as 0) or ``None`` to keep the leaf as it is.

The default takes every float32 array of the state, accumulated gradients too: wrap
``optax.MultiSteps`` around this transform, not inside it, unless its accumulator
should be 8-bit as well. Wrap the optimizer that the other memory transforms wrap:
``jaxmp.loss_scaling(jaxmp.optim.master_weights(quantized_moments(optax.adamw(...))))``
(the reverse, quantizing master weights, is refused). A skipped step under
:func:`jaxmp.loss_scaling` keeps the codes and scales bit for bit. Codes have their
moment's shape and scales the leading axes of it (``dynamic_map.scale_shape``), so
both shard like the param. Params may be float32, bfloat16 or float16: the inner
optimizer always sees float32 and returns float32 updates.

Bytes per value of a quantized leaf: ``1 + 4 / block_size`` (1.016 for 256), against 4
in float32 and 2 in bfloat16.

Example:
  >>> import optax
  >>> tx = jaxmp.optim.quantized_moments(optax.adam(1e-3))
  >>> state = tx.init({"w": jnp.zeros((64, 512)), "b": jnp.zeros(512)})
  >>> state[0].mu["w"].codes.dtype, state[0].mu["w"].scale.shape, state[0].mu["b"].dtype
  (dtype('uint8'), (64, 2), dtype('float32'))
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from jaxmp._src import checks
from jaxmp._src.optim import base
from jaxmp._src.optim import dynamic_map
from jaxmp._src.optim import master_weights as master_weights_lib
from jaxmp._src.optim import state_dtypes as state_dtypes_lib

_WHERE = "quantized_moments"
_F32 = np.dtype(np.float32)
MAPS = ("signed", "unsigned")
MapChoice = Callable[[str, jax.ShapeDtypeStruct], str | None]


class QuantizedMoment(NamedTuple):
  """One optimizer-state leaf stored in 8 bits, in the place of the float32 leaf.

  Attributes:
    codes: uint8 codes into the signed or unsigned dynamic map, in the leaf's shape.
    scale: float32 block scales (each block's largest magnitude, at least ``1e-12``):
      the leaf's leading axes, and its trailing axes merged and divided into blocks
      (``(rows, cols // block_size)`` for a matrix whose rows are whole blocks).

  Example:
    >>> import optax
    >>> state = jaxmp.optim.quantized_moments(optax.adam(1e-3), block_size=128).init(
    ...     {"w": jnp.zeros((32, 256))})
    >>> state[0].nu["w"].codes.shape, state[0].nu["w"].scale.shape
    ((32, 256), (32, 2))
  """

  codes: jax.Array
  scale: jax.Array


def _check_choice(choice: Any, name: str, leaf: Any, block_size: int) -> bool | None:
  """``choice`` for the state leaf ``name`` as ``signed`` (True/False), or None to keep it.

  Raises:
    TypeError: for a choice that is not a map name or None, or a leaf not float32.
    ValueError: for an unknown map name, or a leaf whose size is not a multiple of
      the block.
  """
  if choice is None:
    return None
  if not isinstance(choice, str):
    raise TypeError(f"{_WHERE}: quantize must return 'signed', 'unsigned' or None for each "
                    f"state leaf, got {choice!r} of type {type(choice).__name__} for {name!r}.")
  if choice not in MAPS:
    raise ValueError(f"{_WHERE}: quantize returned {choice!r} for the state leaf {name!r}; "
                     "accepted: 'signed', 'unsigned' or None (keep the leaf).")
  if np.dtype(leaf.dtype) != _F32:
    raise TypeError(f"{_WHERE}: the state leaf {name!r} has dtype {np.dtype(leaf.dtype).name}; "
                    "only float32 state leaves (the moments of float32, bfloat16 or float16 "
                    "params) are stored in 8 bits.")
  if dynamic_map.scale_shape(leaf.shape, block_size) is None:
    raise ValueError(f"{_WHERE}: the state leaf {name!r} has shape {leaf.shape}, which is not "
                     f"made of whole blocks of block_size={block_size} (an array whose size is "
                     "a positive multiple of it); keep it (return None for it) or choose a "
                     "block size that divides its size.")
  return choice == "signed"


def _default_choice(name: str, leaf: Any, squared: dict[str, str], min_size: int,
                   block_size: int) -> str | None:
  """The default: float32 arrays of ``min_size`` values or more, in whole blocks."""
  if (np.dtype(leaf.dtype) != _F32 or leaf.ndim == 0 or leaf.size < min_size
      or dynamic_map.scale_shape(leaf.shape, block_size) is None):
    return None
  return "unsigned" if name in squared else "signed"


def _maps(choose: MapChoice | None, natural: Any, block_size: int, min_size: int) -> Any:
  """For each leaf of the inner state: True (signed map), False (unsigned) or None (kept).

  Raises:
    TypeError, ValueError: as ``_check_choice``.
  """
  squared = state_dtypes_lib.squared_leaves(natural)

  def one(path, leaf):
    name = base.path_name(path)
    if choose is None:
      choice = _default_choice(name, leaf, squared, min_size, block_size)
    else:
      choice = choose(name, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    return _check_choice(choice, name, leaf, block_size)

  return jax.tree_util.tree_map_with_path(one, natural)


def _stored_parts(x: Any) -> tuple[jax.Array, jax.Array] | None:
  """A stored quantized leaf's codes and scale, or None for any other leaf.

  The leaf is a :class:`QuantizedMoment`, or the mapping of its two fields that an
  ``nnx.Optimizer`` hands back in its place.
  """
  if isinstance(x, QuantizedMoment):
    return x.codes, x.scale
  if isinstance(x, Mapping) and set(x.keys()) == set(QuantizedMoment._fields):
    return x["codes"], x["scale"]
  return None


def _stored_like(container: Any, new: QuantizedMoment) -> Any:
  """``new`` in the container the state came in (a QuantizedMoment, or a mapping), so
  that the new state has the old one's structure (``lax.cond`` in loss scaling needs it)."""
  if isinstance(container, QuantizedMoment):
    return new
  flat, treedef = jax.tree_util.tree_flatten_with_path(container)
  names = [str(getattr(path[-1], "key", getattr(path[-1], "name", ""))) for path, _ in flat]
  return treedef.unflatten([getattr(new, name) for name in names])


def _map_chosen(fn: Callable[..., Any], state: Any, maps: Any, *trees: Any) -> Any:
  """``fn(leaf, signed, *others)`` for the chosen leaves of the inner state, None elsewhere."""
  flat, treedef = jax.tree_util.tree_flatten(state)
  others = [treedef.flatten_up_to(tree) for tree in trees]
  return treedef.unflatten([
      None if signed is None else fn(x, signed, *rest)
      for x, signed, *rest in zip(flat, treedef.flatten_up_to(maps), *others)])


def _block_scales(state: Any, maps: Any, block_size: int) -> Any:
  """The block scales of the inner state's chosen leaves (None elsewhere)."""
  return _map_chosen(lambda x, signed: dynamic_map.block_scales(x, block_size), state, maps)


def _quantize_state(state: Any, maps: Any, block_size: int) -> Any:
  """The inner state with its chosen leaves quantized."""
  return _encode_state(state, maps, _block_scales(state, maps, block_size))


def _encode_state(state: Any, maps: Any, scales: Any, containers: list | None = None) -> Any:
  """The inner state with its chosen leaves encoded with ``scales``, each in the
  container it was stored in."""
  flat, treedef = jax.tree_util.tree_flatten(state)
  containers = containers or [None] * len(flat)
  stored = []
  for x, signed, scale, container in zip(
      flat, treedef.flatten_up_to(maps), treedef.flatten_up_to(scales), containers):
    if signed is None:
      stored.append(x)
      continue
    new = QuantizedMoment(dynamic_map.encode(x, scale, signed=signed), scale)
    stored.append(new if container is None else _stored_like(container, new))
  return treedef.unflatten(stored)


def _dequantize_state(state: Any, maps: Any, natural: Any,
                      index_dtype: DTypeLike = jnp.int32) -> tuple[Any, list]:
  """The stored state with its quantized leaves as float32, in the inner state's structure,
  and the stored leaves (one per leaf of the inner state). ``index_dtype``: as
  ``dynamic_map.map_values``'s.

  Raises:
    ValueError: if the state does not have the structure ``init`` gives it.
  """
  natural_def = jax.tree_util.tree_structure(natural)
  try:
    stored = natural_def.flatten_up_to(state)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{_WHERE}: the state does not have the structure this optimizer's init "
                     f"gives it (the inner state's, {natural_def}, with its quantized leaves "
                     "as QuantizedMoment); pass the state init returned.") from e
  values = []
  for x, signed in zip(stored, natural_def.flatten_up_to(maps)):
    parts = _stored_parts(x)
    if (signed is None) != (parts is None):
      raise ValueError(f"{_WHERE}: the state has {type(x).__name__} where this optimizer "
                       f"stores {'a float32 leaf' if signed is None else 'a QuantizedMoment'}"
                       "; pass the state its init returned.")
    values.append(x if parts is None else dynamic_map.dequantize(
        *parts, signed=signed, index_dtype=index_dtype))
  return natural_def.unflatten(values), stored


def quantized_moments(inner: optax.GradientTransformation, *, block_size: int = 256,
                      min_size: int = 4096, quantize: MapChoice | None = None
                      ) -> optax.GradientTransformationExtraArgs:
  """Stores ``inner``'s large float32 state leaves in 8 bits, computing in float32.

  See the module docstring for the algorithm and which leaves are stored how.

  Args:
    inner: any ``optax.GradientTransformation`` (or ``optax.MultiSteps``), e.g.
      ``optax.adamw(1e-3)``.
    block_size: values per float32 scale (torchao's 256 by default; bitsandbytes'
      paper used 2048).
    min_size: leaves with fewer values stay float32 (4096, as torchao and
      bitsandbytes). Ignored when ``quantize`` is given.
    quantize: a function ``quantize(path, leaf)`` returning ``"signed"``,
      ``"unsigned"`` or ``None`` for each array leaf of the inner state, instead of
      the default choice.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is ``inner``'s with each
    quantized leaf a :class:`QuantizedMoment`. Its updates are ``inner``'s, computed
    in float32.

  Raises:
    TypeError: if ``inner`` is not a gradient transformation, ``block_size`` or
      ``min_size`` not an integer, or ``quantize`` not callable; from ``init``, if
      ``quantize`` returns something other than a map name or ``None``, or chooses a
      leaf that is not float32.
    ValueError: if ``block_size`` is below 1 or ``min_size`` below 0; from ``init``,
      for an unknown map name, a chosen leaf whose size is not a multiple of the
      block, or an inner optimizer holding master weights; from ``update``, for a
      state of another structure.

  Example:
    >>> import optax
    >>> tx = jaxmp.optim.quantized_moments(optax.adamw(1e-2))
    >>> params = {"w": jnp.ones((16, 256))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.full((16, 256), 0.5)}, state, params)
    >>> updates["w"][0, 0], state[0].mu["w"].codes[0, 0], state[0].mu["w"].scale[0, 0]
    (Array(-0.01000093, dtype=float32), Array(255, dtype=uint8), Array(0.05, dtype=float32))
  """
  inner = checks.gradient_transformation(inner, "inner", where=_WHERE)
  block_size = checks.positive_int(block_size, "block_size", where=_WHERE)
  min_size = checks.positive_int(min_size, "min_size", where=_WHERE, minimum=0)
  if quantize is not None and not callable(quantize):
    raise TypeError(f"{_WHERE}: quantize must be a function (path, leaf) -> 'signed', "
                    f"'unsigned' or None, got {quantize!r} of type {type(quantize).__name__}.")

  def natural_state(params32):
    return jax.eval_shape(inner.init, params32)

  def init_fn(params):
    # Before widening the params, which master weights would refuse with a message of
    # their own: they are not 8-bit material in the first place.
    if base.find_states(jax.eval_shape(inner.init, params), master_weights_lib.MasterWeightsState):
      raise ValueError(f"{_WHERE}: the inner optimizer holds master weights, which 8 bits "
                       "cannot store; quantize the optimizer the masters are updated by: "
                       "master_weights(quantized_moments(inner)).")
    params32 = state_dtypes_lib.upcast(params)
    state = inner.init(params32)
    maps = _maps(quantize, natural_state(params32), block_size, min_size)
    return _quantize_state(state, maps, block_size)

  def update_fn(updates, state, params=None, **extra_args):
    params32 = None if params is None else state_dtypes_lib.upcast(params)
    updates32 = state_dtypes_lib.upcast(updates)
    natural = natural_state(updates32 if params32 is None else params32)
    maps = _maps(quantize, natural, block_size, min_size)

    # Two passes over the moments, each running the inner update from the stored state:
    # the first for the new moments' block scales (a reduction), the second for their
    # codes and the updates. A single pass writes a float32 copy of each new moment to
    # memory (the reduction and the codes need it at once). The first pass decodes in
    # 16-bit integers, so that XLA does not merge the two passes' computations; every
    # operation is elementwise, a reduction or a reshape, so that inside loss scaling
    # the skip compiles to a select rather than a conditional (docs/guides/memory.md).
    scales_pass, _ = _dequantize_state(state, maps, natural, index_dtype=jnp.int16)
    _, new = inner.update(updates32, scales_pass, params32, **extra_args)
    scales = _block_scales(new, maps, block_size)
    inner_state, stored = _dequantize_state(state, maps, natural)
    updates, new = inner.update(updates32, inner_state, params32, **extra_args)
    return updates, _encode_state(new, maps, scales, stored)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


__all__ = (
    "MAPS",
    "MapChoice",
    "QuantizedMoment",
    "quantized_moments",
)
