"""fp8 matmuls, framework-free: per-tensor, row-wise, block-wise and MXFP8 scaling.

- Per-tensor recipes: :class:`DelayedScaling` (scale from previous steps' amaxes,
  state in the ``_overwrite_with_gradient`` collection) and :class:`CurrentScaling`
  (scale from this step's amax, no state); E4M3 forward operands, E5M2 output
  gradients. Finer current scaling: :class:`RowwiseScaling` (torchao rowwise),
  :class:`BlockScaling` (DeepSeek-V3's 1x128 / 128x128) and :class:`MXScaling` (OCP
  MXFP8, E8M0 scales); :class:`Int8Scaling` is AQT's symmetric int8 with per-row
  scales and int32 accumulation. :class:`GemmRecipes` gives the forward, input-gradient and
  weight-gradient GEMMs a recipe each (or one per operand, :class:`OperandRecipes`), or
  the compute dtype. float32 scaling
  arithmetic and accumulation throughout.
- New recipes: a frozen dataclass derived from :class:`GemmRecipe` and its entry in the
  fp8 ops table (:func:`register_recipe`, a :class:`RecipeOps`): every fp8 op, layer and
  rule then runs it.
- What runs where: :func:`compile_target` names the chip being compiled for, and a
  recipe whose GEMMs do not run as fp8 GEMMs there warns
  (:class:`Fp8FallbackWarning`).
- Pure functions: :func:`fp8_dot_general` (a drop-in ``dot_general``) and
  :func:`fp8_einsum`, over explicit state from :func:`init_state`.
- Training: :mod:`jaxmp.fp8.state` (``for_grad``, ``merge``, ``accumulate``,
  ``all_reduce``) keeps the state sound across reused layers, unused layers,
  micro-batches and skipped steps.

The layers that carry the state live with their framework: ``jaxmp.linen.Fp8DotGeneral``
and ``jaxmp.linen.Fp8Einsum``, ``jaxmp.nnx.Fp8DotGeneral`` and ``jaxmp.nnx.Fp8Einsum``;
a ``jaxmp.Rule(..., fp8=recipe)`` puts them into an unchanged model.

Example:
  >>> from jaxmp import fp8
  >>> recipe = fp8.DelayedScaling(amax_history_length=4)
  >>> state = fp8.init_state(recipe)
  >>> dims = (((1,), (0,)), ((), ()))
  >>> fp8.fp8_dot_general(jnp.ones((2, 3)), jnp.ones((3, 1)), dims, state=state,
  ...                     recipe=recipe).ravel()
  Array([3., 3.], dtype=float32)
"""

from jaxmp._src.fp8.chips import Lowering
from jaxmp._src.fp8.chips import Target
from jaxmp._src.fp8.dot_general import fp8_dot_general
from jaxmp._src.fp8.dot_general import fp8_einsum
from jaxmp._src.fp8.grouped import Grouping
from jaxmp._src.fp8.grouped import Quantized
from jaxmp._src.fp8.ops import GemmCall
from jaxmp._src.fp8.ops import OperandOps
from jaxmp._src.fp8.ops import RecipeOps
from jaxmp._src.fp8.ops import register_recipe
from jaxmp._src.fp8.recipes import BlockScaling
from jaxmp._src.fp8.recipes import CurrentScaling
from jaxmp._src.fp8.recipes import DelayedScaling
from jaxmp._src.fp8.recipes import GemmRecipe
from jaxmp._src.fp8.recipes import GemmRecipes
from jaxmp._src.fp8.recipes import Int8Scaling
from jaxmp._src.fp8.recipes import MXScaling
from jaxmp._src.fp8.recipes import OperandRecipe
from jaxmp._src.fp8.recipes import OperandRecipes
from jaxmp._src.fp8.recipes import Recipe
from jaxmp._src.fp8.recipes import RowwiseScaling
from jaxmp._src.fp8.state import OVERWRITE_WITH_GRADIENT
from jaxmp._src.fp8.state import DelayedScalingState
from jaxmp._src.fp8.state import init_state
from jaxmp._src.fp8.support import Fp8FallbackWarning
from jaxmp._src.fp8.support import compile_target
from jaxmp._src.fp8.support import current_target
from jaxmp.fp8 import state

__all__ = (
    "OVERWRITE_WITH_GRADIENT",
    "BlockScaling",
    "CurrentScaling",
    "DelayedScaling",
    "DelayedScalingState",
    "Fp8FallbackWarning",
    "GemmCall",
    "GemmRecipe",
    "GemmRecipes",
    "Grouping",
    "Int8Scaling",
    "Lowering",
    "MXScaling",
    "OperandOps",
    "OperandRecipe",
    "OperandRecipes",
    "Quantized",
    "Recipe",
    "RecipeOps",
    "RowwiseScaling",
    "Target",
    "compile_target",
    "current_target",
    "fp8_dot_general",
    "fp8_einsum",
    "init_state",
    "register_recipe",
    "state",
)
