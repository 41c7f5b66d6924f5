"""chex's tree assertions with the dtype check that chex's value checks leave out.

``chex.assert_trees_all_equal`` and ``chex.assert_trees_all_close`` compare structures
and values (NaN equals NaN, -0.0 equals 0.0) but read a bfloat16 leaf as float32 before
comparing, so a bfloat16 leaf passes against a float32 one of the same values even with
``strict=True``. Tests that promise dtypes too use these; tests that promise bit
patterns (-0.0, NaN payloads) compare bytes themselves.
"""

import chex


def assert_trees_equal(*trees, what: str | None = None) -> None:
  """Same structure, leaf shapes and dtypes, and exactly equal values."""
  chex.assert_trees_all_equal_shapes_and_dtypes(*trees, custom_message=what)
  chex.assert_trees_all_equal(*trees, custom_message=what)


def assert_trees_close(*trees, rtol: float, atol: float = 0.0, what: str | None = None) -> None:
  """Same structure, leaf shapes and dtypes, and values within ``atol + rtol * |b|``."""
  chex.assert_trees_all_equal_shapes_and_dtypes(*trees, custom_message=what)
  chex.assert_trees_all_close(*trees, rtol=rtol, atol=atol, custom_message=what)
