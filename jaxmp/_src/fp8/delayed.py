"""Delayed scaling: per-tensor scales from the amax histories of previous steps.

:class:`~jaxmp.fp8.DelayedScaling`'s part of ``fp8_dot_general``'s per-tensor op
(:mod:`~jaxmp._src.fp8.dot_general`), and its state. Per tensor (input, kernel, output
gradient) the state holds a scale and an amax history (:class:`DelayedScalingState`).
Forward: the three scales of this step come from the old histories
(:func:`~jaxmp._src.fp8.quantize.amax_from_history`,
:func:`~jaxmp._src.fp8.quantize.scale_from_amax`), the input and kernel are quantized
to E4M3 with theirs, and their amaxes are pushed into their histories. Backward: the
output gradient is quantized to E5M2 with its scale and its amax pushed into its
history. The new scales and histories come back as the cotangent of the old state
(:mod:`jaxmp.fp8.state` says how a trainer applies them).

Example:
  >>> from jaxmp._src.fp8 import delayed
  >>> s = delayed.init_state(jaxmp.fp8.DelayedScaling(amax_history_length=3))
  >>> s.input_scale, s.input_amax_history
  (Array([1.], dtype=float32), Array([0., 0., 0.], dtype=float32))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.fp8 import chips
from jaxmp._src.fp8 import fused_quantize
from jaxmp._src.fp8 import maxgrad
from jaxmp._src.fp8 import quantize as q
from jaxmp._src.fp8 import recipes as recipes_lib
from jaxmp._src.fp8 import scaled_gemm

TENSORS = ("input", "kernel", "output_grad")

F32 = np.dtype(np.float32)


class DelayedScalingState(NamedTuple):
  """The delayed-scaling state of one fp8 matmul.

  Field names are the variable names of Flax's ``nn.Fp8DotGeneral``, and shapes are
  Flax's (scales ``(1,)``, histories ``(amax_history_length,)``, float32), so state
  moves between the two with ``DelayedScalingState(**variables)`` and
  ``state._asdict()``.

  Attributes:
    input_scale: dequantization multiplier of the input (lhs), ``(1,)``.
    input_amax_history: amax history of the input, most recent first.
    kernel_scale: scale of the kernel (rhs).
    kernel_amax_history: amax history of the kernel.
    output_grad_scale: scale of the output gradient.
    output_grad_amax_history: amax history of the output gradient.

  Example:
    >>> import flax.linen as nn
    >>> from jaxmp import fp8
    >>> flax_layer = nn.Dense(2, dot_general_cls=nn.Fp8DotGeneral)  # Flax's own fp8
    >>> variables = flax_layer.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> (flax_state,) = variables[fp8.OVERWRITE_WITH_GRADIENT].values()
    >>> state = fp8.DelayedScalingState.from_variables(flax_state)
    >>> state.input_scale, state.input_amax_history.shape
    (Array([1.], dtype=float32), (1024,))
    >>> sorted(state._asdict()) == sorted(flax_state)
    True
  """

  input_scale: Any
  input_amax_history: Any
  kernel_scale: Any
  kernel_amax_history: Any
  output_grad_scale: Any
  output_grad_amax_history: Any

  @classmethod
  def from_variables(cls, variables: Any) -> DelayedScalingState:
    """Builds the state from a mapping with Flax's six variable names.

    Raises:
      ValueError: naming the missing or unexpected keys.
    """
    names = set(cls._fields)
    given = set(variables)
    if given != names:
      raise ValueError(
          f"fp8 state needs exactly the variables {sorted(names)}; missing "
          f"{sorted(names - given)}, unexpected {sorted(given - names)}.")
    return cls(**{name: variables[name] for name in cls._fields})


def init_state(recipe: recipes_lib.DelayedScaling) -> DelayedScalingState:
  """Scales 1 and histories 0, as in Flax and TransformerEngine.

  The first step quantizes with scale 1 and records the first amaxes.
  """
  scale = jnp.ones((1,), F32)
  history = jnp.zeros((recipe.amax_history_length,), F32)
  return DelayedScalingState(scale, history, scale, history, scale, history)


def check_state(state: Any, recipe: recipes_lib.DelayedScaling) -> DelayedScalingState:
  """``state`` (a :class:`DelayedScalingState` or its variables) as ``fp8_dot_general`` reads it.

  Raises:
    ValueError: for missing state, or leaves of the wrong shape for ``recipe``.
    TypeError: for state of the wrong type or dtype.
  """
  if state is None:
    raise ValueError(
        "fp8_dot_general: DelayedScaling needs state=; create it with "
        "jaxmp.fp8.init_state(recipe) (or use the Fp8DotGeneral module, which keeps it "
        "in the '_overwrite_with_gradient' collection).")
  if isinstance(state, Mapping):
    state = DelayedScalingState.from_variables(state)
  if not isinstance(state, DelayedScalingState):
    raise TypeError(
        "fp8_dot_general: state must be a jaxmp.fp8.DelayedScalingState or a mapping with "
        f"its six variable names, got {type(state).__name__}.")
  state = DelayedScalingState(*(jnp.asarray(x) for x in state))
  for tensor in TENSORS:
    scale = getattr(state, f"{tensor}_scale")
    history = getattr(state, f"{tensor}_amax_history")
    if scale.size != 1:
      raise ValueError(
          f"fp8_dot_general: {tensor}_scale must hold one value, got shape {scale.shape}.")
    if history.shape != (recipe.amax_history_length,):
      raise ValueError(
          f"fp8_dot_general: {tensor}_amax_history has shape {history.shape}, but the recipe "
          f"has amax_history_length={recipe.amax_history_length}.")
  for name, x in zip(state._fields, state):
    # Amax histories and scales are float32 in Flax and TransformerEngine; a narrower
    # state would round every recorded amax.
    if not (maxgrad.is_max_float32(x) or x.dtype == F32):
      raise TypeError(f"fp8_dot_general: fp8 state must be float32, got {name} of dtype "
                      f"{x.dtype}.")
  return state


def _read(state: Any) -> DelayedScalingState:
  """The state's leaves as float32 (their stored form may be max_float32)."""
  def read(x):
    if maxgrad.is_max_float32(x):
      return jax.lax.convert_element_type(x, F32)
    return x.astype(F32)
  return DelayedScalingState(*(read(x) for x in state))


def _scales(st: DelayedScalingState, recipe: recipes_lib.DelayedScaling) -> jax.Array:
  """The input, kernel and output-gradient scales of this step, ``[3]``, from ``st``."""
  # The scales read the old histories through an optimization barrier. Without it
  # XLA fuses their max-reductions with the step's own reductions over the new
  # histories (fp8/state.merge checks those), so that each quantization scale comes
  # to depend on its tensor's current amax, and the quantization can no longer join
  # the kernel that computes that amax: one more read of every output gradient
  # (seen in compiled H100 HLO).
  old = jax.lax.optimization_barrier(
      (st.input_amax_history, st.kernel_amax_history, st.output_grad_amax_history))
  # The three scales as one computation over the stacked histories: three kernels
  # per matmul on GPUs (the reduction, the scales, their products), where three
  # separate computations became six (seen in compiled H100 HLO). Each row is
  # computed alone, so every scale is the one computed on its own.
  previous = jnp.stack([st.input_scale.reshape(()), st.kernel_scale.reshape(()),
                        st.output_grad_scale.reshape(())])
  return q.scale_from_amax(q.amax_from_history(jnp.stack(old), recipe.amax_compute), previous,
                           (q.E4M3, q.E4M3, q.E5M2), recipe.margin, recipe.power_of_two)


def primal(lhs: jax.Array, rhs: jax.Array, state: Any, cfg: Any):
  """The forward GEMM's operands and scale when nothing differentiates the op.

  Nothing records an amax without a gradient, so the amaxes, their barrier and the
  operand layouts of :func:`forward` (which serve the backward pass and the state
  update) are left out, and XLA quantizes the kernel straight into the layout its
  GEMM reads: a Dense 4096^3 forward moved 128 MiB of other traffic through
  :func:`forward`, 96 MiB (Flax's figure) this way (compiled H100 HLO).

  Returns:
    ``(q_lhs, q_rhs, scale)``.
  """
  scales = _scales(_read(state), cfg.recipe)
  q_lhs, q_rhs = scaled_gemm.forward_operands(lhs, rhs, scales[0], scales[1], k_major_fp8=False)
  return q_lhs, q_rhs, scales[0] * scales[1]


def forward(lhs: jax.Array, rhs: jax.Array, state: Any, cfg: Any):
  """The quantized operands and scales of the forward pass, and what the backward pass needs.

  Returns:
    ``(q_lhs, q_rhs, x_scale, k_scale, carry)``; ``carry`` is the output gradient's
    scale and the three histories with this step's input and kernel amaxes recorded.
    With ``cfg.fused_quantize`` ``q_lhs`` is ``(codes, transposed)``, and its amax
    comes from the same kernel (``jaxmp._src.fp8.fused_quantize``).
  """
  st = _read(state)
  scales = _scales(st, cfg.recipe)
  if cfg.fused_quantize:
    # The input in one kernel: its codes in both layouts and its amax (fused_quantize;
    # q_lhs is then a (codes, transposed) pair). The kernel stays XLA's (see there).
    x_q = fused_quantize.quantize(lhs, q.E4M3, scales[0])
    q_lhs, lhs_amax_of = (x_q.codes, x_q.transposed), x_q.amax
    (q_rhs,) = scaled_gemm.in_own_layout_on_gpus(cfg.k_major_fp8,
                                                 q.quantize(rhs, q.E4M3, scales[1]))
    rhs_amax_of = rhs
  else:
    # Each operand is quantized in its own layout, so that one kernel reads it for its
    # quantization and its amax (below); see scaled_gemm.in_own_layout_on_gpus.
    q_lhs, q_rhs = scaled_gemm.forward_operands(lhs, rhs, scales[0], scales[1],
                                                cfg.k_major_fp8)
    lhs_amax_of, rhs_amax_of = lhs, rhs
  # This step's amaxes are computed before the quantized operands are used (a
  # barrier). Left free, XLA fuses each kernel's amax with the optimizer's update of
  # that kernel (the last other reader of the parameter), and with a donated state
  # the updated parameter can then not be written in place: the step copied every
  # fp8 kernel (1.6 GiB on a Llama-3-8B layer; compiled H100 HLO). Measured on an
  # H200 with a donated state, that layer's fp8 step went from 8.75 to 8.12 ms
  # with both amaxes behind the barrier, and to 8.59 ms with the kernel's alone.
  # (The amax of the kernel's amax is itself: shared_amax only adds vmap's rule.)
  x_amax, k_amax = (q.shared_amax(lhs_amax_of, st.input_amax_history),
                    q.shared_amax(rhs_amax_of, st.kernel_amax_history))
  # The scales pass it too: they are also the new state's scales, and left free XLA
  # could recompute them from the old ones inside fp8/state.merge's select, which
  # then cannot write the donated state in place (a small Llama layer's donated step
  # copied its 21 scales: 155 kernels, 140 with this; compiled H100 HLO).
  q_lhs, q_rhs, x_amax, k_amax, scales = jax.lax.optimization_barrier(
      (q_lhs, q_rhs, x_amax, k_amax, scales))
  x_scale, k_scale, g_scale = scales[0], scales[1], scales[2]
  x_history = q.record_amax(st.input_amax_history, x_amax)
  k_history = q.record_amax(st.kernel_amax_history, k_amax)
  g_history = q.valid_history(st.output_grad_amax_history)
  return q_lhs, q_rhs, x_scale, k_scale, (g_scale, (x_history, k_history, g_history))


def backward(g: jax.Array, x_scale: jax.Array, k_scale: jax.Array, carry: Any, cfg: Any):
  """The output gradient quantized to E5M2, its scale, and the new state's values.

  Returns:
    ``(q_g, g_scale, new_state)``: ``new_state`` the six float32 values in
    :class:`DelayedScalingState`'s order; ``q_g`` ``(codes, transposed)`` with
    ``cfg.fused_quantize``.
  """
  g_scale, (x_history, k_history, old_g_history) = carry
  if cfg.fused_quantize:  # both layouts and the amax in one pass (a pair, as forward's)
    g_q = fused_quantize.quantize(g, q.E5M2, g_scale)
    q_g = (g_q.codes, g_q.transposed)
    g_history = q.record_amax(old_g_history, q.shared_amax(g_q.amax, old_g_history))
  else:
    g_history = q.record_amax(old_g_history, q.shared_amax(g, old_g_history))
    # Written by the kernel that computes g, then transposed for the weight gradient's
    # GEMM (see scaled_gemm.in_own_layout_on_gpus: measured faster on an H200).
    (q_g,) = scaled_gemm.in_own_layout_on_gpus(
        cfg.k_major_fp8, q.quantize(g, q.E5M2, g_scale), own_kernel=True)
  return q_g, g_scale, (x_scale, x_history, k_scale, k_history, g_scale, g_history)


def lowering(recipe: recipes_lib.DelayedScaling, target: chips.Target) -> chips.Lowering:
  """An fp8 GEMM wherever XLA lowers one (:func:`~jaxmp._src.fp8.chips.fp8_gemm`)."""
  del recipe
  return chips.fp8_gemm(target)


__all__ = (
    "TENSORS",
    "DelayedScalingState",
    "backward",
    "check_state",
    "forward",
    "init_state",
    "lowering",
    "primal",
)
