"""The jaxprs of a wrapped forward + backward with no non-finite tracing, as of before it.

``tests/test_nonfinite.py`` checks that tracing off changes nothing: the jaxprs built
here by the current code must equal the ones in ``tests/golden/``, which this script
wrote from jaxmp as it was before non-finite tracing existed (commit 588dcb4, jax
0.10.2, flax 0.12.8). Only public APIs of that version are used.

If a later change alters these jaxprs on purpose (a new cast rule, say), regenerate
them from the new code with tracing off and say why in the commit:

  PYTHONPATH=. python tests/nonfinite_golden.py --write
"""

import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import jaxmp

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"
POLICY = "params=float32,compute=float16,output=float32"
VERSIONS = {"jax": "0.10.2", "flax": "0.12.8"}


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(8, name="up")(x))
    h = nn.LayerNorm(name="ln")(h)
    return nn.Dense(2, name="down")(h)


class _NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(3, 8, rngs=rngs)
    self.ln = nnx.LayerNorm(8, rngs=rngs)
    self.down = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.down(self.ln(nnx.gelu(self.up(x))))


def linen_jaxpr(rules=POLICY) -> str:
  """jaxmp.linen.value_and_grad of a wrapped MLP's loss, float16, loss scale 1024."""
  model = jaxmp.linen.mixed_precision(_Net(), rules)
  x = jnp.ones((4, 3))
  variables = model.init(jax.random.key(0), x)
  grad_fn = jaxmp.linen.value_and_grad(lambda v, x: jnp.mean(model.apply(v, x) ** 2))
  return str(jax.make_jaxpr(
      lambda v, x: grad_fn(v, x, loss_scale=jaxmp.StaticLossScale(1024.0)))(variables, x))


def nnx_jaxpr(rules=POLICY) -> str:
  """jaxmp.nnx.value_and_grad of a wrapped MLP's loss, float16, loss scale 1024."""
  model = jaxmp.nnx.mixed_precision(_NnxNet(nnx.Rngs(0)), rules)
  graphdef, state = nnx.split(model)
  grad_fn = jaxmp.nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))

  def step(state, x):
    return grad_fn(nnx.merge(graphdef, state), x, loss_scale=jaxmp.StaticLossScale(1024.0))

  return str(jax.make_jaxpr(step)(state, jnp.ones((4, 3))))


JAXPRS = {"linen": linen_jaxpr, "nnx": nnx_jaxpr}


def golden_path(name: str) -> pathlib.Path:
  return GOLDEN / f"nonfinite_off_{name}.jaxpr.txt"


if __name__ == "__main__":
  if "--write" not in sys.argv:
    sys.exit("usage: python tests/nonfinite_golden.py --write")
  GOLDEN.mkdir(exist_ok=True)
  for name, build in JAXPRS.items():
    golden_path(name).write_text(build())
    print(f"wrote {golden_path(name)}")
