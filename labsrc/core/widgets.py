"""Interactive controls that re-run an experiment through the same labsrc function a notebook's default cell calls."""
from __future__ import annotations

import contextlib
import html
import time
from typing import Any, Callable, Sequence

from labsrc.core.progress import in_notebook


def label_style(names: Sequence[str]) -> dict:
    """One label width for a panel, wide enough for its longest name: "global batch", not "global bat..."."""
    return {"description_width": f"{max((len(name) for name in names), default=0) + 2}ch"}


def _control(name: str, choices: Sequence[Any], default: Any, style: dict):
    import ipywidgets as widgets
    label = name.replace("_", " ")
    if all(isinstance(c, int) and not isinstance(c, bool) for c in choices) and len(choices) > 6:
        return widgets.IntSlider(value=default, min=min(choices), max=max(choices), description=label, style=style)
    return widgets.Dropdown(options=list(choices), value=default, description=label, style=style)


def result_line(result: Any, values: dict, seconds: float) -> str:
    """One line on what the run did: `dp_vs_ddp on 2 rank(s), global_batch=64: done in 12.3 s; records in runs/...`."""
    chosen = ", ".join(f"{name}={value!r}" for name, value in values.items())
    where = f"; records in {result.run_dir}" if hasattr(result, "run_dir") else ""
    lab = f"{result.lab} " if hasattr(result, "lab") else ""
    return f"{lab}({chosen}): done in {seconds:.1f} s{where}"


def _show_new_figures(before: set[int]) -> None:
    """Display the figures drawn since `before` into the current output as PNG, then close them (drawn once, here).

    A figure drawn in a button's callback shows nowhere by itself: the inline backend only shows figures when
    a cell ends, and a callback is not a cell. PNG whatever the backend (under MPLBACKEND=Agg too).
    """
    import io

    import matplotlib.pyplot as plt
    from IPython.display import Image, display
    for number in sorted(set(plt.get_fignums()) - before):
        figure = plt.figure(number)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", bbox_inches="tight")
        display(Image(buffer.getvalue()))
        plt.close(figure)


def rerun_controls(function: Callable[..., Any], show: Callable[[Any], None] | None = None,
                   **options: tuple[Sequence[Any], Any]):
    """A panel of controls and a Run button: pressing it calls function(**chosen values).

    options: name=(choices, default). show(result) draws what the function returned (e.g. a plot). Everything
    lands in the panel's own output area: the progress bars, printed lines, the figures show drew, a result
    line, or the error as a short box (its traceback one click away) when the run failed. In a kernel nobody
    watches (LABSRC_HEADLESS=1) it lands in the output of the cell that ran it instead.
    Returns the panel; `panel.run()` does what the button does and raises what the run raised (a cell that
    calls it fails as any cell would); the button shows the error instead, since nothing would catch it.
    """
    import ipywidgets as widgets
    from IPython.display import HTML, display

    from labsrc.core import feedback
    style = label_style(list(options))
    controls = {name: _control(name, choices, default, style) for name, (choices, default) in options.items()}
    button = widgets.Button(description="Run", button_style="primary")
    output = widgets.Output()
    panel = widgets.VBox([*controls.values(), button, output])

    def run(raise_errors: bool = True):
        import matplotlib.pyplot as plt
        values = {name: control.value for name, control in controls.items()}
        # Nobody watches a headless kernel (LABSRC_HEADLESS=1: nbmake, the grader): the run writes into the cell's
        # own output. Captured into the Output widget there, nbclient's copy of the widget sends its new state on
        # the shell channel while it waits on that channel for the cell's reply, and the reply can go unnoticed
        # until the cell's whole timeout has passed (jupyter/nbclient#312; 1 cell in 6 under load here).
        area = output if in_notebook() else contextlib.nullcontext()
        if area is output:
            output.clear_output()
        button.disabled, panel.last_error = True, None
        before, started = set(plt.get_fignums()), time.perf_counter()
        try:
            with area:
                try:
                    result = function(**values)
                    if show is not None:
                        show(result)
                    _show_new_figures(before)
                    line = html.escape(result_line(result, values, time.perf_counter() - started))
                    display(HTML(f"<div class='labsrc-result'>{line}</div>"))
                except BaseException as error:  # the stop button included: shown, then raised where asked
                    for number in set(plt.get_fignums()) - before:
                        plt.close(number)
                    panel.last_error = error
                    feedback.show(error)
            if panel.last_error is not None and raise_errors:
                raise panel.last_error
        finally:
            button.disabled = False
        panel.last_result = result if panel.last_error is None else None
        return panel.last_result

    button.on_click(lambda _: run(raise_errors=False))
    panel.run, panel.controls, panel.button, panel.output = run, controls, button, output
    panel.last_result = panel.last_error = None
    return panel
