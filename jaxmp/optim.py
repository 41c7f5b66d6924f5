"""Memory: 16-bit params with exact float32 masters, narrow optimizer state, careful rounding.

Optax transforms that keep training quality while params and optimizer state shrink
(bytes per parameter for Adam, gradients aside: float32 everything 12; bfloat16
params + float32 master + bfloat16 moments 10, with 8-bit moments 8; with the master
as a 16-bit remainder 8, or 6 with 8-bit moments; pure bfloat16 6):

* :func:`master_weights`: the params stay 16-bit, the optimizer keeps their exact
  float32 master (a full copy, or only its low 16 bits: :func:`split_remainder`)
  and updates it in float32; :func:`master_params` reads the masters back.
* :func:`state_dtypes`: any optimizer's state stored in bfloat16 (per leaf if you
  like), its arithmetic in float32.
* :func:`quantized_moments`: any optimizer's large state leaves stored in 8 bits, a
  code of the dynamic map per value and a float32 scale per block
  (:class:`QuantizedMoment`; bitsandbytes' and torchao's 8-bit Adam, torchao's
  arithmetic bit for bit), its arithmetic in float32.
* :func:`stochastic_rounding` and :func:`kahan_summation`: alternatives to a master
  for pure 16-bit training, so that updates below half an ulp are not lost; like
  :func:`master_weights` they wrap the optimizer (a transform chained after them
  would undo what they write); the functions :func:`stochastic_round` and
  :func:`kahan_add` do one rounding.

They compose with :func:`jaxmp.loss_scaling` (outermost), sharding (every state leaf
has its param's shape; 8-bit scales its leading axes) and checkpointing (states are
NamedTuples of arrays).
``jaxmp.tools.memory_report`` counts the bytes.

Example:
  >>> import optax
  >>> tx = jaxmp.loss_scaling(jaxmp.optim.master_weights(
  ...     jaxmp.optim.state_dtypes(optax.adamw(1e-3), "bfloat16")), jaxmp.NoOpLossScale())
  >>> params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
  >>> state = tx.init(params)
  >>> jaxmp.optim.master_params(state, params)["w"].dtype
  dtype('float32')
"""

from jaxmp._src.optim.kahan import KahanState
from jaxmp._src.optim.kahan import kahan_add
from jaxmp._src.optim.kahan import kahan_summation
from jaxmp._src.optim.master_weights import MasterWeightsState
from jaxmp._src.optim.master_weights import master_params
from jaxmp._src.optim.master_weights import master_weights
from jaxmp._src.optim.quantized import QuantizedMoment
from jaxmp._src.optim.quantized import quantized_moments
from jaxmp._src.optim.remainders import join_remainder
from jaxmp._src.optim.remainders import split_remainder
from jaxmp._src.optim.state_dtypes import state_dtypes
from jaxmp._src.optim.stochastic_rounding import StochasticRoundingState
from jaxmp._src.optim.stochastic_rounding import stochastic_round
from jaxmp._src.optim.stochastic_rounding import stochastic_rounding

__all__ = (
    "KahanState",
    "MasterWeightsState",
    "QuantizedMoment",
    "StochasticRoundingState",
    "join_remainder",
    "kahan_add",
    "kahan_summation",
    "master_params",
    "master_weights",
    "quantized_moments",
    "split_remainder",
    "state_dtypes",
    "stochastic_round",
    "stochastic_rounding",
)
