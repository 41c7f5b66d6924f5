"""Compile targets for :func:`jaxmp.tools.audit`: GPUs and TPUs without the hardware.

JAX's accelerator plugins compile for a device they do not have. With the CUDA plugin
(``jax[cuda12]``) installed, ``jax.experimental.topologies.get_topology_desc(
platform="cuda", target_config=<GpuTargetConfigProto text>)`` gives compile-only
devices for the GPU the text describes, and XLA runs its whole GPU pipeline for it;
with ``libtpu`` (``jax[tpu]``) the same works for TPU generations by topology name.
Nothing here runs on a device: it only says what to compile for and, for the
roofline estimate, how fast the chip is on paper.

Every fact about a chip (its compute capability, peak rates and their source, memory
bandwidth, XLA's description of it, its TPU topology) is stated once, in the chip
table :data:`jaxmp._src.fp8.chips.CHIPS`; this module turns them into what a
deviceless compile needs: the GpuTargetConfigProto text (XLA's
``xla/tools/hlo_opt/gpu_specs`` fields, plus the CUDA and cuDNN versions the fp8 GEMM
rewrite checks for) and the compile-only device. GPU peaks are dense (no 2:4
sparsity) tensor-core rates from NVIDIA's datasheets; memory bandwidth is the one in
the target description, which is what XLA's own cost model assumes (within 5% of the
datasheets).

Example:
  >>> from jaxmp._src.tools import targets
  >>> h100 = targets.GPU_TARGETS["h100"]
  >>> h100.peak_tflops["fp8"], h100.peak_tflops["bf16"]
  (1978.9, 989.4)
  >>> targets.check_target("H100")
  'h100'
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from collections.abc import Mapping
from typing import Any

import jax

from jaxmp._src import dtypes
from jaxmp._src.fp8 import chips as chips_lib

_GPU_INFO_COMMON = """\
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  threads_per_core_limit: 2048
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
"""


def _target_config(device_info: str, capability: tuple[int, int], name: str) -> str:
  """A GpuTargetConfigProto in text form: XLA's gpu_specs fields plus versions."""
  major, minor = capability
  cudnn = chips_lib.DEVICELESS_CUDNN
  return (f"gpu_device_info {{\n{_GPU_INFO_COMMON}{device_info}"
          f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
          # The fp8 cuBLASLt rewrite needs CUDA >= 12; cuDNN 9 for fused attention,
          # 9.10 for XLA to lower MXFP8 block-scaled dots to cuDNN on Blackwell (jax
          # 0.10.2 accepts cuDNN 9.8 and later; pip installs the newest 9.x).
          "runtime_version { major: 12 minor: 8 patch: 0 }\n"
          "platform_name: \"CUDA\"\n"
          f"dnn_version_info {{ major: {cudnn // 10000} minor: {cudnn // 100 % 100} }}\n"
          f"device_description_str: \"{name}\"\n")


@dataclasses.dataclass(frozen=True)
class GpuSpec:
  """A GPU to compile for and its paper speeds.

  Attributes:
    name: the target name (``"h100"``).
    device_kind: what ``jax.Device.device_kind`` says on that GPU.
    target_config: the GpuTargetConfigProto text XLA compiles for.
    peak_tflops: dense TFLOP/s by arithmetic: ``fp8``, ``bf16`` (also float16),
      ``tf32`` (float32 GEMMs at XLA's default precision), ``f32`` (float32 at
      HIGHEST precision, no tensor cores), ``f64``, ``int8`` (TOP/s).
    hbm_bytes_per_second: memory bandwidth.
    source: where the peaks come from.
  """

  name: str
  device_kind: str
  target_config: str
  peak_tflops: Mapping[str, float]
  hbm_bytes_per_second: float
  source: str


def _gpu_spec(name: str, chip: chips_lib.Chip) -> GpuSpec:
  assert chip.gpu_device_info and chip.compute_capability and chip.peak_tflops
  assert chip.hbm_bytes_per_second is not None  # a compile target has its speeds
  kind = chip.device_kinds[0]
  return GpuSpec(name, kind, _target_config(chip.gpu_device_info, chip.compute_capability, kind),
                 chip.peak_tflops, chip.hbm_bytes_per_second, chip.source)


GPU_TARGETS: Mapping[str, GpuSpec] = {
    name: _gpu_spec(name, chip) for name, chip in chips_lib.CHIPS.items()
    if chip.gpu_device_info is not None}
"""The GPUs jaxmp compiles for without them (the chips with XLA's description)."""

# JAX's CUDA plugins, either of which compiles for a GPU target without the GPU.
CUDA_PLUGINS = ("cuda12", "cuda13")

TPU_TARGETS: Mapping[str, str] = {
    name: chip.tpu_topology for name, chip in chips_lib.CHIPS.items()
    if chip.tpu_topology is not None}
"""The TPUs jaxmp compiles for without them, with their single-chip topologies."""

TARGETS = tuple(GPU_TARGETS) + tuple(TPU_TARGETS)


def check_target(target: Any, where: str = "audit") -> str:
  """The canonical (lower-case) target name, or a TypeError/ValueError.

  ``where`` names the caller in the message.

  Raises:
    TypeError: if ``target`` is not a string.
    ValueError: if it names no known target; the message lists them.
  """
  if not isinstance(target, str):
    raise TypeError(f"{where}: target must be a string such as 'h100', got {target!r} of type "
                    f"{type(target).__name__}.")
  name = target.strip().lower()
  if name not in TARGETS:
    raise ValueError(f"{where}: unknown target {target!r}; accepted targets are "
                     f"{', '.join(repr(t) for t in TARGETS)} (or None for the local backend).")
  return name


def is_tpu(target: str) -> bool:
  return target in TPU_TARGETS


def installed(module: str) -> bool:
  """Whether ``module`` can be imported (without importing it)."""
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package is missing
    return False


def cuda_plugin_installed() -> bool:
  """Whether one of JAX's CUDA plugins (:data:`CUDA_PLUGINS`) is installed."""
  return any(installed(f"jax_plugins.xla_{cuda}") for cuda in CUDA_PLUGINS)


def _require(module: str, extra: str, target: str) -> None:
  if not installed(module):
    # TPU targets need libtpu alone (a small environment); GPU targets the CUDA plugin.
    where = ("for TPU targets alone `pip install \"jax[tpu]==" + jax.__version__
             + "\" -e .` in a virtual environment is enough; `make gpu-report` builds "
             ".venv-cuda with the CUDA plugin and libtpu" if extra == "tpu" else
             "`make gpu-report` builds one (.venv-cuda, which also holds libtpu)")
    raise ImportError(
        f"audit(target={target!r}) compiles without the hardware through JAX's {extra} "
        f"plugin, which is not installed here ({module} not found). Install "
        f"jax[{extra}] at this JAX's version in its own environment: {where}.")


@functools.cache
def compile_device(target: str) -> Any:
  """A compile-only ``jax.Device`` for ``target`` (built once per process).

  Raises:
    ImportError: if the plugin the target needs is not installed.
    RuntimeError: if the plugin is installed but could not describe the target
      (for GPUs: the process's JAX initialised the CUDA backend and failed, which
      happens without a GPU unless ``JAX_PLATFORMS=cpu`` was set before JAX started).
  """
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  if is_tpu(target):
    _require("libtpu", "tpu", target)
    # Without a TPU VM, libtpu must not wait for the GCE metadata server.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    topology = topologies.get_topology_desc(
        topology_name=TPU_TARGETS[target], platform="tpu", chip_config_name="default",
        chips_per_host_bounds=(1, 1, 1), num_slices=1, wrap=(False, False, False))
  else:
    local = dtypes.default_device()
    if local.platform == "gpu" and gpu_spec_for(local.device_kind) is GPU_TARGETS[target]:
      # The target is the GPU here: compile for it, with the versions it really has.
      return local
    if not cuda_plugin_installed():
      _require(f"jax_plugins.xla_{CUDA_PLUGINS[0]}", CUDA_PLUGINS[0], target)
    try:
      topology = topologies.get_topology_desc(
          platform="cuda", target_config=GPU_TARGETS[target].target_config, topology="1x1x1")
    except NotImplementedError as e:
      raise RuntimeError(
          f"audit(target={target!r}): the CUDA plugin is installed but registered no "
          "compile-only topology, because JAX initialised it for a GPU and that failed. On "
          "a machine without a GPU set JAX_PLATFORMS=cpu before JAX starts (as "
          "benchmarks/gpu_report.py does).") from e
  return topology.devices[0]


def gpu_spec_for(device_kind: str) -> GpuSpec | None:
  """The :class:`GpuSpec` whose GPU has this ``device_kind``, if any (H100, A100, B200)."""
  kind = device_kind.lower()
  for name, spec in GPU_TARGETS.items():
    if name in kind:
      return spec
  return None


__all__ = (
    "CUDA_PLUGINS",
    "GPU_TARGETS",
    "TARGETS",
    "TPU_TARGETS",
    "GpuSpec",
    "check_target",
    "compile_device",
    "cuda_plugin_installed",
    "gpu_spec_for",
    "installed",
    "is_tpu",
)
