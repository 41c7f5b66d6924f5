"""Bytes per parameter: what params, master weights, gradients and optimizer state cost.

:func:`memory_report` counts the bytes of the arrays of a training state by role:

* params: the params tree;
* master: the float32 masters (or 16-bit remainders) a ``jaxmp.optim.master_weights``
  state holds, found anywhere in the optimizer state;
* optimizer state: the rest of the optimizer state (moments, 8-bit moments' codes and
  scales, Kahan compensation, keys, counters, loss scale);
* gradients: the gradients tree if given, else one cotangent per param in the
  param's dtype (what ``jax.grad`` returns);

each also per parameter (divided by the number of param values). Given the compiled
train step, it adds XLA's own accounting (``compiled.memory_analysis()``): the bytes
of the step's arguments, outputs and temporaries, the bytes outputs share with
donated arguments, and their peak, ``arguments + outputs + temporaries - aliased``.

Example:
  >>> import optax
  >>> params = {"w": jnp.ones((256, 256), jnp.bfloat16)}
  >>> tx = jaxmp.optim.master_weights(jaxmp.optim.state_dtypes(optax.adam(1e-3), "bfloat16"))
  >>> report = jaxmp.tools.memory_report(params, tx.init(params))
  >>> report.bytes_per_param()
  {'params': 2.0, 'master': 4.0, 'optimizer state': 4.0..., 'gradients': 2.0}
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._src.optim import base as optim_base
from jaxmp._src.optim import master_weights as master_weights_lib
from jaxmp._src.tools import table

_MIB = 2.0**20


def tree_bytes(tree: Any) -> int:
  """The bytes of the array leaves of ``tree`` (arrays or ``jax.ShapeDtypeStruct``)."""
  total = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      continue
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.eval_shape(jax.random.key_data, leaf)
    total += int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
  return total


def _count(tree: Any) -> int:
  return sum(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree_util.tree_leaves(tree)
             if hasattr(x, "shape"))


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Bytes of a training state by role, and of its compiled step.

  Attributes:
    num_params: the number of param values (elements of the params' arrays).
    param_bytes: bytes of the params.
    master_bytes: bytes of the master weights in the optimizer state (0 without).
    opt_state_bytes: bytes of the rest of the optimizer state.
    grad_bytes: bytes of the gradients.
    argument_bytes, output_bytes, temp_bytes, alias_bytes: from the compiled step's
      ``memory_analysis()``; ``None`` without a compiled step (or where the backend
      reports none).

  Example:
    >>> report = jaxmp.tools.memory_report({"w": jnp.ones(4)})
    >>> report.num_params, report.param_bytes, report.peak_bytes
    (4, 16, None)
  """

  num_params: int
  param_bytes: int
  master_bytes: int
  opt_state_bytes: int
  grad_bytes: int
  argument_bytes: int | None = None
  output_bytes: int | None = None
  temp_bytes: int | None = None
  alias_bytes: int | None = None

  @property
  def state_bytes(self) -> int:
    """What lives between steps (params, master and optimizer state)."""
    return self.param_bytes + self.master_bytes + self.opt_state_bytes

  @property
  def peak_bytes(self) -> int | None:
    """The compiled step's arguments + outputs + temporaries - aliased, or ``None``."""
    # The four are set together, from one compiled step's memory analysis.
    arguments, outputs, temps, aliased = (self.argument_bytes, self.output_bytes,
                                          self.temp_bytes, self.alias_bytes)
    if arguments is None:
      return None
    assert outputs is not None and temps is not None and aliased is not None
    return arguments + outputs + temps - aliased

  def bytes_per_param(self) -> dict[str, float]:
    """Bytes per param value of each role: params, master, optimizer state, gradients."""
    n = max(self.num_params, 1)
    return {"params": self.param_bytes / n, "master": self.master_bytes / n,
            "optimizer state": self.opt_state_bytes / n, "gradients": self.grad_bytes / n}

  def __str__(self) -> str:
    n = max(self.num_params, 1)
    rows = [(name, f"{value * n / _MIB:.2f}", f"{value:.2f}")
            for name, value in self.bytes_per_param().items()]
    rows.append(("params + master + optimizer state", f"{self.state_bytes / _MIB:.2f}",
                 f"{self.state_bytes / n:.2f}"))
    text = (f"{self.num_params:,} params\n"
            + table.text_table(("", "MiB", "bytes/param"), rows, (False, True, True)))
    peak = self.peak_bytes
    if peak is not None:
      compiled = (self.argument_bytes, self.output_bytes, self.temp_bytes, self.alias_bytes)
      arguments, outputs, temps, aliased = (x or 0 for x in compiled)  # all set with peak
      text += (f"\ncompiled step (memory_analysis): arguments {arguments / _MIB:.2f} "
               f"MiB, outputs {outputs / _MIB:.2f} MiB, temporaries "
               f"{temps / _MIB:.2f} MiB, aliased {aliased / _MIB:.2f} MiB, "
               f"peak {peak / _MIB:.2f} MiB")
    return text


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """XLA's accounting of a compiled step's device memory (``memory_analysis()``).

  Attributes:
    argument_bytes: the step's arguments.
    output_bytes: its outputs.
    temp_bytes: temporaries XLA allocates while it runs.
    alias_bytes: outputs written into donated arguments (counted in both above).
  """

  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int

  @property
  def peak_bytes(self) -> int:
    """The step's footprint, arguments + outputs + temporaries - aliased."""
    return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


def compiled_memory(compiled: jax.stages.Compiled) -> CompiledMemory | None:
  """``compiled.memory_analysis()`` as a :class:`CompiledMemory`, or None where absent."""
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  return CompiledMemory(int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
                        int(stats.temp_size_in_bytes), int(stats.alias_size_in_bytes))


def _compiled_bytes(compiled: Any) -> dict[str, int | None]:
  if compiled is None:
    return {}
  if not isinstance(compiled, jax.stages.Compiled):
    hint = (" (call .lower(*args).compile() on the jitted step first)"
            if hasattr(compiled, "lower") else "")
    raise TypeError(f"memory_report: compiled must be a compiled step (jax.stages.Compiled), "
                    f"got {type(compiled).__name__}{hint}.")
  memory = compiled_memory(compiled)
  return {} if memory is None else dataclasses.asdict(memory)


def memory_report(params: optax.Params, opt_state: optax.OptState | None = None, *,
                  grads: optax.Updates | None = None,
                  compiled: jax.stages.Compiled | None = None) -> MemoryReport:
  """Counts the bytes of params, master weights, optimizer state and gradients.

  See the module docstring for what each role counts.

  Args:
    params: the params (arrays or ``jax.ShapeDtypeStruct``).
    opt_state: the optimizer state, or ``None``.
    grads: the gradients; ``None`` counts one cotangent per param in its dtype.
    compiled: the compiled train step (``jax.jit(step).lower(...).compile()``), for
      its ``memory_analysis()``.

  Returns:
    A :class:`MemoryReport`; ``str()`` of it is a table.

  Raises:
    TypeError: if ``compiled`` is not a ``jax.stages.Compiled``.

  Example:
    >>> report = jaxmp.tools.memory_report({"w": jnp.ones(8, jnp.bfloat16)},
    ...                                    {"mu": jnp.zeros(8)})
    >>> print(report)
    8 params
                                       MiB  bytes/param
    ---------------------------------  ----  -----------
    params                             0.00         2.00
    master                             0.00         0.00
    optimizer state                    0.00         4.00
    gradients                          0.00         2.00
    params + master + optimizer state  0.00         6.00
  """
  masters = optim_base.find_states(opt_state, master_weights_lib.MasterWeightsState)
  master_bytes = sum(tree_bytes(state.master) for state in masters)
  return MemoryReport(
      num_params=_count(params),
      param_bytes=tree_bytes(params),
      master_bytes=master_bytes,
      opt_state_bytes=tree_bytes(opt_state) - master_bytes,
      grad_bytes=tree_bytes(params if grads is None else grads),
      **_compiled_bytes(compiled),
  )


__all__ = (
    "CompiledMemory",
    "MemoryReport",
    "compiled_memory",
    "memory_report",
    "tree_bytes",
)
