"""Prints pyproject.toml's runtime dependencies pinned at their lower bounds.

`make test-min` installs these pins (a requirements file, one `name==version` a line)
beside the dev extra, so the fast tests run on the oldest releases jaxmp claims to
support. pyproject.toml stays the one place the bounds are written: every runtime
dependency must be `name>=version` (optionally with more clauses, such as `,<2`);
anything else is refused, since it could not be pinned at a tested lower bound.

Usage: python .ci/lower_bounds.py [path/to/pyproject.toml]
"""

from __future__ import annotations

import pathlib
import sys

# pip vendors both parsers, so the script runs on any Python with pip (tomllib is 3.11+).
try:
  import tomllib
except ImportError:
  from pip._vendor import tomli as tomllib
try:
  from packaging.requirements import Requirement
except ImportError:
  from pip._vendor.packaging.requirements import Requirement


def lower_bound(requirement: str) -> str:
  """``name==version`` for a requirement ``name>=version`` (extras and markers dropped).

  Raises:
    ValueError: for a requirement without a ``>=`` lower bound.
  """
  parsed = Requirement(requirement)
  bounds = [spec.version for spec in parsed.specifier if spec.operator == ">="]
  if len(bounds) != 1:
    raise ValueError(f"{requirement!r} has no single '>=' lower bound; every runtime "
                     "dependency in pyproject.toml needs one, the oldest release `make "
                     "test-min` passes on")
  return f"{parsed.name}=={bounds[0]}"


def pins(pyproject: pathlib.Path) -> list[str]:
  """The lower-bound pins of ``pyproject``'s ``[project] dependencies``, in its order."""
  project = tomllib.loads(pyproject.read_text())["project"]
  return [lower_bound(requirement) for requirement in project["dependencies"]]


def main(argv: list[str]) -> int:
  root = pathlib.Path(__file__).resolve().parent.parent
  pyproject = pathlib.Path(argv[1]) if len(argv) > 1 else root / "pyproject.toml"
  try:
    print("\n".join(pins(pyproject)))
  except ValueError as e:
    print(f"{pyproject}: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
