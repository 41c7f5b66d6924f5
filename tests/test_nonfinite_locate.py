"""Where did the inf come from: overflows located in linen, NNX and published models.

Each test makes one overflow on purpose and checks that the trace names its module and
direction: a forward overflow (a layer's output), a backward-only overflow (every
forward value finite, one layer's gradient overflows), under ``jit`` with float16
compute and dynamic loss scaling, which skips the step; and under sharded ``jit`` on 8
devices (``nonfinite_checks.py``, in a subprocess).
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
  report = monitor.nonfinite_report()  # the latest step's
  assert str(report.origin) == "backward input gradient of boom"
  table = str(report).splitlines()
  assert table[0] == "Non-finite trace: first non-finite value: backward input gradient of boom"
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


@pytest.mark.slow
def test_published_lm1b_forward_and_backward_overflows_are_located():
  entry = registry.BY_NAME["lm1b_transformer_lm"]
  model = jaxmp.linen.mixed_precision(entry.module("eval"), nonfinite_models.RULES)
  batch = entry.batch(jax.random.key(1))
  variables = entry.init(model, jax.random.key(0), batch)

  @jax.jit
  def located(variables, k):
    # The backward fault: the gradient into the MLP block's first Dense is multiplied
    # by 2**k. The injection wraps that Dense's call from outside, so it lies in the MLP
    # block's own code: the block made the overflowing gradient, its Dense did not.
    def inject(next_fun, args, kwargs, context):
      if "/".join(context.module.path) == f"{LM1B_MLP}/Dense_0":
        args = (_amplify(args[0], k), *args[1:])
      return next_fun(*args, **kwargs)

    def loss(variables):
      with nn.intercept_methods(inject):
        logits, _ = entry.forward(model, variables, batch, "eval", jax.random.key(2))
      return entry.loss(logits, batch.targets)

    _, grads = jaxmp.linen.value_and_grad(loss)(variables,
                                                loss_scale=jaxmp.StaticLossScale(1024.0))
    return grads.nonfinite

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
