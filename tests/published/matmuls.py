"""Counts the matmuls (dot_general, conv_general_dilated) of a jaxpr by operand dtypes."""

from __future__ import annotations

import collections
from typing import Any, Iterator

import numpy as np

from jaxmp._src.tools import summary

MATMUL_PRIMITIVES = ("dot_general", "conv_general_dilated")


def iter_matmuls(jaxpr: Any, only_in_scans: bool = False
                 ) -> Iterator[tuple[str, tuple[np.dtype, ...]]]:
  """Yields (primitive name, operand dtypes) for every matmul equation, nested ones too.

  A scan or while body is counted once, however many iterations it runs; of a
  ``lax.platform_dependent`` choice only the branch that runs here counts. With
  ``only_in_scans``, only the matmuls inside a scan's body (at any depth below it).
  """
  platform = summary.lowering_platform()

  def walk(jaxpr, inside):
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
      if eqn.primitive.name in MATMUL_PRIMITIVES and (inside or not only_in_scans):
        yield eqn.primitive.name, tuple(np.dtype(v.aval.dtype) for v in eqn.invars)
      for sub in summary.sub_jaxprs_that_run(eqn, platform):
        yield from walk(sub, inside or eqn.primitive.name == "scan")

  return walk(jaxpr, False)


def classify(dtypes: tuple[np.dtype, ...]) -> str:
  """'bfloat16', 'float16', 'float32', ... when all operands agree, else 'mixed:a,b'."""
  names = sorted({d.name for d in dtypes})
  return names[0] if len(names) == 1 else "mixed:" + ",".join(names)


def count_matmuls(jaxpr: Any, only_in_scans: bool = False) -> collections.Counter:
  """Counter of operand-dtype classes ('bfloat16', 'float32', 'mixed:...') over matmuls
  (with ``only_in_scans``, those inside a scan's body)."""
  return collections.Counter(classify(dtypes)
                             for _, dtypes in iter_matmuls(jaxpr, only_in_scans))


def describe_matmuls(jaxpr: Any) -> list[str]:
  """One line per matmul equation: primitive, operand shapes and dtypes."""
  lines = []
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in MATMUL_PRIMITIVES:
      operands = ", ".join(f"{np.dtype(v.aval.dtype).name}{list(v.aval.shape)}"
                           for v in eqn.invars)
      lines.append(f"{eqn.primitive.name}({operands})")
    for sub in summary.sub_jaxprs_that_run(eqn, summary.lowering_platform()):
      lines.extend(describe_matmuls(sub))
  return lines
