"""Every name the docs and docstrings point to exists.

A cross-reference to a module that moved reads fine and leads nowhere. Two forms are
checked: dotted names starting with ``jaxmp.`` anywhere in the package, the docs, the
examples, the benchmarks and the tests (``:func:`jaxmp._src.fp8.maxgrad.max_float32```,
``jaxmp.tools.audit``); and docs/ARCHITECTURE.md's short form, a path under
``jaxmp/_src/`` followed by attributes (```fp8/support.lowering```,
```engine.Call.run```, ```tools/``` ), wherever its first part is a module or folder
of ``_src``.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
from typing import Any, Optional

REPO = pathlib.Path(__file__).resolve().parent.parent
SRC = REPO / "jaxmp" / "_src"
_DOTTED = re.compile(r"\bjaxmp(?:\.[A-Za-z_][A-Za-z0-9_]*)+")

_MISSING = object()


def _attribute(obj: Any, name: str) -> Any:
  """``obj.name``; a dataclass field or annotated class attribute without a default counts."""
  value = getattr(obj, name, _MISSING)
  if value is _MISSING and name in (getattr(obj, "__dataclass_fields__", None) or {}):
    return None
  if value is _MISSING and name in (getattr(obj, "__annotations__", None) or {}):
    return None
  return value


def _resolve(module: str, attributes: list[str]) -> Optional[str]:
  """Why ``module`` with ``attributes`` does not resolve, or None when it does."""
  obj = importlib.import_module(module)
  for i, name in enumerate(attributes):
    if obj is None:  # a field without a default: its attributes are not checked
      return None
    obj = _attribute(obj, name)
    if obj is _MISSING:
      return f"{'.'.join([module] + attributes[:i])} has no attribute {name!r}"
  return None


def _dotted_problem(name: str) -> Optional[str]:
  """Why the ``jaxmp.``-dotted ``name`` names nothing, or None."""
  parts = name.split(".")
  for end in range(len(parts), 0, -1):
    module = ".".join(parts[:end])
    relative = pathlib.Path(*parts[1:end]) if end > 1 else pathlib.Path()
    base = REPO / "jaxmp" / relative
    if end == 1 or base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
      return _resolve(module, parts[end:])
  return None  # not reached: "jaxmp" itself is a module


def _sources() -> list[pathlib.Path]:
  this = pathlib.Path(__file__).resolve()
  files = [REPO / "README.md", REPO / "CONTRIBUTING.md"]
  files += sorted((REPO / "docs").rglob("*.md"))
  for folder in ("jaxmp", "examples", "benchmarks", "tests"):
    files += sorted((REPO / folder).rglob("*.py"))
  return [f for f in files if f.is_file() and f.resolve() != this]


def test_every_dotted_jaxmp_name_exists():
  problems = []
  for path in _sources():
    for number, line in enumerate(path.read_text().splitlines(), 1):
      for name in dict.fromkeys(_DOTTED.findall(line)):
        problem = _dotted_problem(name)
        if problem:
          problems.append(f"{path.relative_to(REPO)}:{number}: {name}: {problem}")
  assert not problems, "\n".join(problems)


def _architecture_references() -> list[str]:
  """ARCHITECTURE.md's inline code spans (outside code blocks)."""
  text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
  text = re.sub(r"```.*?```", "", text, flags=re.S)
  return list(dict.fromkeys(re.findall(r"`([^`\n]+)`", text)))


def _short_problem(reference: str) -> Optional[str]:
  """Why ARCHITECTURE.md's ``reference`` (``fp8/support.lowering``) names nothing, or None.

  The path is under ``jaxmp/_src/``, else under ``jaxmp/`` (the Layers table's
  ``_src/tree.py``, ``linen.py``). References whose first part is no module or folder
  there are not this form.
  """
  match = re.fullmatch(r"((?:[a-z0-9_]+/)*)([a-z0-9_]*)(\.py)?((?:\.[A-Za-z_][A-Za-z0-9_]*)*)",
                       reference)
  if match is None:
    return None
  folders, stem, py, attributes = match.groups()
  first = folders.split("/")[0] if folders else f"{stem}.py"
  bases = [base for base in (SRC, SRC.parent) if (base / first).exists()]
  if not bases or (bases[0] == SRC.parent and not folders and not py):
    return None  # not a path (``apply``, ``nnx.Cache``, ``tests/test_layers.py``)
  base = bases[0]
  if not stem:
    return None if (base / folders).is_dir() else f"no folder {base.relative_to(REPO)}/{folders}"
  if not (base / folders / f"{stem}.py").is_file():
    return f"no module {base.relative_to(REPO)}/{folders}{stem}.py"
  parts = list(base.relative_to(REPO).parts) + [f for f in folders.split("/") if f]
  module = ".".join(parts + ([] if stem == "__init__" else [stem]))
  return _resolve(module, [a for a in attributes.split(".") if a])


def _src_classes() -> dict[str, list[type]]:
  """Every class defined in a ``jaxmp/_src`` module, by name."""
  classes: dict[str, list[type]] = {}
  for path in sorted(SRC.rglob("*.py")):
    parts = path.relative_to(SRC.parent.parent).with_suffix("").parts
    module = importlib.import_module(".".join(p for p in parts if p != "__init__"))
    for value in vars(module).values():
      if isinstance(value, type) and value.__module__ == module.__name__:
        classes.setdefault(value.__name__, []).append(value)
  return classes


def _assigned_in_methods(cls: type, attribute: str) -> bool:
  """Whether a method of ``cls`` assigns ``self.<attribute>``."""
  return re.search(rf"\bself\.{attribute}\s*(:[^=\n]*)?=(?!=)", inspect.getsource(cls)) is not None


def _class_problem(reference: str, classes: dict[str, list[type]]) -> Optional[str]:
  """Why ARCHITECTURE.md's ``Class.attribute`` (``Call.attention_rules_reached``) names
  nothing, or None; references of another form are not checked here."""
  match = re.fullmatch(r"([A-Z][A-Za-z0-9_]*)((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", reference)
  if match is None:
    return None
  name, attributes = match.group(1), [a for a in match.group(2).split(".") if a]
  if name not in classes:
    return f"no class {name} in jaxmp/_src"
  for cls in classes[name]:
    if len(attributes) == 1 and _assigned_in_methods(cls, attributes[0]):
      return None  # an instance attribute (``self.records = ...``)
    obj: Any = cls
    for attribute in attributes:
      obj = None if obj is None else _attribute(obj, attribute)
      if obj is _MISSING:
        break
    else:
      return None
  return f"no class {name} in jaxmp/_src has {'.'.join(attributes)}"


def test_architecture_md_names_what_exists():
  classes = _src_classes()
  problems = [f"`{reference}`: {problem}" for reference in _architecture_references()
              if (problem := _short_problem(reference) or _class_problem(reference, classes))]
  assert not problems, "\n".join(problems)


def test_a_class_attribute_named_without_its_module_is_checked_too():
  classes = _src_classes()
  assert _class_problem("Call.attention_rules_reached", classes) is None
  assert _class_problem("Call.causal_rules_reached", classes) == (
      "no class Call in jaxmp/_src has causal_rules_reached")
  assert _class_problem("NoSuchClass.x", classes) == "no class NoSuchClass in jaxmp/_src"
  checked = [r for r in _architecture_references() if re.fullmatch(r"[A-Z]\w*(\.\w+)+", r)]
  assert len(checked) > 10


def test_the_checks_report_a_moved_name():
  assert _dotted_problem("jaxmp._src.fp8.maxgrad.max_float32") is None
  assert _dotted_problem("jaxmp." + "_src.maxgrad.max_float32") == (
      "jaxmp._src has no attribute 'maxgrad'")
  assert _short_problem("engine.Call.run") is None
  assert _short_problem("_src/tree.py") is None
  assert _short_problem("engine.Call.runs") == "jaxmp._src.engine.Call has no attribute 'runs'"
  assert _short_problem("fp8/compiled.lowering") == "no module jaxmp/_src/fp8/compiled.py"
  assert _short_problem("lax.cond") is None  # not a jaxmp path
  checked = [r for r in _architecture_references() if re.match(r"[a-z0-9_/]+[./]", r)
             and _short_problem(r + ".no_such_name") is not None]
  assert len(checked) > 50  # the check reads the document's references, not nothing
