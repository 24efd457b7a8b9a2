"""Code a lesson explains, shown in the notebook from where it lives: a function, or the lines of it that matter.

`show(obj)` renders a function's (or class's, or module's) source with highlighting; `start=` and `end=` pick the
lines from the first one containing `start` to the first one after it containing `end`, so a notebook shows the
10-40 lines a paragraph explains and the code stays once, in `labsrc`. `show_file(path)` does the same for a
plain script (the course's `notebooks/*.py`). Outside a notebook the text is printed.
"""
from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

from labsrc.core.paths import REPO


class SourceNotFound(LookupError):
    """A marker asked for is not in the source: the code moved or was renamed; the message names what is there."""


def excerpt(text: str, start: str | None = None, end: str | None = None, where: str = "the source") -> str:
    """The lines of `text` from the first containing `start` to the first after it containing `end` (both kept),
    dedented; the whole text when neither is given."""
    lines = text.splitlines()
    first = 0
    if start is not None:
        first = next((i for i, line in enumerate(lines) if start in line), -1)
        if first < 0:
            raise SourceNotFound(f"no line of {where} contains {start!r}; its first line is {lines[0]!r}")
    last = len(lines) - 1
    if end is not None:
        last = next((i for i in range(first + 1, len(lines)) if end in lines[i]), -1)
        if last < 0:
            raise SourceNotFound(f"no line of {where} after {lines[first]!r} contains {end!r}")
    return textwrap.dedent("\n".join(lines[first:last + 1])).rstrip() + "\n"


def source_of(obj, start: str | None = None, end: str | None = None) -> str:
    """The source of a function, class or module (or the excerpt `start`..`end` of it)."""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", repr(obj))
    return excerpt(inspect.getsource(obj), start, end, where=f"{name}'s source")


def _display(text: str, title: str | None) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import Code, Markdown, display
    except ImportError:  # plain Python without IPython: print
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        print((f"# {title}\n" if title else "") + text, end="")
        return
    if title:
        display(Markdown(f"`{title}`"))
    display(Code(text, language="python"))


def show(obj, start: str | None = None, end: str | None = None, title: str | None = None) -> None:
    """Show `obj`'s source (or its `start`..`end` lines), highlighted in a notebook (nothing returned, so a
    cell that ends with it shows the code once; `source_of` gives the text).

    title: a line above it; by default where it lives, e.g. ``labsrc/lessons/collectives/ring.py``.
    """
    text = source_of(obj, start, end)
    if title is None:
        module = inspect.getmodule(obj)
        path = Path(inspect.getsourcefile(obj) or "")
        title = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else getattr(module, "__name__", "")
    _display(text, title or None)


def file_text(path: str | Path, start: str | None = None, end: str | None = None) -> str:
    """A file's text (or its `start`..`end` lines); path: relative to the repository root, or absolute."""
    path = Path(path)
    full = path if path.is_absolute() else REPO / path
    if not full.is_file():
        raise FileNotFoundError(f"{full} is not a file: give a path from the repository root, e.g. notebooks/x.py")
    return excerpt(full.read_text(), start, end, where=str(path))


def show_file(path: str | Path, start: str | None = None, end: str | None = None, title: str | None = None) -> None:
    """Show a file's text (or its `start`..`end` lines), highlighted in a notebook (nothing returned).

    path: relative to the repository root, or absolute.
    """
    _display(file_text(path, start, end), title if title is not None else str(path))
