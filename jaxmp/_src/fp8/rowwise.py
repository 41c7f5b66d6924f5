"""Row-wise scaling: one scale per row of a GEMM operand along its contracted dimension.

:class:`~jaxmp.fp8.RowwiseScaling`'s operands (torchao's "rowwise"): a canonical
operand ``(B, R, C)`` gets one scale per row, from the row's own amax
(:func:`~jaxmp._src.fp8.grouped.scales`); the input and kernel in E4M3, the output
gradient in the recipe's ``gradient_format``. Its GEMM multiplies the fp8 operands
and rescales the product by the outer product of the row scales
(:func:`~jaxmp._src.fp8.scaled_gemm.outer_scaled_gemm`), as per-tensor operands and
:class:`~jaxmp.fp8.OperandRecipes` mixing the two do.

Example:
  >>> from jaxmp._src.fp8 import rowwise
  >>> recipe = jaxmp.fp8.RowwiseScaling(gradient_format="e5m2")
  >>> rowwise.grouping(recipe, "input"), rowwise.fp8_format(recipe, "output_grad")
  (Grouping(rows=1, cols=None), dtype(float8_e5m2))
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxmp._src.fp8 import grouped
from jaxmp._src.fp8 import quantize as q


def grouping(recipe: Any, role: str) -> grouped.Grouping:
  """One group per row (along the contracted dimension)."""
  del recipe, role
  return grouped.ROW


def fp8_format(recipe: Any, role: str) -> np.dtype:
  """E4M3 for the input and the kernel; the recipe's ``gradient_format`` for the gradient."""
  return q.role_format(role, recipe.gradient_format)


__all__ = ("fp8_format", "grouping")
