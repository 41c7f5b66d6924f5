"""Fused attention for wrapped Flax attention layers (PolicyRules(fused_attention=True))."""

import os
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


def test_no_fused_kernel_no_warning_without_cudnn():
  # Without JAX's CUDA plugin nothing could fuse: XLA's implementation runs, quietly.
  if targets.cuda_plugin_installed():
    pytest.skip("this machine has the CUDA plugin (the H100 check below covers it)")
  fused, variables = _linen(F32, True)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fused.apply(variables, X, mask=MASK)


def test_bad_fused_attention_value():
  with pytest.raises(TypeError, match="fused_attention must be True or False, got 'cudnn'"):
    jaxmp.PolicyRules(BF16, fused_attention="cudnn")


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
  if not targets.cuda_plugin_installed():
    pytest.skip("needs jax[cuda12] plugin (make gpu-report builds it)")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run([sys.executable, "-c", _FLOAT32_CHECK], env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  assert ("PolicyRules(fused_attention=True): cuDNN's fused attention does not take query "
          "float32[2, 16, 4, 16] (Q must be fp16/bf16/fp8_e4m3fn/fp8_e5m2, got float32): "
          "XLA's implementation of the same attention runs, unfused." in out.stdout), out.stdout


def test_h100_deviceless_runs_cudnn_fused_attention():
  if not targets.cuda_plugin_installed():
    pytest.skip("needs jax[cuda12] plugin (make gpu-report builds it)")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run([sys.executable, "-c", _H100_CHECK], env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-4000:]
