"""The load harness's pieces (tools/load_harness.py), in seconds: nbmake's failure read back, the table, busy
processes started and all gone after a stop, a Ctrl-C and a SIGKILL of the harness."""
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import load_harness  # noqa: E402

ESC = "\x1b"
REPORT = f"""fail.ipynb F
=================================== FAILURES ===================================
{ESC}[31mAssertionError{ESC}[39m                            Traceback (most recent call last)
{ESC}[32m----> {ESC}[39m{ESC}[32m1{ESC}[39m assert r2 >= 0.6
{ESC}[31mAssertionError{ESC}[39m: the fit's R² 0.41 is below 0.6
=========================== short test summary info ============================
FAILED fail.ipynb::fail.ipynb - {ESC}[31mAssertionError{ESC}[39m: the fit's R² 0.41 is below 0.6
"""


def test_first_failure_is_the_first_error_line_without_colours():
    assert load_harness.first_failure(REPORT) == "AssertionError: the fit's R² 0.41 is below 0.6"
    cut = REPORT.replace(f"- {ESC}[31mAssertionError{ESC}[39m: the fit's R² 0.41 is below 0.6",
                         "- AssertionError: the fit's R² 0...")  # the summary as pytest cuts it to 80 columns
    printed = "RuntimeError: a rank's log line the notebook printed\n" + cut
    assert load_harness.first_failure(printed) == "AssertionError: the fit's R² 0.41 is below 0.6"
    timeout = ("A cell timed out while it was being executed, after 300 seconds.\n"
               "FAILED x.ipynb::x.ipynb - A cell timed out while it was being executed, after 300 seconds.")
    assert load_harness.first_failure(timeout).startswith("A cell timed out")
    assert load_harness.first_failure("FAILED x.ipynb::x.ipynb - kernel died") == "kernel died"
    assert load_harness.first_failure("1 passed in 3.2s") == ""


def test_table_counts_passes_median_worst_and_the_failure():
    run = load_harness.Run
    runs = [run(8, 1, "02_collectives", True, 60.0, "", 15.0, 16.0, "01 04"),
            run(8, 2, "02_collectives", False, 100.0, "AssertionError: R² 0.41", 17.0, 18.0, "01 04"),
            run(8, 3, "02_collectives", True, 70.0, "", 16.0, 17.0, "01 04"),
            run(2, 1, "00_setup", True, 45.0, "", 4.0, 5.0, "")]
    rows = load_harness.summarise(runs)
    assert [(r["load"], r["notebook"], r["runs"], r["passes"]) for r in rows] == [
        (8, "02_collectives", 3, 2), (2, "00_setup", 1, 1)]
    assert rows[0]["median_s"] == 70.0 and rows[0]["worst_s"] == 100.0
    assert rows[0]["worst_over_budget"] == pytest.approx(100 / 90)
    text = load_harness.table(rows[:1])
    assert "02_collectives" in text and "AssertionError: R² 0.41" in text and " 1.11 " in text


def test_a_run_reports_the_timing_claims_its_notebook_left_unasserted(tmp_path):
    notebook = tmp_path / "judging.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("from labsrc.core import busy\n"
                                          "if busy.judged('the bubble', False):\n    raise AssertionError\n"
                                          "assert busy.judged('the fit', True)")]
    nbformat.write(nb, notebook)
    env = load_harness.ci_env("tag", tmp_path / "runs")
    passed, _, failure, _, unjudged = load_harness.run_once(notebook, env, tmp_path / "logs" / "judging.log", 120)
    assert passed and failure == "" and unjudged == ["the bubble"]
    run = load_harness.Run
    rows = load_harness.summarise([run(8, 1, "judging", True, 9.0, "", 16.0, 17.0, "", "the bubble"),
                                   run(8, 2, "judging", True, 8.0, "", 16.0, 17.0, "", "")])
    assert rows[0]["all_asserted"] == 1 and rows[0]["unjudged"] == "the bubble"
    line = load_harness.table(rows).splitlines()[-1]
    assert line.split()[1:4] == ["2", "2", "1"] and line.endswith("unjudged: the bubble")


def test_bad_input_says_what_to_give():
    with pytest.raises(SystemExit, match="factors"):
        load_harness.parse_loads("2,x")
    with pytest.raises(SystemExit, match="no notebook matches"):
        load_harness.notebook_paths(["99_nothing"])
    assert load_harness.notebook_paths(["02"])[0].name == "02_collectives.ipynb"


def test_busy_processes_run_and_are_all_gone_after_stop(tmp_path):
    tag = uuid.uuid4().hex
    load = load_harness.Load(3, tag, [], tmp_path)
    try:
        time.sleep(0.5)
        busy = load_harness.tagged(tag)
        assert len(busy) == 3 and all(p.status() != psutil.STATUS_ZOMBIE for p in busy)
    finally:
        load.stop()
    assert load_harness.tagged(tag) == []


def _harness(tmp_path: Path, tag: str) -> subprocess.Popen:
    """The harness at load 1 on a notebook that sleeps, beside a neighbour running the same notebook."""
    notebook = tmp_path / "sleepy.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import time\ntime.sleep(60)")]
    nbformat.write(nb, notebook)
    command = [sys.executable, str(ROOT / "tools" / "load_harness.py"), "--load", "1", "--runs", "1",
               "--notebooks", str(notebook), "--neighbour", str(notebook), "--out", str(tmp_path / "out")]
    return subprocess.Popen(command, env=dict(os.environ, **{load_harness.TAG_ENV: tag}),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for_notebooks(tag: str, harness: subprocess.Popen) -> None:
    """Until both nbmake runs (the student's and the neighbour's) have their kernels up (in sessions of their own)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and harness.poll() is None:
        kernels = [p for p in load_harness.tagged(tag) if "ipykernel_launcher" in " ".join(p.cmdline())]
        if len(kernels) >= 2:
            return
        time.sleep(0.5)
    raise AssertionError("the harness did not start its two notebooks' kernels within 60 s")


def _gone(tag: str, within: float) -> list:
    deadline = time.monotonic() + within
    while (left := load_harness.tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_nothing_outlives_the_harness(tmp_path, how):
    tag = uuid.uuid4().hex
    harness = _harness(tmp_path, tag)
    try:
        _wait_for_notebooks(tag, harness)
        harness.send_signal(how)
        harness.wait(timeout=30)
        left = _gone(tag, within=20)
        assert left == [], f"left running after {how.name}: {[' '.join(p.cmdline())[:80] for p in left]}"
    finally:
        harness.kill()
        load_harness.kill_all(load_harness.tagged(tag))
