"""Published Flax models, copied verbatim, to run jaxmp on code we did not write.

Every file under ``flax_*/`` is a verbatim copy of a file of the Flax repository
(Apache License 2.0, text in ``LICENSE`` beside this file), taken from the ``flax``
0.12.8 source distribution on PyPI, whose files are byte-identical to
https://github.com/google/flax at commit 18f8f311c275d57f46d95e41b15aa97b454754c0.
The first line of each copy names its source; the only other changes are import lines,
each marked ``# jaxmp: import path``: sibling imports made relative to the package, and
in ``flax_gemma`` ``from jaxtyping import Array`` -> ``from jax import Array``
(``jaxtyping.Array`` is ``jax.Array``; jaxtyping is not a dependency here).

  flax_lm1b/models.py         examples/lm1b/models.py       linen decoder-only LM
  flax_wmt/models.py          examples/wmt/models.py        linen encoder-decoder
  flax_seq2seq/models.py      examples/seq2seq/models.py    linen LSTM encoder-decoder
                                                            (nn.RNN; test_rnn_fp8.py)
  flax_seq2seq/input_pipeline.py
                              examples/seq2seq/input_pipeline.py
                                                            its input pipeline
  flax_imagenet/models.py     examples/imagenet/models.py   linen ResNet (BatchNorm)
  flax_gemma/*.py             examples/gemma/               NNX Gemma transformer
  flax_mnist_cnn/cnn.py       docs_nnx/mnist_tutorial.md    NNX CNN (the model cell,
                                                            lines 67-91)
  flax_scan_mlp/scan_over_layers.py
                              examples/nnx_toy_examples/06_scan_over_layers.py
                                                            NNX scanned MLP (renamed: a
                                                            module name cannot start
                                                            with a digit)
  flax_vit/vit.py             docs_nnx/examples/vit_training.md
                                                            NNX ViT (the imports and
                                                            model cells, lines 26-28,
                                                            49-230); __call__ calls
                                                            self.embed
  flax_scan_layers/{linen,nnx}_scan_mlp.py
                              docs_nnx/migrating/linen_to_nnx.rst
                                                            the linen/NNX scanned MLP pair
                                                            ("Scan over layers", lines
                                                            540-565 and 571-598, dedented,
                                                            with import lines added): nn.scan
                                                            listing only params; nnx.vmap +
                                                            nnx.split_rngs + nnx.scan
                                                            (test_scanned_fp8.py)
  flax_pjit/mlp.py            docs/guides/parallel_training/flax_on_pjit.md
                                                            linen MLP of DotReluDot with
                                                            nn.with_partitioning, nn.scan
                                                            with metadata_params and a
                                                            use_scan switch (the import
                                                            cells, mesh_sharding without the
                                                            lines building the 8-device
                                                            mesh, which the tests set, and
                                                            the model cells)
  flax_autoencoder/{linen,nnx}_autoencoder.py
                              docs_nnx/migrating/linen_to_nnx.rst
                                                            the linen/NNX AutoEncoder
                                                            pair ("Using multiple
                                                            methods", lines 317-334 and
                                                            341-358, dedented, with
                                                            import lines added):
                                                            __call__ calls self.encode
                                                            and self.decode

The ``docs_nnx`` copies are cut from documentation pages at that commit (a code
cell, or one side of a codediff block), so each first line names the lines it took.

One model comes from outside Flax: ``bonsai_qwen3/modeling.py`` is a verbatim copy of
``bonsai/models/qwen3/modeling.py`` of https://github.com/jax-ml/bonsai (the JAX
Authors' NNX model implementations, Apache License 2.0, the same license text) at
commit 36284254cf738d99c1c5d1e3a292d27656a0a365: NNX Qwen3, whose KV cache the caller
builds and passes in (``test_caller_owned_cache.py``). Its one change is the import
line ``from jaxtyping import Array, ArrayLike`` -> ``from jax import Array`` and
``from jax.typing import ArrayLike``, marked ``# jaxmp: import path``.

One linen model comes from t5x: ``t5x_scalable_t5/{layers,network}.py`` are verbatim
copies of ``t5x/examples/scalable_t5/layers.py`` and ``network.py`` of
https://github.com/google-research/t5x (the T5X Authors, Apache License 2.0, the same
license text) at commit cc342d419ec3e3e9c4bf1df33c82330cafdc1e16: the T5.1.1
encoder-decoder whose layers run in ``partitioning.scan_with_axes`` (``param_scan_axis=1``,
``ScanIn``) over ``partitioning.remat``, with t5x's own ``DenseGeneral``, which calls
``lax.dot_general`` itself (``test_t5x_scanned_fp8.py``). Its one change is the import
line ``from t5x.examples.scalable_t5 import layers`` -> ``from . import layers``, marked
``# jaxmp: import path``.

``models.py`` is the registry (tiny versions of the published configs, inputs, call
flags, losses), ``matmuls.py`` counts matmuls in a jaxpr by dtype, and
``report_baseline.py`` prints the baseline (``python -m tests.published.report_baseline``).
Do not edit the copies: re-copy them from a newer release instead.
"""
