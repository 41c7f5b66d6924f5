"""Published models that scan their layers, their unrolled twins, and train steps.

Shared by ``test_scanned_fp8.py`` and its eight-device checks (``scanned_checks.py``).
The models are Flax's, copied verbatim (``tests/published/__init__.py``):

* ``linen_mlp``: the Linen side of ``docs_nnx/migrating/linen_to_nnx.rst``'s "Scan over
  layers": ``nn.scan`` over a ``Block`` (``nn.Dense``, ``nn.Dropout``), listing only
  ``{'params': 0}``;
* ``pjit_mlp``: ``docs/guides/parallel_training/flax_on_pjit.md``'s ``MLP``: ``nn.scan``
  over ``DotReluDot`` (an ``nn.Dense`` and a raw ``W2`` param multiplied by
  ``jnp.dot``) with ``metadata_params={nn.PARTITION_NAME: None}`` and
  ``nn.with_partitioning`` params, and a ``use_scan`` switch for the unrolled loop;
* ``nnx_mlp``: the NNX side of that "Scan over layers": layers built by
  ``nnx.split_rngs`` + ``nnx.vmap``, run by ``nnx.scan``.

Each has an unrolled twin with the same layers one after another (``pjit_mlp``: its own
``use_scan=False``; the others: the published ``Block`` called ``LAYERS`` times), whose
variables are the scanned model's sliced per layer (:func:`unrolled_variables`,
:func:`unrolled_nnx`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

import jaxmp
from jaxmp import fp8
from tests.published.flax_pjit import mlp as pjit
from tests.published.flax_scan_layers import linen_scan_mlp  # noqa: F401 (used by the tests)
from tests.published.flax_scan_layers import nnx_scan_mlp

LAYERS, WIDTH, BATCH = 4, 32, 8
RECIPE = fp8.DelayedScaling(amax_history_length=4)
BF16 = "params=float32,compute=bfloat16,output=float32"
OWG = fp8.OVERWRITE_WITH_GRADIENT
LINEN = ("linen_mlp", "pjit_mlp")


def rules(recipe=RECIPE, policy: str = BF16, classes=(nn.Dense,)) -> jaxmp.PolicyRules:
  return jaxmp.PolicyRules(policy, [jaxmp.Rule(classes, fp8=recipe)] if recipe else [])


def set_mesh(devices=None) -> Mesh:
  """The flax_on_pjit model's ``mesh`` global ('data', 'model'): one device by default."""
  devices = np.array(devices if devices is not None else jax.devices()[:1])
  pjit.mesh = Mesh(devices.reshape(-1, 1), ("data", "model"))
  return pjit.mesh


class UnrolledMLP(nn.Module):
  """linen_to_nnx's Linen ``Block``, called ``num_layers`` times without ``nn.scan``."""
  features: int
  num_layers: int

  @nn.compact
  def __call__(self, x, training: bool):
    for _ in range(self.num_layers):
      x, _ = linen_scan_mlp.Block(self.features, training)(x, None)
    return x


def linen_model(name: str, scanned: bool = True) -> nn.Module:
  if name == "linen_mlp":
    return (linen_scan_mlp.MLP(WIDTH, num_layers=LAYERS) if scanned
            else UnrolledMLP(WIDTH, LAYERS))
  if getattr(pjit, "mesh", None) is None:
    set_mesh()
  return pjit.MLP(LAYERS, WIDTH, scanned)


def linen_apply(name: str, apply, variables, x, rngs=None):
  """The model's own call: linen_mlp takes ``training`` (on with dropout rngs)."""
  if name == "linen_mlp":
    return apply(variables, x, rngs is not None, rngs=rngs or {})
  return apply(variables, x)


def linen_init(name: str, wrapped, key=0):
  x = jnp.ones((BATCH, WIDTH))
  args = (x, False) if name == "linen_mlp" else (x,)
  return nn.meta.unbox(wrapped.init(jax.random.key(key), *args))


def stacked_name(name: str) -> str:
  return "ScanBlock_0" if name == "linen_mlp" else "ScanDotReluDot_0"


def unrolled_name(name: str, i: int) -> str:
  return f"Block_{i}" if name == "linen_mlp" else f"DotReluDot_{i}"


def unrolled_variables(name: str, variables: dict) -> dict:
  """The scanned model's variables for its unrolled twin: layer i is row i of the stack."""
  return {collection: {unrolled_name(name, i): jax.tree_util.tree_map(
      lambda a, i=i: a[i], tree[stacked_name(name)]) for i in range(LAYERS)}
          for collection, tree in variables.items()}


def data(key=1):
  kx, ky = jax.random.split(jax.random.key(key))
  return jax.random.normal(kx, (BATCH, WIDTH)), jax.random.normal(ky, (BATCH, WIDTH))


def mse(y, target):
  return jnp.mean(jnp.square(y.astype(jnp.float32) - target))


def linen_state(wrapped, variables, learning_rate=1e-2) -> jaxmp.linen.TrainState:
  return jaxmp.linen.TrainState.create(
      apply_fn=wrapped.apply, variables=variables,
      tx=jaxmp.loss_scaling(optax.adam(learning_rate)))


def linen_step(name: str):
  """A jaxmp TrainState step of the model (eval mode: no dropout, so it is reproducible)."""

  def step(state, x, y):
    loss, grads = state.value_and_grad(
        lambda v: mse(linen_apply(name, state.apply_fn, v, x), y))()
    return state.apply_gradients(grads), loss

  return step


# ---- NNX ---------------------------------------------------------------------------------


def nnx_model(key: int = 0) -> nnx_scan_mlp.MLP:
  model = nnx_scan_mlp.MLP(WIDTH, num_layers=LAYERS, rngs=nnx.Rngs(key))
  model.eval()  # the Dropout layers: deterministic, so that runs compare bit for bit
  return model


class UnrolledNnxMLP(nnx.Module):
  """The NNX ``Block``s of a stack, one module per layer, called one after another."""

  def __init__(self, blocks: list):
    self.layers = nnx.List(blocks)

  def __call__(self, x):
    for block in self.layers:
      x = block(x)
    return x


def unrolled_nnx(model: nnx_scan_mlp.MLP) -> UnrolledNnxMLP:
  """The stack's layers as separate modules: layer i's variables are row i of the stack."""
  graphdef, state = nnx.split(model.blocks)
  blocks = [nnx.merge(graphdef, jax.tree_util.tree_map(lambda a, i=i: a[i], state))
            for i in range(LAYERS)]
  return UnrolledNnxMLP(blocks)


def nnx_optimizer(wrapped, learning_rate=1e-2) -> nnx.Optimizer:
  return nnx.Optimizer(wrapped, jaxmp.loss_scaling(optax.adam(learning_rate)), wrt=nnx.Param)


@nnx.jit
def nnx_step(wrapped, optimizer, x, y):
  loss, grads = jaxmp.nnx.value_and_grad(lambda m, x, y: mse(m(x), y))(
      wrapped, x, y, loss_scale=jaxmp.get_loss_scale(optimizer.opt_state))
  jaxmp.nnx.apply_gradients(optimizer, wrapped, grads)
  return loss
