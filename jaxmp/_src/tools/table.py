"""Plain-text tables for the reports (summary, underflow, sensitivity, audit).

Example:
  >>> from jaxmp._src.tools import table
  >>> print(table.text_table(("name", "n"), [("a", "1"), ("bb", "22")], (False, True)))
  name   n
  ----  --
  a      1
  bb    22
"""

from __future__ import annotations

from collections.abc import Sequence


def text_table(header: Sequence[str], body: Sequence[Sequence[str]],
               right: Sequence[bool] | None = None) -> str:
  """A plain-text table: the header, a rule of dashes, then the rows.

  Columns are two spaces apart and as wide as their widest cell; a column whose
  ``right`` flag is set is right-aligned (numbers), the others left-aligned.
  """
  cells = [list(header)] + [list(row) for row in body]
  right = right or [False] * len(header)
  widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

  def line(row):
    return "  ".join(c.rjust(w) if r else c.ljust(w)
                     for c, w, r in zip(row, widths, right)).rstrip()

  lines = [line(row) for row in cells]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


__all__ = ("text_table",)
