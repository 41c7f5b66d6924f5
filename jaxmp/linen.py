"""Flax linen: per-module precision for unchanged models, fp8 layers, and train steps.

* :func:`mixed_precision` wraps a linen Module with a policy or
  :class:`jaxmp.PolicyRules`; the wrapper's ``init`` and ``apply`` take exactly what
  the Module's take.
* :class:`Fp8DotGeneral` (``nn.Dense(dot_general_cls=...)``) and :class:`Fp8Einsum`
  compute a layer's matmul in fp8 with delayed-scaling state; a
  ``jaxmp.Rule(..., fp8=recipe)`` installs them without changing the model.
* :class:`TrainState`, :func:`value_and_grad`, :func:`apply_gradients` and
  :func:`accumulate_gradients` keep params, loss scaling and fp8 state in step.
* With ``PolicyRules(trace_nonfinite=True)``, ``init`` adds the non-finite probe
  (collection :data:`NONFINITE_COLLECTION`) and ``value_and_grad`` returns the step's
  per-module inf/NaN trace in ``Gradients.nonfinite``.

Example:
  >>> import flax.linen as nn
  >>> model = jaxmp.linen.mixed_precision(nn.Dense(2),
  ...                                     "params=float32,compute=bfloat16,output=float32")
  >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
  >>> model.apply(variables, jnp.ones((1, 3))).dtype
  dtype('float32')
"""

from jaxmp._src.engine import CallRecord
from jaxmp._src.linen.fp8 import Fp8DotGeneral
from jaxmp._src.linen.fp8 import Fp8Einsum
from jaxmp._src.linen.train import TrainState
from jaxmp._src.linen.train import apply_gradients
from jaxmp._src.linen.train import join_variables
from jaxmp._src.linen.train import split_variables
from jaxmp._src.linen.train import value_and_grad
from jaxmp._src.linen.wrapper import NONFINITE_COLLECTION
from jaxmp._src.linen.wrapper import MixedPrecision
from jaxmp._src.linen.wrapper import mixed_precision
from jaxmp._src.step import Gradients
from jaxmp._src.step import accumulate_gradients

__all__ = (
    "NONFINITE_COLLECTION",
    "CallRecord",
    "Fp8DotGeneral",
    "Fp8Einsum",
    "Gradients",
    "MixedPrecision",
    "TrainState",
    "accumulate_gradients",
    "apply_gradients",
    "join_variables",
    "mixed_precision",
    "split_variables",
    "value_and_grad",
)
