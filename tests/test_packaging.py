"""pyproject.toml is in the form current build tools read without deprecation warnings."""

import ast
import importlib.util
import sys

import pytest
from packaging.requirements import Requirement

from tests.doc_snippets import ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def test_the_license_is_an_spdx_expression():
  # setuptools deprecates `project.license` as a TOML table ({ text = ... }) and warns
  # on every build; an SPDX string (PEP 639) needs setuptools >= 77 to build.
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert pyproject["project"]["license"] == "Apache-2.0"
  assert "setuptools>=77" in pyproject["build-system"]["requires"]


def _third_party_imports() -> set[str]:
  """The top-level names of every non-stdlib module jaxmp's code imports (lazy ones too)."""
  found = set()
  for path in (ROOT / "jaxmp").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        found.update(alias.name.split(".")[0] for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
        found.add(node.module.split(".")[0])
  return found - set(sys.stdlib_module_names) - {"jaxmp", "__future__"}


def test_the_runtime_dependencies_are_what_jaxmp_imports():
  # A package jaxmp does not import belongs in an extra (chex: the tests'); one it
  # imports without declaring it would be missing from a user's install.
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  declared = {Requirement(r).name for r in pyproject["project"]["dependencies"]}
  assert declared == _third_party_imports()


def _lower_bounds_script():
  spec = importlib.util.spec_from_file_location("lower_bounds", ROOT / ".ci" / "lower_bounds.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_make_test_min_pins_each_runtime_dependency_at_its_lower_bound():
  pins = _lower_bounds_script().pins(ROOT / "pyproject.toml")
  dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
  assert [pin.split("==")[0] for pin in pins] == [Requirement(r).name for r in dependencies]
  for pin, requirement in zip(pins, dependencies):
    assert pin.split("==")[1] in requirement and f">={pin.split('==')[1]}" in requirement


@pytest.mark.parametrize("requirement, pin", [
    ("jax>=0.8.1", "jax==0.8.1"),
    ("numpy >= 2.0, <3", "numpy==2.0"),
    ("flax[all]>=0.12.0; python_version >= '3.10'", "flax==0.12.0"),
])
def test_a_lower_bound_becomes_a_pin(requirement, pin):
  assert _lower_bounds_script().lower_bound(requirement) == pin


@pytest.mark.parametrize("requirement", ["chex", "jax==0.8.1", "jax<1", "jax>=0.7,>=0.8"])
def test_a_dependency_without_one_lower_bound_is_refused(requirement):
  with pytest.raises(ValueError, match="lower bound"):
    _lower_bounds_script().lower_bound(requirement)


def test_the_readme_names_the_tested_lower_bounds():
  readme = " ".join((ROOT / "README.md").read_text().split())
  tested = readme.split("Tested versions:", 1)[1].split(". ", 1)[0]
  for pin in _lower_bounds_script().pins(ROOT / "pyproject.toml"):
    name, version = pin.split("==")
    assert f"{name} {version}" in tested, f"README's 'Tested versions' does not name {pin}"
