"""The bytes JupyterLab 4 writes for a course notebook, so opening and saving an untouched one changes nothing.

What JupyterLab does, checked in Chromium against this JupyterLab (4.6) and jupyter_server (2.21):
- on opening, the page sets two metadata keys from the kernel it starts: ``kernelspec`` (the kernel's name, display
  name and language) and ``language_info`` (the kernel's reply, Python's version included); a value that differs
  from the stored one marks the notebook modified, and autosave rewrites it;
- on saving, jupyter_server writes the page's model with ``nbformat.write``: JSON with keys sorted, an indent of 1,
  multi-line strings split into lists of lines, non-ASCII kept, and a final newline.
So a course notebook is stored with the course kernel's metadata and through ``nbformat.write`` (``normalize``);
``python tools/notebook_format.py`` (``make format-notebooks``) rewrites every committed notebook that way.
A learner whose kernel runs another Python version sees one line change (``language_info.version``):
``--python-version`` restamps the notebooks for a class server's own Python.
"""
import argparse
import io
import sys
import uuid
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_GLOBS = ("notebooks/*.ipynb", "appendix/*.ipynb")

# The kernel `make setup` installs (Makefile: ipykernel install --name labsrc), and the TensorFlow appendix's own.
COURSE_KERNEL = {"display_name": "Python (labsrc course)", "language": "python", "name": "labsrc"}
TENSORFLOW_KERNEL = {"display_name": "Python (labsrc TensorFlow)", "language": "python", "name": "labsrc-tf"}

# The Python of the course's reference set-up and CI (environment.yml pins 3.11; this machine runs 3.11.7).
COURSE_PYTHON = "3.11.7"


def language_info(python_version: str = COURSE_PYTHON) -> dict:
    """What ipykernel 7 reports as ``language_info`` (ipykernel/ipkernel.py), for a given Python version."""
    major = int(python_version.split(".")[0])
    return {"codemirror_mode": {"name": "ipython", "version": major}, "file_extension": ".py",
            "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
            "pygments_lexer": "ipython3", "version": python_version}


def kernel_for(path: Path) -> dict:
    """The kernel a notebook names: the TensorFlow appendix runs in its own environment, the rest in the course's."""
    return TENSORFLOW_KERNEL if "tensorflow" in path.name else COURSE_KERNEL


def save_bytes(notebook: nbformat.NotebookNode) -> bytes:
    """The bytes jupyter_server writes for this notebook model (FileContentsManager._save_notebook)."""
    stream = io.StringIO()
    nbformat.write(notebook, stream, version=nbformat.NO_CONVERT)
    return stream.getvalue().encode("utf-8")


def normalize(text: str, kernel: dict = COURSE_KERNEL, python_version: str = COURSE_PYTHON) -> bytes:
    """A notebook as JupyterLab saves it untouched with ``kernel``: no outputs, execution counts or run timings.

    Other metadata is kept (notebook's and cells'); a cell without an id gets one (as JupyterLab does).
    """
    notebook = nbformat.reads(text, as_version=4)
    if (notebook.nbformat, notebook.nbformat_minor) < (4, 5):
        notebook.nbformat_minor = 5
    notebook.metadata["kernelspec"] = dict(kernel)
    notebook.metadata["language_info"] = language_info(python_version)
    for cell in notebook.cells:
        if "id" not in cell:
            cell["id"] = uuid.uuid4().hex[:8]
        cell.metadata.pop("execution", None)  # run timings nbclient (and JupyterLab's recordTiming) write
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return save_bytes(notebook)


def course_notebooks(root: Path = REPO) -> list[Path]:
    """Every committed notebook of the course: the numbered ones and the appendix."""
    return sorted(path for pattern in NOTEBOOK_GLOBS for path in root.glob(pattern))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/notebook_format.py", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks to rewrite (default: every course notebook)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook would change")
    parser.add_argument("--python-version", default=COURSE_PYTHON,
                        help=f"the kernel's Python, as language_info.version (default {COURSE_PYTHON}; "
                             f"this interpreter: {sys.version.split()[0]})")
    options = parser.parse_args(argv)
    changed = []
    for path in options.paths or course_notebooks():
        before = path.read_bytes()
        after = normalize(before.decode("utf-8"), kernel_for(path), options.python_version)
        if after != before:
            changed.append(path)
            if not options.check:
                path.write_bytes(after)
    verb = "would change" if options.check else "rewrote"
    print(f"{verb} {len(changed)} notebook(s)" + "".join(f"\n  {path}" for path in changed))
    return 1 if options.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
