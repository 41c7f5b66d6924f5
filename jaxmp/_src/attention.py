"""Fused attention for wrapped Flax attention layers: the score matrix never reaches memory.

Flax's attention layers (``nn.MultiHeadDotProductAttention``, ``nnx.MultiHeadAttention``)
compute ``softmax(q k^T) v`` in separate steps, so the ``[batch, heads, q, kv]`` score
matrix goes through memory forward and backward. With ``PolicyRules(...,
fused_attention=True)`` the wrapper gives those layers, for the duration of their
call, an ``attention_fn`` that computes the same attention with
``jax.nn.dot_product_attention``:

* where cuDNN's fused flash-attention kernel can take the call (it is installed, the
  dtype is bfloat16 or float16, the head size and shapes are ones it supports), the
  GPU lowering runs it (``jax.lax.platform_dependent``: ``cuda`` gets cuDNN, every
  other platform XLA's implementation, so one traced step serves both);
* otherwise XLA's implementation, the same maths in one jitted function; where cuDNN
  is installed but refuses the call (float32, an unsupported head size), with a
  warning that says why no fused kernel runs.

Both accumulate the scores and compute the softmax in float32 whatever the compute
dtype (as the float32 op list asks) and hand back the values' dtype. The layer's own
attention function runs instead, with a warning that names the reason, where the
fused one cannot stand in for it: dropout on the attention weights, sown attention
weights (``module=``), an explicit ``precision``, custom einsums, or query/key/value
with more than one batch dimension. Warnings come when the call is traced (once per
jitted step), never silently.

Causal attention. A mask tensor reaches cuDNN as a dense bias that every tile reads,
and every tile is computed. ``Rule(match, causal_attention=True)`` declares the matched
layers causal: they compute the fused attention with ``is_causal=True`` (cuDNN's
CAUSAL mask mode, which skips the tiles above the diagonal, about half of them) and do
not read the mask they are handed. That is exact for causal self-attention with right
padding (a real token never attends to the padding after it); left padding and packed
sequences need the mask. A call whose query and keys differ in length (one decoding
step against a cache) keeps its mask. The declaration is about self-attention: where a
matched layer is called with keys or values from another sequence (an ``inputs_k``,
``inputs_v`` or ``inputs_kv`` other than its ``inputs_q``:
:func:`cross_attention_argument`), the call computes without it, as the layer does,
and a warning names the layer (``engine.Call.attention_precision``).

Padded attention. ``Rule(match, padded_attention=True)`` declares the matched layers'
masks right-padding masks, the same for every head (each sequence's real tokens first,
``nn.make_attention_mask(tokens > 0, tokens > 0)``; combined with a causal mask only
with a causal rule too): the mask is read once for each sequence's query and key
lengths (:func:`padding_lengths`) and the attention runs with them (cuDNN's PADDING
mode, PADDING_CAUSAL with a causal rule) and no dense mask. Every real query's output
is the masked attention's; the padding queries' outputs are not (the loss ignores
them). Left padding, packed sequences and masks that differ by head are not
right-padding masks: keep the mask for those. A concrete mask (outside ``jit``) of
another form is refused (:func:`check_right_padding`); a traced one cannot be read
ahead, and there the declaration is trusted.

Example:
  >>> import flax.linen as nn
  >>> rules = jaxmp.PolicyRules("params=float32,compute=bfloat16,output=float32",
  ...                           fused_attention=True)
  >>> model = jaxmp.linen.mixed_precision(nn.MultiHeadDotProductAttention(num_heads=2), rules)
  >>> x = jnp.ones((1, 4, 8))
  >>> variables = model.init(jax.random.key(0), x)
  >>> model.apply(variables, x).shape
  (1, 4, 8)
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import checks

_NOT_GIVEN = object()


FUSED_ATTENTION = "PolicyRules(fused_attention=True)"
CAUSAL_ATTENTION = "Rule(causal_attention=True)"
PADDED_ATTENTION = "Rule(padded_attention=True)"
"""The settings that ask for fused attention, as the fallback warnings name them."""


def _cudnn_refusal(query, key, value, bias, mask, is_causal, local_window_size,
                   lengths) -> str | None:
  """Why JAX's cuDNN attention refuses these arguments (traced abstractly), or None.

  Returns ``""`` where there is no cuDNN to ask (a machine without JAX's CUDA plugin):
  nothing could fuse there, so there is nothing to warn about.
  """
  try:
    jax.eval_shape(functools.partial(_with_lengths, implementation="cudnn",
                                     is_causal=is_causal, local_window_size=local_window_size),
                   query, key, value, bias, mask, *lengths)
  except (ValueError, TypeError, NotImplementedError) as refusal:
    return str(refusal).strip() or type(refusal).__name__  # a dtype or shape it rejects
  except RuntimeError:  # after NotImplementedError, which is one
    return ""  # "cuDNN is not detected"
  return None


def _with_lengths(query, key, value, bias, mask, query_lengths=None, key_lengths=None,
                  **kwargs):
  """``jax.nn.dot_product_attention`` with the sequence lengths as positional arguments
  (``lax.platform_dependent`` passes its operands positionally)."""
  return jax.nn.dot_product_attention(query, key, value, bias, mask,
                                      query_seq_lengths=query_lengths,
                                      key_value_seq_lengths=key_lengths, **kwargs)


def attend(query: jax.Array, key: jax.Array, value: jax.Array,
           bias: jax.Array | None = None, mask: jax.Array | None = None,
           is_causal: bool = False, asked_by: str = FUSED_ATTENTION,
           local_window_size: tuple[int, int] | None = None,
           lengths: tuple[jax.Array | None, jax.Array | None] = (None, None)) -> jax.Array:
  """``softmax(q k^T / sqrt(d) + bias, masked) v``: cuDNN's fused kernel on GPUs, else XLA's.

  Args:
    query: ``[batch, q_length, heads, depth]``.
    key: ``[batch, kv_length, kv_heads, depth]``.
    value: like ``key``.
    bias: added to the scores, broadcastable to ``[batch, heads, q_length, kv_length]``.
    mask: where the scores count (bool), broadcastable like ``bias``.
    is_causal: also mask every key after its query (cuDNN then skips those blocks).
    asked_by: the setting that asked for the fused kernel, named by the warning when
      cuDNN refuses it.
    local_window_size: ``(left, right)``: each query also attends only to the
      ``left`` keys before it and the ``right`` after it (cuDNN's sliding window).
    lengths: ``(query_lengths, key_lengths)``, int32 ``[batch]``: each sequence's real
      queries and keys come first, the rest is padding (cuDNN's padding mode);
      ``(None, None)``: no padding.

  Returns:
    ``[batch, q_length, heads, depth]`` in the inputs' dtype.
  """
  implementation = functools.partial(_with_lengths, is_causal=is_causal,
                                     local_window_size=local_window_size)
  xla = functools.partial(implementation, implementation="xla")
  refusal = _cudnn_refusal(query, key, value, bias, mask, is_causal, local_window_size,
                           lengths)
  if refusal is None:
    return jax.lax.platform_dependent(
        query, key, value, bias, mask, *lengths,
        cuda=functools.partial(implementation, implementation="cudnn"), default=xla)
  if refusal:
    _warn(f"cuDNN's fused attention does not take query {query.dtype}{list(query.shape)} "
          f"({refusal}): XLA's implementation of the same attention runs, unfused", asked_by)
  return xla(query, key, value, bias, mask, *lengths)


def padding_lengths(mask: jax.Array, query_length: int, key_length: int
                    ) -> tuple[jax.Array, jax.Array]:
  """Each sequence's real query and key counts, read from a right-padding mask.

  ``mask`` (bool, ``[batch, heads or 1, q, kv]`` or broadcastable to it) is taken to be
  a padding mask, alone or combined with a causal one: ``mask[b, h, i, j]`` true for
  the real queries ``i < q_len[b]`` and real keys ``j < kv_len[b]`` (``j <= i`` too
  when causal). Then ``kv_len`` is the most keys any query sees and ``q_len`` the
  number of queries that see any key (the first head's mask is read).

  Example:
    >>> import flax.linen as nn
    >>> tokens = jnp.array([[5, 6, 7, 0], [5, 0, 0, 0]])
    >>> mask = nn.make_attention_mask(tokens > 0, tokens > 0)
    >>> [x.tolist() for x in padding_lengths(mask, 4, 4)]
    [[3, 1], [3, 1]]
  """
  first_head = _by_head(mask, query_length, key_length)[:, 0]
  key_lengths = jnp.max(jnp.sum(first_head, axis=-1, dtype=jnp.int32), axis=-1)
  query_lengths = jnp.sum(jnp.any(first_head, axis=-1), axis=-1, dtype=jnp.int32)
  return query_lengths, key_lengths


def _by_head(mask: jax.Array, query_length: int, key_length: int) -> jax.Array:
  """``mask`` as bool ``[batch, heads or 1, q, kv]``."""
  mask = jnp.asarray(mask, bool)
  mask = jnp.broadcast_to(mask, mask.shape[:-2] + (query_length, key_length))
  return mask.reshape((mask.shape[0], -1, query_length, key_length))


def check_right_padding(mask: jax.Array, query_length: int, key_length: int,
                        lengths: tuple[jax.Array, jax.Array], causal: bool = False,
                        window: int | None = None) -> None:
  """Refuses a mask that the padding mode, given its lengths, would not reproduce.

  The padding mode (cuDNN's PADDING, PADDING_CAUSAL with ``causal``) attends each real
  query ``i < q_len`` to the keys ``j < kv_len`` (and ``j <= i``, within ``window``,
  where causal). That is the masked attention for every real query exactly where the
  mask is that pattern, on every head (where causal, whatever it holds above the
  diagonal, which the causal mode masks anyway). A left-padding mask, packed
  sequences, a mask that differs by head, or, without ``causal``, a causal mask is
  not. A traced mask (under ``jit``) cannot be read ahead of the computation and is
  not checked: there the declaration is the caller's promise.

  Args:
    mask: the layer's mask, bool, broadcastable to ``[batch, heads, q, kv]``.
    query_length: ``q``.
    key_length: ``kv``.
    lengths: what :func:`padding_lengths` read from it.
    causal: the layer is also declared causal.
    window: its declared sliding window, or ``None``.

  Raises:
    ValueError: for a concrete mask that is not such a right-padding mask; the message
      says what is supported and what to change.

  Example:
    >>> import flax.linen as nn
    >>> real = jnp.array([[True, True, True, False]])
    >>> right = nn.make_attention_mask(real, real)
    >>> check_right_padding(right, 4, 4, padding_lengths(right, 4, 4))
    >>> left = nn.make_attention_mask(real[:, ::-1], real[:, ::-1])
    >>> check_right_padding(left, 4, 4, padding_lengths(left, 4, 4))
    Traceback (most recent call last):
    ...
    ValueError: Rule(padded_attention=True): the mask is not a right-padding mask (sequence 0, ...
  """
  if any(checks.is_traced(x) for x in (mask, *lengths)):
    return
  given = np.asarray(_by_head(mask, query_length, key_length))
  i, j = np.arange(query_length)[:, None], np.arange(key_length)[None, :]
  query_lengths, key_lengths = (np.asarray(x)[:, None, None, None] for x in lengths)
  padding = (i < query_lengths) & (j < key_lengths)
  causal_band = (j <= i) & (i - j < (key_length if window is None else window))
  declared = causal_band if causal else np.ones_like(causal_band)
  differs = (given & declared) != (padding & declared)
  if not differs.any():
    return
  b, h, q, k = np.argwhere(differs)[0]
  seen = (f"lets query {q} attend to key {k}, which the padding mode would hide"
          if given[b, h, q, k] else
          f"hides key {k} from query {q}, which the padding mode would attend to")
  where = (f"sequence {b}, head {h}: the mask {seen}, reading {query_lengths[b, 0, 0, 0]} "
           f"real queries and {key_lengths[b, 0, 0, 0]} keys from it")
  if not causal and np.array_equal(given, np.broadcast_to(padding & causal_band, given.shape)):
    where = ("it is combined with a causal mask: declare causal_attention=True in the same "
             "rule, and the padding mode is causal too")
  raise ValueError(
      f"{PADDED_ATTENTION}: the mask is not a right-padding mask ({where}). The rule declares "
      "each mask of its layers one: each sequence's real tokens first, then its padding "
      "(nn.make_attention_mask(tokens > 0, tokens > 0), the same for every head; combined "
      "with a causal mask only where the rule also says causal_attention=True), and only "
      "the lengths read from it would be used, so its real tokens would attend to other "
      "keys than this mask's. Left padding, packed sequences and masks that differ by "
      "head need the mask itself: leave padded_attention out of the rule for these "
      "layers, or right-pad the batch.")


KEY_VALUE_ARGUMENTS = ("inputs_k", "inputs_v", "inputs_kv")
"""The arguments through which Flax's attention layers (linen's and NNX's) take keys and
values from another sequence than their query (``inputs_q``)."""


def cross_attention_argument(method: Callable[..., Any], args: tuple,
                             kwargs: dict[str, Any]) -> str | None:
  """The argument that makes a call of an attention layer cross-attention, or None.

  A call is self-attention where each of Flax's key and value arguments
  (:data:`KEY_VALUE_ARGUMENTS`) is absent, ``None`` or the query itself, the very
  object the caller passed as ``inputs_q`` (``layer(x)``, ``layer(x, x)``); any other
  value of one of them makes it cross-attention, keys from another sequence than the
  query's, whose positions a causal mask does not relate to the query's. A method
  without these arguments (a layer that computes its own keys) attends to its input.

  Args:
    method: the method called, bound (its signature without ``self``).
    args: the positional arguments as the caller passed them.
    kwargs: the keyword arguments as the caller passed them.

  Example:
    >>> def call(inputs_q, inputs_k=None, inputs_v=None, *, mask=None): ...
    >>> x, context = jnp.ones((1, 4, 8)), jnp.zeros((1, 4, 8))
    >>> cross_attention_argument(call, (x, x), {}) is None
    True
    >>> cross_attention_argument(call, (x,), {"inputs_k": context})
    'inputs_k'
  """
  try:
    arguments = inspect.signature(method).bind(*args, **kwargs).arguments
  except (TypeError, ValueError):
    return None  # arguments the method refuses: the call itself raises
  query = arguments.get("inputs_q", _NOT_GIVEN)
  for name in KEY_VALUE_ARGUMENTS:
    value = arguments.get(name)
    if value is not None and value is not query:
      return name
  return None


def _fallback_reason(query, dropout_rate, deterministic, module, precision,
                     einsums) -> str | None:
  """Why the fused computation cannot stand in for the layer's own, or None."""
  if dropout_rate > 0.0 and not deterministic:
    return f"dropout on the attention weights (dropout_rate={dropout_rate})"
  if module is not None:
    return "the attention weights are sown (sow_weights=True)"
  if precision is not None:
    return f"an explicit precision ({precision!r})"
  if any(e is not None for e in einsums):
    return "custom einsums (qk_attn_weights_einsum / attn_weights_value_einsum)"
  if query.ndim != 4:
    return f"query with {query.ndim - 3} batch dimensions (the fused kernel takes one)"
  return None


def _warn(message: str, asked_by: str) -> None:
  # At trace time, once per distinct message (Python's default filter): a jitted step
  # warns when it is traced, not on every step.
  warnings.warn(f"{asked_by}: {message}.", UserWarning, stacklevel=4)


def fused_attention_fn(original: Callable[..., Any], causal: bool = False,
                       window: int | None = None, padded: bool = False) -> Callable[..., Any]:
  """A Flax-compatible ``attention_fn`` computing with :func:`attend`.

  Takes the keyword arguments Flax's linen and NNX attention layers pass their
  ``attention_fn``; where the fused computation cannot stand in (see the module
  docstring), calls ``original`` with exactly the arguments it was given.

  Args:
    original: the layer's own attention function.
    causal: the layer's call is causal self-attention (``Rule(causal_attention=True)``;
      ``engine.Call.attention_precision`` leaves it out for a cross-attention call):
      where the query and keys have the same length, attend with ``is_causal=True``
      and leave the mask the layer was handed unread, so no dense mask reaches the
      kernel.
    window: with ``causal``, each query attends to itself and the ``window - 1`` keys
      before it (``Rule(attention_window=...)``: cuDNN's causal sliding window). Where
      the query and keys differ in length (decoding with a cache) the window cannot be
      placed, and the layer's mask runs without it, with a warning.
    padded: the layer's masks are declared right-padding masks (``Rule(
      padded_attention=True)``; combined with a causal mask where ``causal``): where the query
      and keys have the same length, each sequence's lengths are read from the mask
      (:func:`padding_lengths`; a concrete mask of another form is refused,
      :func:`check_right_padding`) and the attention runs in cuDNN's padding mode,
      with no dense mask.

  Returns:
    The function to set as the layer's ``attention_fn`` for the call.
  """
  accepted = inspect.signature(original).parameters
  asked_by = (CAUSAL_ATTENTION if causal else PADDED_ATTENTION if padded
              else FUSED_ATTENTION)

  def attention(query, key, value, bias=None, mask=None, broadcast_dropout=_NOT_GIVEN,
                dropout_rng=_NOT_GIVEN, dropout_rate=0.0, deterministic=False, dtype=None,
                precision=None, module=None, force_fp32_for_softmax=_NOT_GIVEN,
                is_causal=False, qk_attn_weights_einsum=None, attn_weights_value_einsum=None):
    given = dict(bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
                 dropout_rng=dropout_rng, dropout_rate=dropout_rate,
                 deterministic=deterministic, dtype=dtype, precision=precision, module=module,
                 force_fp32_for_softmax=force_fp32_for_softmax, is_causal=is_causal,
                 qk_attn_weights_einsum=qk_attn_weights_einsum,
                 attn_weights_value_einsum=attn_weights_value_einsum)
    einsums = (qk_attn_weights_einsum, attn_weights_value_einsum)
    reason = _fallback_reason(query, dropout_rate, deterministic, module, precision, einsums)
    if reason is not None:
      _warn(f"{reason}: the layer's own attention runs, unfused", asked_by)
      kwargs = {k: v for k, v in given.items() if k in accepted and v is not _NOT_GIVEN}
      return original(query, key, value, **kwargs)
    dtype = jnp.result_type(query, key, value) if dtype is None else dtype
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    local_window_size, lengths = None, (None, None)
    same_length = query.shape[-3] == key.shape[-3]
    if padded and mask is not None and same_length:
      # The mask read once for each sequence's lengths: no dense mask reaches the kernel.
      lengths = padding_lengths(mask, query.shape[-3], key.shape[-3])
      check_right_padding(mask, query.shape[-3], key.shape[-3], lengths, causal, window)
      mask = None
    if causal and same_length:
      mask, is_causal = None, True  # the declared causal mask, as cuDNN's CAUSAL mode
      local_window_size = None if window is None else (window - 1, 0)
    elif window is not None:
      _warn(f"attention_window={window} is not applied to a query of length "
            f"{query.shape[-3]} against {key.shape[-3]} keys (no position to place it "
            "from); the layer's own mask runs", CAUSAL_ATTENTION)
    mask = None if mask is None else mask.astype(bool)
    return attend(query, key, value, bias, mask, is_causal, asked_by, local_window_size,
                  lengths)

  return attention


def is_fused(attention_fn: Any) -> bool:
  """Whether ``attention_fn`` came from :func:`fused_attention_fn`."""
  return getattr(attention_fn, "__qualname__", "").startswith("fused_attention_fn.")


__all__ = ("KEY_VALUE_ARGUMENTS", "attend", "check_right_padding", "cross_attention_argument",
           "fused_attention_fn", "is_fused", "padding_lengths")
