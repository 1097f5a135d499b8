"""The playground in a real JupyterLab, driven by headless Chromium through Playwright.

Starts ``jupyter lab`` on a free port (a copy of the notebook in a temp folder, so autosave
never writes outputs into the repository), runs all its cells as a trainer does (the last is
``# lab.close()``, commented, so Run All leaves the playground open), moves the micro-batch slider with the keyboard, and checks that the ipympl timeline redrew and
the metrics text changed. Screenshots land in tests/artifacts/ (git-ignored).

Needs Debian's ``chromium`` at /usr/bin/chromium (``.ci/run`` installs it); skips without it.

    python -m pytest tests/test_browser.py
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "05_playground.ipynb"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"

pytestmark = [
    pytest.mark.slow, pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Debian's chromium at {CHROMIUM}"),
]

# Page-side helpers: the notebook panel, and the state of its code cells.
PANEL = "window.jupyterapp.shell.currentWidget"
CELLS_STATE = f"""() => {{
  const cells = {PANEL}.content.widgets.filter(c => c.model.type === 'code');
  return cells.map(c => ({{
    count: c.model.executionCount,
    errors: c.model.outputs.toJSON().filter(o => o.output_type === 'error')
                                    .map(o => o.ename + ': ' + o.evalue)}}));
}}"""
CANVAS_PIXELS = """() => {
  const c = document.querySelector('.labkit-timeline canvas') ||
            document.querySelector('.jupyter-matplotlib-figure canvas');
  return c ? c.toDataURL() : null;
}"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab server over a temp copy of the playground; yields (base url, token)."""
    try:
        from conftest import release_labs
        release_labs()                     # 2 cores: no shared lab beside the notebook's engines
    except ImportError:
        pass
    root = tmp_path / "notebooks"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    port, token = _free_port(), secrets.token_hex(8)
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
         f"--port={port}", f"--IdentityProvider.token={token}", "--LabApp.expose_app_in_browser=True",
         "--LabApp.news_url=None", f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
         f"--ServerApp.root_dir={root}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_server(url, token, server, tmp_path / "jupyterlab.log")
        yield url, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def _wait_for_server(url: str, token: str, server, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"jupyter lab exited ({server.returncode}):\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"jupyter lab did not answer within {timeout} s:\n{log.read_text()[-2000:]}")


def _poll(page, what: str, check, timeout: float, every: float = 0.5):
    """Call ``check()`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        page.wait_for_timeout(every * 1000)


def _cells_ran(page, upto: int):
    """True once the first ``upto`` code cells have run; fails on a cell error."""
    cells = page.evaluate(CELLS_STATE)
    errors = [e for c in cells[:upto] for e in c["errors"]]
    assert not errors, f"a notebook cell failed: {errors}"
    return all(c["count"] is not None for c in cells[:upto])


def _status(page) -> str:
    # text_content, not inner_text: JupyterLab leaves an output scrolled out of view unrendered
    return page.locator(".labkit-status").text_content()


def _last_done_run(page) -> int:
    """The number of the last run the status line reports done (0 while none is)."""
    found = re.search(r"run (\d+) done", _status(page))
    return int(found.group(1)) if found else 0


def test_playground_slider_redraws_the_timeline_in_jupyterlab(jupyterlab):
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    url, token = jupyterlab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1024, "height": 1100})      # a trainer's laptop
        try:
            _drive(page, f"{url}/lab/tree/{NOTEBOOK.name}?token={token}")
        finally:
            page.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)
            _close_lab(page)
            browser.close()


def _drive(page, address: str) -> None:
    page.goto(address)
    page.wait_for_function(f"() => window.jupyterapp && {PANEL} && {PANEL}.sessionContext && "
                           f"{PANEL}.context.path.endsWith('{NOTEBOOK.name}')", timeout=90_000)
    page.evaluate(f"async () => {{ await {PANEL}.sessionContext.ready; }}")
    news = page.locator(".jp-Notification-Toast-Close")         # "get Jupyter news?" toast
    if news.count():
        news.first.click()
    code_cells = len(page.evaluate(CELLS_STATE))
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")     # Run All
    _poll(page, "the notebook's cells to run", lambda: _cells_ran(page, code_cells), timeout=300)
    assert "closed" not in _status(page), _status(page)       # Run All must not close the playground
    before_run = _poll(page, "a finished run in the status line", lambda: _last_done_run(page), timeout=120)
    page.locator(".labkit-timeline").scroll_into_view_if_needed()
    before_pixels = _poll(page, "the ipympl timeline canvas", lambda: page.evaluate(CANVAS_PIXELS), timeout=60)
    before_metrics = page.locator(".labkit-metrics").inner_text()
    slider = page.locator(".labkit-microbatches")
    before_value = slider.locator(".widget-readout").inner_text()

    slider.locator(".noUi-handle").focus()
    page.keyboard.press("ArrowRight")                     # micro-batches 1 → 2

    _poll(page, "the slider to move", lambda: slider.locator(".widget-readout").inner_text() != before_value,
          timeout=10)
    _poll(page, "a new run to finish", lambda: _last_done_run(page) > before_run, timeout=120)
    _poll(page, "the timeline to redraw", lambda: page.evaluate(CANVAS_PIXELS) != before_pixels, timeout=30)
    after_metrics = _poll(page, "the metrics to change",
                          lambda: (t := page.locator(".labkit-metrics").inner_text()) != before_metrics and t,
                          timeout=30)
    assert f"run {_last_done_run(page)}" in after_metrics
    assert "cannot run" not in _status(page) and "failed" not in _status(page)


def _close_lab(page) -> None:
    """Run ``lab.close()`` in the kernel (the notebook's last cell holds it commented), then
    shut the kernel down: no engines left behind."""
    try:
        page.evaluate(f"async () => {{ const k = {PANEL}.sessionContext.session.kernel; "
                      "await k.requestExecute({code: 'lab.close()'}).done; }")
        page.evaluate(f"async () => {{ await {PANEL}.sessionContext.shutdown(); }}")
    except Exception as exc:          # the server's own shutdown stops the kernel anyway
        print(f"closing the notebook's lab: {exc}", file=sys.stderr)
