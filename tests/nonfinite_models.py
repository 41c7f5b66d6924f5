"""Models with an overflow to find, for the non-finite tracing tests (one and eight devices).

The same small network in linen and NNX: ``up`` (Dense) -> gelu -> ``down`` (Dense) ->
``boom`` -> ``head`` (Dense), computing in float16 under dynamic loss scaling. ``boom``
is the identity forward; backward it multiplies the gradient by ``2**k`` (``k`` an
integer input), so ``k = 200`` makes a backward-only overflow in ``boom`` while every
forward value stays finite. Multiplying ``down``'s kernel by 1e6 makes a forward
overflow in ``down``. One compiled step serves the clean run and both faults.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxmp
from jaxmp._src import nonfinite
from jaxmp._src.tools import nonfinite as nonfinite_report  # pylint: disable=g-import-not-at-top

POLICY = "params=float32,compute=float16,output=float32"
RULES = jaxmp.PolicyRules(POLICY, trace_nonfinite=True)
WIDTH = 16
BACKWARD_K = 200
FORWARD_FACTOR = 1e6
EXPECTED = {
    "clean": None,
    "forward": ("down", "forward", "output"),
    "backward": ("boom", "backward", "input_grad"),
}
"""What each run must locate: (path, direction, value) of the first non-finite value."""


@jax.custom_vjp
def amplify(x, k):
  del k
  return x


def _amplify_fwd(x, k):
  return x, k


def _amplify_bwd(k, g):
  # In float32, so that the factor itself does not overflow before it is applied.
  factor = jnp.exp2(k.astype(jnp.float32))
  return (g.astype(jnp.float32) * factor).astype(g.dtype), None


amplify.defvjp(_amplify_fwd, _amplify_bwd)


class Amplify(nn.Module):
  @nn.compact
  def __call__(self, x, k):
    return amplify(x, k)


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x, k):
    h = nn.gelu(nn.Dense(WIDTH, name="up")(x))
    h = Amplify(name="boom")(nn.Dense(WIDTH, name="down")(h), k)
    return nn.Dense(4, name="head")(h)


class NnxAmplify(nnx.Module):
  def __call__(self, x, k):
    return amplify(x, k)


class NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(8, WIDTH, rngs=rngs)
    self.down = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.boom = NnxAmplify()
    self.head = nnx.Linear(WIDTH, 4, rngs=rngs)

  def __call__(self, x, k):
    return self.head(self.boom(self.down(nnx.gelu(self.up(x))), k))


def data(rows: int = 16) -> jax.Array:
  return jax.random.normal(jax.random.key(1), (rows, 8))


def _tx():
  return jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(16.0))


def linen_runs(x: jax.Array) -> dict:
  """The clean, forward-fault and backward-fault steps of the linen net (jitted)."""
  model = jaxmp.linen.mixed_precision(LinenNet(), RULES)
  state = jaxmp.linen.TrainState.create(
      apply_fn=model.apply, variables=model.init(jax.random.key(0), x[:1], 0), tx=_tx())

  @jax.jit
  def step(state, x, k):
    loss, grads = state.value_and_grad(lambda v: jnp.mean(state.apply_fn(v, x, k) ** 2))()
    new = state.apply_gradients(grads)
    return jaxmp.tools.training_metrics(grads.params, new.opt_state,
                                        nonfinite_trace=grads.nonfinite)

  params = jax.tree.map(lambda a: a, state.params)
  params["down"]["kernel"] = params["down"]["kernel"] * FORWARD_FACTOR
  return {"clean": step(state, x, 0), "forward": step(state.replace(params=params), x, 0),
          "backward": step(state, x, BACKWARD_K)}


def nnx_runs(x: jax.Array) -> dict:
  """The clean, forward-fault and backward-fault steps of the NNX net (``nnx.jit``)."""

  @nnx.jit
  def step(model, optimizer, x, k):
    _, grads = jaxmp.nnx.value_and_grad(lambda m: jnp.mean(m(x, k) ** 2))(
        model, loss_scale=jaxmp.get_loss_scale(optimizer.opt_state))
    jaxmp.nnx.apply_gradients(optimizer, model, grads)
    return jaxmp.tools.training_metrics(grads.params, optimizer.opt_state,
                                        nonfinite_trace=grads.nonfinite)

  def run(fault):
    model = jaxmp.nnx.mixed_precision(NnxNet(nnx.Rngs(0)), RULES)
    if fault == "forward":
      model.model.down.kernel[...] = model.model.down.kernel[...] * FORWARD_FACTOR
    optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
    return step(model, optimizer, x, BACKWARD_K if fault == "backward" else 0)

  return {fault: run(fault) for fault in EXPECTED}


def located(metrics: dict):
  """(path, direction, value) of a run's first non-finite value, or None."""
  origin = nonfinite_report.first_nonfinite(metrics["nonfinite_trace"])
  return None if origin is None else (origin.path, origin.direction, origin.value)


def check_runs(runs: dict) -> str:
  """Asserts what each run must show; returns a summary line."""
  for fault, expected in EXPECTED.items():
    metrics = runs[fault]
    assert located(metrics) == expected, (fault, located(metrics), expected)
    assert bool(metrics["last_step_finite"]) == (expected is None), fault
  forward_columns = [nonfinite.INPUT, nonfinite.OUTPUT]
  backward_run = nonfinite_report.decoded(runs["backward"]["nonfinite_trace"])
  assert np.isfinite(backward_run[:, forward_columns]).all(), "the backward fault is backward-only"
  return ", ".join(f"{fault}: {located(runs[fault])}" for fault in EXPECTED)
