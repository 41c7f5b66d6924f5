"""The docs pages' examples run as written, and the API reference covers every public module.

`make docs` builds the site (warnings and broken cross-references fail it); these tests
run the code the pages teach, which the build does not execute.
"""

import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxmp
from tests import doc_snippets
from tests import xla_flags
from tests.doc_snippets import ROOT
from tests.doc_snippets import snippet

DOCS = ROOT / "docs"


def _public_modules() -> set[str]:
  """``jaxmp``, its namespaces in ``__all__``, and their submodules in theirs."""
  names = {"jaxmp"}
  for name in jaxmp.__all__:
    module = getattr(jaxmp, name)
    if isinstance(module, types.ModuleType):
      names.add(module.__name__)
      names.update(getattr(module, n).__name__ for n in module.__all__
                   if isinstance(getattr(module, n), types.ModuleType))
  return names


def test_the_api_reference_documents_every_public_module():
  documented = set()
  for page in (DOCS / "api").glob("*.md"):
    documented.update(re.findall(r"^\.\. automodule:: (\S+)$", page.read_text(), re.M))
  public = _public_modules()
  assert {"jaxmp.linen", "jaxmp.fp8.state", "jaxmp.tools"} <= public  # the walk finds them
  assert documented == public, (sorted(public - documented), sorted(documented - public))


# Pages whose code takes long on 2 cores (every page still runs in `make test`): the
# diagnostics guide compiles its model 55 times for the sensitivity report, the sharding
# guide trains on 8 devices and checkpoints.
SLOW_PAGES = {"diagnostics.md", "sharding.md"}

# What each page's code must have left behind, checked after its last block.
AFTER_PAGE = {
    # The README's quickstart is checked in detail by tests/test_readme.py.
    "sharding.md": (
        "assert jax.device_count() == 8\n"
        "assert int(jaxmp.loss_scaling_metrics(optimizer.opt_state)['skipped_steps']) == 0\n"
        "assert int(optimizer.step[...]) == 2 and bool(jnp.isfinite(loss))\n"),
    "memory.md": "assert int(state.step) == 2 and {m.dtype for m in jax.tree.leaves(masters)} "
                 "== {jnp.dtype('float32')}\n",
    "policies.md": "assert logits.dtype == jnp.float32 and bool(jnp.isfinite(loss))\n",
}


def _page_id(page) -> str:
  return page.name


# The README's one block, the quickstart, runs in tests/test_readme.py, which checks what
# it computed; getting_started.md shows that block through an include (checked below).
RUN_BY_TEST_README = {"README.md", "getting_started.md"}


@pytest.mark.parametrize("page", [
    pytest.param(page, marks=[pytest.mark.slow] if page.name in SLOW_PAGES else [])
    for page in doc_snippets.PAGES if page.name not in RUN_BY_TEST_README], ids=_page_id)
def test_every_page_s_python_runs_as_written_in_order(page, tmp_path):
  # One fresh interpreter per page, as a reader pasting its blocks in order would have;
  # from the repository's root, on the CPU, temporary files (checkpoints) under tmp_path.
  blocks = doc_snippets.python_blocks(page)
  env = xla_flags.environ(JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join(
      [str(ROOT), os.environ.get("PYTHONPATH", "")]))
  result = subprocess.run(
      [sys.executable, "-m", "tests.doc_snippets", str(page), AFTER_PAGE.get(page.name, "")],
      env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT)
  assert result.returncode == 0, result.stderr[-6000:]
  ran = [line for line in result.stdout.splitlines() if line.startswith("doc block ")]
  assert len(ran) == len(blocks), (ran, blocks)


def test_every_page_with_python_is_run_and_blocks_name_known_requirements():
  pages_with_code = {p for p in [ROOT / "README.md", *DOCS.rglob("*.md")]
                     if "_build" not in p.parts and "```python" in p.read_text()}
  assert pages_with_code <= set(doc_snippets.PAGES), pages_with_code - set(doc_snippets.PAGES)
  blocks = [b for page in doc_snippets.PAGES for b in doc_snippets.python_blocks(page)]
  assert {b.needs for b in blocks} - {None} <= set(doc_snippets.REQUIREMENTS)
  # RUN_BY_TEST_README: the README's only block is its quickstart, and getting_started.md
  # shows that block through a MyST include.
  quickstart = snippet(ROOT / "README.md", "quickstart")
  for page in RUN_BY_TEST_README:
    (block,) = doc_snippets.python_blocks(next(p for p in doc_snippets.PAGES if p.name == page))
    assert block.path == ROOT / "README.md" and block.source == quickstart, page


@pytest.mark.parametrize("met, code, outcome", [
    (False, "1 / 0", "stopped as marked (divisor missing)"),  # unmet: stops for its reason
    (True, "x = 1", "ran"),                                   # met: runs as any block
    (False, "x = 1", "but it ran: remove the marker"),        # unmet, yet it ran
    (False, "raise ZeroDivisionError('odd')", "another ZeroDivisionError: odd"),  # not why
    (False, "int('a')", "invalid literal"),                   # another error: raised as is
])
def test_a_marked_block_runs_only_if_its_marker_s_reason_holds(monkeypatch, tmp_path, met,
                                                               code, outcome):
  monkeypatch.setitem(doc_snippets.REQUIREMENTS, "divisor", doc_snippets.Requirement(
      lambda: met, ZeroDivisionError, "division by zero"))
  page = tmp_path / "page.md"
  page.write_text(f"Text.\n\n<!-- needs: divisor (why) -->\n```python\n{code}\n```\n\n"
                  "```python\nafter = 2\n```\n")
  if outcome.startswith(("stopped", "ran")):
    assert doc_snippets.run_page(page, "assert after == 2") == [
        f"{page}:5: {outcome}", f"{page}:9: ran"]
  else:
    with pytest.raises(ValueError if "literal" in outcome else AssertionError,
                       match=re.escape(outcome)):
      doc_snippets.run_page(page)


def test_nnx_float16_attention_still_needs_the_float32_rule_the_policies_guide_shows():
  # The guide states an XLA:CPU limit, upstream of jaxmp (Flax NNX's attention alone):
  # when XLA lifts it, this fails, and the guide's paragraph goes.
  q = jnp.ones((2, 8, 4, 16), jnp.float16)
  attention = lambda q: jnp.sum(nnx.dot_product_attention(q, q, q).astype(jnp.float32))
  assert jax.grad(attention)(q).dtype == jnp.float16  # eagerly it runs
  with pytest.raises(ValueError, match="F16_F16_F32' is not supported by dot_general on CPU"):
    jax.jit(jax.grad(attention))(q)


@pytest.mark.parametrize("page", ["README.md", "docs/demo.md"])
def test_the_demo_figure_quoted_in_the_prose_is_the_table_s(page):
  # The unscaled float16 run's validation loss against float32's, in the table and in
  # the "Honestly" sentence under it.
  text = (ROOT / page).read_text()
  row = re.search(r"^float16, no loss scaling +\S+ +\S+ +(\S+%)", text, re.M)
  quoted = re.search(r"short, small run \(`(\S+%)`\)", text)
  assert row and quoted and quoted.group(1) == row.group(1), (row, quoted)
