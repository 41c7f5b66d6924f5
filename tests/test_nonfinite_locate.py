"""Where did the inf come from: overflows located in linen, NNX and published models.

Each test makes one overflow on purpose and checks that the trace names its module and
direction: a forward overflow (a layer's output), a backward-only overflow (every
forward value finite, one layer's gradient overflows), under ``jit`` with float16
compute and dynamic loss scaling, which skips the step; and under sharded ``jit`` on 8
devices (``nonfinite_checks.py``, in a subprocess). On published models whose root calls
its own methods (WMT's encode/decode, the NNX ViT's embed, Flax's linen/NNX AutoEncoder
pair), those methods are named as such and never taken for the model's own call.
"""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp._src import nonfinite
from jaxmp._src.tools import nonfinite as nonfinite_report  # pylint: disable=g-import-not-at-top
from tests import eight_devices
from tests import nonfinite_models
from tests.published import models as registry
from tests.published.flax_autoencoder import linen_autoencoder
from tests.published.flax_autoencoder import nnx_autoencoder
from tests.published.flax_vit import vit

SCRIPT = pathlib.Path(__file__).with_name("nonfinite_checks.py")
CHECKS = ("linen_sharded_jit", "nnx_sharded_jit")

eight_device_results, test_eight_devices, test_the_check_names_match_the_script = (
    eight_devices.make_tests(SCRIPT, CHECKS, cwd=SCRIPT.parents[1]))


@pytest.fixture(scope="module")
def linen_runs():
  return jax.device_get(nonfinite_models.linen_runs(nonfinite_models.data()))


def test_linen_forward_and_backward_only_overflows_are_located_under_jit(linen_runs):
  nonfinite_models.check_runs(linen_runs)


def test_nnx_forward_and_backward_only_overflows_are_located_under_jit():
  nonfinite_models.check_runs(jax.device_get(nonfinite_models.nnx_runs(nonfinite_models.data())))


def test_monitor_names_the_module_and_direction_of_a_skipped_step(linen_runs):
  monitor = jaxmp.tools.Monitor()
  assert monitor.nonfinite_report() is None
  seen = [monitor.update(linen_runs[fault]) for fault in ("clean", "forward", "clean",
                                                            "backward")]
  origins = [a for found in seen for a in found if a.kind == "nonfinite_origin"]
  assert [str(a) for a in origins] == [
      "step 1: nonfinite_origin: skipped step 1: first non-finite value: forward output of "
      "down (amax inf)",
      "step 3: nonfinite_origin: skipped step 3: first non-finite value: backward input "
      "gradient of boom (amax inf)",
  ]
  report = monitor.nonfinite_report()  # the latest step that overflowed
  assert str(report.origin) == "backward input gradient of boom" and report.step == 3
  table = str(report).splitlines()
  assert table[0] == ("Non-finite trace of step 3: first non-finite value: backward input "
                      "gradient of boom")
  assert [line.split()[0] for line in table[4:]] == ["up", "down", "boom", "head", "<root>"]
  assert table[6].split()[-2:] == ["<-", "input_grad"]


def test_report_tracks_outliers_of_a_finite_step(linen_runs):
  report = jaxmp.tools.nonfinite_report(linen_runs["clean"]["nonfinite_trace"],
                                        loss_scale=jaxmp.DynamicLossScale(16.0))
  assert report.origin is None and report.loss_scale == 16.0
  assert "(gradients x loss scale 16)" in str(report)
  outputs = {m.path: m.output for m in report.modules}
  assert [m.path for m in report.largest("output", 2)] == sorted(
      outputs, key=outputs.get, reverse=True)[:2]
  assert all(np.isfinite(m.output) and m.forward for m in report.modules)


# ---- published models (Flax's own code, unchanged) -----------------------------------------

LM1B_MLP = "decoder/encoderdecoderblock_1/MlpBlock_0"


@jax.custom_vjp
def _amplify(x, k):
  del k
  return x


_amplify.defvjp(lambda x, k: (x, k), lambda k, g: (
    (g.astype(jnp.float32) * jnp.exp2(k.astype(jnp.float32))).astype(g.dtype), None))


def _published_linen(name: str):
  """A published linen model wrapped to trace: (entry, wrapper, batch, variables)."""
  entry = registry.BY_NAME[name]
  model = jaxmp.linen.mixed_precision(entry.module("eval"), nonfinite_models.RULES)
  batch = entry.batch(jax.random.key(1))
  return entry, model, batch, entry.init(model, jax.random.key(0), batch)


def _trace_with(entry, model, batch, inject, variables, loss_scale):
  """The trace of the published loss's gradient, every module call passing ``inject``."""

  def loss(variables):
    with nn.intercept_methods(inject):
      logits, _ = entry.forward(model, variables, batch, "eval", jax.random.key(2))
    return entry.loss(logits, batch.targets)

  _, grads = jaxmp.linen.value_and_grad(loss)(variables,
                                              loss_scale=jaxmp.StaticLossScale(loss_scale))
  return grads.nonfinite


@pytest.mark.slow
def test_published_lm1b_forward_and_backward_overflows_are_located():
  entry, model, batch, variables = _published_linen("lm1b_transformer_lm")

  @jax.jit
  def located(variables, k):
    # The backward fault: the gradient into the MLP block's first Dense is multiplied
    # by 2**k. The injection wraps that Dense's call from outside, so it lies in the MLP
    # block's own code: the block made the overflowing gradient, its Dense did not.
    def inject(next_fun, args, kwargs, context):
      if "/".join(context.module.path) == f"{LM1B_MLP}/Dense_0":
        args = (_amplify(args[0], k), *args[1:])
      return next_fun(*args, **kwargs)
    return _trace_with(entry, model, batch, inject, variables, 1024.0)

  params = jax.tree.map(lambda a: a, variables["params"], is_leaf=nn.meta.is_axis_metadata)
  dense = params["decoder"]["encoderdecoderblock_1"]["MlpBlock_0"]["Dense_1"]
  dense["kernel"] = dense["kernel"].replace_boxed(dense["kernel"].unbox() * 1e6)
  origins = {fault: nonfinite_report.first_nonfinite(located(v, k)) for fault, v, k in (
      ("clean", variables, 0), ("forward", {**variables, "params": params}, 0),
      ("backward", variables, 200))}
  assert origins["clean"] is None
  assert origins["forward"][:4] == (f"{LM1B_MLP}/Dense_1", "__call__", "forward", "output")
  assert origins["backward"][:4] == (LM1B_MLP, "__call__", "backward", "input_grad")


def test_published_nnx_scan_over_layers_forward_overflow_is_located():
  entry = registry.BY_NAME["scan_mlp"]
  model = jaxmp.nnx.mixed_precision(entry.module(nnx.Rngs(0)), nonfinite_models.RULES)
  batch = entry.batch(jax.random.key(1))
  # The layers are one vmapped stack run by nnx.scan: "layers/linear" is every layer.
  model.model.layers.linear.kernel[...] = model.model.layers.linear.kernel[...] * 1e6
  loss = lambda m: entry.loss(entry.forward(m, batch, "eval", jax.random.key(2)), batch.targets)
  _, grads = nnx.jit(jaxmp.nnx.value_and_grad(loss))(model)
  origin = nonfinite_report.first_nonfinite(grads.nonfinite)
  assert origin[:4] == ("layers/linear", "__call__", "forward", "output")


# ---- a root module calling its own methods (setup-style models) -----------------------------
#
# The model's own call is the one the caller made (the root's __call__, or the method
# given to apply): the root's other methods that it calls (self.encode, self.embed) are
# calls inside it, named by their method, though their path is the root's "" too. A
# forward overflow in a child of one of them is not a bad model input, nor a backward
# overflow inside the model a bad gradient at the model's output.

AUTOENCODER_X = jax.random.normal(jax.random.key(1), (2, 12))
AUTOENCODER_EXPECTED = {
    "clean": None,
    # encoder's kernel x 1e6: its float16 output overflows; decode gets it as its input.
    "forward": ("encoder", "__call__", "forward", "output"),
    # loss x 2**20: the float32 gradient at the model's output is finite, the root's own
    # cast of it to float16 (its output was float16 before the policy's float32) is not.
    "loss_scale": ("", "__call__", "backward", "input_grad"),
    # apply(method="decode") / wrapped.decode(x): decode is then the model's own call.
    "method_input": ("", "decode", "forward", "input"),
}


def _autoencoder_origins(framework: str) -> dict:
  scales = {"clean": 1.0, "forward": 1.0, "loss_scale": 2.0**20}
  origins = {}
  if framework == "linen":
    model = jaxmp.linen.mixed_precision(linen_autoencoder.AutoEncoder(8, 12),
                                        nonfinite_models.RULES)
    variables = model.init(jax.random.key(0), AUTOENCODER_X)
    params = jax.tree.map(lambda a: a, variables["params"])
    params["encoder"]["kernel"] = params["encoder"]["kernel"] * 1e6
    faulty = {"forward": {**variables, "params": params}}
    for fault, scale in scales.items():
      _, grads = jaxmp.linen.value_and_grad(lambda v: jnp.sum(model.apply(v, AUTOENCODER_X)))(
          faulty.get(fault, variables), loss_scale=jaxmp.StaticLossScale(scale))
      origins[fault] = grads.nonfinite
    probe = model.nonfinite_probe(variables, AUTOENCODER_X[:, :8], method="decode")
    decode = lambda v: jnp.sum(model.apply(v, AUTOENCODER_X[:, :8] * jnp.inf, method="decode"))
    origins["method_input"] = jaxmp.linen.value_and_grad(decode)(
        {**variables, jaxmp.linen.NONFINITE_COLLECTION: probe})[1].nonfinite
  else:
    def grads_of(loss, fault=None, scale=1.0):
      model = jaxmp.nnx.mixed_precision(nnx_autoencoder.AutoEncoder(12, 8, 12, rngs=nnx.Rngs(0)),
                                        nonfinite_models.RULES)
      if fault == "forward":
        model.model.encoder.kernel[...] = model.model.encoder.kernel[...] * 1e6
      return jaxmp.nnx.value_and_grad(loss)(model, loss_scale=jaxmp.StaticLossScale(scale))[1]

    for fault, scale in scales.items():
      origins[fault] = grads_of(lambda m: jnp.sum(m(AUTOENCODER_X)), fault, scale).nonfinite
    origins["method_input"] = grads_of(
        lambda m: jnp.sum(m.decode(AUTOENCODER_X[:, :8] * jnp.inf))).nonfinite
  return {fault: nonfinite_report.first_nonfinite(trace) for fault, trace in origins.items()}


def test_published_autoencoder_root_methods_are_located_alike_in_linen_and_nnx():
  # Flax's own linen/NNX pair (docs_nnx/migrating/linen_to_nnx.rst): __call__ calls
  # self.encode and self.decode.
  linen, nnx_ = _autoencoder_origins("linen"), _autoencoder_origins("nnx")
  for fault, expected in AUTOENCODER_EXPECTED.items():
    for framework, origins in (("linen", linen), ("nnx", nnx_)):
      got = None if origins[fault] is None else origins[fault][:4]
      assert got == expected, (framework, fault, got)
  assert str(linen["forward"]) == str(nnx_["forward"]) == "forward output of encoder"
  assert str(linen["loss_scale"]) == "backward input gradient of <root>"
  assert str(linen["method_input"]) == "forward input of <root>.decode"


@pytest.mark.slow
def test_published_wmt_overflows_in_and_under_root_methods_are_located():
  # examples/wmt: Transformer.__call__ calls self.encode and self.decode (setup-style).
  entry, model, batch, variables = _published_linen("wmt_transformer")

  @jax.jit
  def located(variables, factor, k, scale):
    # Faults in the root's own methods, injected from outside the calls they make:
    # encode multiplies the encoder's output by `factor` (forward), decode multiplies
    # the gradient of the encoded input it hands the decoder by 2**k (backward).
    def inject(next_fun, args, kwargs, context):
      is_call = lambda name: "/".join(context.module.path) == name and (
          context.method_name == "__call__")
      if is_call("decoder"):
        args = (_amplify(args[0], k), *args[1:])
      out = next_fun(*args, **kwargs)
      return out * factor.astype(out.dtype) if is_call("encoder") else out
    return _trace_with(entry, model, batch, inject, variables, scale)

  params = jax.tree.map(lambda a: a, variables["params"], is_leaf=nn.meta.is_axis_metadata)
  params["shared_embedding"]["embedding"] = params["shared_embedding"]["embedding"] * 1e6
  one = jnp.float32(1.0)
  runs = {  # fault: (variables, factor, k, loss scale)
      "clean": (variables, one, 0, one),
      "embedding": ({**variables, "params": params}, one, 0, one),
      "encode": (variables, jnp.float32(1e6), 0, one),
      "decode": (variables, one, 200, one),
      "loss_scale": (variables, one, 0, jnp.float32(2.0**40)),
  }
  origins = {fault: nonfinite_report.first_nonfinite(located(*args))
             for fault, args in runs.items()}
  got = {fault: None if o is None else o[:4] for fault, o in origins.items()}
  assert got == {
      "clean": None,
      # The shared embedding's float16 lookups overflow: not a bad input of decode. The
      # embedding is one call site, placed at its last call (the decoder's lookup), so
      # the first call to make an inf is the encoder, whose lookup came first.
      "embedding": ("encoder", "__call__", "forward", "output"),
      "encode": ("", "encode", "forward", "output"),
      "decode": ("", "decode", "backward", "input_grad"),
      # decode casts the decoder's float16 logits to float32 (logits.astype(config.dtype)):
      # the float32 gradient from the loss is cast back to float16 there and overflows.
      "loss_scale": ("", "decode", "backward", "input_grad"),
  }
  assert str(origins["embedding"]) == "forward output of encoder"
  assert str(origins["encode"]) == "forward output of <root>.encode"


@pytest.mark.slow
def test_published_nnx_vit_overflows_in_and_under_its_embed_method_are_located():
  # docs_nnx/examples/vit_training.md: VisionTransformer.__call__ calls self.embed.
  config = vit.ModelConfig(num_classes=10, img_size=16, patch_size=8, num_layers=2,
                           num_heads=2, mlp_dim=64, hidden_size=32)  # the rest as published
  images = jax.random.normal(jax.random.key(2), (2, 16, 16, 3))
  labels = jnp.array([1, 2])

  @nnx.jit
  def located(model, scale):
    loss = lambda m: registry.cross_entropy(m(images), labels)
    _, grads = jaxmp.nnx.value_and_grad(loss)(model, loss_scale=jaxmp.StaticLossScale(scale))
    return grads.nonfinite

  model = jaxmp.nnx.mixed_precision(vit.VisionTransformer(config, rngs=nnx.Rngs(0)),
                                    nonfinite_models.RULES)
  model.eval()
  clean = nonfinite_report.first_nonfinite(located(model, 1.0))
  scaled = nonfinite_report.first_nonfinite(located(model, 2.0**40))
  # embed adds the position embeddings (a param of the root) in float16: x 1e9 overflows.
  model.model.position_embeddings[...] = model.model.position_embeddings[...] * 1e9
  forward = nonfinite_report.first_nonfinite(located(model, 1.0))
  assert clean is None
  assert str(forward) == "forward output of <root>.embed"
  assert forward[:4] == ("", "embed", "forward", "output")
  # The root casts the classifier's float16 logits to float32: the scaled float32
  # gradient overflows in the root's own cast back, not at embed's output.
  assert scaled[:4] == ("", "__call__", "backward", "input_grad")
