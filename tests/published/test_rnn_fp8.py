"""fp8 delayed scaling inside ``nn.RNN``, on Flax's published seq2seq LSTM.

``tests/published/flax_seq2seq`` is Flax's ``examples/seq2seq`` model and input
pipeline, copied verbatim: an encoder ``nn.RNN(nn.LSTMCell)`` and a decoder
``nn.RNN(DecoderLSTMCell)``, neither of which lists the fp8 collection in its scan.
``Rule(nn.Dense, fp8=DelayedScaling())`` puts every LSTM gate (and the decoder's
logits layer) in fp8; jaxmp passes their state through the RNNs' scans
(``jaxmp._src.linen.lifted``: the state goes where the params go). The config is the published one
(``configs/default.py``, ``train.py``: Adam at 0.003, numbers of up to 3 digits, no
teacher forcing) with the hidden size and batch shrunk from 512 and 128.
"""

from __future__ import annotations

import random

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp import fp8
from tests.published import matmuls
from tests.published.flax_seq2seq import input_pipeline
from tests.published.flax_seq2seq import models

HIDDEN, BATCH = 16, 8          # published: 512, 128
LEARNING_RATE = 0.003          # published
MAX_LEN_QUERY_DIGIT = 3        # published
RECIPE = fp8.DelayedScaling(amax_history_length=4)
BF16 = "params=float32,compute=bfloat16,output=float32"
OWG = fp8.OVERWRITE_WITH_GRADIENT
GATES = ("ii", "if", "ig", "io", "hi", "hf", "hg", "ho")
# The cells are created in Seq2seq's own scope, so they sit beside the RNNs.
FP8_LAYERS = (tuple(f"LSTMCell_0/{g}" for g in GATES)
              + tuple(f"DecoderLSTMCell_0/LSTMCell_0/{g}" for g in GATES)
              + ("DecoderLSTMCell_0/Dense_0",))


@pytest.fixture(name="ctable")
def _ctable():
  # The published pipeline draws its examples from Python's global `random`.
  saved = random.getstate()
  random.seed(0)
  yield input_pipeline.CharacterTable("0123456789+= ", MAX_LEN_QUERY_DIGIT)
  random.setstate(saved)


def _wrapped(ctable):
  # train.get_model(ctable): teacher_force=False, as the published training runs.
  model = models.Seq2seq(teacher_force=False, hidden_size=HIDDEN, eos_id=ctable.eos_id,
                         vocab_size=ctable.vocab_size)
  return jaxmp.linen.mixed_precision(
      model, jaxmp.PolicyRules(BF16, [jaxmp.Rule(nn.Dense, fp8=RECIPE)]))


def _init(wrapped, ctable):
  # train.get_initial_params.
  rng1, rng2 = jax.random.split(jax.random.key(0))
  return wrapped.init({"params": rng1, "lstm": rng2},
                      jnp.ones(ctable.encoder_input_shape, jnp.float32),
                      jnp.ones(ctable.decoder_input_shape, jnp.float32))


def _layer(tree, path):
  for key in path.split("/"):
    tree = tree[key]
  return tree


def test_every_lstm_gate_gets_fp8_state_and_runs_in_fp8(ctable):
  # Before jaxmp passed the state through nn.RNN's scan, init failed here with
  # Flax's ScopeCollectionNotFound.
  wrapped = _wrapped(ctable)
  variables = _init(wrapped, ctable)
  found = jax.tree_util.tree_leaves(variables[OWG], is_leaf=lambda t: "input_scale" in t)
  assert len(found) == len(FP8_LAYERS)
  for path in FP8_LAYERS:
    state = _layer(variables[OWG], path)["Fp8DotGeneral_0"]
    assert state["input_amax_history"].shape == (RECIPE.amax_history_length,)
  batch = ctable.get_batch(BATCH)
  summary = jaxmp.tools.summary(wrapped, None, batch["query"], batch["answer"],
                                variables=variables, rngs={"lstm": jax.random.key(1)})
  ran = {row.path: row.ran for row in summary.rows}
  assert {path: ran[path] for path in FP8_LAYERS} == dict.fromkeys(FP8_LAYERS, "float8_e4m3fn")


def _cross_entropy_loss(logits, labels, lengths):
  # train.cross_entropy_loss (train.py imports absl and clu, so it is not copied).
  xe = jnp.sum(nn.log_softmax(logits) * labels, axis=-1)
  masked_xe = jnp.mean(input_pipeline.mask_sequences(xe, lengths))
  return -masked_xe


def _train_step(state, batch, lstm_rng, eos_id):
  """train.train_step, with jaxmp's TrainState: the fp8 state is differentiated too."""
  labels = batch["answer"][:, 1:]
  lstm_key = jax.random.fold_in(lstm_rng, state.step)

  def loss_fn(variables):
    logits, _ = state.apply_fn(variables, batch["query"], batch["answer"],
                               rngs={"lstm": lstm_key})
    return _cross_entropy_loss(logits, labels,
                               input_pipeline.get_sequence_lengths(labels, eos_id))

  loss, grads = state.value_and_grad(loss_fn)()
  return state.apply_gradients(grads), loss


@pytest.mark.slow
def test_training_updates_every_gates_fp8_state(ctable):
  wrapped = _wrapped(ctable)
  state = jaxmp.linen.TrainState.create(apply_fn=wrapped.apply,
                                        variables=_init(wrapped, ctable),
                                        tx=jaxmp.loss_scaling(optax.adam(LEARNING_RATE)))
  rng = jax.random.key(0)
  batches = [ctable.get_batch(BATCH) for _ in range(3)]
  # What runs: every matmul of the step, forward and backward, has fp8 operands.
  jaxpr = jax.make_jaxpr(_train_step, static_argnums=3)(state, batches[0], rng, ctable.eos_id)
  counts = matmuls.count_matmuls(jaxpr)
  assert all("float8" in dtypes for dtypes in counts), counts
  assert counts["float8_e4m3fn"] >= len(FP8_LAYERS)

  step = jax.jit(_train_step, static_argnums=3)
  states = [state]
  for batch in batches:
    state, loss = step(state, batch, rng, ctable.eos_id)
    assert np.isfinite(float(loss))
    states.append(state)
  for path in FP8_LAYERS:
    before, *after = [_layer(s.fp8, path)["Fp8DotGeneral_0"] for s in states]
    kernels = [_layer(s.params, path)["kernel"] for s in states[:-1]]
    for i, new in enumerate(after):
      # Each step records the amax of the kernel it multiplied (the bfloat16 compute
      # copy), once however many time steps read it, and rolls the history by one.
      amax = jnp.max(jnp.abs(kernels[i].astype(jnp.bfloat16))).astype(jnp.float32)
      assert float(new["kernel_amax_history"][0]) == float(amax), (path, i)
      old = before if i == 0 else after[i - 1]
      np.testing.assert_array_equal(new["kernel_amax_history"][1:],
                                    np.roll(old["kernel_amax_history"], -1)[1:])
      assert float(new["input_amax_history"][0]) > 0
      assert float(new["output_grad_amax_history"][0]) > 0
    # From the second step on, the scales come from the recorded amaxes.
    assert float(after[1]["input_scale"][0]) != 1.0, path
    assert float(after[1]["output_grad_scale"][0]) != 1.0, path
