"""The rerun panel: pressing Run draws the plot and a result line (or the error) inside the panel's own output area.

A figure drawn in a button callback shows nowhere unless it is displayed into the widget's output; a test
that calls the run function from a cell cannot see that. These tests press the button in a real kernel
(nbclient, which routes captured messages into the Output widget as a browser does) and read the widget's
outputs back from the notebook's widget state.
"""
from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]

SETUP = """
import matplotlib.pyplot as plt
from labsrc.core.widgets import rerun_controls

def lab(size):
    if size < 0:
        raise ValueError("size must be 0 or more")
    return {"size": size}

def draw(result):  # as the course's plots do: a new figure, no plt.show()
    plt.subplots()[1].plot(range(result["size"] + 2))

panel = rerun_controls(lab, show=draw, size=([-1, 3, 5], 3))
panel
"""


def run_in_kernel(cells: list[str], allow_errors: bool = False, **env) -> nbformat.NotebookNode:
    """Execute cells in a fresh kernel with `env` added, as nbmake would; the executed notebook (widget state kept)."""
    from nbclient import NotebookClient
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell) for cell in cells])
    client = NotebookClient(notebook, timeout=120, kernel_name="python3", store_widget_state=True,
                            allow_errors=allow_errors, resources={"metadata": {"path": str(ROOT)}})
    client.km = client.create_kernel_manager()
    start_kernel = client.km.start_kernel
    kernel_env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    client.km.start_kernel = lambda **kwargs: start_kernel(env=kernel_env, **kwargs)
    try:
        client.execute()
    finally:
        client.km = None
    return notebook


def widget_states(notebook: nbformat.NotebookNode, model_name: str) -> list[dict]:
    state = notebook.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    return [model["state"] for model in state.get("state", {}).values() if model["model_name"] == model_name]


def press_run(cell: str) -> list[dict]:
    """Execute SETUP then `cell` in a fresh kernel a learner watches; the outputs the panel's Output widget holds
    afterwards."""
    notebook = run_in_kernel([SETUP, cell], LABSRC_HEADLESS="0")
    outputs = [state["outputs"] for state in widget_states(notebook, "OutputModel")]
    assert len(outputs) == 1, f"expected the panel's one Output widget, found {len(outputs)}"
    return outputs[0]


def mime_types(outputs: list[dict]) -> list[str]:
    return [kind for output in outputs for kind in output.get("data", {})]


def test_pressing_run_draws_the_plot_and_a_result_line_in_the_panels_output():
    outputs = press_run("panel.button.click()")
    kinds = mime_types(outputs)
    assert "image/png" in kinds, f"the button drew no figure into its output area; it holds {kinds}"
    html = " ".join(o["data"].get("text/html", "") for o in outputs if "data" in o)
    assert "labsrc-result" in html and "size=3" in html, f"no result line naming the chosen value: {html!r}"


def test_pressing_run_on_a_failing_choice_shows_the_error_as_a_box_not_a_traceback():
    outputs = press_run("panel.controls['size'].value = -1\npanel.button.click()\n"
                        "assert isinstance(panel.last_error, ValueError)")
    html = " ".join(o["data"].get("text/html", "") for o in outputs if "data" in o)
    assert "labsrc-feedback" in html and "size must be 0 or more" in html, f"no error box: {outputs}"
    assert "image/png" not in mime_types(outputs), "a failed run should draw no figure"
    assert not [o for o in outputs if o.get("output_type") == "error"], "a raw traceback in the panel"


def test_in_a_headless_kernel_the_run_writes_into_the_cell_not_the_widget():
    # nbclient's copy of an Output widget syncs over the shell channel and can hide the cell's reply (nbclient#312)
    notebook = run_in_kernel([SETUP, "panel.run()"], LABSRC_HEADLESS="1")
    widget_outputs = [state["outputs"] for state in widget_states(notebook, "OutputModel")]
    assert widget_outputs == [[]], f"a headless run captured into the widget: {widget_outputs}"
    cell = notebook.cells[1].outputs
    kinds = mime_types(cell)
    assert "image/png" in kinds and "done in" in " ".join(o["data"].get("text/html", "") for o in cell if "data" in o)


def test_panel_run_from_a_cell_raises_what_the_run_raised():
    pytest.importorskip("ipywidgets")
    from labsrc.core.widgets import rerun_controls

    def lab(size):
        raise ValueError(f"size {size} is wrong")
    panel = rerun_controls(lab, size=([1, 2], 1))
    with pytest.raises(ValueError, match="size 1 is wrong"):
        panel.run()
    assert not panel.button.disabled, "the Run button stays disabled after a failed run"
    wide = rerun_controls(lab, nproc=([2], 2), global_batch=([8], 8))
    widths = {control.style.description_width for control in wide.controls.values()}
    assert widths == {f"{len('global batch') + 2}ch"}, f"one width that holds 'global batch' (not 'global bat...'): {widths}"
