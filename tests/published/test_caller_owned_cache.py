"""A decode cache the caller owns: bonsai's Qwen3, as published, under jaxmp.nnx.

The model (``bonsai_qwen3/modeling.py``, copied verbatim) takes its KV cache as an
argument: a list of ``LayerCache`` modules whose ``nnx.Cache`` variables each attention
layer updates with ``lax.dynamic_update_slice(cache, key, ...)`` and assigns back. Its
run script builds that cache in float32 (``dtype=jnp.float32``); its ``init_cache``
default is bfloat16. Under a policy whose compute dtype is the other one, the update
needs one dtype: jaxmp reads the cache in the compute dtype of the module it is passed
to and writes it back in its own dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxmp
from tests.published import matmuls
from tests.published.bonsai_qwen3 import modeling

BF16 = "params=float32,compute=bfloat16,output=float32"
BATCH, PROMPT, STEPS = 2, 4, 2


def _config():
  # A tiny Qwen3: the published architecture (GQA, qk-norm, tied embedding) at toy sizes.
  return modeling.ModelConfig(
      num_layers=2, vocab_size=64, emb_dim=32, mlp_dim=64, num_heads=4, head_dim=8,
      num_kv_heads=2, rope_theta=10_000, rope_scaling_factor=1, local_rope_theta=1e4,
      norm_eps=1e-6, tie_word_embeddings=True)


def _tokens():
  # Left-padded prompts (pad id 0), as the run script's tokenizer makes them.
  tokens = jax.random.randint(jax.random.key(1), (BATCH, PROMPT), 1, 64)
  return tokens.at[1, 0].set(0)


def _decode(model, cache_dtype):
  """The run script's loop: prefill, then greedy steps; every step's logits and the cache."""
  cfg = model.model.config if isinstance(model, jaxmp.nnx.MixedPrecision) else model.config
  cache = modeling.init_cache(cfg, BATCH, PROMPT, STEPS, dtype=cache_dtype)
  logits, cache = modeling.forward(model, cache, _tokens(), 0)
  steps = [logits]
  for _ in range(STEPS):
    logits, cache = modeling.forward(model, cache, jnp.argmax(logits, -1)[:, None], 0)
    steps.append(logits)
  return steps, cache


def _kv(cache):
  return [(layer.k_cache[...], layer.v_cache[...]) for layer in cache]


def test_run_scripts_float32_cache_under_a_bfloat16_policy():
  wrapped = jaxmp.nnx.mixed_precision(modeling.Qwen3(_config(), rngs=nnx.Rngs(0)), BF16)
  logits, cache = _decode(wrapped, jnp.float32)
  # The same wrapped model with a cache in its compute dtype, which never needs a cast.
  same_dtype_logits, same_dtype_cache = _decode(wrapped, jnp.bfloat16)
  for layer in cache:
    assert layer.k_cache[...].dtype == layer.v_cache[...].dtype == jnp.float32
    assert int(layer.cur_ind[...]) == PROMPT + STEPS
  # Every key and value written was computed in bfloat16: the float32 cache holds the
  # bfloat16 cache's values exactly, and every step's logits are the same.
  for (k, v), (k16, v16) in zip(_kv(cache), _kv(same_dtype_cache)):
    np.testing.assert_array_equal(k, k16.astype(jnp.float32))
    np.testing.assert_array_equal(v, v16.astype(jnp.float32))
  for a, b in zip(logits, same_dtype_logits):
    assert a.dtype == jnp.float32
    np.testing.assert_array_equal(a, b)
  # And it is the published model's computation: close to the unwrapped float32 run.
  reference, _ = _decode(wrapped.model, jnp.float32)
  for a, b in zip(logits, reference):
    a, b = a.ravel(), b.ravel()
    assert float(a @ b / (jnp.linalg.norm(a) * jnp.linalg.norm(b))) > 0.99


def test_every_matmul_reads_the_float32_cache_in_bfloat16():
  cfg = _config()
  wrapped = jaxmp.nnx.mixed_precision(modeling.Qwen3(cfg, rngs=nnx.Rngs(0)), BF16)
  cache = modeling.init_cache(cfg, BATCH, PROMPT, STEPS, dtype=jnp.float32)
  jaxpr = jax.make_jaxpr(lambda tokens: modeling.forward(wrapped, cache, tokens, 0))(_tokens())
  counts = matmuls.count_matmuls(jaxpr)
  # Besides each layer's RoPE angles (integer positions times float32 frequencies, at
  # HIGHEST precision in the published code), every matmul is bfloat16: the attention
  # reads the float32 cache in bfloat16.
  assert counts.pop("mixed:float32,int32") == cfg.num_layers
  assert set(counts) == {"bfloat16"}, matmuls.describe_matmuls(jaxpr)


def test_default_bfloat16_cache_under_a_float32_policy():
  model = modeling.Qwen3(_config(), rngs=nnx.Rngs(0))
  wrapped = jaxmp.nnx.mixed_precision(model, "float32")
  logits, cache = _decode(wrapped, jnp.bfloat16)  # init_cache's default dtype
  reference, reference_cache = _decode(model, jnp.float32)
  for layer in cache:
    assert layer.k_cache[...].dtype == layer.v_cache[...].dtype == jnp.bfloat16
  # What the cache holds is the float32 projections rounded once to bfloat16; the steps
  # after the prompt read that rounded cache, so only the prompt's logits are exact.
  for (k, v), (k32, v32) in zip(_kv(cache), _kv(reference_cache)):
    np.testing.assert_array_equal(k[:, :PROMPT], k32[:, :PROMPT].astype(jnp.bfloat16))
    np.testing.assert_array_equal(v[:, :PROMPT], v32[:, :PROMPT].astype(jnp.bfloat16))
  np.testing.assert_array_equal(logits[0], reference[0])
