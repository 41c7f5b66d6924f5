"""The chips fp8 ops compile for, as far as their GEMMs go, and what one GEMM runs as.

A :class:`Target` is what the fp8 core needs to know of a chip: whether fp8 (and MX,
and int8) GEMMs run natively, and the layout and kernel choices that depend on the
generation. :data:`TARGETS` names the chips ``jaxmp.fp8.compile_target`` and
``jaxmp.tools.audit`` accept; :func:`target_for_device` describes a live device.
A :class:`Lowering` is the answer to "what does this GEMM run as here": each recipe's
entry in :mod:`jaxmp._src.fp8.ops` gives it, and :func:`fp8_gemm` is the answer of
every recipe whose GEMMs XLA itself lowers to fp8 GEMMs (per tensor, per row).

Example:
  >>> from jaxmp._src.fp8 import chips
  >>> chips.TARGETS["h100"].k_major_fp8, chips.fp8_gemm(chips.TARGETS["v5e"]).kind
  (True, 'fallback')
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src import jax_compat


@dataclasses.dataclass(frozen=True)
class Target:
  """A chip, as far as fp8 GEMMs go.

  Attributes:
    name: ``"h100"``, ``"b200"``, ``"v7"``, ``"cpu"``, or a device kind.
    platform: ``"gpu"``, ``"tpu"`` or ``"cpu"``.
    fp8: fp8 operands run on fp8 matrix units (Hopper and later, TPU v7).
    mx: MXFP8 block-scaled GEMMs run natively (Blackwell through cuDNN >= 9.10).
    description: what the chip is, for messages.
    int8: int8 GEMMs run faster than bfloat16 ones (TPU v5e, v5p, v6e by libtpu's cost
      model); ``None`` where jaxmp makes no claim.
    block_fp8: ``BlockScaling``'s GEMMs run as jaxmp's block-scaled fp8 kernel
      (``jaxmp._src.fp8.block_gemm``: Triton's ``wgmma``, Hopper, sm_90) where
      ``block_gemm.supports`` the recipe.
    k_major_fp8: cuBLASLt's fp8 GEMMs read both operands with the contracted dimension
      minor (Ada and Hopper, sm_89 and sm_90; Blackwell takes any layout), so jaxmp
      writes the forward pass's quantized operands row-major
      (``jaxmp._src.fp8.scaled_gemm.in_own_layout_on_gpus``).
  """

  name: str
  platform: str
  fp8: bool | None
  mx: bool
  description: str
  int8: bool | None = None
  block_fp8: bool = False
  k_major_fp8: bool = False


TARGETS = {
    "h100": Target("h100", "gpu", True, False, "NVIDIA H100, sm_90", block_fp8=True,
                   k_major_fp8=True),
    "h200": Target("h200", "gpu", True, False, "NVIDIA H200, sm_90", block_fp8=True,
                   k_major_fp8=True),
    "b200": Target("b200", "gpu", True, True, "NVIDIA B200, sm_100, cuDNN >= 9.10"),
    "a100": Target("a100", "gpu", False, False, "NVIDIA A100, sm_80: no fp8 tensor cores"),
    "v5e": Target("v5e", "tpu", False, False, "TPU v5e: fp8 at the bfloat16 rate", True),
    "v5p": Target("v5p", "tpu", False, False, "TPU v5p: fp8 at the bfloat16 rate", True),
    "v6e": Target("v6e", "tpu", False, False, "TPU v6e: fp8 at the bfloat16 rate", True),
    "v7": Target("v7", "tpu", True, False, "TPU v7: int8 at the bfloat16 rate", False),
    "cpu": Target("cpu", "cpu", False, False, "CPU: fp8 emulated"),
}
"""The targets ``jaxmp.fp8.compile_target`` accepts (``jaxmp.tools.audit``'s names)."""

_TPU_KINDS = {"TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v6 lite": "v6e", "TPU7x": "v7",
              "TPU v7": "v7"}


def target_for_device(device: Any) -> Target:
  """The :class:`Target` of a ``jax.Device`` (duck-typed on ``platform``, ``device_kind``).

  Example:
    >>> import types
    >>> gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
    ...                             compute_capability="9.0")
    >>> jaxmp._src.fp8.chips.target_for_device(gpu).fp8
    True
  """
  platform, kind = device.platform, str(getattr(device, "device_kind", device.platform))
  if platform == "tpu":
    return TARGETS.get(_TPU_KINDS.get(kind, ""), Target(kind, "tpu", False, False, kind))
  if platform != "gpu":
    return Target(platform, platform, False, False, f"{kind}: fp8 emulated")
  capability = dtypes_lib.gpu_compute_capability(device, "jaxmp.fp8")
  if capability is None:  # ROCm: not described here, so no claim is made
    return Target(kind, "gpu", None, False, kind)
  cudnn = jax_compat.cudnn_version()
  mx = capability >= (10, 0) and (cudnn is None or cudnn >= 91000)
  return Target(kind, "gpu", capability >= (8, 9), mx,
                f"{kind}, sm_{capability[0]}{capability[1]}", block_fp8=capability == (9, 0),
                k_major_fp8=capability in ((8, 9), (9, 0)))


@dataclasses.dataclass(frozen=True)
class Lowering:
  """What one GEMM runs as: ``kind`` is ``"fp8"``, ``"mx"``, ``"int8"``, ``"fallback"``,
  ``"unknown"``, ``"emulated"`` (CPU) or ``"compute dtype"`` (no recipe); ``detail``
  says more."""

  kind: str
  detail: str


def unknown_fp8(target: Target) -> Lowering | None:
  """``"unknown"`` where the target's fp8 support is not described (ROCm), else ``None``."""
  if target.fp8 is None:
    return Lowering("unknown", f"fp8 support of {target.description} is not described")
  return None


def fp8_gemm(target: Target) -> Lowering:
  """What an fp8 GEMM XLA lowers itself (per-tensor or per-row scales) runs as on ``target``."""
  unknown = unknown_fp8(target)
  if unknown is not None:
    return unknown
  if target.fp8:
    return Lowering("fp8", "an fp8 GEMM")
  if target.platform == "tpu":
    return Lowering("fallback", "fp8 GEMMs at the bfloat16 rate (no fp8 matrix units)")
  return Lowering("fallback", "16-bit GEMMs (XLA widens the fp8 operands: no fp8 tensor cores)")


__all__ = (
    "TARGETS",
    "Lowering",
    "Target",
    "fp8_gemm",
    "target_for_device",
    "unknown_fp8",
)
