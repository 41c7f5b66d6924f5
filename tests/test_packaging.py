"""pyproject.toml is in the form current build tools read without deprecation warnings."""

import pytest

from tests.doc_snippets import ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def test_the_license_is_an_spdx_expression():
  # setuptools deprecates `project.license` as a TOML table ({ text = ... }) and warns
  # on every build; an SPDX string (PEP 639) needs setuptools >= 77 to build.
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert pyproject["project"]["license"] == "Apache-2.0"
  assert "setuptools>=77" in pyproject["build-system"]["requires"]
