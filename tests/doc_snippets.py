"""The Python blocks of the README and the docs pages, and a runner for a page's code.

A page's Python blocks, pasted in order into one interpreter, must run: ``python -m
tests.doc_snippets PAGE`` does that (each block executed in one namespace, the
page's own line numbers in tracebacks) and is what ``tests/test_docs.py`` runs for
every page, one process per page.

A block that cannot run everywhere says why in a marker on the line above its fence,
``<!-- needs: NAME (a sentence for the reader) -->``, with ``NAME`` one of
:data:`REQUIREMENTS`. The runner still runs it: where the requirement is met, as any
block; where it is not, the block must stop with the error the requirement names (so
the marker's reason is checked, and everything before that line runs), and the page
goes on with the next block.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The Markdown pages whose Python blocks run as written (tests/test_docs.py).
PAGES = (ROOT / "README.md", ROOT / "docs" / "getting_started.md",
         *sorted((ROOT / "docs" / "guides").glob("*.md")))

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
_NEEDS = re.compile(r"<!-- needs: (\S+)")
_INCLUDE_OPTION = re.compile(r"^:([\w-]+): (.*)$", re.M)


@dataclasses.dataclass(frozen=True)
class Requirement:
  """What a ``<!-- needs: NAME -->`` block needs, and how it fails without it.

  Attributes:
    met: whether this environment has it.
    error: the exception the block stops with where it is not met.
    says: a text that error's message contains.
  """

  met: Callable[[], bool]
  error: type[BaseException]
  says: str


def _cuda_plugin_installed() -> bool:
  from jaxmp._src.tools import targets  # pylint: disable=g-import-not-at-top
  return targets.cuda_plugin_installed()


REQUIREMENTS = {
    # jaxmp.tools.audit(..., target="h100") compiles through JAX's CUDA plugin.
    "cuda-plugin": Requirement(_cuda_plugin_installed, ImportError, "plugin, which is not "
                               "installed here (jax_plugins.xla_cuda12 not found)"),
}


@dataclasses.dataclass(frozen=True)
class Block:
  """One Python block of a page.

  Attributes:
    path: the file it is written in (an included file's, for a MyST ``{include}``).
    line: the line of that file its code starts on.
    source: the code.
    needs: the requirement its ``<!-- needs: -->`` marker names, or None.
  """

  path: pathlib.Path
  line: int
  source: str
  needs: str | None


def _blocks_in(path: pathlib.Path, text: str, first_line: int) -> list[Block]:
  blocks = []
  for fence in _FENCE.finditer(text):
    language, body = fence.group(1).strip(), fence.group(2)
    line = first_line + text.count("\n", 0, fence.start(2))
    if language == "python":
      before = text[:fence.start()].rstrip().rsplit("\n", 1)[-1]
      needs = _NEEDS.search(before)
      blocks.append(Block(path, line, body, needs.group(1) if needs else None))
    elif language.startswith("{include}"):
      blocks += _included_blocks(path, language, body)
  return blocks


def _included_blocks(path: pathlib.Path, directive: str, body: str) -> list[Block]:
  """The Python blocks of what a MyST ``{include}`` directive brings into the page."""
  included = (path.parent / directive.removeprefix("{include}").strip()).resolve()
  options = dict(_INCLUDE_OPTION.findall(body))
  text = included.read_text()
  start = 0
  if "start-after" in options:
    start = text.index(options["start-after"]) + len(options["start-after"])
  end = text.index(options["end-before"], start) if "end-before" in options else len(text)
  return _blocks_in(included, text[start:end], 1 + text.count("\n", 0, start))


def python_blocks(path: pathlib.Path) -> list[Block]:
  """Every Python block of the page at ``path``, included ones too, in order."""
  return _blocks_in(path, path.read_text(), 1)


def run_page(path: pathlib.Path, then: str = "") -> list[str]:
  """Runs the page's Python blocks in order in one namespace, then ``then``.

  Returns one line per block saying how it ran. Raises what a block raises, except a
  marked block's documented error where its requirement is not met; an
  ``AssertionError`` if such a block runs through or stops otherwise.
  """
  namespace = {"__name__": "__main__"}
  ran = []
  for block in python_blocks(path):
    shown = block.path.relative_to(ROOT) if block.path.is_relative_to(ROOT) else block.path
    where = f"{shown}:{block.line}"
    # Blank lines in front, so that a traceback points at the page's own line.
    code = compile("\n" * (block.line - 1) + block.source, str(block.path), "exec")
    requirement = REQUIREMENTS[block.needs] if block.needs else None
    if requirement is None or requirement.met():
      exec(code, namespace)  # pylint: disable=exec-used
      ran.append(f"{where}: ran")
      continue
    try:
      exec(code, namespace)  # pylint: disable=exec-used
    except requirement.error as e:
      assert requirement.says in str(e), (
          f"{where} is marked as needing {block.needs}; it stopped with another "
          f"{type(e).__name__}: {e}")
      ran.append(f"{where}: stopped as marked ({block.needs} missing)")
    else:
      raise AssertionError(f"{where} is marked as needing {block.needs}, which is missing "
                           "here, but it ran: remove the marker.")
  exec(compile(then, "<then>", "exec"), namespace)  # pylint: disable=exec-used
  return ran


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


if __name__ == "__main__":
  # python -m tests.doc_snippets PAGE [CODE]: run PAGE's blocks, then CODE.
  for line in run_page(pathlib.Path(sys.argv[1]).resolve(), *sys.argv[2:3]):
    print(f"doc block {line}", flush=True)
