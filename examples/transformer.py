"""A small decoder-only transformer language model in Flax linen.

Written the way models are usually written: no precision code at all, so that jaxmp
wraps it unchanged. ``dtype`` exists only so benchmarks can build the same model "by
hand" with ``dtype=jnp.bfloat16`` on every layer and compare.
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

  @nn.compact
  def __call__(self, x):
    width = self.config.width
    h = nn.Dense(self.config.mlp_ratio * width, dtype=self.dtype, name="up")(x)
    return nn.Dense(width, dtype=self.dtype, name="down")(nn.gelu(h))


class DecoderBlock(nn.Module):
  config: Config
  dtype: Optional[Any] = None

  @nn.compact
  def __call__(self, x, train: bool = False):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    h = nn.LayerNorm(dtype=self.dtype, name="ln_attn")(x)
    h = nn.MultiHeadDotProductAttention(
        num_heads=self.config.heads, dtype=self.dtype, dropout_rate=self.config.dropout,
        deterministic=not train, name="attn")(h, h, mask=mask)
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype, name="ln_mlp")(x)
    return x + MLPBlock(self.config, dtype=self.dtype, name="mlp")(h)


class TransformerLM(nn.Module):
  """Token ids ``[batch, length]`` in, next-token logits ``[batch, length, vocab]`` out."""

  config: Config
  dtype: Optional[Any] = None

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    config = self.config
    x = nn.Embed(config.vocab, config.width, dtype=self.dtype, name="embed")(tokens)
    positions = self.param("positions", nn.initializers.normal(0.02),
                           (config.context, config.width))
    x = x + positions[: tokens.shape[1]].astype(x.dtype)
    for i in range(config.depth):
      x = DecoderBlock(config, dtype=self.dtype, name=f"block_{i}")(x, train)
    x = nn.LayerNorm(dtype=self.dtype, name="ln_final")(x)
    return nn.Dense(config.vocab, dtype=self.dtype, name="head")(x)
