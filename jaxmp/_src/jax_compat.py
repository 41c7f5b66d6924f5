"""The one place that knows which JAX is installed: private modules and moved APIs.

jaxmp supports the JAX releases ``pyproject.toml`` allows, and ``make test-min`` runs
the fast tests on the oldest of them. What differs between those releases, and every
use of a module JAX does not promise to keep (``jax._src``, ``jaxlib``'s Triton and
MLIR bindings, an experimental API that was renamed), is reached through this module
and nowhere else (``tests/test_layers.py`` refuses such an import anywhere else).
Each piece has a probe that imports it and checks the names jaxmp uses, and each
caller has a fallback for a JAX without it:

======================================  ==============================================
the piece (probe)                       without it
======================================  ==============================================
Pallas' Triton lowering and Triton's    ``BlockScaling`` GEMMs on Hopper use the chip's
``tt.dot(max_num_imprecise_acc=)``      next kernel (Mosaic GPU), or dequantized
(:func:`pallas_triton`)                 operands (the fp8 fallback warning says why)
Pallas' Mosaic GPU back end with the     fp8 operands are quantized by XLA's fusions
register layouts and transposed refs     (the same values); the fused quantization
the fused quantization uses              kernel reports itself unavailable
(:func:`pallas_mosaic_gpu`)
layout constraints                      fp8 operands on Hopper keep XLA's layout
(:func:`row_major`)                     (slower, same values); :class:`JaxVersionWarning`
Pallas' Mosaic GPU API (the names      ``BlockScaling`` GEMMs on Hopper use the chip's
the kernel uses: :func:`mosaic_gpu`)    next kernel, or dequantized operands (the
                                        fp8 fallback warning says why)
Mosaic GPU's interpreter                ``block_gemm_mosaic.gemm(interpret=True)``
(:func:`mosaic_gpu_interpreter`)        raises ``NotImplementedError`` naming it
the CUDA plugin's cuDNN version         no claim either way: MXFP8 GEMMs are taken to
(:func:`cudnn_version`)                 run on Blackwell; :class:`JaxVersionWarning`
the extended-dtype protocol             none: the fp8 state's max-accumulating dtype
(:func:`extended_dtypes`)               cannot be built, and its first use raises
                                        ``ImportError`` saying so (a sum in its place
                                        would make wrong scales silently)
======================================  ==============================================

A probe answers once per process (the installed JAX does not change). Nothing is
imported or registered with JAX when jaxmp is imported: each probe runs on first use.

Example:
  >>> from jaxmp._src import jax_compat
  >>> jax_compat.jax_version()
  'jax ... (jaxlib ...)'
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any
from typing import NamedTuple

import jax


class JaxVersionWarning(UserWarning):
  """A jaxmp feature is unavailable with the installed JAX, and jaxmp falls back.

  The message names the missing piece, the installed version and what runs instead.
  """


def jax_version() -> str:
  """The installed ``jax`` and ``jaxlib`` versions, for messages."""
  import jaxlib  # pylint: disable=g-import-not-at-top

  return f"jax {jax.__version__} (jaxlib {getattr(jaxlib, '__version__', 'unknown')})"


def warn_unavailable(piece: str, fallback: str, stacklevel: int = 2) -> None:
  """Warns (:class:`JaxVersionWarning`) that ``piece`` is missing and ``fallback`` runs.

  The message is the same each time for one piece, so Python's warning filter shows it
  once (per place it is reported from) rather than once per traced layer.

  Args:
    piece: what the installed JAX lacks.
    fallback: what jaxmp does instead.
    stacklevel: as for ``warnings.warn``, counted from the caller of this function.

  Example:
    >>> from jaxmp._src import jax_compat
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   jax_compat.warn_unavailable("a thing", "another thing runs")
    >>> "another thing runs" in str(caught[0].message)
    True
  """
  warnings.warn(f"jaxmp: {jax_version()} has no {piece}; {fallback}.", JaxVersionWarning,
                stacklevel=stacklevel + 1)


# --- Pallas' Triton lowering: the block-scaled fp8 kernel's dot. ------------------------


class PallasTriton(NamedTuple):
  """The private pieces the block-scaled fp8 kernel's dot is built from."""

  lowering: Any  # jax._src.pallas.triton.lowering: register_lowering, _zeros
  tt: Any  # jaxlib.triton.dialect: dot (with max_num_imprecise_acc), trans
  ir: Any  # jaxlib.mlir.ir: RankedTensorType, F32Type


PALLAS_TRITON = ("Pallas Triton internals (jax._src.pallas.triton.lowering, "
                 "jaxlib.triton's tt.dot with max_num_imprecise_acc)")
"""How messages name what :func:`pallas_triton` looks for."""


@functools.cache
def pallas_triton() -> PallasTriton | None:
  """Pallas' Triton lowering module and the Triton/MLIR bindings, or ``None``.

  ``None`` where an import fails, or where the lowering module lacks
  ``register_lowering`` or ``_zeros``, or Triton's ``tt.dot`` takes no
  ``max_num_imprecise_acc`` (the kernel's dot needs all of them; Pallas has no public
  way to set it). Pallas' Triton back end is deprecated from jax 0.11.
  """
  try:
    from jax._src.pallas.triton import lowering  # pylint: disable=g-import-not-at-top
    from jaxlib.mlir import ir  # pylint: disable=g-import-not-at-top
    from jaxlib.triton import dialect as tt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  usable = (callable(getattr(lowering, "register_lowering", None))
            and callable(getattr(lowering, "_zeros", None))
            and callable(getattr(tt, "dot", None))
            and "max_num_imprecise_acc" in inspect.signature(tt.dot).parameters)
  return PallasTriton(lowering, tt, ir) if usable else None


# --- Pallas' Mosaic GPU back end: the fused fp8 quantization kernel. -------------------


PALLAS_MOSAIC_GPU_NAMES = ("BlockSpec", "CompilerParams", "GMEM", "Layout", "SwizzleTransform",
                           "TilingTransform", "layout_cast", "transpose_ref")
"""What the fused quantization kernel uses of ``jax.experimental.pallas.mosaic_gpu``."""
PALLAS_MOSAIC_GPU_NAMES_TEXT = ("jax.experimental.pallas.mosaic_gpu with "
                                + ", ".join(PALLAS_MOSAIC_GPU_NAMES)
                                + " and Layout.WGMMA_TRANSPOSED")
"""How messages name what :func:`pallas_mosaic_gpu` looks for."""


@functools.cache
def pallas_mosaic_gpu() -> Any | None:
  """``jax.experimental.pallas.mosaic_gpu``, or ``None`` where it lacks what jaxmp uses.

  The module calls its own API "highly unstable"; ``None`` where the import fails, where
  a name of :data:`PALLAS_MOSAIC_GPU_NAMES` is missing, or where its ``Layout`` has no
  ``WGMMA`` and ``WGMMA_TRANSPOSED`` (the register layouts between which a warpgroup
  transposes a tile with one shuffle).

  Example:
    >>> from jaxmp._src import jax_compat
    >>> jax_compat.pallas_mosaic_gpu() is None or hasattr(jax_compat.pallas_mosaic_gpu(), "kernel")
    True
  """
  try:
    from jax.experimental.pallas import mosaic_gpu  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  usable = (all(hasattr(mosaic_gpu, name) for name in PALLAS_MOSAIC_GPU_NAMES)
            and all(hasattr(mosaic_gpu.Layout, name) for name in ("WGMMA", "WGMMA_TRANSPOSED")))
  return mosaic_gpu if usable else None
# --- Pallas Mosaic GPU: the block-scaled fp8 kernel for Hopper. -------------------------


MOSAIC_GPU = "Pallas Mosaic GPU API (jax.experimental.pallas.mosaic_gpu) with the names jaxmp uses"
"""How messages name what :func:`mosaic_gpu` looks for."""

MOSAIC_GPU_NAMES = ("kernel", "emit_pipeline_warp_specialized", "BlockSpec", "ACC", "SMEM",
                    "wgmma", "wgmma_wait", "transpose_ref", "layout_cast", "Layout",
                    "TilingTransform", "SwizzleTransform", "find_swizzle", "planar_snake",
                    "commit_smem", "copy_smem_to_gmem", "wait_smem_to_gmem")
"""The names of ``jax.experimental.pallas.mosaic_gpu`` the kernel is written with."""

MOSAIC_GPU_INTERPRETER = ("Mosaic GPU interpreter (jax._src.pallas.mosaic_gpu.interpret"
                          ".params.InterpretGPUParams)")
"""How messages name what :func:`mosaic_gpu_interpreter` looks for."""


@functools.cache
def mosaic_gpu() -> Any:
  """``jax.experimental.pallas.mosaic_gpu``, or ``None`` where it lacks a name jaxmp uses.

  Pallas' Mosaic GPU API is experimental ("can change weekly", its docstring says):
  the probe checks every name of :data:`MOSAIC_GPU_NAMES`.
  """
  try:
    from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return plgpu if all(hasattr(plgpu, name) for name in MOSAIC_GPU_NAMES) else None


@functools.cache
def mosaic_gpu_interpreter() -> Any:
  """Mosaic GPU's interpreter parameters class (``InterpretGPUParams``), or ``None``.

  Private in jax 0.10.2: it runs a Mosaic GPU kernel on the CPU, simulating its
  warpgroups, shared memory, TMA copies and barriers.
  """
  try:
    from jax._src.pallas.mosaic_gpu.interpret import params  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return getattr(params, "InterpretGPUParams", None)


# --- Layout constraints: fp8 operands written in their own layout on Hopper. -----------


@functools.cache
def _layout_api() -> tuple[Any, Any] | None:
  """``(with_layout_constraint, Layout)`` (JAX 0.7's names), or ``None``."""
  try:
    from jax.experimental.layout import Layout  # pylint: disable=g-import-not-at-top
    from jax.experimental.layout import with_layout_constraint  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return with_layout_constraint, Layout


def row_major(x: jax.Array) -> jax.Array:
  """``x`` constrained to the row-major layout; unconstrained without the layout API.

  Without ``jax.experimental.layout.with_layout_constraint`` XLA keeps its own choice
  (the same values; on Hopper fp8 steps run slower) and :class:`JaxVersionWarning`
  says so.

  Example:
    >>> from jaxmp._src import jax_compat
    >>> jax.jit(jax_compat.row_major)(jnp.ones((2, 3))).shape
    (2, 3)
  """
  api = _layout_api()
  if api is None:
    warn_unavailable("layout constraints (jax.experimental.layout.with_layout_constraint)",
                     "fp8 GEMM operands keep XLA's layout choice, which on Hopper GPUs "
                     "costs an extra pass over each weight")
    return x
  with_layout_constraint, layout = api
  return with_layout_constraint(x, layout(tuple(range(x.ndim))))


# --- The cuDNN version: whether MXFP8 GEMMs run on Blackwell. ---------------------------


@functools.cache
def _cuda_versions() -> tuple[bool, Any]:
  """``(found, module)``: ``jax._src.lib.cuda_versions`` (``None`` without a CUDA plugin)."""
  try:
    from jax._src.lib import cuda_versions  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False, None
  return True, cuda_versions


def cudnn_version() -> int | None:
  """The installed cuDNN's version number (``91000`` for 9.10), or ``None`` if unknown.

  Unknown without a CUDA plugin (nothing to say), or where this JAX no longer has the
  private module that reports it (then :class:`JaxVersionWarning` says that MXFP8
  support is assumed rather than checked).
  """
  found, cuda_versions = _cuda_versions()
  if not found:
    warn_unavailable("cuDNN version query (jax._src.lib.cuda_versions)",
                     "MXFP8 GEMMs are assumed to run on Blackwell GPUs (they need cuDNN "
                     ">= 9.10)")
    return None
  if cuda_versions is None:
    return None
  try:
    return int(cuda_versions.cudnn_get_version())
  except Exception:  # pylint: disable=broad-except
    return None  # the plugin could not load cuDNN: no claim either way


# --- The extended-dtype protocol: the fp8 state's max-accumulating dtype. -------------


class ExtendedDtypes(NamedTuple):
  """The private pieces :mod:`jaxmp._src.fp8.maxgrad` builds its dtype from."""

  ExtendedDType: type  # jax._src.dtypes.ExtendedDType, the base class
  core: Any  # jax._src.core: ShapedArray, physical_aval
  ad_util: Any  # jax._src.ad_util: raw_jaxval_adders
  earray: Any  # jax._src.earray: EArray
  pxla: Any  # jax._src.interpreters.pxla: global_result_handlers


@functools.cache
def extended_dtypes() -> ExtendedDtypes | None:
  """JAX's extended-dtype protocol (as typed PRNG keys use it), or ``None``.

  Not public API; Flax's ``fp8_ops.fm32`` relies on the same protocol.
  """
  try:
    from jax._src import ad_util  # pylint: disable=g-import-not-at-top
    from jax._src import core  # pylint: disable=g-import-not-at-top
    from jax._src import dtypes  # pylint: disable=g-import-not-at-top
    from jax._src import earray  # pylint: disable=g-import-not-at-top
    from jax._src.interpreters import pxla  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  needed = ((dtypes, "ExtendedDType"), (core, "physical_aval"), (core, "ShapedArray"),
            (ad_util, "raw_jaxval_adders"), (earray, "EArray"),
            (pxla, "global_result_handlers"))
  if not all(hasattr(module, name) for module, name in needed):
    return None
  return ExtendedDtypes(dtypes.ExtendedDType, core, ad_util, earray, pxla)


__all__ = (
    "PALLAS_MOSAIC_GPU_NAMES",
    "PALLAS_MOSAIC_GPU_NAMES_TEXT",
    "MOSAIC_GPU",
    "MOSAIC_GPU_INTERPRETER",
    "MOSAIC_GPU_NAMES",
    "PALLAS_TRITON",
    "ExtendedDtypes",
    "JaxVersionWarning",
    "PallasTriton",
    "cudnn_version",
    "extended_dtypes",
    "jax_version",
    "pallas_mosaic_gpu",
    "mosaic_gpu",
    "mosaic_gpu_interpreter",
    "pallas_triton",
    "row_major",
    "warn_unavailable",
)
