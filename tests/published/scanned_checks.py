"""Eight-device checks: a scanned model's stack sharded on its layer axis, fp8 state too.

Run by ``test_scanned_fp8.py`` in a subprocess with 8 forced CPU devices
(``tests/eight_devices.py``); ``python tests/published/scanned_checks.py [names]``
runs them by hand. Each shards every leaf of the stack (params, their Adam moments and
the stacked fp8 state: leading axis ``LAYERS``) over a mesh axis ``layers`` of 4
devices, the rest replicated, trains a few steps and compares every byte with the same
steps on one device.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402  pylint: disable=g-import-not-at-top
import numpy as np  # noqa: E402  pylint: disable=g-import-not-at-top
from flax import nnx  # noqa: E402  pylint: disable=g-import-not-at-top
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxmp  # noqa: E402  pylint: disable=g-import-not-at-top
from tests import eight_devices  # noqa: E402  pylint: disable=g-import-not-at-top
from tests.published import scanned as s  # noqa: E402  pylint: disable=g-import-not-at-top

STEPS = 3


def _mesh() -> Mesh:
  return Mesh(np.array(jax.devices()).reshape(4, 2), ("layers", "rest"))


def _under(path, stacked: str) -> bool:
  """Whether a leaf's path passes through ``stacked`` (a module, or an fp8 layer key in it)."""
  keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
  return any(k == stacked or k.startswith(stacked + "/") for k in keys)


def _on_layers(mesh: Mesh, tree, stacked: str):
  """``tree`` placed with every leaf under ``stacked`` sharded on its leading (layer) axis."""
  def place(path, x):
    layered = _under(path, stacked) and np.ndim(x) >= 1 and np.shape(x)[0] == s.LAYERS
    return jax.device_put(x, NamedSharding(mesh, P("layers") if layered else P()))
  return jax.tree_util.tree_map_with_path(place, tree)


def _layer_sharded(tree, stacked: str) -> int:
  """How many leaves under ``stacked`` are sharded on 'layers'."""
  found = 0
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    spec = getattr(getattr(x, "sharding", None), "spec", ())
    found += _under(path, stacked) and len(spec) > 0 and spec[0] == "layers"
  return found


def _bytes(tree):
  return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def check_linen_stack_sharded_on_layers() -> str:
  name = "linen_mlp"
  wrapped = jaxmp.linen.mixed_precision(s.linen_model(name), s.rules())
  variables = s.linen_init(name, wrapped)
  step = jax.jit(s.linen_step(name))
  single, sharded = s.linen_state(wrapped, variables), None
  sharded = _on_layers(_mesh(), single, s.stacked_name(name))
  fp8_sharded = _layer_sharded(sharded.fp8, s.stacked_name(name))
  assert fp8_sharded == 6, fp8_sharded
  for _ in range(STEPS):
    single, loss1 = step(single, *s.data())
    sharded, loss8 = step(sharded, *s.data())
    assert np.asarray(loss1).tobytes() == np.asarray(loss8).tobytes()
  assert _bytes(single) == _bytes(sharded), "the sharded run differs from one device"
  return f"params, Adam moments, 6 fp8 state leaves sharded on 'layers'; {STEPS} steps equal"


def check_nnx_stack_sharded_on_layers() -> str:
  def run(place):
    wrapped = jaxmp.nnx.mixed_precision(s.nnx_model(), s.rules(classes=(nnx.Linear,)))
    optimizer = s.nnx_optimizer(wrapped)
    graphdef, state = nnx.split((wrapped, optimizer))
    state = place(state)
    nnx.update((wrapped, optimizer), state)
    losses = [np.asarray(s.nnx_step(wrapped, optimizer, *s.data())) for _ in range(STEPS)]
    return losses, nnx.to_pure_dict(nnx.state((wrapped, optimizer)))

  mesh = _mesh()
  counted = []

  def on_layers(state):
    placed = _on_layers(mesh, state, "blocks")
    counted.append(_layer_sharded(nnx.to_pure_dict(placed)[0]["fp8"], "blocks"))
    return placed

  losses1, state1 = run(lambda state: state)
  losses8, state8 = run(on_layers)
  assert counted == [6], counted
  assert [x.tobytes() for x in losses1] == [x.tobytes() for x in losses8]
  as_data = lambda tree: jax.tree_util.tree_map(
      lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
      else x, tree)
  assert _bytes(as_data(state1)) == _bytes(as_data(state8)), "sharded run differs"
  return f"the stack and its 6 fp8 state leaves sharded on 'layers'; {STEPS} steps equal"


CHECKS = {
    "linen_stack_sharded_on_layers": check_linen_stack_sharded_on_layers,
    "nnx_stack_sharded_on_layers": check_nnx_stack_sharded_on_layers,
}

if __name__ == "__main__":
  sys.exit(eight_devices.main(CHECKS, sys.argv[1:]))
