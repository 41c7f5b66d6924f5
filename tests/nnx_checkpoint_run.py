"""The NNX run that tests/test_checkpoint.py saves, kills and resumes, with the docs' recipe.

The checkpoint code is the sharding guide's own (docs/guides/sharding.md): :func:`recipe`
executes the first Python block of its "Checkpoints of NNX models" section, with
``MyNnxModel``, ``rules`` and ``tx`` defined as this run's (Flax's published scanned
MLP: BatchNorm statistics, a Dropout holding its RNG stream, ``nnx.Linear`` layers in an
``nnx.scan``; bfloat16 params with float32 masters, fp8 by rule, dynamic loss scaling).

Resuming in a fresh process, as a restarted job does::

  python -m tests.nnx_checkpoint_run RESTORE_DIR SAVE_DIR STEPS

restores the latest checkpoint of ``RESTORE_DIR``, trains ``STEPS`` steps, saves the
result to ``SAVE_DIR`` and prints one line per step, ``loss <float.hex()>``.
"""

from __future__ import annotations

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxmp
from tests import doc_snippets
from tests.published import models as registry

GUIDE = pathlib.Path(__file__).parents[1] / "docs" / "guides" / "sharding.md"
SECTION = "## Checkpoints of NNX models (Orbax)"

RULES = jaxmp.PolicyRules("params=bfloat16,compute=bfloat16,output=float32", [
    jaxmp.Rule(nnx.Linear, fp8=jaxmp.fp8.DelayedScaling(amax_history_length=4))])
# Built once: the optimizer is static data of nnx.Optimizer, so the jitted step's cache
# is keyed on this object.
TX = jaxmp.loss_scaling(jaxmp.optim.master_weights(optax.adam(1e-2)),
                        jaxmp.DynamicLossScale(2.0**10, growth_interval=2))
BATCH = registry.BY_NAME["scan_mlp"].batch(jax.random.key(1))


def guide_block() -> str:
  """The first Python code block after the sharding guide's NNX checkpoint heading."""
  return doc_snippets.first_block_after(GUIDE, SECTION)


@functools.cache
def recipe() -> dict:
  """The guide's ``create``, ``save`` and ``restore``, run on this module's model."""
  scope = {"jax": jax, "jaxmp": jaxmp, "rules": RULES, "tx": TX,
           "MyNnxModel": registry.BY_NAME["scan_mlp"].module}
  exec(compile(guide_block(), str(GUIDE), "exec"), scope)  # pylint: disable=exec-used
  return scope


TRACES: list[int] = []


@nnx.jit
def train_step(model, optimizer, fault):
  """One step on the fixed batch; ``fault`` is added to every gradient (inf: a skip)."""
  TRACES.append(1)  # once per trace, not per call
  x, y = BATCH.inputs[0], BATCH.targets
  model.train()
  loss, grads = jaxmp.nnx.value_and_grad(lambda m: registry.cross_entropy(m(x), y))(
      model, loss_scale=jaxmp.get_loss_scale(optimizer.opt_state))
  grads = grads._replace(params=jax.tree.map(lambda g: g + fault, grads.params))
  jaxmp.nnx.apply_gradients(optimizer, model, grads)
  return loss


def train(model, optimizer, steps: int, skip_at: int = -1) -> list:
  """``steps`` steps, the one numbered ``skip_at`` poisoned; the losses."""
  return [train_step(model, optimizer, jnp.float32(jnp.inf if i == skip_at else 0.0))
          for i in range(steps)]


def main(argv: list) -> int:
  restore_dir, save_dir, steps = argv
  model, optimizer = recipe()["restore"](restore_dir)
  losses = train(model, optimizer, int(steps))
  recipe()["save"](save_dir, model, optimizer)
  for loss in losses:
    print("loss", float(loss).hex())
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
