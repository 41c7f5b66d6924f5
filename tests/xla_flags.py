"""The XLA flags the test suite compiles with, and the environment of its subprocesses.

The suite compiles a few thousand small XLA:CPU programs and runs most of them only a
few times, so most of its time is XLA compiling, and most of that is LLVM optimising
machine code that then runs for microseconds. Three flags shorten those compiles:

* ``--xla_cpu_use_fusion_emitters=false``: fusions go through XLA's elemental IR
  emitter instead of the MLIR fusion emitters, whose pipeline costs more per kernel;
* ``--xla_backend_optimization_level=0``: no LLVM optimisation of the generated code;
* ``--xla_cpu_max_isa=AVX``: no FMA instructions. Unoptimised code forms fused
  multiply-adds in some kernels and not in others, so two programs that compute the
  same operations (an optimizer wrapper and the same optimizer by hand, in
  ``tests/optim/test_state_dtypes.py``) would differ by an ulp; without FMA every
  multiply and add rounds on its own, in every program alike.

None of them changes what jaxmp traces (jaxprs, dtypes, values up to the FMA choice
above). The first also changes some of XLA:CPU's fusion decisions (one fp8 train step:
96 kernels instead of 111, the same ops and dtypes); the other two leave the optimized
HLO as it is. What tests read from compiled GPU and TPU programs comes from those
compilers' own pipelines. Measured on 2 idle cores: compiling one published model's
four train steps 10.3 s -> 2.2 s; the whole of ``make test``'s pytest 16:46 -> 6:48.

The root ``conftest.py`` appends :data:`FAST_COMPILE` to ``XLA_FLAGS`` before JAX
starts, unless ``XLA_FLAGS`` already names one of them (a run that wants XLA's defaults
sets ``XLA_FLAGS=--xla_backend_optimization_level=2``, say) or the installed XLA does
not know them (an unknown flag in ``XLA_FLAGS`` aborts the process, so a subprocess
that compiles one small program decides). pytest-xdist's workers inherit the variable.
"""

import os
import subprocess
import sys

FAST_COMPILE = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=0",
                "--xla_cpu_max_isa=AVX")

_PROBE = "import jax; jax.jit(lambda x: x * 3.0 + 1.0)(2.0).block_until_ready()"


def _names(flags: str) -> set:
  return {flag.split("=", 1)[0] for flag in flags.split()}


def _known_to_xla(flags: str) -> bool:
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                        timeout=120).returncode == 0


def use_fast_compile() -> str:
  """Appends :data:`FAST_COMPILE` to ``XLA_FLAGS`` (see the module docstring); returns it."""
  flags = os.environ.get("XLA_FLAGS", "")
  if not _names(flags) & _names(" ".join(FAST_COMPILE)):
    candidate = " ".join([flags, *FAST_COMPILE]).strip()
    if _known_to_xla(candidate):
      os.environ["XLA_FLAGS"] = flags = candidate
  return flags


def environ(*flags: str, **variables: str) -> dict:
  """A copy of ``os.environ`` with ``flags`` added to ``XLA_FLAGS`` and ``variables`` set.

  For subprocesses that need a flag of their own (eight CPU devices, say) and should
  compile as the rest of the suite does.
  """
  env = dict(os.environ, **variables)
  env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *flags]).strip()
  return env
