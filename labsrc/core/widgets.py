"""Interactive controls that re-run an experiment through the same labsrc function a notebook's default cell calls."""
from __future__ import annotations

from typing import Any, Callable, Sequence


def _control(name: str, choices: Sequence[Any], default: Any):
    import ipywidgets as widgets
    label = name.replace("_", " ")
    if all(isinstance(c, int) and not isinstance(c, bool) for c in choices) and len(choices) > 6:
        return widgets.IntSlider(value=default, min=min(choices), max=max(choices), description=label)
    return widgets.Dropdown(options=list(choices), value=default, description=label)


def rerun_controls(function: Callable[..., Any], show: Callable[[Any], None] | None = None,
                   **options: tuple[Sequence[Any], Any]):
    """A panel of controls and a Run button: pressing it calls function(**chosen values).

    options: name=(choices, default). show(result) draws what the function returned (e.g. a plot).
    Returns the panel; `panel.run()` does what the button does (tests and headless runs use it).
    """
    import ipywidgets as widgets
    controls = {name: _control(name, choices, default) for name, (choices, default) in options.items()}
    button = widgets.Button(description="Run", button_style="primary")
    output = widgets.Output()
    panel = widgets.VBox([*controls.values(), button, output])

    def run(_=None):
        values = {name: control.value for name, control in controls.items()}
        with output:
            output.clear_output(wait=True)
            result = function(**values)
            if show is not None:
                show(result)
        panel.last_result = result
        return result

    button.on_click(run)
    panel.run = run
    panel.controls = controls
    return panel
