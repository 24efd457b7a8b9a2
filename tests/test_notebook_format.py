"""Every committed notebook is stored as JupyterLab saves it with the course's kernel, so opening one changes no byte."""
import io
import re
import sys
from pathlib import Path

import nbformat
import pytest
from ipykernel.ipkernel import IPythonKernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import notebook_format  # noqa: E402

NOTEBOOKS = notebook_format.course_notebooks(ROOT)


def test_every_course_notebook_is_found():
    names = {path.name for path in NOTEBOOKS}
    assert "00_setup.ipynb" in names and "13_tensorflow_mirrored.ipynb" in names and len(NOTEBOOKS) >= 17


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_round_trips_unchanged_through_the_servers_save(path):
    """GET then PUT through jupyter_server's own code path: nbformat.reads (as_version=4), nbformat.write."""
    stored = path.read_bytes()
    model = nbformat.reads(stored.decode("utf-8"), as_version=4)
    saved = io.StringIO()
    nbformat.write(nbformat.from_dict(model), saved, version=nbformat.NO_CONVERT)
    assert saved.getvalue().encode("utf-8") == stored, (
        f"{path.name} is not stored as JupyterLab saves it: run `make format-notebooks`")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_names_the_kernel_the_page_would_set(path):
    """The two keys JupyterLab sets from the running kernel equal the stored ones, so opening marks nothing modified."""
    notebook = nbformat.read(path, as_version=4)
    assert notebook.metadata["kernelspec"] == notebook_format.kernel_for(path)
    assert notebook.metadata["language_info"] == notebook_format.language_info(notebook_format.COURSE_PYTHON)
    assert (notebook.nbformat, notebook.nbformat_minor) == (4, 5)
    for cell in notebook.cells:
        assert cell.get("id"), f"{path.name}: a cell without an id"
        assert "execution" not in cell.metadata, f"{path.name}: run timings committed"
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: outputs committed"


def test_language_info_is_what_ipykernel_reports():
    reported = dict(IPythonKernel.language_info)
    assert notebook_format.language_info(reported["version"]) == reported


def test_kernels_are_the_ones_make_installs():
    makefile = (ROOT / "Makefile").read_text()
    for kernel in (notebook_format.COURSE_KERNEL, notebook_format.TENSORFLOW_KERNEL):
        assert re.search(rf'ipykernel install .*--name {kernel["name"]} --display-name "{re.escape(kernel["display_name"])}"',
                         makefile), kernel


@pytest.mark.filterwarnings("ignore::nbformat.warnings.MissingIDFieldWarning")
def test_normalize_is_idempotent_and_drops_what_a_run_left():
    messy = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}})
    code = nbformat.v4.new_code_cell("print(1)\nprint(2)", execution_count=3,
                                     outputs=[nbformat.v4.new_output("stream", text="1\n")])
    del code["id"]
    code.metadata["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
    code.metadata["tags"] = ["kept"]
    messy.cells = [nbformat.v4.new_markdown_cell("# title"), code]
    once = notebook_format.normalize(nbformat.writes(messy))
    assert notebook_format.normalize(once.decode()) == once
    notebook = nbformat.reads(once.decode(), as_version=4)
    assert notebook.metadata.kernelspec == notebook_format.COURSE_KERNEL and notebook.cells[1].outputs == []
    assert notebook.cells[1].id and notebook.cells[1].execution_count is None
    assert notebook.cells[1].metadata == {"tags": ["kept"]}
    assert once.endswith(b"}\n") and b'\n "cells": [\n  {\n' in once


def test_check_mode_reports_a_notebook_that_would_change(tmp_path, capsys):
    path = tmp_path / "00_x.ipynb"
    path.write_text(nbformat.writes(nbformat.v4.new_notebook()))
    assert notebook_format.main(["--check", str(path)]) == 1
    before = path.read_bytes()
    assert notebook_format.main([str(path)]) == 0 and path.read_bytes() != before
    assert notebook_format.main(["--check", str(path)]) == 0
    assert "would change 0" in capsys.readouterr().out


def test_python_version_restamps_language_info(tmp_path):
    path = tmp_path / "00_x.ipynb"
    path.write_text(nbformat.writes(nbformat.v4.new_notebook()))
    notebook_format.main(["--python-version", "3.12.3", str(path)])
    language = nbformat.read(path, as_version=4).metadata.language_info
    assert language.version == "3.12.3" and language == notebook_format.language_info("3.12.3")
