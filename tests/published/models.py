"""Registry of published Flax models, run on tiny versions of their published configs.

The model code under ``tests/published/flax_*`` is copied verbatim from the Flax
repository (see each file's first line and ``tests/published/__init__.py``); only this
registry is ours. Each :class:`PublishedModel` says how to build the model, what a batch
looks like, how its published training/eval/decode code calls it, and which "surfaces"
it has, so that tests can run any of them unwrapped or under a jaxmp wrapper.

Conventions (both frameworks):
  * ``entry.batch(key)`` -> :class:`Batch` with the forward's positional ``inputs`` and
    integer ``targets`` (one class per row of logits) for :func:`cross_entropy`.
  * ``mode`` is ``"train"`` (dropout on, batch statistics updated) or ``"eval"``.

linen entries (``framework == "linen"``): ``entry.module(mode)`` returns an unbound
Module built from the published config for that mode (``"decode"`` too, where the model
has a decode cache); ``entry.init(model, key, batch)`` returns its variables and
``entry.forward(model, variables, batch, mode, key)`` returns ``(logits, updates)``,
``updates`` being the mutated collections (``{"batch_stats": ...}`` or ``{}``). ``model``
may be the Module or a ``jaxmp.linen.mixed_precision`` wrapper of it: both have
``init``/``apply`` with the same signature.

nnx entries (``framework == "nnx"``): ``entry.module(rngs)`` returns the model;
``entry.forward(model, batch, mode, key)`` puts it in train/eval mode and returns the
logits (``model`` may be the ``jaxmp.nnx.mixed_precision`` wrapper).

Decode caches (``entry.decode``, where the model has one): linen
``decode.init_cache(model, key, batch)`` with ``model = entry.module("decode")``, then
``decode.step(model, variables, cache, batch)`` -> ``(logits, cache)`` for one token;
nnx ``decode.init_cache(model, batch)`` and ``decode.step(model, cache, batch)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

FLAX_COMMIT = "18f8f311c275d57f46d95e41b15aa97b454754c0"
FLAX_BLOB = f"https://github.com/google/flax/blob/{FLAX_COMMIT}/"

# The surfaces a model can have.
DROPOUT = "dropout"            # stochastic layers switched by a train/deterministic flag
BATCH_STATS = "batch_stats"    # BatchNorm statistics updated in train mode
METHOD = "method"              # other entry points than __call__ (linen apply(method=))
DECODE_CACHE = "decode_cache"  # autoregressive KV cache
TIED_EMBEDDING = "tied_embedding"  # logits through the input embedding (Embed.attend)
CONV = "conv"                  # convolutions
SCAN = "scan"                  # layers stacked with nnx.vmap and applied with nnx.scan
RNGS_ARG = "rngs_arg"          # the call takes an nnx.Rngs argument
AXIS_NAME = "axis_name"        # BatchNorm reduces over a named axis ('batch') in train mode

VOCAB = 64
SEQ = 8
BATCH = 2
# ResNet's BatchNorm over 2 images makes its 30-step Adam run chaotic: a 2**-20 relative
# change of the float32 inputs moved the final loss by 40% of test_training_tracks_float32's
# bar (measured). Over 8 images the same change moves it by 5e-7, and every precision's
# final loss is then a statement about precision, not about the trajectory it fell into.
RESNET_BATCH = 8
WIDTH = 32
HEADS = 2
LAYERS = 2


@dataclasses.dataclass(frozen=True)
class Batch:
  inputs: tuple
  targets: jax.Array


@dataclasses.dataclass(frozen=True)
class DecodeSurface:
  init_cache: Callable[..., Any]
  step: Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class PublishedModel:
  """One published model and how its own code calls it."""
  name: str
  framework: str            # "linen" or "nnx"
  source: str               # the copied file, at the copied commit
  config_dtype: Optional[str]  # the computation dtype its published config sets (None:
                               # no config; its layers' default dtype=None)
  surfaces: frozenset
  module: Callable[..., Any]
  batch: Callable[[jax.Array], Batch]
  forward: Callable[..., Any]
  init: Optional[Callable[..., Any]] = None   # linen only
  decode: Optional[DecodeSurface] = None
  notes: str = ""

  def loss(self, logits: jax.Array, targets: jax.Array) -> jax.Array:
    return cross_entropy(logits, targets)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy of integer targets, computed in float32."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets).mean()


def _tokens(key, shape=(BATCH, SEQ), vocab=VOCAB):
  return jax.random.randint(key, shape, 1, vocab)  # 0 is padding in these models


def _dropout_rngs(mode, key):
  return {"dropout": key} if mode == "train" else {}


# ---- linen: flax/examples/lm1b (decoder-only LM) -------------------------------------

def _lm1b_module(mode: str):
  from .flax_lm1b import models
  # examples/lm1b/train.py: train, eval (deterministic) and predict (decode) configs;
  # the config class's defaults otherwise (dtype=jnp.float32), sizes shrunk.
  config = models.TransformerConfig(
      vocab_size=VOCAB, output_vocab_size=VOCAB, emb_dim=WIDTH, num_heads=HEADS,
      num_layers=LAYERS, qkv_dim=WIDTH, mlp_dim=2 * WIDTH, max_len=SEQ,
      deterministic=mode != "train", decode=mode == "decode")
  return models.TransformerLM(config)


def _lm1b_batch(key):
  k1, k2 = jax.random.split(key)
  return Batch((_tokens(k1),), _tokens(k2))


def _lm1b_init(model, key, batch):
  return model.init(key, jnp.ones(batch.inputs[0].shape, jnp.float32))


def _lm1b_forward(model, variables, batch, mode, key):
  return model.apply(variables, *batch.inputs, rngs=_dropout_rngs(mode, key)), {}


def _lm1b_init_cache(model, key, batch):
  return model.init(key, jnp.ones(batch.inputs[0].shape, jnp.float32))["cache"]


def _lm1b_step(model, variables, cache, batch):
  logits, updates = model.apply({"params": variables["params"], "cache": cache},
                                batch.inputs[0][:, :1], mutable=["cache"])
  return logits, updates["cache"]


# ---- linen: flax/examples/wmt (encoder-decoder) -------------------------------------

def _wmt_module(mode: str):
  from .flax_wmt import models
  # examples/wmt/configs/default.py: share_embeddings=True, logits_via_embedding=True.
  config = models.TransformerConfig(
      vocab_size=VOCAB, output_vocab_size=VOCAB, share_embeddings=True,
      logits_via_embedding=True, emb_dim=WIDTH, num_heads=HEADS, num_layers=LAYERS,
      qkv_dim=WIDTH, mlp_dim=2 * WIDTH, max_len=SEQ,
      deterministic=mode != "train", decode=mode == "decode")
  return models.Transformer(config)


def _wmt_batch(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return Batch((_tokens(k1), _tokens(k2)), _tokens(k3))


def _wmt_init(model, key, batch):
  inputs, targets = batch.inputs
  return model.init(key, jnp.ones(inputs.shape, jnp.float32),
                    jnp.ones(targets.shape, jnp.float32))


def _wmt_forward(model, variables, batch, mode, key):
  return model.apply(variables, *batch.inputs, rngs=_dropout_rngs(mode, key)), {}


def _wmt_init_cache(model, key, batch):
  return _wmt_init(model, key, batch)["cache"]


def _wmt_step(model, variables, cache, batch):
  # examples/wmt/train.py predict_step: encode once, then decode token by token.
  from .flax_wmt import models
  inputs, targets = batch.inputs
  params = {"params": variables["params"]}
  encoded = model.apply(params, inputs, method=models.Transformer.encode)
  logits, updates = model.apply({**params, "cache": cache}, encoded, inputs,
                                targets[:, :1], mutable=["cache"],
                                method=models.Transformer.decode)
  return logits, updates["cache"]


# ---- linen: flax/examples/imagenet (ResNet with BatchNorm) ----------------------------

def _resnet_module(mode: str):
  del mode  # train/eval is the call's `train` flag
  from .flax_imagenet import models
  return models.ResNet18(num_classes=10, num_filters=8)  # dtype=jnp.float32 default


def _image_batch(key, shape=(BATCH, 16, 16, 3), classes=10):
  k1, k2 = jax.random.split(key)
  return Batch((jax.random.normal(k1, shape),),
               jax.random.randint(k2, shape[:1], 0, classes))


def _resnet_init(model, key, batch):
  # examples/imagenet/train.py initialized(): init outside pmap, train=True default.
  return model.init({"params": key}, jnp.ones(batch.inputs[0].shape, jnp.float32))


def _resnet_forward(model, variables, batch, mode, key):
  del key
  (images,) = batch.inputs
  if mode == "eval":
    return model.apply(variables, images, train=False, mutable=False), {}
  # Train mode: BatchNorm(axis_name='batch') pmeans its statistics over the devices
  # (train.py runs under pmap); a one-member vmapped axis binds the name here.
  def one(x):
    return model.apply(variables, x, train=True, mutable=["batch_stats"])
  logits, updates = jax.vmap(one, axis_name="batch")(images[None])
  return logits[0], jax.tree.map(lambda u: u[0], updates)


# ---- nnx: flax/examples/gemma (decoder-only, explicit KV cache) -----------------------

def _gemma_config():
  from .flax_gemma import transformer_cfg as cfg
  # The smallest published config (gemma3_270m: MQA, qk-norm, local sliding + global
  # attention, tied embedding); dtype=weight_dtype=jnp.float32 defaults; sizes shrunk.
  return cfg.TransformerConfig.gemma3_270m(
      num_layers=LAYERS, num_embed=VOCAB, embed_dim=WIDTH, hidden_dim=2 * WIDTH,
      num_heads=HEADS, head_dim=WIDTH // HEADS, num_kv_heads=1, sliding_window_size=4,
      attention_types=cfg.make_attention_layers_types(cfg.GEMMA3_ATTENTION_PATTERN,
                                                      LAYERS))


def _gemma_module(rngs):
  from .flax_gemma import transformer
  return transformer.Transformer(_gemma_config(), rngs=rngs)


def _set_mode(model, mode):
  if mode == "train":
    model.train()
  else:
    model.eval()


def _gemma_forward(model, batch, mode, key):
  from .flax_gemma import transformer
  _set_mode(model, mode)
  (tokens,) = batch.inputs
  input_mask = tokens != 0
  positions = transformer.build_positions_from_mask(input_mask)
  attention_mask = transformer.make_causal_attn_mask(input_mask)
  logits, _ = model(tokens, positions, None, attention_mask,
                    rngs=nnx.Rngs(dropout=key) if mode == "train" else None)
  return logits


def _gemma_init_cache(model, batch):
  return model.init_cache(cache_size=SEQ, batch_size=batch.inputs[0].shape[0])


def _gemma_step(model, cache, batch):
  # examples/gemma/sampler.py: one token, attending to the cache slots filled so far.
  _set_mode(model, "eval")
  tokens = batch.inputs[0][:, :1]
  positions = jnp.zeros_like(tokens)
  attention_mask = (jnp.arange(SEQ) < 1)[None, None, :].repeat(tokens.shape[0], 0)
  return model(tokens, positions, cache, attention_mask)


# ---- nnx: flax docs_nnx/mnist_tutorial.md CNN (BatchNorm, Dropout) --------------------

def _cnn_module(rngs):
  from .flax_mnist_cnn import cnn
  return cnn.CNN(rngs=rngs)  # fixed sizes: 28x28x1 inputs (linear1 takes 7*7*64)


def _cnn_forward(model, batch, mode, key):
  _set_mode(model, mode)
  rngs = nnx.Rngs(dropout=key) if mode == "train" else None
  return model(batch.inputs[0], rngs)


# ---- nnx: flax examples/nnx_toy_examples/06_scan_over_layers.py ----------------------

def _scan_mlp_module(rngs):
  # The published file builds and runs a demo model when imported (it prints).
  with contextlib.redirect_stdout(io.StringIO()):
    from .flax_scan_mlp import scan_over_layers
  return scan_over_layers.ScanMLP(WIDTH, n_layers=LAYERS, rngs=rngs)


def _vector_batch(key):
  k1, k2 = jax.random.split(key)
  return Batch((jax.random.normal(k1, (4, WIDTH)),),
               jax.random.randint(k2, (4,), 0, WIDTH))


def _scan_mlp_forward(model, batch, mode, key):
  del key  # Dropout holds its own rngs
  _set_mode(model, mode)
  return model(batch.inputs[0])


MODELS: tuple[PublishedModel, ...] = (
    PublishedModel(
        name="lm1b_transformer_lm", framework="linen",
        source=FLAX_BLOB + "examples/lm1b/models.py", config_dtype="float32",
        surfaces=frozenset({DROPOUT, DECODE_CACHE}),
        module=_lm1b_module, batch=_lm1b_batch, init=_lm1b_init, forward=_lm1b_forward,
        decode=DecodeSurface(_lm1b_init_cache, _lm1b_step),
        notes="dropout via config.deterministic; logits_via_embedding=False as in "
              "configs/default.py (train.py sets dtype=bfloat16 when use_bfloat16)"),
    PublishedModel(
        name="wmt_transformer", framework="linen",
        source=FLAX_BLOB + "examples/wmt/models.py", config_dtype="float32",
        surfaces=frozenset({DROPOUT, DECODE_CACHE, METHOD, TIED_EMBEDDING}),
        module=_wmt_module, batch=_wmt_batch, init=_wmt_init, forward=_wmt_forward,
        decode=DecodeSurface(_wmt_init_cache, _wmt_step),
        notes="encoder-decoder; shared + tied embeddings (Embed.attend); "
              "apply(method=Transformer.encode/.decode)"),
    PublishedModel(
        name="imagenet_resnet18", framework="linen",
        source=FLAX_BLOB + "examples/imagenet/models.py", config_dtype="float32",
        surfaces=frozenset({BATCH_STATS, CONV, AXIS_NAME}),
        module=_resnet_module, batch=lambda key: _image_batch(key, (RESNET_BATCH, 16, 16, 3)),
        init=_resnet_init,
        forward=_resnet_forward,
        notes="train=True with mutable=['batch_stats']; BatchNorm axis_name='batch'"),
    PublishedModel(
        name="gemma3_transformer", framework="nnx",
        source=FLAX_BLOB + "examples/gemma/transformer.py", config_dtype="float32",
        surfaces=frozenset({DECODE_CACHE, TIED_EMBEDDING, RNGS_ARG}),
        module=_gemma_module, batch=_lm1b_batch, forward=_gemma_forward,
        decode=DecodeSurface(_gemma_init_cache, _gemma_step),
        notes="config dtype and weight_dtype float32; published dropout_rate=0.0; the "
              "KV cache is an explicit argument/return (init_cache dtype float32)"),
    PublishedModel(
        name="mnist_cnn", framework="nnx",
        source=FLAX_BLOB + "docs_nnx/mnist_tutorial.md", config_dtype=None,
        surfaces=frozenset({CONV, BATCH_STATS, DROPOUT, RNGS_ARG}),
        module=_cnn_module,
        batch=lambda key: _image_batch(key, (BATCH, 28, 28, 1)),
        forward=_cnn_forward,
        notes="no config: layer defaults (dtype=None, param_dtype=float32); "
              "Dropout takes rngs at call time"),
    PublishedModel(
        name="scan_mlp", framework="nnx",
        source=FLAX_BLOB + "examples/nnx_toy_examples/06_scan_over_layers.py",
        config_dtype=None,
        surfaces=frozenset({SCAN, BATCH_STATS, DROPOUT}),
        module=_scan_mlp_module, batch=_vector_batch, forward=_scan_mlp_forward,
        notes="nnx.vmap-created layer stack applied with nnx.scan; layer defaults "
              "(dtype=None, param_dtype=float32)"),
)

BY_NAME = {m.name: m for m in MODELS}
