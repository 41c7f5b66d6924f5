"""The Python blocks of the README and the docs pages that tests run as written."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def snippet(path: pathlib.Path, name: str) -> str:
  """The Python block between ``<!-- name: begin -->`` and ``<!-- name: end -->`` in ``path``."""
  text = path.read_text()
  marked = re.search(rf"<!-- {name}: begin[^>]*-->(.*?)<!-- {name}: end -->", text, re.S)
  assert marked, f"{path.relative_to(ROOT)} has no block marked <!-- {name}: begin/end -->"
  blocks = re.findall(r"```python\n(.*?)```", marked.group(1), re.S)
  assert len(blocks) == 1, f"expected one Python block between the {name} markers"
  return blocks[0]


def first_block_after(path: pathlib.Path, heading: str) -> str:
  """The first Python block after the line ``heading`` of ``path``."""
  text = path.read_text()
  start = text.index(heading + "\n")
  return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)
