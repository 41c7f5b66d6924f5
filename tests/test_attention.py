"""Fused attention for wrapped Flax attention layers (PolicyRules(fused_attention=True))."""

import os
import re
import subprocess
import sys
import textwrap
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp._src.tools import targets

F32 = "float32"
BF16 = "params=float32,compute=bfloat16,output=float32"
X = jax.random.normal(jax.random.key(1), (2, 6, 16))
MASK = nn.make_causal_mask(jnp.ones((2, 6)))


def _linen(policy, fused, **attention):
  rules = jaxmp.PolicyRules(policy, fused_attention=fused)
  model = jaxmp.linen.mixed_precision(
      nn.MultiHeadDotProductAttention(num_heads=2, **attention), rules)
  variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, X,
                         mask=MASK)
  return model, variables


def _same_computation(f, g, *args):
  return str(jax.make_jaxpr(f)(*args)) == str(jax.make_jaxpr(g)(*args))


@pytest.mark.highest_precision
@pytest.mark.parametrize("policy, atol", [(F32, 1e-6), (BF16, 2e-2)])
def test_linen_fused_attention_matches_flaxs_own(policy, atol):
  plain, variables = _linen(policy, False)
  fused, _ = _linen(policy, True)
  loss = lambda model: lambda v: jnp.sum(model.apply(v, X, mask=MASK) ** 2)
  np.testing.assert_allclose(fused.apply(variables, X, mask=MASK),
                             plain.apply(variables, X, mask=MASK), atol=atol)
  g_plain = jax.grad(loss(plain))(variables)
  g_fused = jax.grad(loss(fused))(variables)
  for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_fused)):
    assert a.dtype == b.dtype == jnp.float32
    np.testing.assert_allclose(a, b, atol=atol * 10, rtol=atol * 10)
  # What ran: another computation than Flax's own (jax.nn.dot_product_attention).
  assert not _same_computation(lambda v: plain.apply(v, X, mask=MASK),
                               lambda v: fused.apply(v, X, mask=MASK), variables)


def test_nnx_fused_attention_matches_flaxs_own():
  layer = lambda: nnx.MultiHeadAttention(2, 16, decode=False, rngs=nnx.Rngs(0))
  plain = jaxmp.nnx.mixed_precision(layer(), jaxmp.PolicyRules(F32))
  fused = jaxmp.nnx.mixed_precision(layer(), jaxmp.PolicyRules(F32, fused_attention=True))
  np.testing.assert_allclose(fused(X, mask=MASK), plain(X, mask=MASK), atol=1e-6)


def test_dropout_and_sown_weights_run_the_layers_own_attention():
  # The fused kernel has no attention dropout and no weights to sow: Flax's own runs,
  # bit for bit as without the option.
  plain, variables = _linen(BF16, False, dropout_rate=0.5, deterministic=False)
  fused, _ = _linen(BF16, True, dropout_rate=0.5, deterministic=False)
  rngs = {"dropout": jax.random.key(3)}
  # Never silently: the fallback warns with its reason.
  with pytest.warns(UserWarning, match=r"fused_attention=True\): dropout on the attention "
                                       r"weights \(dropout_rate=0.5\): the layer's own"):
    out = fused.apply(variables, X, mask=MASK, rngs=rngs)
  np.testing.assert_array_equal(out, plain.apply(variables, X, mask=MASK, rngs=rngs))
  assert _same_computation(lambda v: plain.apply(v, X, mask=MASK, rngs=rngs),
                           lambda v: fused.apply(v, X, mask=MASK, rngs=rngs), variables)
  sown = lambda model: model.apply(variables, X, mask=MASK, sow_weights=True,
                                   mutable=["intermediates"])
  deterministic, _ = _linen(BF16, True)
  plain_deterministic, _ = _linen(BF16, False)
  with pytest.warns(UserWarning, match=r"the attention weights are sown"):
    fused_sown = sown(deterministic)
  np.testing.assert_array_equal(fused_sown[0], sown(plain_deterministic)[0])
  assert "attention_weights" in fused_sown[1]["intermediates"]
  # Asked for by a causal rule alone, the warning names the rule.
  causal = jaxmp.linen.mixed_precision(
      nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.5, deterministic=False),
      jaxmp.PolicyRules(BF16, [CAUSAL]))
  with pytest.warns(UserWarning, match=r"^Rule\(causal_attention=True\): dropout on the "):
    causal.apply(variables, X, mask=MASK, rngs=rngs)


def test_no_fused_kernel_no_warning_without_cudnn():
  # Without JAX's CUDA plugin nothing could fuse: XLA's implementation runs, quietly.
  if targets.cuda_plugin_installed():
    pytest.skip("this machine has the CUDA plugin (the H100 check below covers it)")
  fused, variables = _linen(F32, True)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fused.apply(variables, X, mask=MASK)


CAUSAL = jaxmp.Rule(nn.MultiHeadDotProductAttention, causal_attention=True)


@pytest.mark.highest_precision
def test_causal_attention_attends_causally_and_reads_no_mask():
  # Declared causal: whatever mask the layer is handed (here one that masks nothing),
  # it computes Flax's own attention under the causal mask.
  model = jaxmp.linen.mixed_precision(nn.MultiHeadDotProductAttention(num_heads=2),
                                      jaxmp.PolicyRules(F32, [CAUSAL]))
  plain = jaxmp.linen.mixed_precision(nn.MultiHeadDotProductAttention(num_heads=2),
                                      jaxmp.PolicyRules(F32))
  variables = plain.init(jax.random.key(0), X)
  everything = jnp.ones_like(MASK)
  np.testing.assert_allclose(model.apply(variables, X, mask=everything),
                             plain.apply(variables, X, mask=MASK), atol=1e-6)
  np.testing.assert_allclose(model.apply(variables, X), plain.apply(variables, X, mask=MASK),
                             atol=1e-6)
  _assert_same_gradients(model, everything, plain, MASK, variables)


def _assert_same_gradients(model, model_mask, plain, plain_mask, variables):
  """``model`` under ``model_mask`` has ``plain``'s gradients under ``plain_mask``."""
  loss = lambda m, mask: lambda v: jnp.sum(m.apply(v, X, mask=mask) ** 2)
  for a, b in zip(jax.tree.leaves(jax.grad(loss(model, model_mask))(variables)),
                  jax.tree.leaves(jax.grad(loss(plain, plain_mask))(variables))):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_causal_attention_on_nnx():
  layer = lambda: nnx.MultiHeadAttention(2, 16, decode=False, rngs=nnx.Rngs(0))
  rule = jaxmp.Rule(nnx.MultiHeadAttention, causal_attention=True)
  causal = jaxmp.nnx.mixed_precision(layer(), jaxmp.PolicyRules(F32, [rule]))
  plain = jaxmp.nnx.mixed_precision(layer(), jaxmp.PolicyRules(F32))
  np.testing.assert_allclose(causal(X), plain(X, mask=MASK), atol=1e-6)


def _sliding_causal_mask(length: int, window: int) -> jax.Array:
  """Each query attends to itself and the ``window - 1`` keys before it."""
  i, j = np.arange(length)[:, None], np.arange(length)[None, :]
  return jnp.asarray((j <= i) & (i - j < window))[None, None]


def _declared_and_plain(**declared):
  """Flax's attention wrapped with a rule declaring ``declared``, and without; params."""
  rule = jaxmp.Rule(nn.MultiHeadDotProductAttention, **declared)
  model = jaxmp.linen.mixed_precision(nn.MultiHeadDotProductAttention(num_heads=2),
                                      jaxmp.PolicyRules(F32, [rule]))
  plain = jaxmp.linen.mixed_precision(nn.MultiHeadDotProductAttention(num_heads=2),
                                      jaxmp.PolicyRules(F32))
  return model, plain, plain.init(jax.random.key(0), X)


@pytest.mark.highest_precision
@pytest.mark.parametrize("window", [1, 3, 6])
def test_attention_window_attends_to_a_sliding_band(window):
  model, plain, variables = _declared_and_plain(causal_attention=True,
                                                attention_window=window)
  band = _sliding_causal_mask(X.shape[1], window)
  np.testing.assert_allclose(model.apply(variables, X, mask=MASK),
                             plain.apply(variables, X, mask=band), atol=1e-6)
  _assert_same_gradients(model, MASK, plain, band, variables)


def test_attention_window_on_nnx():
  layer = lambda: nnx.MultiHeadAttention(2, 16, decode=False, rngs=nnx.Rngs(0))
  rule = jaxmp.Rule(nnx.MultiHeadAttention, causal_attention=True, attention_window=2)
  windowed = jaxmp.nnx.mixed_precision(layer(), jaxmp.PolicyRules(F32, [rule]))
  plain = jaxmp.nnx.mixed_precision(layer(), jaxmp.PolicyRules(F32))
  np.testing.assert_allclose(windowed(X), plain(X, mask=_sliding_causal_mask(6, 2)), atol=1e-6)


def _published_lm1b(rules, mode="eval"):
  from tests.published import models  # pylint: disable=import-outside-toplevel
  return jaxmp.linen.mixed_precision(models._lm1b_module(mode), rules)  # pylint: disable=protected-access


@pytest.mark.parametrize("padded", [False, True])
def test_causal_attention_on_published_lm1b_with_right_padding(padded):
  # Flax's lm1b masks padding and the future (combine_masks of both); declared causal,
  # the padding mask is not read, and every real token's logits stay Flax's: a real
  # token never attends to the padding after it. Declared padded as well, the mask is
  # read for each sequence's lengths (cuDNN's PADDING_CAUSAL mode on GPUs).
  rule = jaxmp.Rule(nn.MultiHeadDotProductAttention, causal_attention=True,
                    padded_attention=padded)
  causal, plain = _published_lm1b(jaxmp.PolicyRules(F32, [rule])), _published_lm1b(F32)
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 1, 64).at[0, 5:].set(0)
  variables = plain.init(jax.random.key(0), tokens)
  real = np.asarray(tokens > 0)
  np.testing.assert_allclose(np.asarray(causal.apply(variables, tokens))[real],
                             np.asarray(plain.apply(variables, tokens))[real], atol=2e-5)
  # Left padding is what the declaration rules out: the first real token would attend
  # to the padding before it. Declared padded, the mask is read, and refused where it
  # can be; declared causal alone, the mask is not read at all.
  left = jnp.roll(tokens, 3, axis=1)
  if padded:
    with pytest.raises(ValueError, match=NOT_RIGHT_PADDING):
      causal.apply(variables, left)
    return
  real = np.asarray(left > 0)
  assert not np.allclose(np.asarray(causal.apply(variables, left))[real],
                         np.asarray(plain.apply(variables, left))[real], atol=1e-3)


def test_attention_window_on_published_lm1b():
  # A window as long as the sequence is the causal rule itself; a shorter one changes
  # what the published model's real tokens see.
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 1, 64)
  window = lambda w: jaxmp.Rule(nn.MultiHeadDotProductAttention, causal_attention=True,
                                attention_window=w)
  causal = _published_lm1b(jaxmp.PolicyRules(F32, [CAUSAL]))
  variables = causal.init(jax.random.key(0), tokens)
  full = _published_lm1b(jaxmp.PolicyRules(F32, [window(8)]))
  np.testing.assert_array_equal(full.apply(variables, tokens), causal.apply(variables, tokens))
  short = _published_lm1b(jaxmp.PolicyRules(F32, [window(2)]))
  logits = np.asarray(short.apply(variables, tokens))
  reference = np.asarray(causal.apply(variables, tokens))
  # The first two positions see the same keys either way; the rest see fewer.
  np.testing.assert_allclose(logits[:, :2], reference[:, :2], atol=1e-5)
  assert not np.allclose(logits[:, 2:], reference[:, 2:], atol=1e-3)


def test_attention_window_is_not_applied_when_decoding_with_a_cache_and_says_so():
  rule = jaxmp.Rule(nn.MultiHeadDotProductAttention, causal_attention=True, attention_window=2)
  decode = _published_lm1b(jaxmp.PolicyRules(F32, [rule]), "decode")
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 1, 64)
  variables = _published_lm1b(F32).init(jax.random.key(0), tokens)
  cache = _published_lm1b(F32, "decode").init(jax.random.key(0), tokens)["cache"]
  with pytest.warns(UserWarning, match="attention_window=2 is not applied to a query of length 1"):
    decode.apply({**variables, "cache": cache}, tokens[:, :1], mutable=["cache"])


def test_causal_attention_decoding_with_a_cache_uses_the_mask():
  # One query against the whole cache: not the square causal pattern, so the mask runs.
  causal = _published_lm1b(jaxmp.PolicyRules(F32, [CAUSAL]), "decode")
  plain = _published_lm1b(F32, "decode")
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 1, 64)
  variables = _published_lm1b(F32).init(jax.random.key(0), tokens)
  cache = plain.init(jax.random.key(0), tokens)["cache"]
  step = lambda m: m.apply({"params": variables["params"], "cache": cache}, tokens[:, :1],
                           mutable=["cache"])[0]
  np.testing.assert_allclose(step(causal), step(plain), atol=1e-6)


NO_ATTENTION_FN = "declares causal attention but matches no module with an attention_fn field"


def test_causal_rule_that_reaches_no_attention_function_warns_on_published_models():
  # A causal declaration on modules without an attention_fn computes nothing causally:
  # Flax's lm1b with the rule on its Dense layers, and the published NNX Gemma, whose
  # attention is written out with einsums (no attention_fn to replace).
  from tests.published import models  # pylint: disable=import-outside-toplevel
  from tests.published.flax_gemma import modules as gemma_modules  # pylint: disable=import-outside-toplevel
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 1, 64)
  with pytest.warns(UserWarning, match=r"rule 0 \(.*Dense.*\) " + NO_ATTENTION_FN):
    _published_lm1b(jaxmp.PolicyRules(F32, [jaxmp.Rule(nn.Dense, causal_attention=True)])
                    ).init(jax.random.key(0), tokens)
  with pytest.warns(UserWarning, match=r"rule 0 \(.*Attention.*\) " + NO_ATTENTION_FN):
    jaxmp.nnx.mixed_precision(
        models._gemma_module(nnx.Rngs(0)),  # pylint: disable=protected-access
        jaxmp.PolicyRules(F32, [jaxmp.Rule(gemma_modules.Attention, causal_attention=True)]))
  # Where the rule reaches an attention function, no such warning.
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*" + NO_ATTENTION_FN)
    _published_lm1b(jaxmp.PolicyRules(F32, [CAUSAL])).init(jax.random.key(0), tokens)
    jaxmp.nnx.mixed_precision(nnx.MultiHeadAttention(2, 16, decode=False, rngs=nnx.Rngs(0)),
                              jaxmp.PolicyRules(F32, [jaxmp.Rule(nnx.MultiHeadAttention,
                                                                 causal_attention=True)]))


TOKENS = jnp.array([[3, 5, 7, 2, 4, 6], [3, 5, 7, 0, 0, 0]])  # the second right-padded
PADDING = nn.make_attention_mask(TOKENS > 0, TOKENS > 0)


def test_padding_lengths_are_read_from_right_padding_masks():
  from jaxmp._src import attention  # pylint: disable=import-outside-toplevel
  for mask in (PADDING, nn.combine_masks(PADDING, MASK), PADDING[:, :, :1, :].repeat(6, 2)):
    queries, keys = attention.padding_lengths(mask, 6, 6)
    assert keys.tolist() == [6, 3], mask
  assert attention.padding_lengths(PADDING, 6, 6)[0].tolist() == [6, 3]
  # A key-only mask (broadcast over the queries): every query is real.
  assert [x.tolist() for x in attention.padding_lengths(PADDING[:, :, :1, :], 6, 6)] == [
      [6, 6], [6, 3]]


def test_every_form_of_a_right_padding_mask_passes_its_check():
  from jaxmp._src import attention  # pylint: disable=import-outside-toplevel
  causal_padding = nn.combine_masks(PADDING, MASK)
  for mask, causal, window in (
      (PADDING, False, None), (PADDING, True, None), (causal_padding, True, None),
      (causal_padding, True, 2), (PADDING[:, :, :1, :], False, None),  # keys only
      (PADDING.repeat(2, axis=1), False, None),  # a head axis, every head the same
      (jnp.ones_like(PADDING), False, None)):  # no padding at all
    attention.check_right_padding(mask, 6, 6, attention.padding_lengths(mask, 6, 6),
                                  causal, window)


@pytest.mark.highest_precision
@pytest.mark.parametrize("causal", [False, True])
def test_padded_attention_is_the_masked_attention_on_every_real_token(causal):
  # Declared padded: the mask is read for each sequence's lengths only; every real
  # query's output and every gradient through the real queries are Flax's under the
  # mask itself.
  model, plain, variables = _declared_and_plain(padded_attention=True,
                                                causal_attention=causal)
  mask = nn.combine_masks(PADDING, MASK) if causal else PADDING
  real = np.asarray(TOKENS > 0)
  np.testing.assert_allclose(np.asarray(model.apply(variables, X, mask=mask))[real],
                             np.asarray(plain.apply(variables, X, mask=mask))[real], atol=1e-6)
  loss = lambda m: lambda v, x: jnp.sum(jnp.where(real[..., None], m.apply(v, x, mask=mask),
                                                  0.0) ** 2)
  for a, b in zip(jax.tree.leaves(jax.grad(loss(model), argnums=(0, 1))(variables, X)),
                  jax.tree.leaves(jax.grad(loss(plain), argnums=(0, 1))(variables, X))):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  if not causal:  # (causally, right padding is after every real query anyway)
    # It reads the mask: without the padding the real queries see more keys.
    assert not np.allclose(np.asarray(model.apply(variables, X, mask=mask))[1, :3],
                           np.asarray(plain.apply(variables, X))[1, :3], atol=1e-3)


def _not_right_padding(causal: bool) -> dict[str, jax.Array]:
  """Masks that no right-padding declaration describes (causal ones where ``causal``)."""
  left = TOKENS[:, ::-1] > 0
  segments = jnp.array([[1, 1, 1, 2, 2, 2], [1, 1, 2, 2, 2, 0]])
  masks = {
      "left padding": nn.make_attention_mask(left, left),
      "packed sequences": nn.make_attention_mask(segments, segments, jnp.equal),
      "one head unpadded": jnp.concatenate([PADDING, jnp.ones_like(PADDING)], axis=1),
  }
  return {name: nn.combine_masks(m, MASK) if causal else m for name, m in masks.items()}


NOT_RIGHT_PADDING = (r"^Rule\(padded_attention=True\): the mask is not a right-padding mask .*"
                     r"leave padded_attention out of the rule")


@pytest.mark.parametrize("causal", [False, True])
def test_padded_attention_refuses_a_mask_it_can_read_that_is_not_right_padding(causal):
  # Only lengths would be read, so the real tokens would attend to other keys than
  # the mask's: refused wherever the mask is concrete, each form of it.
  model, plain, variables = _declared_and_plain(padded_attention=True,
                                                causal_attention=causal)
  for mask in _not_right_padding(causal).values():
    with pytest.raises(ValueError, match=NOT_RIGHT_PADDING):
      model.apply(variables, X, mask=mask)
    with pytest.raises(ValueError, match=NOT_RIGHT_PADDING):
      jax.grad(lambda v, mask=mask: jnp.sum(model.apply(v, X, mask=mask)))(variables)
  # Traced (under jit) the mask cannot be read ahead: its lengths are, as documented,
  # and a left-padding mask's real tokens get other outputs than Flax's.
  left = _not_right_padding(causal)["left padding"]
  run = lambda m: np.asarray(jax.jit(lambda v, mask: m.apply(v, X, mask=mask))(variables, left))
  real_left = np.asarray(TOKENS[:, ::-1] > 0)
  assert not np.allclose(run(model)[real_left], run(plain)[real_left], atol=1e-3)


@pytest.mark.highest_precision
def test_padded_attention_refuses_a_causal_mask_unless_declared_causal():
  # Without causal_attention the padding mode is not causal: a causal padding mask is
  # refused, naming the fix; declared causal too, the padding alone is enough.
  padded, plain, variables = _declared_and_plain(padded_attention=True)
  causal_padding = nn.combine_masks(PADDING, MASK)
  with pytest.raises(ValueError, match=r"mask \(it is combined with a causal mask: declare "
                     r"causal_attention=True in the same rule"):
    padded.apply(variables, X, mask=causal_padding)
  both, _, _ = _declared_and_plain(padded_attention=True, causal_attention=True)
  real = np.asarray(TOKENS > 0)
  np.testing.assert_allclose(np.asarray(both.apply(variables, X, mask=PADDING))[real],
                             np.asarray(plain.apply(variables, X, mask=causal_padding))[real],
                             atol=1e-6)


def test_padded_attention_on_nnx():
  layer = lambda: nnx.MultiHeadAttention(2, 16, decode=False, rngs=nnx.Rngs(0))
  rule = jaxmp.Rule(nnx.MultiHeadAttention, padded_attention=True)
  padded = jaxmp.nnx.mixed_precision(layer(), jaxmp.PolicyRules(F32, [rule]))
  plain = jaxmp.nnx.mixed_precision(layer(), jaxmp.PolicyRules(F32))
  real = np.asarray(TOKENS > 0)
  np.testing.assert_allclose(np.asarray(padded(X, mask=PADDING))[real],
                             np.asarray(plain(X, mask=PADDING))[real], atol=1e-6)
  with pytest.raises(ValueError, match=NOT_RIGHT_PADDING):
    padded(X, mask=_not_right_padding(False)["left padding"])


def test_padded_rule_that_reaches_no_attention_function_warns():
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 1, 64)
  with pytest.warns(UserWarning, match=r"rule 0 \(.*Dense.*\) declares padded attention but "
                    "matches no module with an attention_fn field"):
    _published_lm1b(jaxmp.PolicyRules(F32, [jaxmp.Rule(nn.Dense, padded_attention=True)])
                    ).init(jax.random.key(0), tokens)


def test_bad_padded_attention_value():
  with pytest.raises(TypeError, match=r"padded_attention must be True or False, got 1 of type int"):
    jaxmp.Rule(nn.MultiHeadDotProductAttention, padded_attention=1)


def test_bad_causal_attention_value():
  with pytest.raises(TypeError, match=r"causal_attention must be True or False, got 'yes'"):
    jaxmp.Rule(nn.MultiHeadDotProductAttention, causal_attention="yes")


def test_bad_fused_attention_value():
  with pytest.raises(TypeError, match="fused_attention must be True or False, got 'cudnn'"):
    jaxmp.PolicyRules(BF16, fused_attention="cudnn")


def _run_deviceless(script: str) -> subprocess.CompletedProcess:
  """``script`` in a process that compiles for an H100 it does not have (or a skip)."""
  if not targets.cuda_plugin_installed():
    pytest.skip("needs jax[cuda12] plugin (make gpu-report builds it)")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
  return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                        text=True, timeout=600)


_H100_CHECK = textwrap.dedent("""\
    import flax.linen as nn, jax, jax.numpy as jnp, jaxmp
    S = jax.ShapeDtypeStruct
    rules = jaxmp.PolicyRules("params=float32,compute=bfloat16,output=float32",
                              fused_attention=True)
    model = jaxmp.linen.mixed_precision(nn.MultiHeadDotProductAttention(num_heads=4), rules)
    x = S((2, 128, 256), jnp.float32)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((2, 128, 256))))
    def step(v, x):
      return jax.grad(lambda v: jnp.sum(model.apply(v, x).astype(jnp.float32)))(v)
    report = jaxmp.tools.audit(step, variables, x, target="h100")
    fused = [g for g in report.gemms if g.backend.startswith("cuDNN fused attention")]
    assert len(fused) == 2, str(report)  # forward and backward: no score matrix in memory
    print("ok")
    """)


_CAUSAL_CHECK = textwrap.dedent("""\
    import re
    import flax.linen as nn, jax, jax.numpy as jnp, jaxmp
    S = jax.ShapeDtypeStruct
    BF16 = "params=float32,compute=bfloat16,output=float32"
    last_hlo = []
    def attention(rules):
      model = jaxmp.linen.mixed_precision(nn.MultiHeadDotProductAttention(num_heads=4), rules)
      variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((2, 128, 256))))
      def step(v, x):
        mask = nn.make_causal_mask(x[..., 0])
        return jax.grad(lambda v: jnp.sum(model.apply(v, x, mask=mask).astype(jnp.float32)))(v)
      report = jaxmp.tools.audit(step, variables, S((2, 128, 256), jnp.float32), target="h100")
      last_hlo[:] = [report.hlo]
      return (re.findall(r'custom_call_target="(__cudnn[$]fmha\\w*)"', report.hlo),
              re.findall(r'"mask_type":\\s*"(\\w+)"', report.hlo),
              [g.shape for g in report.gemms if g.backend.startswith("cuDNN")])
    print(attention(jaxmp.PolicyRules(BF16, fused_attention=True)))
    print(attention(jaxmp.PolicyRules(
        BF16, [jaxmp.Rule(nn.MultiHeadDotProductAttention, causal_attention=True)])))
    print(attention(jaxmp.PolicyRules(
        BF16, [jaxmp.Rule(nn.MultiHeadDotProductAttention, causal_attention=True,
                          attention_window=32)]))
          + (re.findall(r'"sliding_window_length":\\s*"?(\\w+)', last_hlo[0]),))
    """)


def test_h100_deviceless_causal_attention_runs_cudnns_causal_mode_with_no_bias():
  out = _run_deviceless(_CAUSAL_CHECK)
  assert out.returncode == 0, out.stderr[-4000:]
  with_mask, causal, windowed = out.stdout.strip().splitlines()
  # The mask as a tensor: cuDNN reads it as a dense bias, every tile computed.
  assert with_mask == str((["__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"],
                           ["NO_MASK", "NO_MASK"],
                           ["attention 2*4*128x128x64"] * 2)), with_mask
  # Declared causal: no bias operand, cuDNN's CAUSAL mode.
  assert causal == str((["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"],
                        ["CAUSAL", "CAUSAL"],
                        ["attention 2*4*128x128x64 causal"] * 2)), causal
  # A sliding window: the same causal kernels, told the window's length; no bias.
  assert windowed == str((["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"],
                          ["CAUSAL", "CAUSAL"],
                          ["attention 2*4*128x128x64 causal"] * 2, ["32", "32"])), windowed


_PADDED_CHECK = textwrap.dedent("""\
    import re
    import flax.linen as nn, jax, jax.numpy as jnp, jaxmp
    S = jax.ShapeDtypeStruct
    BF16 = "params=float32,compute=bfloat16,output=float32"
    def attention(causal):
      rule = jaxmp.Rule(nn.MultiHeadDotProductAttention, padded_attention=True,
                        causal_attention=causal)
      model = jaxmp.linen.mixed_precision(nn.MultiHeadDotProductAttention(num_heads=4),
                                          jaxmp.PolicyRules(BF16, [rule]))
      variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((2, 128, 256))))
      def step(v, x, tokens):
        mask = nn.make_attention_mask(tokens > 0, tokens > 0)
        if causal:
          mask = nn.combine_masks(mask, nn.make_causal_mask(tokens))
        return jax.grad(lambda v: jnp.sum(model.apply(v, x, mask=mask).astype(jnp.float32)))(v)
      report = jaxmp.tools.audit(step, variables, S((2, 128, 256), jnp.float32),
                                 S((2, 128), jnp.int32), target="h100")
      return (re.findall(r'custom_call_target="(__cudnn[$]fmha\\w*)"', report.hlo),
              re.findall(r'"mask_type":\\s*"(\\w+)"', report.hlo))
    print(attention(False))
    print(attention(True))
    """)


def test_h100_deviceless_padded_attention_runs_cudnns_padding_mode_with_no_bias():
  out = _run_deviceless(_PADDED_CHECK)
  assert out.returncode == 0, out.stderr[-4000:]
  padded, padded_causal = out.stdout.strip().splitlines()
  # The lengths read from the mask, no bias operand (fmhaSoftmax, not ScaleBiasSoftmax).
  assert padded == str((["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"],
                        ["PADDING", "PADDING"])), padded
  assert padded_causal == str((["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"],
                               ["PADDING_CAUSAL", "PADDING_CAUSAL"])), padded_causal


_FLOAT32_CHECK = textwrap.dedent("""\
    import warnings
    import flax.linen as nn, jax, jax.numpy as jnp, jaxmp
    rules = jaxmp.PolicyRules("float32", fused_attention=True)
    model = jaxmp.linen.mixed_precision(nn.MultiHeadDotProductAttention(num_heads=4), rules)
    x = jnp.ones((2, 16, 64))
    variables = model.init(jax.random.key(0), x)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      model.apply(variables, x)
    print([str(w.message) for w in caught])
    """)


def test_float32_fused_attention_warns_that_cudnn_refuses_it():
  out = _run_deviceless(_FLOAT32_CHECK)
  assert out.returncode == 0, out.stderr[-4000:]
  assert ("PolicyRules(fused_attention=True): cuDNN's fused attention does not take query "
          "float32[2, 16, 4, 16] (Q must be fp16/bf16/fp8_e4m3fn/fp8_e5m2, got float32): "
          "XLA's implementation of the same attention runs, unfused." in out.stdout), out.stdout


def test_h100_deviceless_runs_cudnn_fused_attention():
  out = _run_deviceless(_H100_CHECK)
  assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-4000:]


# ---- a causal declaration is about self-attention ----------------------------------------

CONTEXT = jax.random.normal(jax.random.key(5), (2, 6, 16))  # as long as X: the hard case
SHORT_CONTEXT = CONTEXT[:, :4]
CROSS = r"called as cross-attention \(its {} is not its inputs_q\)"
_CROSS_CALLS = {  # each way Flax's layers (linen and NNX) take keys and values
    "inputs_k positional": lambda layer, q, kv: layer(q, kv),
    "inputs_k keyword": lambda layer, q, kv: layer(q, inputs_k=kv),
    "inputs_k and inputs_v": lambda layer, q, kv: layer(q, kv, kv),
}
_CONTEXTS = pytest.mark.parametrize("context", [CONTEXT, SHORT_CONTEXT],
                                    ids=["equal", "shorter"])
_CROSS_FORMS = pytest.mark.parametrize("call", _CROSS_CALLS.values(), ids=list(_CROSS_CALLS))
_CAUSAL_DECLARATIONS = pytest.mark.parametrize(
    "declared", [dict(causal_attention=True), dict(causal_attention=True, attention_window=2)],
    ids=["causal", "window"])


@_CONTEXTS
@_CROSS_FORMS
@_CAUSAL_DECLARATIONS
def test_linen_causal_rule_leaves_a_cross_attention_call_as_flax_computes_it(
    context, call, declared):
  # Keys from another sequence: a causal mask would hide some of them from each query
  # for no reason. The call computes exactly as the unwrapped layer, and says why.
  layer = nn.MultiHeadDotProductAttention(num_heads=2)
  rules = jaxmp.PolicyRules(F32, [jaxmp.Rule(nn.MultiHeadDotProductAttention, **declared)])
  wrapped = jaxmp.linen.mixed_precision(layer, rules)
  variables = layer.init(jax.random.key(0), X, context)
  run = lambda model: lambda v: model.apply(v, X, context, method=_cross(call))
  with pytest.warns(UserWarning, match=r"<root> \(MultiHeadDotProductAttention\) is "
                    + CROSS.format("inputs_k")):
    out = run(wrapped)(variables)
  np.testing.assert_array_equal(out, run(layer)(variables))
  # What ran is the layer's own attention, as wrapped without the rule.
  plain = jaxmp.linen.mixed_precision(layer, jaxmp.PolicyRules(F32))
  assert _same_computation(run(wrapped), run(plain), variables)


def _cross(call):
  """A linen ``method`` calling the layer itself with ``call``'s keys and values."""
  return lambda module, q, kv: call(module.__call__, q, kv)


@pytest.mark.highest_precision
def test_linen_causal_rule_still_makes_self_attention_causal():
  # Self-attention however the layer is told so: no key input, or the query itself.
  model, plain, variables = _declared_and_plain(causal_attention=True)
  everything = jnp.ones_like(MASK)
  expected = plain.apply(variables, X, mask=MASK)
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*cross-attention")
    for kwargs in ({}, dict(inputs_k=X), dict(inputs_k=X, inputs_v=X)):
      np.testing.assert_allclose(model.apply(variables, X, mask=everything, **kwargs),
                                 expected, atol=1e-6)


@pytest.mark.highest_precision
def test_linen_layer_called_both_ways_is_causal_only_as_self_attention():
  class Decoder(nn.Module):  # one layer, shared: self-attention, then over a context
    @nn.compact
    def __call__(self, x, context, mask):
      attention = nn.MultiHeadDotProductAttention(num_heads=2, name="attention")
      return attention(attention(x, mask=mask), context)

  rules = jaxmp.PolicyRules(F32, [CAUSAL])
  declared = jaxmp.linen.mixed_precision(Decoder(), rules)
  plain = jaxmp.linen.mixed_precision(Decoder(), jaxmp.PolicyRules(F32))
  variables = plain.init(jax.random.key(0), X, CONTEXT, MASK)
  with pytest.warns(UserWarning, match=r"but attention \(MultiHeadDotProductAttention\) is "
                    + CROSS.format("inputs_k")):
    out = declared.apply(variables, X, CONTEXT, jnp.ones_like(MASK))
  np.testing.assert_allclose(out, plain.apply(variables, X, CONTEXT, MASK), atol=1e-6)


def test_cross_attention_warning_comes_once_per_layer():
  layer = nn.MultiHeadDotProductAttention(num_heads=2)
  wrapped = jaxmp.linen.mixed_precision(layer, jaxmp.PolicyRules(F32, [CAUSAL]))
  variables = layer.init(jax.random.key(0), X, CONTEXT)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")
    for _ in range(3):
      wrapped.apply(variables, X, CONTEXT)
  assert len([w for w in caught if "cross-attention" in str(w.message)]) == 1, caught


@_CONTEXTS
@_CROSS_FORMS
@_CAUSAL_DECLARATIONS
def test_nnx_causal_rule_leaves_a_cross_attention_call_as_flax_computes_it(
    context, call, declared):
  layer = nnx.MultiHeadAttention(2, 16, decode=False, rngs=nnx.Rngs(0))
  rules = jaxmp.PolicyRules(F32, [jaxmp.Rule(nnx.MultiHeadAttention, **declared)])
  wrapped = jaxmp.nnx.mixed_precision(layer, rules)
  with pytest.warns(UserWarning, match=r"<root> \(MultiHeadAttention\) is "
                    + CROSS.format("inputs_k")):
    out = call(wrapped, X, context)
  np.testing.assert_array_equal(out, call(layer, X, context))  # the unwrapped layer
  plain = jaxmp.nnx.mixed_precision(layer, jaxmp.PolicyRules(F32))
  assert (str(jax.make_jaxpr(lambda: call(wrapped, X, context))())
          == str(jax.make_jaxpr(lambda: call(plain, X, context))()))


def test_nnx_causal_rule_still_makes_self_attention_causal():
  class Decoder(nnx.Module):  # one layer, shared: self-attention, then over a context
    def __init__(self, rngs):
      self.attention = nnx.MultiHeadAttention(2, 16, decode=False, rngs=rngs)

    def __call__(self, x, context, mask=None):
      return self.attention(self.attention(x, x, mask=mask), context)

  rule = jaxmp.Rule(nnx.MultiHeadAttention, causal_attention=True)
  declared = jaxmp.nnx.mixed_precision(Decoder(nnx.Rngs(0)), jaxmp.PolicyRules(F32, [rule]))
  plain = jaxmp.nnx.mixed_precision(Decoder(nnx.Rngs(0)), jaxmp.PolicyRules(F32))
  with pytest.warns(UserWarning, match=r"but attention \(MultiHeadAttention\) is "
                    + CROSS.format("inputs_k")):
    out = declared(X, CONTEXT)
  np.testing.assert_allclose(out, plain(X, CONTEXT, MASK), atol=1e-6)
  layer = lambda: nnx.MultiHeadAttention(2, 16, decode=False, rngs=nnx.Rngs(0))
  declared = jaxmp.nnx.mixed_precision(layer(), jaxmp.PolicyRules(F32, [rule]))
  plain = jaxmp.nnx.mixed_precision(layer(), jaxmp.PolicyRules(F32))
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*cross-attention")
    for args in ((X,), (X, X), (X, X, X)):
      np.testing.assert_allclose(declared(*args), plain(X, mask=MASK), atol=1e-6)


def test_causal_rule_on_published_wmt_decoder_leaves_its_cross_attention_alone():
  # Flax's WMT decoder: causal self-attention, then attention over the encoder's
  # output (as long as the targets here). Declared causal by path, the self-attention
  # runs causally and the encoder-decoder attention as Flax computes it; the
  # declaration reaches attention functions, so no unused-rule warning.
  from tests.published import models  # pylint: disable=import-outside-toplevel
  inputs = jax.random.randint(jax.random.key(1), (2, 8), 1, 64).at[1, 5:].set(0)
  targets = jax.random.randint(jax.random.key(2), (2, 8), 1, 64).at[0, 6:].set(0)
  plain = jaxmp.linen.mixed_precision(models._wmt_module("eval"), F32)  # pylint: disable=protected-access
  variables = plain.init(jax.random.key(0), inputs, targets)
  for match in (r"decoder/.*", r"decoder/.*_1"):  # both layers, the cross-attention ones
    declared = jaxmp.linen.mixed_precision(
        models._wmt_module("eval"),  # pylint: disable=protected-access
        jaxmp.PolicyRules(F32, [jaxmp.Rule(match, causal_attention=True)]))
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      logits = declared.apply(variables, inputs, targets)
    messages = {str(w.message) for w in caught}
    assert not any(NO_ATTENTION_FN in m for m in messages), messages
    cross = sorted(re.search(r"but (\S+) \(MultiHeadDotProductAttention\) is called as "
                             "cross-attention", m)[1] for m in messages if "cross-" in m)
    assert cross == [f"decoder/encoderdecoderblock_{i}/MultiHeadDotProductAttention_1"
                     for i in range(2)], messages
    real = np.asarray(targets > 0)
    np.testing.assert_allclose(np.asarray(logits)[real],
                               np.asarray(plain.apply(variables, inputs, targets))[real],
                               atol=2e-5)


@pytest.mark.highest_precision
def test_a_lifted_layer_is_self_attention_called_with_its_query_alone():
  # nn.remat hands the layer each argument as a value of its own, so layer(x, x) of a
  # lifted layer class reads as cross-attention (and says how to write it); layer(x)
  # stays causal self-attention.
  class Block(nn.Module):
    twice: bool

    @nn.compact
    def __call__(self, x, mask=None):
      attention = nn.remat(nn.MultiHeadDotProductAttention)(num_heads=2, name="attention")
      return attention(x, x, mask=mask) if self.twice else attention(x, mask=mask)

  plain = jaxmp.linen.mixed_precision(Block(twice=False), jaxmp.PolicyRules(F32))
  variables = plain.init(jax.random.key(0), X)
  declared = lambda twice: jaxmp.linen.mixed_precision(Block(twice=twice),
                                                       jaxmp.PolicyRules(F32, [CAUSAL]))
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*cross-attention")
    np.testing.assert_allclose(declared(False).apply(variables, X),
                               plain.apply(variables, X, MASK), atol=1e-6)
  with pytest.warns(UserWarning, match=r"lifted by nn.remat.*call it as layer\(x\)"):
    declared(True).apply(variables, X)
