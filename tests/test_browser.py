"""What a learner sees in JupyterLab, in a real browser: a launch's bars end on "done", a widget's Run button draws its
plot in place, a failed widget run, a wrong exercise answer and a stopped launch are short boxes.

Starts the course's JupyterLab on a free port with a token (as root: --allow-root) on a temporary notebook made of
course calls, and drives the system's Chromium headless with Playwright (no browser download). Screenshots go
to a temporary folder (or LABSRC_SCREENSHOT_DIR), named in the test's output. Skips with its reason where
Chromium or Playwright is missing.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]

CELLS = [
    # 0: a launch, as 00_setup does
    "import functools\n\nfrom labsrc import launch\nfrom labsrc.core.widgets import rerun_controls\n"
    "from labsrc.lessons.setup.lab import AllReduce\nfrom labsrc.core.figures import bars\n\n"
    "result = launch.run('setup', nproc=2, timeout=120, hold_s=2)",
    # 1: a rerun panel whose show draws a figure (as 01, 03, 04 and 05 do) and whose fail_rank plants a crash
    "def show(run):\n"
    "    bars({f'rank {row.rank}': row.received for row in run.of(AllReduce)}, 'what each rank received',"
    " 'all_reduce sum')\n\n"
    "rerun_controls(functools.partial(launch.run, 'setup', timeout=120, hold_s=2), show=show,\n"
    "               nproc=([2, 3], 2), fail_rank=([-1, 0, 1], -1), fail_attempts=([0, 1], 0))",
    # 2: a wrong exercise answer, as a learner would write it
    "from labsrc.lessons.setup.exercises import check_mean_over_ranks\n\n"
    "def mean_over_ranks(tensor):\n    return tensor.clone()  # forgot the all_reduce\n\n"
    "check_mean_over_ranks(mean_over_ranks)",
    # 3: a long launch, stopped with the kernel's interrupt (the toolbar's stop button)
    "launch.run('setup', nproc=2, timeout=120, hold_s=60)",
]


def _free_port() -> int:
    from labsrc.launch import free_port
    return free_port()


def _playwright():
    """Playwright's sync API, or skip saying what is missing (checked before JupyterLab starts)."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed (pip install -r requirements.txt)")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install -y chromium)")
    return sync_api


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab serving a temporary folder holding demo.ipynb; yields (base url, token); ends it after."""
    _playwright()
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell) for cell in CELLS])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, tmp_path / "demo.ipynb")
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    port, token = _free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k not in ("LABSRC_HEADLESS", "MPLBACKEND")}  # as a learner's
    env.update(PYTHONPATH=str(ROOT), LABSRC_PROFILE="ci", JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               LABSRC_RUNS=str(tmp_path / "runs"))
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
               "--port-retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
               "--expose-app-in-browser", "--allow-root"]
    log = open(tmp_path / "jupyterlab.log", "wb")
    server = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    pytest.fail(f"JupyterLab exited: {(tmp_path / 'jupyterlab.log').read_text()[-2000:]}")
                time.sleep(0.5)
        else:
            pytest.fail(f"JupyterLab did not answer in 60 s: {(tmp_path / 'jupyterlab.log').read_text()[-2000:]}")
        yield url, token
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def _browser(playwright, profile: Path):
    return playwright.chromium.launch_persistent_context(
        str(profile), executable_path=CHROMIUM, headless=True, args=FLAGS, viewport={"width": 1200, "height": 1000})


def _run_cell(page, index: int) -> None:
    """Run one cell as its Run button does; returns at once (the page shows when it ends)."""
    page.evaluate("""(index) => {
        const panel = window.jupyterapp.shell.currentWidget;
        panel.content.activeCellIndex = index;
        window.jupyterapp.commands.execute('notebook:run-cell');
    }""", index)


def test_a_learner_sees_bars_end_on_done_the_widgets_plot_and_short_boxes(jupyterlab, tmp_path):
    sync_api = _playwright()
    shots = Path(os.environ.get("LABSRC_SCREENSHOT_DIR") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    url, token = jupyterlab
    with sync_api.sync_playwright() as playwright:
        browser = _browser(playwright, tmp_path / "chromium-profile")
        page = browser.new_page()
        page.set_default_timeout(60_000)
        page.goto(f"{url}/lab/tree/demo.ipynb?token={token}")
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                               " && window.jupyterapp.shell.currentWidget.sessionContext?.session?.kernel?.status"
                               " === 'idle'")
        cells = page.locator(".jp-Notebook .jp-Cell")
        # the launch cell: its bars end on "done"
        _run_cell(page, 0)
        launch_cell = cells.nth(0)
        launch_cell.locator(".labsrc-progress-state", has_text="done").wait_for(state="attached")
        assert launch_cell.get_by_text("done: 2/2 seconds").count() == 2, "each rank's bar should say done, in seconds"
        launch_cell.screenshot(path=shots / "1_launch_done.png")
        # the widget: Run draws its plot, a result line and its own finished bars inside its output area
        _run_cell(page, 1)
        panel = cells.nth(1)
        panel.locator("button.widget-button", has_text="Run").click()
        output = panel.locator(".widget-output")
        output.locator("img").wait_for(state="attached")
        assert output.locator(".labsrc-progress-state", has_text="done").count() == 1
        assert output.locator(".labsrc-result").count() == 1
        cut = panel.locator(".widget-dropdown label").evaluate_all(
            "labels => labels.filter(e => e.scrollWidth > e.clientWidth).map(e => e.textContent)")
        assert cut == [], f"labels cut short (as 'global bat...'): {cut}"
        panel.screenshot(path=shots / "2_widget_plot.png")
        # the widget with a crashing rank: the error as a box in its output, no plot
        panel.locator(".widget-dropdown", has_text="fail rank").locator("select").select_option(label="1")
        panel.locator("button.widget-button", has_text="Run").click()
        output.locator(".labsrc-feedback", has_text="A rank failed").wait_for(state="attached")
        assert output.locator("img").count() == 0
        assert output.locator(".labsrc-progress-state", has_text="failed").count() == 1
        panel.screenshot(path=shots / "3_widget_error.png")
        # a wrong exercise answer: a short box, the traceback behind a click, no red traceback
        _run_cell(page, 2)
        exercise = cells.nth(2)
        exercise.locator(".labsrc-feedback", has_text="Not yet").wait_for(state="attached")
        assert exercise.locator(".jp-RenderedText[data-mime-type='application/vnd.jupyter.stderr']").count() == 0
        exercise.screenshot(path=shots / "4_exercise_verdict.png")
        exercise.locator(".labsrc-feedback summary").click()  # the full traceback, one click away
        assert "Traceback (most recent call last)" in exercise.locator(".labsrc-feedback details").inner_text()
        exercise.screenshot(path=shots / "4b_exercise_traceback_opened.png")
        # a stopped launch: a short box, bars say "stopped"
        _run_cell(page, 3)
        stopped = cells.nth(3)
        stopped.locator(".labsrc-progress-state", has_text="running").wait_for(state="attached")
        page.evaluate("() => window.jupyterapp.commands.execute('kernelmenu:interrupt')")
        stopped.locator(".labsrc-feedback", has_text="Stopped").wait_for(state="attached")
        assert stopped.locator(".labsrc-progress-state", has_text="stopped").count() == 1
        assert "Traceback" not in stopped.inner_text()
        stopped.screenshot(path=shots / "5_stopped.png")
        page.screenshot(path=shots / "6_page.png", full_page=True)
        browser.close()
    print(f"screenshots: {shots}")
