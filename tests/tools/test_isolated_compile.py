"""Compiling in a child process: the same compile, and a crash that ends only the child.

``jaxmp.tools.audit`` compiles TPU targets this way (libtpu 0.0.42.1 crashed the caller
compiling a Llama-3-8B-shaped layer's int8 step for v7 at 2 x 4096 tokens); here the
child compiles for its own CPU, which needs no plugin.
"""

import dataclasses
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp._src.tools import audit as audit_lib
from jaxmp._src.tools import isolated_compile


def _train_step(state, x):  # a donated state, a GEMM, a reduction: a small train step
  w, count = state
  loss, grad = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
  return (w - 0.1 * grad, count + 1), loss


STEP = jax.jit(_train_step, donate_argnums=0)
ARGS = ((jax.ShapeDtypeStruct((32, 16), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)),
        jax.ShapeDtypeStruct((64, 32), jnp.bfloat16))


def _in_child(command=None):
  lowered = STEP.trace(*ARGS).lower()
  return isolated_compile.compile_in_child(STEP, ARGS, {}, lowered, None, "cpu", None,
                                           command=command)


def test_a_step_compiled_in_a_child_reads_as_the_same_step_compiled_here():
  child = _in_child()
  here = isolated_compile.read_compiled(STEP.trace(*ARGS).lower().compile())
  assert child.memory == here.memory and child.memory.alias_bytes > 0  # donated there too
  assert child.cost == here.cost
  # The same GEMMs and kernels (only instruction names and the source locations the
  # HLO records differ).
  def read(result):
    report = audit_lib.analyze(result.hlo, "cpu")
    unnamed = lambda items: [dataclasses.replace(x, name="") for x in items]
    return unnamed(report.gemms), unnamed(report.kernels)

  assert read(child) == read(here) and read(child)[0]


@pytest.mark.parametrize("child, says", [
    # What libtpu printed before it died, then the signal.
    ("import os, signal, sys\n"
     "print('*** SIGSEGV STACK OVERFLOW (see go/cppstackoverflow) received', file=sys.stderr)\n"
     "os.kill(os.getpid(), signal.SIGSEGV)",
     "the compiler crashed with SIGSEGV (a stack overflow) compiling _train_step"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGABRT)",
     "the compiler crashed with SIGABRT compiling _train_step"),
    ("raise ValueError('RESOURCE_EXHAUSTED: out of memory')",
     "the compile failed: ValueError: RESOURCE_EXHAUSTED: out of memory compiling _train_step"),
    ("pass", "the compile failed: exit status 0"),  # wrote nothing back
], ids=["stack overflow", "abort", "error", "no result"])
def test_a_child_that_dies_raises_naming_the_chip_and_shapes_and_this_process_goes_on(
    child, says):
  with pytest.raises(isolated_compile.CompileCrashError) as e:
    _in_child(command=[sys.executable, "-c", child])
  assert says in str(e.value)
  assert ("for cpu (cpu), whose arguments are 3 arrays, the largest bfloat16[64,32], "
          "float32[32,16], int32[]") in str(e.value)
  assert isinstance(e.value, RuntimeError)
  assert float(jnp.sum(jnp.ones(3))) == 3.0  # this process goes on


def test_a_step_that_cannot_be_exported_is_left_to_this_process():
  # A host callback cannot leave the process: audit then compiles it here, as before.
  def with_callback(x):
    doubled = jax.pure_callback(lambda a: np.asarray(a) * 2,
                                jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return doubled + 1

  step = jax.jit(with_callback)
  x = jax.ShapeDtypeStruct((4,), jnp.float32)
  assert isolated_compile.compile_in_child(step, (x,), {}, step.trace(x).lower(), None,
                                           "cpu", None) is None


def test_arguments_are_described_by_count_and_largest_shapes():
  avals = [jax.core.ShapedArray(s, d) for s, d in
           [((4096, 14336), jnp.float32), ((2, 4096, 4096), jnp.bfloat16), ((), jnp.int32)]]
  assert isolated_compile.describe_arguments(avals, shown=2) == textwrap.dedent(
      "3 arrays, the largest float32[4096,14336], bfloat16[2,4096,4096]")
  assert isolated_compile.describe_arguments(avals[2:]) == "1 array, the largest int32[]"
