"""Flax's published models overflowing in float16 until one module moves to float32.

Shared by ``tests/test_adaptive_precision.py`` (one device) and
``tests/adaptive_checks.py`` (eight devices, the batch sharded). Each run trains a
published model, copied verbatim under ``tests/published/``, in float16 with dynamic
loss scaling, non-finite tracing and :class:`jaxmp.tools.PrecisionController`
(``auto_apply=True``, ``k = 2`` of ``n = 4`` steps), with one of two faults made from
outside the model's code:

* forward: one attention layer's query and key kernels times 300, so its logits
  (``q . k``, in the attention module's own code) exceed float16's 65504 while ``q``
  and ``k`` do not; softmax of inf is NaN. In float32 the logits are finite and the
  attention output (an average of values) is bounded.
* backward: an op whose backward pass holds a large intermediate (the gradient times
  2**20, then times 2**-20, each rounded to the gradient's dtype), in one module's own
  code: inf in float16, exact in float32; every forward value stays finite.

linen: lm1b's ``TransformerLM``, its Dense layers in fp8 (delayed
scaling), so that the fp8 state is kept across the change too; the backward fault sits
in ``MlpBlock_0``'s code, before its first Dense (a Flax interceptor, as
``tests/test_nonfinite_locate.py`` places it). NNX: the ViT of Flax's NNX docs; the
backward fault is that layer's ``attention_fn``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxmp
from tests.published import models as registry
from tests.published.flax_vit import vit

POLICY = "params=float32,compute=float16,output=float32"
LINEN_RULES = jaxmp.PolicyRules(POLICY, [jaxmp.Rule(nn.Dense, fp8=jaxmp.fp8.DelayedScaling(4))],
                                trace_nonfinite=True)
NNX_RULES = jaxmp.PolicyRules(POLICY, trace_nonfinite=True)
STEPS, WINDOW, CULPRIT_STEPS = 5, 4, 2
BATCH = 8  # divides over 8 devices
QK_FACTOR = 300.0
BACKWARD_EXPONENT = 20

LM1B_ATTENTION = "decoder/encoderdecoderblock_1/MultiHeadDotProductAttention_0"
LM1B_MLP = "decoder/encoderdecoderblock_1/MlpBlock_0"
VIT_ATTENTION = "encoder/layers/1/mha"
EXPECTED = {  # (framework, fault): the first non-finite value at the steps before the change
    ("linen", "forward"): f"forward output of {LM1B_ATTENTION}",
    ("linen", "backward"): f"backward input gradient of {LM1B_MLP}",
    ("nnx", "forward"): f"forward output of {VIT_ATTENTION}",
    ("nnx", "backward"): f"backward input gradient of {VIT_ATTENTION}",
}


@jax.custom_vjp
def fragile(x):
  """The identity; backward, the gradient through a large intermediate in its own dtype."""
  return x


def _fragile_bwd(_, g):
  big = (g.astype(jnp.float32) * 2.0**BACKWARD_EXPONENT).astype(g.dtype)  # inf in float16
  return ((big.astype(jnp.float32) * 2.0**-BACKWARD_EXPONENT).astype(g.dtype),)


fragile.defvjp(lambda x: (x, None), _fragile_bwd)


class Run(NamedTuple):
  """What one run shows.

  Attributes:
    changes: the controller's log.
    finite: per step, whether it was applied.
    origins: per step, ``str`` of the first non-finite value (``None`` when finite).
    loss_scales: per step, the loss scale after it.
    traces: per step, how many times the step function has been traced (so lowered and
      compiled) after it.
    cache_sizes: per step, the number of entries in the jitted step's dispatch cache after
      it. On one device, one per compiled version; with sharded arguments an argument
      placed equivalently but described differently may add one without compiling.
    kept: whether applying the change kept every array of the state (the same objects).
    replicated: whether every metric array was fully replicated (the decision's inputs).
    losses: per step, the loss.
  """

  changes: tuple
  finite: list
  origins: list
  loss_scales: list
  traces: list
  cache_sizes: list
  kept: bool
  replicated: bool
  losses: list


def _cache_size(jitted) -> int:
  return getattr(jitted, "jitted_fn", jitted)._cache_size()  # nnx.jit wraps a jax.jit


def _loop(model, step, run_step, leaves, traced) -> Run:
  """The training loop with a monitor and a controller; ``run_step(model)`` runs one step.

  ``traced`` is the list the step function appends to each time it is traced.
  """
  monitor = jaxmp.tools.Monitor()
  controller = jaxmp.tools.PrecisionController(
      model, monitor, window=WINDOW, culprit_steps=CULPRIT_STEPS, auto_apply=True)
  finite, origins, scales, sizes, losses, kept, replicated = [], [], [], [], [], True, True
  traces = []
  for _ in range(STEPS):
    model, loss, metrics = run_step(model)
    replicated &= all(a.is_fully_replicated for a in jax.tree.leaves(metrics))
    monitor.update(metrics, loss)
    latest = monitor.latest
    finite.append(not latest.skipped)
    origins.append(None if latest.origin is None else str(latest.origin))
    scales.append(latest.loss_scale)
    losses.append(latest.loss)
    sizes.append(_cache_size(step))
    traces.append(len(traced))
    before = leaves(model)
    model, change = controller.update(model)
    if change is not None:
      after = leaves(model)
      kept &= len(before) == len(after) and all(a is b for a, b in zip(before, after))
  return Run(controller.changes, finite, origins, scales, traces, sizes, kept, replicated,
             losses)


def _placements(mesh: Optional[Mesh]):
  """(batch, state) placement functions: the batch split over ``mesh``, the state replicated."""
  if mesh is None:
    return (lambda tree: tree), (lambda tree: tree)
  return ((lambda tree: jax.device_put(tree, NamedSharding(mesh, P("data")))),
          (lambda tree: jax.device_put(tree, NamedSharding(mesh, P()))))


def _lm1b_tokens(key) -> jax.Array:
  return jax.random.randint(key, (BATCH, registry.SEQ), 1, registry.VOCAB)


def linen_run(fault: str, mesh: Optional[Mesh] = None) -> Run:
  """lm1b's TransformerLM with ``fault`` ("forward" or "backward"), the batch over ``mesh``."""
  entry = registry.BY_NAME["lm1b_transformer_lm"]
  model = jaxmp.linen.mixed_precision(entry.module("eval"), LINEN_RULES)
  inputs, targets = _lm1b_tokens(jax.random.key(1)), _lm1b_tokens(jax.random.key(2))
  variables = model.init(jax.random.key(0), jnp.ones(inputs.shape, jnp.float32))
  if fault == "forward":
    params = jax.tree.map(lambda a: a, variables["params"], is_leaf=nn.meta.is_axis_metadata)
    attention = params["decoder"]["encoderdecoderblock_1"]["MultiHeadDotProductAttention_0"]
    for name in ("query", "key"):
      kernel = attention[name]["kernel"]
      attention[name]["kernel"] = kernel.replace_boxed(kernel.unbox() * QK_FACTOR)
    variables = {**variables, "params": params}
  split, replicate = _placements(mesh)
  inputs, targets = split((inputs, targets))

  def inject(next_fun, args, kwargs, context):
    # Around the MLP block's first Dense, from outside it: in the block's own code.
    if fault == "backward" and "/".join(context.module.path) == f"{LM1B_MLP}/Dense_0":
      args = (fragile(args[0]), *args[1:])
    return next_fun(*args, **kwargs)

  traced = []

  @jax.jit
  def step(state, inputs, targets):
    traced.append(1)  # runs when the step is traced, not when it runs
    def loss_fn(variables):
      with nn.intercept_methods(inject):
        return registry.cross_entropy(state.apply_fn(variables, inputs), targets)
    loss, grads = state.value_and_grad(loss_fn)()
    new = state.apply_gradients(grads)
    return new, loss, jaxmp.tools.training_metrics(grads.params, new.opt_state,
                                                   nonfinite_trace=grads.nonfinite)

  tx = jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.DynamicLossScale(2.0**10))
  state = replicate(jaxmp.linen.TrainState.create(apply_fn=model.apply, variables=variables,
                                                  tx=tx))
  assert state.fp8, "the Dense layers keep fp8 state"
  return _loop(state, step, lambda state: step(state, inputs, targets), jax.tree.leaves, traced)


def nnx_run(fault: str, mesh: Optional[Mesh] = None) -> Run:
  """The NNX ViT with ``fault`` ("forward" or "backward"), the batch over ``mesh``."""
  config = vit.ModelConfig(num_classes=10, img_size=16, patch_size=8, num_layers=2,
                           num_heads=2, mlp_dim=64, hidden_size=32)  # the rest as published
  published = vit.VisionTransformer(config, rngs=nnx.Rngs(0))
  mha = published.encoder.layers[1].mha
  if fault == "forward":
    for projection in (mha.query, mha.key):
      projection.kernel[...] = projection.kernel[...] * QK_FACTOR
  else:
    attention_fn = mha.attention_fn
    mha.attention_fn = lambda *args, **kwargs: fragile(attention_fn(*args, **kwargs))
  model = jaxmp.nnx.mixed_precision(published, NNX_RULES)
  model.eval()  # no dropout: the runs compare exactly
  images = jax.random.normal(jax.random.key(1), (BATCH, 16, 16, 3))
  labels = jax.random.randint(jax.random.key(2), (BATCH,), 0, 10)
  split, replicate = _placements(mesh)
  images, labels = split((images, labels))
  optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(optax.adam(1e-3),
                                                      jaxmp.DynamicLossScale(2.0**10)),
                            wrt=nnx.Param)
  nnx.update((model, optimizer), replicate(nnx.state((model, optimizer))))

  traced = []

  @nnx.jit
  def step(model, optimizer, images, labels):
    traced.append(1)  # runs when the step is traced, not when it runs
    loss, grads = jaxmp.nnx.value_and_grad(
        lambda m: registry.cross_entropy(m(images), labels))(
            model, loss_scale=jaxmp.get_loss_scale(optimizer.opt_state))
    jaxmp.nnx.apply_gradients(optimizer, model, grads)
    return loss, jaxmp.tools.training_metrics(grads.params, optimizer.opt_state,
                                              nonfinite_trace=grads.nonfinite)

  def run_step(model):
    return (model, *step(model, optimizer, images, labels))

  variables = lambda model: [v for _, v in nnx.to_flat_state(nnx.state(model))]
  return _loop(model, step, run_step, variables, traced)


RUNS = {"linen": linen_run, "nnx": nnx_run}


def check(framework: str, fault: str, run: Run, one_device: bool = True) -> str:
  """Asserts what a run must show; returns a summary line."""
  expected = EXPECTED[framework, fault]
  assert run.origins[:2] == [expected] * 2, run.origins
  assert run.finite == [False, False, True, True, True], run.finite
  assert np.all(np.isfinite(run.losses[2:])), run.losses
  (change,) = run.changes
  assert change.applied and change.step == 1 and change.kind == "module_float32", change
  culprit = expected.rsplit(" of ", 1)[1]
  assert change.module == culprit, change
  assert change.rules.rules[0] == jaxmp.Rule(culprit, "params=float32,compute=float32"), change
  assert change.rules.rules[1:] == change.previous.rules
  # Nothing re-initialised: the loss scale goes on from where the skips left it.
  assert run.loss_scales == [512.0, 256.0, 256.0, 256.0, 256.0], run.loss_scales
  assert run.kept, "applying the change kept every array"
  assert run.traces == [1, 1, 2, 2, 2], run.traces  # traced once more, once
  if one_device:
    assert run.cache_sizes == [1, 1, 2, 2, 2], run.cache_sizes  # the jit cache: one more
  assert run.replicated
  return f"{framework} {fault}: {change}"
