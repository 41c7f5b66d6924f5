"""The jaxprs of a wrapped forward + backward with no non-finite tracing, as of before it.

``tests/test_nonfinite.py`` checks that tracing off changes nothing: the jaxprs built
here by the current code must equal the ones in ``tests/golden/``, which this script
first wrote from jaxmp as it was before non-finite tracing existed (commit 588dcb4, jax
0.10.2, flax 0.12.8). Only public APIs of that version are used.

A jaxpr's text depends on the JAX and Flax versions, so each golden file starts with a
line naming the versions it was written with; the test fails (it does not skip) when
they are not the installed ones. Then, or when a change alters these jaxprs on purpose
(a new cast rule, say), regenerate them from the current code with tracing off, check
the diff, and say why in the commit:

  make golden        # or: PYTHONPATH=. python tests/nonfinite_golden.py --write
"""

import pathlib
import re
import sys

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxmp

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"
POLICY = "params=float32,compute=float16,output=float32"
REGENERATE = "make golden"
# The first line of each golden file: "# jax 0.10.2, flax 0.12.8; regenerate: make golden".
_HEADER = re.compile(r"# (jax \S+, flax \S+); regenerate: .*\n")


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


def installed_versions() -> str:
  """The versions a jaxpr's text depends on, as a golden file's first line names them."""
  return f"jax {jax.__version__}, flax {flax.__version__}"


def write(path: pathlib.Path, jaxpr: str) -> None:
  """Writes ``jaxpr`` to ``path`` under a line naming the installed versions."""
  path.write_text(f"# {installed_versions()}; regenerate: {REGENERATE}\n{jaxpr}")


def read(path: pathlib.Path) -> str:
  """The jaxpr in the golden file ``path``; fails the test if other versions wrote it.

  A jaxpr printed by another JAX or Flax differs in its text (names, parameters), so
  comparing would fail for no fault of jaxmp's, and skipping would hide that the file
  is stale: the test fails with the versions and the command that regenerates it.
  """
  text = path.read_text()
  header = _HEADER.match(text)
  if header is None:
    pytest.fail(f"{path} does not start with the line naming the versions that wrote it; "
                f"regenerate it with `{REGENERATE}`.", pytrace=False)
  if header.group(1) != installed_versions():
    pytest.fail(f"{path} was written with {header.group(1)}, but {installed_versions()} is "
                f"installed: regenerate it with `{REGENERATE}` (it writes what the current "
                "code builds with tracing off; check the diff before committing it).",
                pytrace=False)
  return text[header.end():]


if __name__ == "__main__":
  if "--write" not in sys.argv:
    sys.exit("usage: python tests/nonfinite_golden.py --write")
  GOLDEN.mkdir(exist_ok=True)
  for name, build in JAXPRS.items():
    write(golden_path(name), build())
    print(f"wrote {golden_path(name)} ({installed_versions()})")
