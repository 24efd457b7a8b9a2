"""Course errors in a watched notebook: a short box, the traceback one click away, and the cell still fails."""
from __future__ import annotations

import pytest
from nbclient.exceptions import CellExecutionError
from test_widgets import run_in_kernel, widget_states

WATCHED = {"LABSRC_HEADLESS": "0"}  # as in JupyterLab: the box is registered


def html_of(outputs: list[dict]) -> str:
    return " ".join(o["data"].get("text/html", "") for o in outputs if "data" in o)


def test_a_checkers_verdict_is_a_box_and_still_fails_the_cell_as_nbmake_runs_it():
    cells = ["from labsrc.core.exercises import ExerciseFailed",
             "raise ExerciseFailed('rank 1: the mean is 0.5, expected 1.5: divide after the all_reduce')",
             "print('never reached')"]
    with pytest.raises(CellExecutionError, match="ExerciseFailed"):
        run_in_kernel(cells, **WATCHED)
    notebook = run_in_kernel(cells, allow_errors=True, **WATCHED)
    outputs = notebook.cells[1].outputs
    box = html_of(outputs)
    assert "labsrc-feedback" in box and "divide after the all_reduce" in box and "Full traceback" in box, outputs
    tracebacks = [o["traceback"] for o in outputs if o["output_type"] == "error"]
    assert not any(tracebacks), f"the red traceback should be behind the box's click, not under it: {tracebacks}"


def test_plain_python_keeps_the_usual_traceback():
    cells = ["from labsrc.core.exercises import ExerciseFailed",
             "raise ExerciseFailed('wrong on purpose')"]
    notebook = run_in_kernel(cells, allow_errors=True, LABSRC_HEADLESS="1")
    outputs = notebook.cells[1].outputs
    assert "labsrc-feedback" not in html_of(outputs)
    errors = [o for o in outputs if o["output_type"] == "error"]
    assert errors and any("wrong on purpose" in line for line in errors[0]["traceback"])


def test_stopping_a_launch_is_a_short_box_and_the_bars_say_stopped():
    stop = ("import os, signal, threading\n"
            "from labsrc import launch\n"
            "threading.Timer(12, os.kill, (os.getpid(), signal.SIGINT)).start()  # what the stop button does\n"
            "launch.run('setup', nproc=2, timeout=120, hold_s=60)")
    notebook = run_in_kernel([stop, "import sys; print(type(sys.last_value).__name__)"], allow_errors=True,
                             LABSRC_PROFILE="ci", **WATCHED)
    outputs = notebook.cells[0].outputs
    box = html_of(outputs)
    assert "labsrc-feedback" in box and "Stopped" in box and "Interrupted: ended" in box, outputs
    tracebacks = [o["traceback"] for o in outputs if o["output_type"] == "error"]
    assert not any(tracebacks), f"a stop should not print the launcher's traceback: {tracebacks}"
    with pytest.raises(CellExecutionError, match="LaunchInterrupted"):  # the cell still failed
        run_in_kernel(["from labsrc.launch.result import LaunchInterrupted\nraise LaunchInterrupted('x')"],
                      **WATCHED)
    assert "LaunchInterrupted" in notebook.cells[1].outputs[0]["text"], "%tb would not find the traceback"
    headers = [state["value"] for state in widget_states(notebook, "HTMLModel") if "rank(s)" in state["value"]]
    assert headers and "stopped" in headers[0], f"the progress header did not end on 'stopped': {headers}"
    labels = [state["value"] for state in widget_states(notebook, "LabelModel")]
    assert labels and all(label.startswith("stopped") for label in labels), labels
