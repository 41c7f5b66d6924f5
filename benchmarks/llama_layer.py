"""A Llama-3-shaped decoder layer in Flax linen, for ``gpu_report.py``'s ``llama`` workload.

The shapes of Llama-3-8B's layer (Meta's published config: d_model 4096, 32 query heads
and 8 key/value heads of 128, SwiGLU FFN 14336, RMSNorm, rotary embeddings), written
with Flax's own layers so that jaxmp's rules reach them: ``nn.DenseGeneral`` for every
projection (fp8 rules match it; Flax's fp8 goes in through ``dot_general_cls``) and an
``attention_fn`` field, ``nn.dot_product_attention`` by default, which
``PolicyRules(fused_attention=True)`` and ``Rule(causal_attention=True)`` replace. The
key/value heads are repeated to the query heads before attention (grouped-query
attention as Flax's attention function takes it).

Stacks of layers come three ways: :class:`Stack` (a Python loop: unrolled),
:class:`ScannedStack` (linen's large-model form: the layer in ``nn.scan``, params
stacked along a layer axis, listing only ``params``) and :class:`NnxScannedStack` (NNX's:
layers built by ``nnx.vmap``, run by ``nnx.scan``; :class:`NnxDecoderLayer` is the same
layer with ``nnx.LinearGeneral`` projections).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Config:
  """A decoder layer's sizes; :data:`LLAMA3_8B` is the published 8B model's."""
  d_model: int
  heads: int
  kv_heads: int
  head_dim: int
  ffn: int
  rope_theta: float = 500000.0


LLAMA3_8B = Config(d_model=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336)
SMOKE = Config(d_model=64, heads=4, kv_heads=2, head_dim=16, ffn=128)


def rotary(x: jnp.ndarray, theta: float) -> jnp.ndarray:
  """Rotary position embedding of ``x``: ``[batch, seq, heads, head_dim]``."""
  half = x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freq  # [seq, half]
  cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
  a, b = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1).astype(x.dtype)


class Attention(nn.Module):
  """Grouped-query self-attention with a causal mask handed to ``attention_fn``."""
  config: Config
  dtype: Any = None
  dot_general_cls: Any = None
  attention_fn: Callable[..., Any] = nn.dot_product_attention

  @nn.compact
  def __call__(self, x):
    c = self.config
    project = lambda heads, name: nn.DenseGeneral(
        (heads, c.head_dim), use_bias=False, dtype=self.dtype,
        dot_general_cls=self.dot_general_cls, name=name)(x)
    q = rotary(project(c.heads, "q"), c.rope_theta)
    k = rotary(project(c.kv_heads, "k"), c.rope_theta)
    v = project(c.kv_heads, "v")
    k, v = (jnp.repeat(t, c.heads // c.kv_heads, axis=2) for t in (k, v))
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    out = self.attention_fn(q, k, v, mask=mask, dtype=self.dtype)
    return nn.DenseGeneral(c.d_model, axis=(-2, -1), use_bias=False, dtype=self.dtype,
                           dot_general_cls=self.dot_general_cls, name="o")(out)


class DecoderLayer(nn.Module):
  """Pre-norm attention and SwiGLU FFN, each with a residual."""
  config: Config
  dtype: Any = None
  dot_general_cls: Any = None

  @nn.compact
  def __call__(self, x):
    c = self.config
    dense = lambda features, name: nn.DenseGeneral(
        features, use_bias=False, dtype=self.dtype, dot_general_cls=self.dot_general_cls,
        name=name)
    x = x + Attention(c, self.dtype, self.dot_general_cls, name="attn")(
        nn.RMSNorm(dtype=self.dtype, name="attn_norm")(x))
    h = nn.RMSNorm(dtype=self.dtype, name="ffn_norm")(x)
    h = nn.silu(dense(c.ffn, "gate")(h)) * dense(c.ffn, "up")(h)
    return x + dense(c.d_model, "down")(h)


class Stack(nn.Module):
  """``layers`` decoder layers, one after another."""
  config: Config
  layers: int
  dtype: Any = None
  dot_general_cls: Any = None

  @nn.compact
  def __call__(self, x):
    for i in range(self.layers):
      x = DecoderLayer(self.config, self.dtype, self.dot_general_cls, name=f"layer_{i}")(x)
    return x


class _ScanBody(nn.Module):
  """One decoder layer as ``nn.scan``'s body: the carry in, ``(carry, None)`` out."""
  config: Config
  dtype: Any = None
  dot_general_cls: Any = None

  @nn.compact
  def __call__(self, x, _):
    return DecoderLayer(self.config, self.dtype, self.dot_general_cls, name="layer")(x), None


class ScannedStack(nn.Module):
  """``layers`` decoder layers in one ``nn.scan``: the params stacked on a layer axis."""
  config: Config
  layers: int
  dtype: Any = None
  dot_general_cls: Any = None

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(_ScanBody, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=self.layers)
    return scan(self.config, self.dtype, self.dot_general_cls, name="layers")(x, None)[0]


def _grouped_attention(q, k, v, config: Config, dtype: Any) -> jnp.ndarray:
  """Causal grouped-query attention: key/value heads repeated to the query heads."""
  k, v = (jnp.repeat(t, config.heads // config.kv_heads, axis=2) for t in (k, v))
  mask = nn.make_causal_mask(jnp.ones(q.shape[:2], jnp.int32))
  return nnx.dot_product_attention(q, k, v, mask=mask, dtype=dtype)


class NnxDecoderLayer(nnx.Module):
  """:class:`DecoderLayer` in NNX: ``nnx.LinearGeneral`` projections, ``nnx.RMSNorm``."""

  def __init__(self, config: Config, rngs: nnx.Rngs, dtype: Any = None):
    c = config
    dense = lambda features, **kw: nnx.LinearGeneral(
        kw.pop("in_features", c.d_model), features, use_bias=False, dtype=dtype, rngs=rngs, **kw)
    self.config, self.dtype = config, dtype
    self.attn_norm = nnx.RMSNorm(c.d_model, dtype=dtype, rngs=rngs)
    self.q = dense((c.heads, c.head_dim))
    self.k = dense((c.kv_heads, c.head_dim))
    self.v = dense((c.kv_heads, c.head_dim))
    self.o = dense(c.d_model, in_features=(c.heads, c.head_dim), axis=(-2, -1))
    self.ffn_norm = nnx.RMSNorm(c.d_model, dtype=dtype, rngs=rngs)
    self.gate, self.up = dense(c.ffn), dense(c.ffn)
    self.down = dense(c.d_model, in_features=c.ffn)

  def __call__(self, x):
    c = self.config
    h = self.attn_norm(x)
    q, k = rotary(self.q(h), c.rope_theta), rotary(self.k(h), c.rope_theta)
    x = x + self.o(_grouped_attention(q, k, self.v(h), c, self.dtype))
    h = self.ffn_norm(x)
    return x + self.down(nnx.silu(self.gate(h)) * self.up(h))


class NnxScannedStack(nnx.Module):
  """``layers`` :class:`NnxDecoderLayer` built by ``nnx.vmap`` and run by ``nnx.scan``."""

  def __init__(self, config: Config, layers: int, rngs: nnx.Rngs, dtype: Any = None):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NnxDecoderLayer(config, rngs, dtype)
    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, layer):
      return layer(x)
    return body(x, self.layers)
