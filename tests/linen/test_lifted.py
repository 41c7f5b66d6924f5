"""fp8 state through Flax's lifted transforms (``jaxmp._src.linen.lifted``), by rule.

Each model lists only ``params`` (or nothing) in its transform, as published models do;
the state goes where the params go: stacked (layer axes first) where they are scanned
or vmapped, one state where they are broadcast, passed whole through jit and remat.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp import fp8

OWG = fp8.OVERWRITE_WITH_GRADIENT
RECIPE = fp8.DelayedScaling(amax_history_length=4)
X = jax.random.normal(jax.random.key(1), (4, 8))


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    return nn.relu(nn.Dense(8)(x)) + x, None


class Layer(nn.Module):  # one carry, no scan output: nn.remat_scan's body
  @nn.compact
  def __call__(self, x):
    return nn.relu(nn.Dense(8)(x)) + x


def _scan(target, length, **kwargs):
  return nn.scan(target, variable_axes={"params": kwargs.pop("axis", 0)},
                 split_rngs={"params": True}, length=length, **kwargs)


class Scanned(nn.Module):
  axis: int = 0
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    return _scan(nn.remat(Block) if self.remat else Block, 3, axis=self.axis)()(x, None)[0]


class Nested(nn.Module):
  @nn.compact
  def __call__(self, x):
    class Inner(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        return _scan(Block, 2)()(x, None)[0], None
    return _scan(Inner, 3)()(x, None)[0]


class RematScan(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.remat_scan(Layer, lengths=(2, 3))()(x)


class Ensemble(nn.Module):  # nn.vmap over stacked params, one member per input row
  @nn.compact
  def __call__(self, x):
    return nn.vmap(Layer, variable_axes={"params": 0}, split_rngs={"params": True})()(x)


class SharedVmap(nn.Module):  # nn.vmap over the batch with the weights shared
  @nn.compact
  def __call__(self, x):
    return nn.vmap(Layer, variable_axes={"params": None}, split_rngs={"params": False})()(x)


class Jitted(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.jit(Layer, variables="params")()(x)


class ScannedEinsum(nn.Module):
  @nn.compact
  def __call__(self, x):
    class EinsumBlock(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        return nn.Einsum((8, 8), "bd,dh->bh")(x), None
    return _scan(EinsumBlock, 3)()(x, None)[0]


def _train(model, x=X, steps=2, classes=(nn.Dense,)):
  wrapped = jaxmp.linen.mixed_precision(model, jaxmp.PolicyRules(
      "float32", [jaxmp.Rule(classes, fp8=RECIPE)]))
  state = jaxmp.linen.TrainState.create(apply_fn=wrapped.apply,
                                        variables=wrapped.init(jax.random.key(0), x),
                                        tx=optax.adam(1e-2))
  step = jax.jit(lambda state: state.apply_gradients(state.value_and_grad(
      lambda v: jnp.mean(state.apply_fn(v, x) ** 2))()[1]))
  for _ in range(steps):
    state = step(state)
  return state


def _op_states(tree):
  return jax.tree_util.tree_leaves(tree, is_leaf=lambda t: isinstance(t, dict) and
                                   "input_scale" in t)


@pytest.mark.parametrize("model,layers", [
    (Scanned(), (3,)), (Scanned(remat=True), (3,)), (Scanned(axis=1), (3,)),
    (Nested(), (3, 2)), (RematScan(), (2, 3)), (Ensemble(), (4,)),
    (SharedVmap(), ()), (Jitted(), ())], ids=[
        "scan", "scan_of_remat", "params_on_axis_1", "nested_scans", "remat_scan",
        "vmap_stack", "vmap_shared", "jit"])
def test_the_state_follows_the_params_layer_axes_first(model, layers):
  x = X if not isinstance(model, Ensemble) else jnp.stack([X] * 4)
  state = _train(model, x)
  (op,) = _op_states(state.fp8)
  assert {k: v.shape for k, v in op.items()} == {
      k: (*layers, 1 if k.endswith("scale") else 4) for k in op}
  histories = np.asarray(op["kernel_amax_history"]).reshape(-1, 4)
  # Two steps recorded in every layer, each from its own kernel: no two layers alike.
  assert np.all(np.sum(histories > 0, axis=1) == 2)
  assert len({tuple(h) for h in histories}) == len(histories)


def test_params_scanned_on_axis_1_keep_the_state_layer_axis_first():
  state = _train(Scanned(axis=1))
  assert state.params["ScanBlock_0"]["Dense_0"]["kernel"].shape == (8, 3, 8)
  (op,) = _op_states(state.fp8)
  assert op["input_amax_history"].shape == (3, 4)


def test_an_einsum_inside_a_scan_gets_stacked_state():
  state = _train(ScannedEinsum(), classes=(nn.Einsum,))
  (op,) = _op_states(state.fp8)
  assert op["kernel_amax_history"].shape == (3, 4)
  assert len(set(np.asarray(op["kernel_amax_history"][:, 0]).tolist())) == 3


def test_outside_a_wrapped_model_flax_is_untouched():
  # The same scan, unwrapped, with the user's own fp8 layer: nn.scan passes only the
  # params, as Flax does; jaxmp changes nothing outside its wrappers.
  class Cell(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return nn.Dense(8, dot_general_cls=jaxmp.linen.Fp8DotGeneral)(x), None
  with pytest.raises(ValueError, match="lifted scan, which does not pass the collection"):
    _scan(Cell, 3)().init(jax.random.key(0), X, None)
