"""Training fp8 delayed-scaling state soundly: max over uses, merge, never sum.

The state's new value arrives as its "gradient". :func:`for_grad` (inside the
differentiated function) makes repeated reads accumulate by max; :func:`merge` takes
the new state where it carries information and the step was applied;
:func:`accumulate` combines micro-batches by max; :func:`all_reduce` combines devices
inside ``shard_map`` by max. ``jaxmp.linen`` and ``jaxmp.nnx``'s train steps call
them for you. :func:`require_state_gradient` is what jaxmp's fp8 layers pass their
kernel through, so that a step that differentiates the params but not the state (and
would drop every state update) is refused; a custom fp8 layer can do the same.

Example:
  >>> from jaxmp import fp8
  >>> old = fp8.init_state(fp8.DelayedScaling(amax_history_length=2))
  >>> new = old._replace(input_amax_history=jnp.array([3.0, 0.0]))
  >>> fp8.state.merge(old, new, jnp.array(False)).input_amax_history  # a skipped step
  Array([0., 0.], dtype=float32)
"""

from jaxmp._src.fp8.state import accumulate
from jaxmp._src.fp8.state import all_reduce
from jaxmp._src.fp8.state import empty_like
from jaxmp._src.fp8.state import for_grad
from jaxmp._src.fp8.state import from_grad
from jaxmp._src.fp8.state import merge
from jaxmp._src.fp8.state import require_state_gradient

__all__ = ("accumulate", "all_reduce", "empty_like", "for_grad", "from_grad", "merge",
           "require_state_gradient")
