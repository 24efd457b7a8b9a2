"""The course's own errors shown short in a notebook: what is wrong and what to try, the traceback one click away.

In a Jupyter kernel that a person watches, creating a course error (a checker's verdict, a stopped or failed
launch, a request this machine cannot meet) registers a display for it with IPython's `set_custom_exc`: the
cell still fails (its reply is an error, so "Run all" stops there and nbmake/nbclient fail), but what shows is
a styled box; the full traceback is inside it behind "Full traceback", in `feedback.last_traceback`, and
`%tb` prints it. Plain Python (scripts, tests, LABSRC_HEADLESS=1) is unchanged: the usual traceback.
"""
from __future__ import annotations

import html
import sys
import traceback

last_traceback: str | None = None
"""The full traceback of the last course error shown as a box (None before one was)."""

_HINTS = {
    "ExerciseFailed": ("Not yet", "Read what the checker says above, change your function, run its cell and this one "
                                  "again."),
    "LaunchInterrupted": ("Stopped", "Nothing of the run is left running. Run the cell again to start over."),
    "LaunchTimeout": ("Ran past its timeout", "The message above says what may help in the profile in force."),
    "RankFailed": ("A rank failed", "The rank's own traceback is above; fix what it points at and run again."),
    "RequestError": ("Not started", "Nothing was started: change the request as the message says."),
}
_DEFAULT_HINT = ("The run did not succeed", "Read the message above; the log it names has every process's output.")
_COLORS = {"Stopped": ("#eff6ff", "#1d4ed8"), "Not yet": ("#fffbeb", "#b45309")}


class Feedback(BaseException):
    """Mixed into the course's error types: a message a learner reads, shown as a box in a watched notebook."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        install()


def title_and_hint(error: BaseException) -> tuple[str, str]:
    for cls in type(error).__mro__:
        if cls.__name__ in _HINTS:
            return _HINTS[cls.__name__]
    return _DEFAULT_HINT


def box_html(error: BaseException, full_traceback: str = "") -> str:
    """A short styled box: a title, the error's message, what to try, and the traceback behind a click."""
    title, hint = title_and_hint(error)
    background, accent = _COLORS.get(title, ("#fef2f2", "#b91c1c"))
    message = html.escape(str(error) or type(error).__name__)
    details = (f"<details style='margin-top:6px'><summary style='cursor:pointer;color:#555'>Full traceback "
               f"(also <code>%tb</code>, or <code>labsrc.core.feedback.last_traceback</code>)</summary>"
               f"<pre style='font-size:11px;white-space:pre-wrap'>{html.escape(full_traceback)}</pre></details>"
               if full_traceback else "")
    return (f"<div class='labsrc-feedback' style='border-left:4px solid {accent};background:{background};"
            f"padding:8px 12px;margin:4px 0;font-family:var(--jp-content-font-family,sans-serif)'>"
            f"<b style='color:{accent}'>{html.escape(title)}</b>"
            f"<pre style='white-space:pre-wrap;margin:6px 0;font-size:12px;background:none'>{message}</pre>"
            f"<div>{html.escape(hint)}</div>{details}</div>")


def show(error: BaseException, tb=None) -> None:
    """Display the box for `error` (and keep its traceback in last_traceback)."""
    global last_traceback
    from IPython.display import HTML, display
    tb = tb or error.__traceback__
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, tb  # so %tb finds it
    last_traceback = "".join(traceback.format_exception(type(error), error, tb))
    display(HTML(box_html(error, last_traceback)))


def _handler(shell, etype, value, tb, tb_offset=None):
    show(value, tb)
    return []  # no red traceback under the box; the cell's reply is still an error


def _watched_shell():
    from labsrc.core.progress import in_notebook
    if not in_notebook():
        return None
    from IPython import get_ipython
    return get_ipython()


def install() -> bool:
    """Register the box for course errors in a watched notebook kernel (once); False elsewhere."""
    try:
        shell = _watched_shell()
    except ImportError:
        return False
    if shell is None:
        return False
    if Feedback not in shell.custom_exceptions:
        shell.set_custom_exc((Feedback,), _handler)
    return True
