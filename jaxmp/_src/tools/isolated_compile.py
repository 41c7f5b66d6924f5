"""Compiling a step in a child process, so that a crashing compiler takes only the child.

libtpu 0.0.42.1 overflows a worker thread's stack in its cost model while compiling some
large steps (a Llama-3-8B-shaped layer's fp8 and int8 train steps for TPU v7 at
2 x 4096 tokens): a SIGSEGV no Python code can catch, which ended the process that
called :func:`jaxmp.tools.audit` (and :func:`jaxmp.tools.recommend_precision` with
it). :func:`compile_in_child` compiles in a fresh interpreter instead:

1. the parent traces and lowers the step as usual (jaxmp's fp8 recipes decide there
   what their GEMMs lower to for the target) and exports the lowered module with
   ``jax.export`` (its pytree structure flattened, since static fields such as a
   ``TrainState``'s ``apply_fn`` cannot be pickled), with which arguments are donated;
2. ``python -m jaxmp._src.tools.isolated_compile IN OUT`` jits the exported module
   over the same abstract arguments on the compile-only device of the target,
   donating the same ones, compiles it with the same XLA options, and writes back the
   optimized HLO text, the cost analysis and the memory analysis: what the parent
   would have read from its own compile (the same HLO and figures: checked on TPU
   train steps);
3. a child that dies (a signal) or fails raises :class:`CompileCrashError` in the
   parent, naming the chip, the function and its largest arguments; the parent lives
   on.

A step that ``jax.export`` cannot export (a host callback, say) is compiled in the
parent as before (:func:`compile_in_child` returns None). The child costs a Python
start and a JAX import per compile, small beside a TPU compile.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import pickle
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax

from jaxmp._src.tools import memory as memory_lib
from jaxmp._src.tools import targets as targets_lib


class CompileCrashError(RuntimeError):
  """The compiler died (or failed) compiling a step, in the child process it ran in.

  :func:`jaxmp.tools.audit` compiles for a TPU in a child process, since libtpu can
  crash the process that compiles (libtpu 0.0.42.1: a stack overflow compiling a
  Llama-3-8B-shaped layer's int8 train step for v7 at 2 x 4096 tokens). The message
  names the chip, the function and its largest arguments; the caller goes on, and
  :func:`jaxmp.tools.recommend_precision` leaves such a candidate out.

  Example:
    >>> issubclass(jaxmp.tools.CompileCrashError, RuntimeError)
    True
  """


@dataclasses.dataclass(frozen=True)
class CompileResult:
  """What :func:`jaxmp.tools.audit` reads from a compiled step.

  Attributes:
    hlo: the optimized HLO text.
    cost: ``cost_analysis()``, a flat mapping (empty where the backend gives none).
    memory: ``memory_analysis()`` as a :class:`~jaxmp._src.tools.memory.CompiledMemory`,
      or None.
  """

  hlo: str
  cost: Mapping[str, float]
  memory: memory_lib.CompiledMemory | None


def read_compiled(compiled: jax.stages.Compiled) -> CompileResult:
  """The parts of ``compiled`` that :func:`jaxmp.tools.audit` reads."""
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  text = compiled.as_text()
  assert text is not None  # JAX types it Optional; a compiled executable has its HLO
  return CompileResult(text, {k: float(v) for k, v in cost.items()},
                       memory_lib.compiled_memory(compiled))


def describe_arguments(avals: Sequence[Any], shown: int = 4) -> str:
  """``"23 arrays, the largest f32[14336,4096], ..."``: a step's inputs, for a message."""
  largest = sorted(avals, key=lambda a: -a.size * a.dtype.itemsize)[:shown]
  return (f"{len(avals)} array{'s' if len(avals) != 1 else ''}, the largest "
          + ", ".join(a.str_short() for a in largest))


_CUSTOM_CALL = re.compile(r'custom_call @"?([\w.$-]+)')


def _export(jitted: Any, args: tuple, kwargs: dict, lowered: jax.stages.Lowered,
            platform: str) -> tuple[Any, tuple[bool, ...]] | None:
  """The step exported for the child, flat, and which inputs it donates; None if not
  exportable. Call it where ``lowered`` was traced (under the same fp8 target)."""
  # Whatever the module calls, jax.export may not vouch for (cuDNN, Mosaic, layout
  # constraints): the child compiles it at once, with this very JAX, so it need not.
  checks = [jax.export.DisabledSafetyCheck.custom_call(name)
            for name in sorted(set(_CUSTOM_CALL.findall(lowered.as_text())))]
  try:
    exported = jax.export.export(jitted, platforms=(platform,), disabled_checks=checks)(
        *args, **kwargs)
  except (ValueError, NotImplementedError, TypeError):
    return None  # e.g. a host callback: compiled in the parent instead
  donated = tuple(info.donated for info in jax.tree_util.tree_leaves(lowered.args_info))
  if len(donated) != len(exported.in_avals):
    return None
  flat = lambda n: jax.tree_util.tree_structure(tuple(range(n)))
  replaced = {"in_tree": jax.tree_util.tree_structure((tuple(range(len(donated))), {})),
              "out_tree": flat(len(exported.out_avals))}
  if "_get_vjp" in {f.name for f in dataclasses.fields(exported)}:
    replaced["_get_vjp"] = None  # a closure; the child differentiates nothing
  return dataclasses.replace(exported, **replaced), donated


def _child_environment() -> dict[str, str]:
  root = str(pathlib.Path(__file__).resolve().parents[3])  # the folder holding jaxmp/
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
  # The child only compiles: never the local accelerator (the caller may hold it), and
  # libtpu must not wait for a TPU VM's metadata server, nor for the lock file the
  # parent's libtpu holds (compiling needs no exclusive chip).
  env["JAX_PLATFORMS"] = "cpu"
  env.setdefault("TPU_SKIP_MDS_QUERY", "1")
  env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
  return env


def _failure(returncode: int, stderr: str) -> str:
  if returncode < 0:
    name = signal.Signals(-returncode).name
    overflow = " (a stack overflow)" if "STACK OVERFLOW" in stderr else ""
    return f"the compiler crashed with {name}{overflow}"
  lines = [line for line in stderr.strip().splitlines() if line.strip()]
  return f"the compile failed: {lines[-1] if lines else f'exit status {returncode}'}"


def compile_in_child(jitted: Any, args: tuple, kwargs: dict, lowered: jax.stages.Lowered,
                     target: str | None, device_kind: str,
                     compiler_options: Mapping[str, Any] | None,
                     command: Sequence[str] | None = None) -> CompileResult | None:
  """Compiles ``lowered`` (``jitted`` traced at ``args``, ``kwargs``) in a child process.

  Args:
    jitted: the jitted function; exported again from the trace cache (call this under
      the fp8 target ``lowered`` was traced under).
    args: its positional arguments, abstract, on the compile device.
    kwargs: its keyword arguments.
    lowered: ``jitted.trace(*args, **kwargs).lower()``.
    target: the :mod:`~jaxmp._src.tools.targets` name to compile for, or None for the
      child's own backend (the CPU).
    device_kind: the device compiled for, for messages.
    compiler_options: XLA options for the compile.
    command: the child's command line before its two file arguments (default: this
      module run by the current interpreter).

  Returns:
    The :class:`CompileResult`, or None if the step cannot be exported (compile it in
    this process).

  Raises:
    CompileCrashError: if the child dies or fails; the message names the chip, the
      function and its arguments' largest shapes, and the child's last words.
  """
  platform = "tpu" if target and targets_lib.is_tpu(target) else jax.devices()[0].platform
  prepared = _export(jitted, args, kwargs, lowered, platform)
  if prepared is None:
    return None
  exported, donated = prepared
  with tempfile.TemporaryDirectory(prefix="jaxmp-compile-") as folder:
    inputs, outputs = pathlib.Path(folder, "in.pickle"), pathlib.Path(folder, "out.pickle")
    inputs.write_bytes(pickle.dumps((exported, donated, target, dict(compiler_options or {}))))
    command = list(command or [sys.executable, "-m", __name__])
    done = subprocess.run([*command, str(inputs), str(outputs)], env=_child_environment(),
                          capture_output=True, text=True, check=False)
    if done.returncode != 0 or not outputs.exists():
      what = getattr(jitted, "__name__", type(jitted).__name__)
      raise CompileCrashError(
          f"audit(target={target!r}): {_failure(done.returncode, done.stderr)} compiling "
          f"{what} for {device_kind} ({target or platform}), whose arguments are "
          f"{describe_arguments(exported.in_avals)}. The compile ran in a child process, "
          "so this one goes on; a smaller step (fewer tokens per step, say) may compile.")
    return pickle.loads(outputs.read_bytes())


def _compile_exported(inputs: pathlib.Path, outputs: pathlib.Path) -> None:
  """The child: compiles the exported step in ``inputs``, writes a CompileResult."""
  exported, donated, target, options = pickle.loads(inputs.read_bytes())
  device = targets_lib.compile_device(target) if target else jax.devices()[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding, weak_type=a.weak_type)
           for a in exported.in_avals]
  donate = tuple(i for i, d in enumerate(donated) if d)
  step = jax.jit(lambda *flat: exported.call(*flat), donate_argnums=donate)
  compiled = step.trace(*avals).lower().compile(options or None)
  outputs.write_bytes(pickle.dumps(read_compiled(compiled)))


__all__ = ("CompileCrashError", "CompileResult", "compile_in_child", "describe_arguments",
           "read_compiled")


if __name__ == "__main__":
  # Through the module's own name, so that what the child pickles is
  # jaxmp._src.tools.isolated_compile.CompileResult, not __main__'s.
  from jaxmp._src.tools import isolated_compile  # pylint: disable=g-import-not-at-top
  isolated_compile._compile_exported(  # pylint: disable=protected-access
      pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
