"""jaxmp: mixed-precision training for JAX, Flax and Optax.

Precision policies with per-module overrides for Flax models, dynamic loss scaling as
an Optax transform, and fp8 matmuls. Everything is a pure function or an immutable
pytree, so it composes with ``jit``, ``grad``, sharding, ``remat`` and checkpointing.

The top level holds the core: policies and rules, tree utilities, loss scales and the
loss-scaling transform. Five namespaces hold the rest, each imported on first use:

* :mod:`jaxmp.linen`: wrap a linen model, its fp8 layers, and its train steps;
* :mod:`jaxmp.nnx`: the same for Flax NNX;
* :mod:`jaxmp.fp8`: fp8 recipes and the framework-free fp8 matmul;
* :mod:`jaxmp.optim`: memory-saving Optax transforms (master weights, low-precision
  optimizer state, stochastic rounding, Kahan summation);
* :mod:`jaxmp.tools`: the precision summary, underflow and sensitivity reports,
  training monitor, hardware capabilities.

Importing jaxmp changes nothing in JAX or Flax: what jaxmp must register (an autodiff
dtype for fp8 state, an NNX variable type) is registered on first use.

Example:
  >>> import jaxmp
  >>> policy = jaxmp.get_policy("params=float32,compute=bfloat16,output=float32")
"""

import importlib
from typing import TYPE_CHECKING
from typing import Any

from jaxmp._src.dtypes import half_dtype
from jaxmp._src.dynamic_loss_scale import DynamicLossScale
from jaxmp._src.jax_compat import JaxVersionWarning
from jaxmp._src.loss_scale import LossScale
from jaxmp._src.loss_scale import NoOpLossScale
from jaxmp._src.loss_scale import StaticLossScale
from jaxmp._src.loss_scaling import LossScalingState
from jaxmp._src.loss_scaling import get_loss_scale
from jaxmp._src.loss_scaling import loss_scaling
from jaxmp._src.loss_scaling import loss_scaling_metrics
from jaxmp._src.policy import Policy
from jaxmp._src.policy import get_policy
from jaxmp._src.rules import PolicyRules
from jaxmp._src.rules import Rule
from jaxmp._src.tree import all_finite
from jaxmp._src.tree import cast_tree
from jaxmp._src.tree import select_tree

__version__ = "0.1.0"

_NAMESPACES = ("fp8", "linen", "nnx", "optim", "tools")

if TYPE_CHECKING:  # type checkers see the namespaces that __getattr__ loads on first use
  from jaxmp import fp8
  from jaxmp import linen
  from jaxmp import nnx
  from jaxmp import optim
  from jaxmp import tools


def __getattr__(name: str) -> Any:
  # The namespaces import Flax and jaxmp's adapters; they load when first touched.
  if name in _NAMESPACES:
    return importlib.import_module(f"jaxmp.{name}")
  raise AttributeError(f"module 'jaxmp' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_NAMESPACES))


__all__ = (
    "DynamicLossScale",
    "JaxVersionWarning",
    "LossScale",
    "LossScalingState",
    "NoOpLossScale",
    "Policy",
    "PolicyRules",
    "Rule",
    "StaticLossScale",
    "all_finite",
    "cast_tree",
    "fp8",
    "get_loss_scale",
    "get_policy",
    "half_dtype",
    "linen",
    "loss_scaling",
    "loss_scaling_metrics",
    "nnx",
    "optim",
    "select_tree",
    "tools",
)
