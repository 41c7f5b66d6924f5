"""jaxmp ships its type hints (PEP 561): ``py.typed`` is in the package and its data."""

import importlib.resources
import pathlib

import pytest


def test_py_typed_is_in_the_package():
  assert importlib.resources.files("jaxmp").joinpath("py.typed").is_file()


def test_py_typed_is_package_data():
  # What setuptools puts into the wheel and sdist besides the .py files.
  tomllib = pytest.importorskip("tomllib")  # Python 3.11+
  pyproject = pathlib.Path(__file__).parent.parent / "pyproject.toml"
  config = tomllib.loads(pyproject.read_text())
  assert "py.typed" in config["tool"]["setuptools"]["package-data"]["jaxmp"]
