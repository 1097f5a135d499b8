"""Shared fixtures: one lab per engine count for the whole session (starting engines costs
~10 s each on a 2-core machine), and the Agg backend for plots."""
from __future__ import annotations

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


def pytest_collection_modifyitems(config, items):
    """Every test that uses a shared lab starts engines: it is ``slow`` (pyproject's marker),
    so ``-m "not slow"`` runs the pure layer alone. Tests that start their own engines or
    processes carry the mark themselves."""
    for item in items:
        if {"lab2", "lab4"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def pytest_sessionfinish(session, exitstatus):
    for lab in _labs.values():
        lab.close()
    _labs.clear()
