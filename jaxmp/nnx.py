"""Flax NNX: per-module precision for unchanged models, fp8 layers, and train steps.

* :func:`mixed_precision` wraps an ``nnx.Module`` with a policy or
  :class:`jaxmp.PolicyRules`; the wrapper is an ``nnx.Module`` called like the model,
  whose params are the model's own.
* :class:`Fp8DotGeneral` (``nnx.Linear(dot_general=...)``) and :class:`Fp8Einsum`
  (``nnx.Einsum(einsum_op=...)``) compute a layer's matmul in fp8, their state held as
  :class:`Fp8State` variables; a ``jaxmp.Rule(..., fp8=recipe)`` installs them without
  changing the model.
* :func:`value_and_grad`, :func:`apply_gradients` and :func:`accumulate_gradients`
  keep params, loss scaling and fp8 state in step with an ``nnx.Optimizer``.
* With ``PolicyRules(trace_nonfinite=True)`` the wrapper holds a
  :class:`NonfiniteProbe` and ``value_and_grad`` returns the step's per-module
  inf/NaN trace in ``Gradients.nonfinite``.

Example:
  >>> from flax import nnx
  >>> wrapped = jaxmp.nnx.mixed_precision(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "p=f32,c=bf16,o=f32")
  >>> wrapped(jnp.ones((1, 3))).dtype
  dtype('float32')
"""

from jaxmp._src.engine import CallRecord
from jaxmp._src.nnx import fp8 as _fp8
from jaxmp._src.nnx.fp8 import Fp8DotGeneral
from jaxmp._src.nnx.fp8 import Fp8Einsum
from jaxmp._src.nnx.fp8 import Fp8State
from jaxmp._src.nnx.fp8 import for_grad as fp8_for_grad
from jaxmp._src.nnx.nonfinite import NonfiniteProbe
from jaxmp._src.nnx.train import apply_gradients
from jaxmp._src.nnx.train import value_and_grad
from jaxmp._src.nnx.wrapper import MixedPrecision
from jaxmp._src.nnx.wrapper import mixed_precision
from jaxmp._src.step import Gradients
from jaxmp._src.step import accumulate_gradients

# Using the NNX namespace is the first use of jaxmp's NNX variable type: nnx.bridge maps
# linen's fp8 collection onto it from now on.
_fp8.register_collection_name()

__all__ = (
    "CallRecord",
    "Fp8DotGeneral",
    "Fp8Einsum",
    "Fp8State",
    "Gradients",
    "MixedPrecision",
    "NonfiniteProbe",
    "accumulate_gradients",
    "apply_gradients",
    "fp8_for_grad",
    "mixed_precision",
    "value_and_grad",
)
