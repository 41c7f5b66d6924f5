"""A small decoder-only transformer language model in Flax linen.

Written the way models are usually written: no precision code at all, so that jaxmp
wraps it unchanged. ``dtype`` and ``dot_general_cls`` exist only so benchmarks can build
the same model "by hand" (``dtype=jnp.bfloat16`` on every layer, Flax's own fp8
``dot_general_cls`` in the blocks) and compare.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 256
  context: int = 128
  width: int = 128
  depth: int = 2
  heads: int = 4
  mlp_ratio: int = 4
  dropout: float = 0.0


class MLPBlock(nn.Module):
  config: Config
  dtype: Optional[Any] = None
  dot_general_cls: Optional[Any] = None

  @nn.compact
  def __call__(self, x):
    width = self.config.width
    dense = lambda n, name: nn.Dense(n, dtype=self.dtype, dot_general_cls=self.dot_general_cls,
                                     name=name)
    h = dense(self.config.mlp_ratio * width, "up")(x)
    return dense(width, "down")(nn.gelu(h))


class DecoderBlock(nn.Module):
  config: Config
  dtype: Optional[Any] = None
  dot_general_cls: Optional[Any] = None

  @nn.compact
  def __call__(self, x, train: bool = False):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    h = nn.LayerNorm(dtype=self.dtype, name="ln_attn")(x)
    h = nn.MultiHeadDotProductAttention(
        num_heads=self.config.heads, dtype=self.dtype, dropout_rate=self.config.dropout,
        deterministic=not train, qkv_dot_general_cls=self.dot_general_cls,
        out_dot_general_cls=self.dot_general_cls, name="attn")(h, h, mask=mask)
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype, name="ln_mlp")(x)
    return x + MLPBlock(self.config, self.dtype, self.dot_general_cls, name="mlp")(h)


class TransformerLM(nn.Module):
  """Token ids ``[batch, length]`` in, next-token logits ``[batch, length, vocab]`` out."""

  config: Config
  dtype: Optional[Any] = None
  dot_general_cls: Optional[Any] = None  # for the blocks; the head keeps lax.dot_general

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    config = self.config
    x = nn.Embed(config.vocab, config.width, dtype=self.dtype, name="embed")(tokens)
    positions = self.param("positions", nn.initializers.normal(0.02),
                           (config.context, config.width))
    x = x + positions[: tokens.shape[1]].astype(x.dtype)
    for i in range(config.depth):
      x = DecoderBlock(config, self.dtype, self.dot_general_cls, name=f"block_{i}")(x, train)
    x = nn.LayerNorm(dtype=self.dtype, name="ln_final")(x)
    return nn.Dense(config.vocab, dtype=self.dtype, name="head")(x)
