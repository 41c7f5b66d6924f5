"""fp8 matmuls with delayed or current scaling, and sound training of their state.

- Recipes: :class:`DelayedScaling` (scale from previous steps' amaxes, state in the
  ``_overwrite_with_gradient`` collection) and :class:`CurrentScaling` (scale from
  this step's amax, no state). E4M3 forward operands, E5M2 output gradients, float32
  scaling arithmetic and accumulation.
- Pure functions: :func:`fp8_dot_general` (a drop-in ``dot_general``) and
  :func:`fp8_einsum`, over explicit state from :func:`init_state`.
- Flax linen: :class:`Fp8DotGeneral` (``nn.Dense(dot_general_cls=...)``) and
  :class:`Fp8Einsum`.
- Training: :mod:`jaxmp.fp8.state` (``for_grad``, ``merge``, ``accumulate``) keeps
  the state sound across reused layers, unused layers, micro-batches and skipped
  steps.

Example:
  >>> import flax.linen as nn
  >>> from jaxmp import fp8
  >>> model = nn.Dense(8, dot_general_cls=fp8.Fp8DotGeneral)
  >>> x = jnp.ones((4, 16))
  >>> variables = model.init(jax.random.key(0), x)
  >>> def loss(params, fp8_state):
  ...   fp8_state = fp8.state.for_grad(fp8_state)  # repeated uses take the max
  ...   y = model.apply({"params": params, fp8.OVERWRITE_WITH_GRADIENT: fp8_state}, x)
  ...   return jnp.sum(y ** 2)
  >>> grads, fp8_ct = jax.grad(loss, argnums=(0, 1))(
  ...     variables["params"], variables[fp8.OVERWRITE_WITH_GRADIENT])
  >>> new_fp8 = fp8.state.merge(variables[fp8.OVERWRITE_WITH_GRADIENT], fp8_ct,
  ...                           jaxmp.all_finite(grads))
  >>> float(new_fp8["Fp8DotGeneral_0"]["input_amax_history"][0])
  1.0
"""

from jaxmp.fp8 import maxgrad
from jaxmp.fp8 import quantize
from jaxmp.fp8 import recipes
from jaxmp.fp8 import state
from jaxmp.fp8.dot_general import fp8_dot_general
from jaxmp.fp8.dot_general import fp8_einsum
from jaxmp.fp8.linen import Fp8DotGeneral
from jaxmp.fp8.linen import Fp8Einsum
from jaxmp.fp8.recipes import CurrentScaling
from jaxmp.fp8.recipes import DelayedScaling
from jaxmp.fp8.recipes import Recipe
from jaxmp.fp8.state import OVERWRITE_WITH_GRADIENT
from jaxmp.fp8.state import DelayedScalingState
from jaxmp.fp8.state import init_state

__all__ = (
    "OVERWRITE_WITH_GRADIENT",
    "CurrentScaling",
    "DelayedScaling",
    "DelayedScalingState",
    "Fp8DotGeneral",
    "Fp8Einsum",
    "Recipe",
    "fp8_dot_general",
    "fp8_einsum",
    "init_state",
    "maxgrad",
    "quantize",
    "recipes",
    "state",
)
