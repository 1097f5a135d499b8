"""Every notebook of the course runs top to bottom on local CPU engines.

Each notebook is executed once per session (``conftest.executed_notebook``); the claims its
text makes are checked on that same run in ``test_notebook_claims.py``.
"""
from __future__ import annotations

import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path):
    from conftest import executed_notebook
    nb, _ = executed_notebook(path)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
