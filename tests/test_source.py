"""core.source: the lines a lesson shows are cut from the code where it lives, and a moved marker says so."""
import pytest

from labsrc.core import source


def _sample(tensor):
    total = tensor.sum()
    doubled = total * 2
    return doubled


def test_an_excerpt_runs_from_the_start_marker_to_the_end_marker_dedented():
    text = source.source_of(_sample, start="total =", end="doubled =")
    assert text == "total = tensor.sum()\ndoubled = total * 2\n"


def test_the_whole_function_without_markers_and_printed_outside_a_notebook(capsys):
    assert source.show(_sample) is None  # a cell ending with it shows the code once, not again as a string
    shown = source.source_of(_sample)
    assert shown.startswith("def _sample(tensor):") and shown.rstrip().endswith("return doubled")
    printed = capsys.readouterr().out
    assert printed.startswith("# tests/test_source.py\n") and "return doubled" in printed


def test_a_marker_that_is_gone_names_what_is_there():
    with pytest.raises(source.SourceNotFound, match="no line of _sample's source contains 'halved'"):
        source.source_of(_sample, start="halved")
    with pytest.raises(source.SourceNotFound, match="contains 'missing'"):
        source.source_of(_sample, start="doubled", end="missing")


def test_a_file_by_its_path_from_the_repository_root(capsys):
    assert source.show_file("tests/test_source.py", start="def _sample", end="return doubled") is None
    assert capsys.readouterr().out.startswith("# tests/test_source.py\ndef _sample(tensor):")
    shown = source.file_text("tests/test_source.py", start="def _sample", end="return doubled")
    assert shown.splitlines()[0] == "def _sample(tensor):" and len(shown.splitlines()) == 4
    with pytest.raises(FileNotFoundError, match="repository root"):
        source.show_file("no/such/file.py")
