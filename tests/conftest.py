"""Shared fixtures: one lab per engine count for the whole session (starting engines costs
5–8 s on a 2-core machine), and the Agg backend for plots."""
from __future__ import annotations

import json
import pathlib

import matplotlib
import pytest

matplotlib.use("Agg")

_labs: dict[int, object] = {}


def lab_with(engines: int):
    """A started lab of ``engines`` local CPU engines, shared across tests; closed at exit."""
    import labkit

    lab = _labs.get(engines)
    if lab is None or lab.client is None:
        for other in list(_labs):          # keep at most one lab alive: 2 cores
            _labs.pop(other).close()
        lab = _labs[engines] = labkit.Lab.start(engines=engines, timeout=30, progress=False)
    return lab


def release_labs() -> None:
    """Close the shared labs (before something that starts its own engines)."""
    for engines in list(_labs):
        _labs.pop(engines).close()


@pytest.fixture
def lab2():
    return lab_with(2)


@pytest.fixture
def lab4():
    return lab_with(4)


SHARED = {"lab2": 2, "lab4": 4, "at_step_2": 2, "saved": 2}
"""Fixtures that use a shared lab, and its engines (``at_step_2`` and ``saved`` call lab_with)."""


def _engines(item) -> int:
    """The shared lab's engines ``item`` uses, 0 for none."""
    return max((SHARED[f] for f in getattr(item, "fixturenames", ()) if f in SHARED), default=0)


def pytest_collection_modifyitems(config, items):
    """Every test that uses a shared lab starts engines: it is ``slow`` (pyproject's marker),
    so ``-m "not slow"`` runs the pure layer alone. Tests that start their own engines or
    processes carry the mark themselves.

    The items are then grouped by the shared lab they use (none first, then 2 engines, then 4;
    the files' order kept inside each group): only one lab lives at a time on 2 cores, and each
    start costs 5–8 s, so running the 2- and 4-engine tests as the files interleave them started
    about thirty labs where two will do."""
    for item in items:
        if _engines(item):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_engines)


# -- notebooks: each executed once per session, shared by test_notebooks and test_notebook_claims
PROBE = "__labkit_probe__ "
_PROBE_CELL = f"""
import json as _json
def _plain(v):
    try:
        _json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False
_seen = {{}}
for _k, _v in dict(globals()).items():
    if _k.startswith("_"):
        continue
    if isinstance(_v, (int, float, str, list, tuple, dict)) and _plain(_v):
        _seen[_k] = _v
    elif isinstance(_v, dict) and _v and all(hasattr(_r, "metrics") for _r in _v.values()):
        _seen[_k + ".metrics"] = {{str(_n): _r.metrics for _n, _r in _v.items()}}   # runs by label
print({PROBE!r} + _json.dumps(_seen, default=float))
"""
_executed: dict[str, tuple] = {}


def executed_notebook(path):
    """(notebook with outputs, its JSON-able globals at the end) — run once per session.

    A notebook that fails raises the same error in every test that asks for it. The probe
    cell appended at the end reads the notebook's own variables (the numbers its text talks
    about) and is removed from the returned notebook.
    """
    import os

    import nbformat
    from nbclient import NotebookClient

    key = str(path)
    if key not in _executed:
        release_labs()                           # 2 cores: no shared lab alive beside the notebook's
        nb = nbformat.read(path, as_version=4)
        nb.cells.append(nbformat.v4.new_code_cell(_PROBE_CELL))
        old = os.environ.get("MPLBACKEND")
        os.environ["MPLBACKEND"] = "Agg"         # until the notebook's own %matplotlib line
        try:
            NotebookClient(nb, timeout=300, kernel_name="python3",
                           resources={"metadata": {"path": str(path.parent)}}).execute()
            probe = nb.cells.pop()
            if os.environ.get("LABKIT_EXECUTED_DIR"):      # keep the executed copy, to look at
                nbformat.write(nb, pathlib.Path(os.environ["LABKIT_EXECUTED_DIR"]) / path.name)
            text = "".join(o.get("text", "") for o in probe.outputs if o.get("name") == "stdout")
            _executed[key] = (nb, json.loads(text.split(PROBE, 1)[1]) if PROBE in text else {})
        except Exception as exc:             # noqa: BLE001 — kept and re-raised for every asker
            _executed[key] = exc
        finally:
            if old is None:
                os.environ.pop("MPLBACKEND", None)
            else:
                os.environ["MPLBACKEND"] = old
    result = _executed[key]
    if isinstance(result, Exception):
        raise result
    return result


def pytest_sessionfinish(session, exitstatus):
    for lab in _labs.values():
        lab.close()
    _labs.clear()
