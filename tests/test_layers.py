"""The layering of jaxmp's modules: a contract that every import keeps.

:data:`LAYERS` is the contract, lowest layer first. Each layer lists its modules as
paths under ``jaxmp/`` (a folder ending in ``/`` stands for every module in it). A
module imports only modules of its own layer or lower ones; within a layer whose
``among`` is False its entries (the fp8 core and optim; the linen and NNX adapters)
import nothing of each other; no code in ``jaxmp/_src`` imports a public face
(``jaxmp``, ``jaxmp.fp8``, ...); and the imports between jaxmp's modules have no
cycle. Every import counts, at module level or inside a function: a lazy import is
still a dependency, and it would close a cycle as surely as an eager one (the two
left, tools importing the NNX adapter when given an NNX model, point down). The check
reads the source with ``ast``: nothing is imported, and an ``importlib`` import by a
computed name is not seen (the one there is, ``jaxmp.__getattr__`` loading the other
faces, stays among the faces).

docs/ARCHITECTURE.md's "Layers" table states the same contract; a test below keeps the
two equal, so a move that changes a module's layer changes both.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import shutil
from typing import Iterator, Optional

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "jaxmp"
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"


@dataclasses.dataclass(frozen=True)
class Layer:
  """One layer of the contract.

  Attributes:
    name: how messages and docs/ARCHITECTURE.md name it.
    entries: its modules, as paths under ``jaxmp/``; a folder (ending in ``/``) is
      every module in it.
    among: whether its entries may import each other (within one entry, a folder,
      modules always may).
  """

  name: str
  entries: tuple[str, ...]
  among: bool


LAYERS = (
    Layer("core", ("_src/__init__.py", "_src/checks.py", "_src/dtypes.py",
                   "_src/dynamic_loss_scale.py", "_src/jax_compat.py", "_src/loss_scale.py",
                   "_src/loss_scaling.py", "_src/paths.py", "_src/policy.py", "_src/pytree.py",
                   "_src/sharding.py", "_src/swaps.py", "_src/tree.py"), among=True),
    Layer("fp8 core, optim", ("_src/fp8/", "_src/optim/"), among=False),
    Layer("engine", ("_src/adapter.py", "_src/attention.py", "_src/engine.py",
                     "_src/float32_ops.py", "_src/nonfinite.py", "_src/rules.py",
                     "_src/step.py"), among=True),
    Layer("adapters", ("_src/linen/", "_src/nnx/"), among=False),
    Layer("tools", ("_src/tools/",), among=True),
    Layer("faces", ("__init__.py", "fp8/", "linen.py", "nnx.py", "optim.py", "tools.py"),
          among=True),
)
"""The contract, lowest layer first (docs/ARCHITECTURE.md's "Layers" table)."""


@dataclasses.dataclass(frozen=True)
class Import:
  """One import of a jaxmp module by another."""

  importer: str
  imported: str
  where: str  # "jaxmp/_src/x.py:12"
  lazy: bool  # inside a function


def modules(package: pathlib.Path) -> dict[str, pathlib.Path]:
  """Every module of ``package`` (a ``jaxmp/`` folder) by dotted name."""
  found = {}
  for path in sorted(package.rglob("*.py")):
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    found[".".join(parts)] = path
  return found


def _known(name: str, known: dict[str, pathlib.Path]) -> Optional[str]:
  """The module ``name`` loads: itself, or the longest enclosing module that exists."""
  parts = name.split(".")
  for end in range(len(parts), 0, -1):
    if ".".join(parts[:end]) in known:
      return ".".join(parts[:end])
  return None


def _import_nodes(tree: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
  """Every import statement of a module, with whether it sits inside a function."""
  stack = [(tree, False)]
  while stack:
    node, lazy = stack.pop()
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node, lazy
    inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def imports(package: pathlib.Path) -> list[Import]:
  """Every import of one module of ``package`` by another, in file and line order."""
  known = modules(package)
  found = []
  for name, path in known.items():
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text(), str(path))
    for node, lazy in _import_nodes(tree):
      if isinstance(node, ast.Import):
        targets = [_known(alias.name, known) for alias in node.names]
      else:
        base = node.module or ""
        if node.level:
          base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
        # ``from a import b`` loads module a.b when there is one, else a.
        targets = [_known(f"{base}.{alias.name}", known) for alias in node.names]
      where = f"{path.relative_to(package.parent)}:{node.lineno}"
      found += [Import(name, target, where, lazy) for target in dict.fromkeys(targets)
                if target is not None and target != name]
  return sorted(found, key=lambda i: (i.where.split(":")[0], int(i.where.split(":")[1])))


def _entry_matches(entry: str, relative: str) -> bool:
  return relative.startswith(entry) if entry.endswith("/") else relative == entry


def placement(package: pathlib.Path, layers=LAYERS) -> tuple[dict[str, tuple[int, str]],
                                                            list[str]]:
  """Each module's (layer index, entry), and the problems of placing them."""
  placed, problems = {}, []
  used = set()
  for name, path in modules(package).items():
    relative = path.relative_to(package).as_posix()
    matches = [(i, entry) for i, layer in enumerate(layers) for entry in layer.entries
               if _entry_matches(entry, relative)]
    used.update(entry for _, entry in matches)
    if not matches:
      problems.append(f"jaxmp/{relative} is in no layer: add it to LAYERS in "
                      f"tests/test_layers.py and to the Layers table of docs/ARCHITECTURE.md")
    elif len(matches) > 1:
      problems.append(f"jaxmp/{relative} is in more than one layer entry: {matches}")
    else:
      placed[name] = matches[0]
  problems += [f"LAYERS names {entry!r} ({layer.name}), which holds no module"
               for layer in layers for entry in layer.entries if entry not in used]
  return placed, problems


def _is_face(module: str) -> bool:
  return not (module == "jaxmp._src" or module.startswith("jaxmp._src."))


def _cycles(edges: list[Import]) -> list[tuple[list[Import], set[str]]]:
  """A shortest cycle through each group of modules that import each other in a circle.

  The groups are the strongly connected components of the import graph (Tarjan's
  algorithm); each comes with the imports of one cycle through its first module.
  """
  graph: dict[str, dict[str, Import]] = {}
  for edge in edges:
    graph.setdefault(edge.importer, {}).setdefault(edge.imported, edge)
    graph.setdefault(edge.imported, {})
  index, low, on_stack, stack, groups = {}, {}, set(), [], []

  def connect(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for successor in graph[node]:
      if successor not in index:
        connect(successor)
        low[node] = min(low[node], low[successor])
      elif successor in on_stack:
        low[node] = min(low[node], index[successor])
    if low[node] == index[node]:
      group = set()
      while True:
        member = stack.pop()
        on_stack.discard(member)
        group.add(member)
        if member == node:
          break
      if len(group) > 1:
        groups.append(group)

  for node in sorted(graph):
    if node not in index:
      connect(node)
  cycles = []
  for group in groups:
    start = min(group)
    # The shortest way back to ``start`` within the group (breadth first).
    paths = {start: []}
    frontier = [start]
    cycle = None
    while frontier and cycle is None:
      following = []
      for node in frontier:
        for successor, edge in sorted(graph[node].items()):
          if successor not in group:
            continue
          if successor == start:
            cycle = paths[node] + [edge]
            break
          if successor not in paths:
            paths[successor] = paths[node] + [edge]
            following.append(successor)
        if cycle is not None:
          break
      frontier = following
    cycles.append((cycle, group))
  return cycles


def check(package: pathlib.Path, layers=LAYERS) -> list[str]:
  """Every way the imports of ``package`` break the contract, one sentence each."""
  placed, problems = placement(package, layers)
  edges = imports(package)
  for edge in edges:
    if edge.importer not in placed or edge.imported not in placed:
      continue
    (mine, my_entry), (theirs, their_entry) = placed[edge.importer], placed[edge.imported]
    how = " (inside a function)" if edge.lazy else ""
    if not _is_face(edge.importer) and _is_face(edge.imported):
      problems.append(f"{edge.where}: {edge.importer} imports the public {edge.imported}"
                      f"{how}; code in jaxmp._src imports jaxmp._src modules only (the public "
                      f"modules re-export them)")
    elif theirs > mine:
      problems.append(f"{edge.where}: {edge.importer} ({layers[mine].name}) imports "
                      f"{edge.imported} ({layers[theirs].name}){how}, a higher layer; a "
                      f"module imports only its own layer and those below")
    elif theirs == mine and my_entry != their_entry and not layers[mine].among:
      problems.append(f"{edge.where}: {edge.importer} imports {edge.imported}{how}, but "
                      f"{my_entry} and {their_entry} ({layers[mine].name}) import nothing of "
                      f"each other")
  for cycle, group in _cycles(edges):
    names = " -> ".join([cycle[0].importer] + [edge.imported for edge in cycle])
    lines = ", ".join(edge.where + (" (inside a function)" if edge.lazy else "")
                      for edge in cycle)
    others = sorted(group - {edge.importer for edge in cycle})
    more = f"; {', '.join(others)} are in the same circle" if others else ""
    problems.append(f"import cycle: {names} ({lines}){more}")
  return problems


FRAMEWORK_FREE = ("core", "fp8 core, optim", "engine")
"""The layers that import nothing of Flax: what they know of a framework, the adapters
tell them (``jaxmp._src.adapter.Adapter``)."""

FRAMEWORKS = ("flax",)


def framework_imports(package: pathlib.Path, layers=LAYERS) -> list[str]:
  """Every import of a framework (Flax) by a module of a :data:`FRAMEWORK_FREE` layer."""
  placed, _ = placement(package, layers)
  found = []
  for name, path in modules(package).items():
    if name not in placed or layers[placed[name][0]].name not in FRAMEWORK_FREE:
      continue
    tree = ast.parse(path.read_text(), str(path))
    where = lambda node: (f"{path.relative_to(package.parent)}:{node.lineno}: {name} "
                          f"({layers[placed[name][0]].name})")
    for node, lazy in _import_nodes(tree):
      names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
               else [node.module or ""] if not node.level else [])
      for imported in names:
        if imported.split(".")[0] in FRAMEWORKS:
          how = " (inside a function)" if lazy else ""
          found.append(f"{where(node)} imports {imported}{how}; only the adapters and above "
                       f"import a framework")
    for node in ast.walk(tree):
      looked_up = _sys_modules_key(node)
      if looked_up is not None and looked_up.split(".")[0] in FRAMEWORKS:
        found.append(f"{where(node)} looks {looked_up} up in sys.modules; only the adapters "
                     f"and above know a framework")
  return found


def _sys_modules_key(node: ast.AST) -> Optional[str]:
  """The constant key of a ``sys.modules.get(key)`` or ``sys.modules[key]``, else None."""
  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
    target, key = node.func.value if node.func.attr == "get" else None, (
        node.args[0] if node.args else None)
  elif isinstance(node, ast.Subscript):
    target, key = node.value, node.slice
  else:
    return None
  if (isinstance(target, ast.Attribute) and target.attr == "modules"
      and isinstance(target.value, ast.Name) and target.value.id == "sys"
      and isinstance(key, ast.Constant) and isinstance(key.value, str)):
    return key.value
  return None


def test_the_layers_below_the_adapters_import_no_framework():
  problems = framework_imports(PACKAGE)
  assert not problems, "\n".join(problems)


def test_a_planted_framework_import_is_reported(tmp_path):
  package = tmp_path / "jaxmp"
  shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
  assert framework_imports(package) == []
  path = package / "_src" / "rules.py"
  lines = len(path.read_text().splitlines())
  path.write_text(path.read_text() + "\ndef _later():\n  from flax import nnx\n"
                  "  return sys.modules.get('flax.nnx')\n")
  assert framework_imports(package) == [
      f"jaxmp/_src/rules.py:{lines + 3}: jaxmp._src.rules (engine) imports flax (inside a "
      f"function); only the adapters and above import a framework",
      f"jaxmp/_src/rules.py:{lines + 4}: jaxmp._src.rules (engine) looks flax.nnx up in "
      f"sys.modules; only the adapters and above know a framework"]


JAX_COMPAT = "jaxmp._src.jax_compat"
"""The one module that imports what JAX does not promise to keep between releases."""

PRIVATE_JAX = ("jax._src", "jaxlib", "jax.experimental")
"""Module prefixes only :data:`JAX_COMPAT` imports: JAX's private modules, jaxlib's
bindings (Triton, MLIR), and experimental APIs, which have been renamed between the
releases jaxmp supports (``jax.experimental.layout``'s ``DeviceLocalLayout``)."""

STABLE_EXPERIMENTAL = ("jax.experimental.pallas", "jax.experimental.topologies")
"""Experimental modules imported elsewhere: Pallas' public API (``pallas_call``,
``BlockSpec``, ``pallas.triton.CompilerParams``) and deviceless topologies, the same at
every release ``make test-min`` and ``make test`` run. A new experimental import goes
through :data:`JAX_COMPAT` unless both runs show it there too."""


def _is_private_jax(imported: str) -> bool:
  inside = lambda name, prefix: name == prefix or name.startswith(prefix + ".")
  return (any(inside(imported, prefix) for prefix in PRIVATE_JAX)
          and not any(inside(imported, prefix) for prefix in STABLE_EXPERIMENTAL))


def private_jax_imports(package: pathlib.Path) -> list[str]:
  """Every import of a :data:`PRIVATE_JAX` module by a module other than :data:`JAX_COMPAT`."""
  found = []
  for name, path in modules(package).items():
    if name == JAX_COMPAT:
      continue
    for node, lazy in _import_nodes(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif node.level:
        continue
      else:  # ``from a import b``: module a.b, or name b of a (``from jax import _src``)
        names = [f"{node.module}.{alias.name}" for alias in node.names]
      for imported in dict.fromkeys(n for n in names if _is_private_jax(n)):
        how = " (inside a function)" if lazy else ""
        found.append(f"{path.relative_to(package.parent)}:{node.lineno}: {name} imports "
                     f"{imported}{how}; only {JAX_COMPAT} imports JAX's private or moved "
                     f"modules")
        break
  return sorted(found, key=lambda line: (line.split(":")[0], int(line.split(":")[1])))


def test_only_jax_compat_imports_private_jax_modules():
  problems = private_jax_imports(PACKAGE)
  assert not problems, "\n".join(problems)


@pytest.mark.parametrize("code, imported", [
    ("from jax._src import core", "jax._src.core"),
    ("def _later():\n  import jaxlib.triton.dialect", "jaxlib.triton.dialect"),
    ("from jax import _src", "jax._src"),
    ("from jax.experimental.layout import Layout", "jax.experimental.layout.Layout"),
    ("from jax.experimental import layout", "jax.experimental.layout"),
])
def test_a_planted_private_jax_import_is_reported(tmp_path, code, imported):
  package = tmp_path / "jaxmp"
  shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
  assert private_jax_imports(package) == []
  path = package / "_src" / "fp8" / "scaled_gemm.py"
  line = len(path.read_text().splitlines()) + 1 + len(code.splitlines())
  path.write_text(path.read_text() + "\n" + code + "\n")
  how = " (inside a function)" if "def " in code else ""
  assert private_jax_imports(package) == [
      f"jaxmp/_src/fp8/scaled_gemm.py:{line}: jaxmp._src.fp8.scaled_gemm imports {imported}"
      f"{how}; only jaxmp._src.jax_compat imports JAX's private or moved modules"]


def test_the_imports_keep_the_contract():
  problems = check(PACKAGE)
  assert not problems, "\n".join(problems)


def _architecture_layers() -> tuple[Layer, ...]:
  """The "Layers" table of docs/ARCHITECTURE.md, as :class:`Layer` rows."""
  text = ARCHITECTURE.read_text()
  section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
  rows = [line for line in section.splitlines()
          if line.startswith("| ") and not line.startswith("| ---")]
  assert rows and rows[0].startswith("| layer |"), (
      "docs/ARCHITECTURE.md's Layers section has no table starting '| layer |'")
  layers = []
  for row in rows[1:]:
    name, entries, among = [cell.strip() for cell in row.strip().strip("|").split("|")]
    assert among in ("yes", "no"), f"{row!r}: the last column is 'yes' or 'no'"
    layers.append(Layer(re.sub(r"^\d+\.\s*", "", name), tuple(re.findall(r"`([^`]+)`",
                                                                         entries)),
                        among == "yes"))
  return tuple(layers)


def test_architecture_md_states_the_contract():
  assert _architecture_layers() == LAYERS


# ---- the checker finds what it should ----------------------------------------------------


def _planted(tmp_path: pathlib.Path, relative: str, code: str) -> list[str]:
  """The problems of a copy of the package with ``code`` appended to ``relative``."""
  package = tmp_path / "jaxmp"
  shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
  path = package / relative
  path.write_text((path.read_text() if path.exists() else "") + "\n" + code + "\n")
  return check(package)


def test_the_copy_without_a_plant_keeps_the_contract(tmp_path):
  assert _planted(tmp_path, "_src/dtypes.py", "") == []


@pytest.mark.parametrize("relative, code, expected", [
    ("_src/fp8/recipes.py", "from jaxmp._src.tools import audit",
     "jaxmp/_src/fp8/recipes.py:{line}: jaxmp._src.fp8.recipes (fp8 core, optim) imports "
     "jaxmp._src.tools.audit (tools), a higher layer"),
    ("_src/fp8/recipes.py", "from ..tools import audit as audit_lib",
     "jaxmp/_src/fp8/recipes.py:{line}: jaxmp._src.fp8.recipes (fp8 core, optim) imports "
     "jaxmp._src.tools.audit (tools), a higher layer"),
    ("_src/engine.py", "def _later():\n  from jaxmp._src.linen import wrapper",
     "jaxmp/_src/engine.py:{line}: jaxmp._src.engine (engine) imports "
     "jaxmp._src.linen.wrapper (adapters) (inside a function), a higher layer"),
    ("_src/loss_scaling.py", "import jaxmp._src.rules",
     "jaxmp/_src/loss_scaling.py:{line}: jaxmp._src.loss_scaling (core) imports "
     "jaxmp._src.rules (engine), a higher layer"),
    ("_src/nnx/train.py", "from jaxmp._src.linen import train as linen_train",
     "jaxmp/_src/nnx/train.py:{line}: jaxmp._src.nnx.train imports jaxmp._src.linen.train, "
     "but _src/nnx/ and _src/linen/ (adapters) import nothing of each other"),
    ("_src/optim/kahan.py", "from jaxmp._src.fp8 import quantize",
     "jaxmp/_src/optim/kahan.py:{line}: jaxmp._src.optim.kahan imports "
     "jaxmp._src.fp8.quantize, but _src/optim/ and _src/fp8/ (fp8 core, optim) import "
     "nothing of each other"),
    ("_src/tools/hardware.py", "from jaxmp import fp8",
     "jaxmp/_src/tools/hardware.py:{line}: jaxmp._src.tools.hardware imports the public "
     "jaxmp.fp8; code in jaxmp._src imports jaxmp._src modules only"),
    ("_src/tools/summary.py", "import jaxmp",
     "jaxmp/_src/tools/summary.py:{line}: jaxmp._src.tools.summary imports the public jaxmp;"),
    ("_src/dtypes.py", "def _later():\n  from jaxmp._src import tree",
     "import cycle: jaxmp._src.dtypes -> jaxmp._src.tree -> jaxmp._src.dtypes "
     "(jaxmp/_src/dtypes.py:{line} (inside a function), jaxmp/_src/tree.py:"),
    ("_src/extra.py", "X = 1",
     "jaxmp/_src/extra.py is in no layer: add it to LAYERS in tests/test_layers.py"),
])
def test_a_planted_import_is_reported(tmp_path, relative, code, expected):
  original = PACKAGE / relative
  line = (len(original.read_text().splitlines()) if original.exists() else 0) + 1 + len(
      code.splitlines())
  problems = _planted(tmp_path, relative, code)
  expected = expected.format(line=line)
  assert any(p.startswith(expected) for p in problems), (expected, problems)


def test_a_cycle_is_reported_once_with_each_import():
  edges = [Import("m.a", "m.b", "m/a.py:3", False), Import("m.b", "m.c", "m/b.py:4", True),
           Import("m.c", "m.a", "m/c.py:5", False), Import("m.c", "m.d", "m/c.py:6", False)]
  assert [([e.where for e in cycle], group) for cycle, group in _cycles(edges)] == [
      (["m/a.py:3", "m/b.py:4", "m/c.py:5"], {"m.a", "m.b", "m.c"})]
