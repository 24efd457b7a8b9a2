"""`make reset-notebooks` restores the course's notebooks and keeps every changed one in saved_work/ first."""
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import notebook_reset  # noqa: E402


def git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


@pytest.fixture
def course(tmp_path):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "00_setup.ipynb").write_text("course 00\n")
    (tmp_path / "notebooks" / "01_dp_vs_ddp.ipynb").write_text("course 01\n")
    (tmp_path / "README.md").write_text("readme\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "course")
    return tmp_path


def test_reset_restores_changed_notebooks_and_keeps_the_learners_versions(course):
    (course / "notebooks" / "00_setup.ipynb").write_text("my answers\n")
    (course / "notebooks" / "01_dp_vs_ddp.ipynb").unlink()
    (course / "notebooks" / "mine.ipynb").write_text("my own notebook\n")
    (course / "README.md").write_text("my readme\n")
    changed, folder = notebook_reset.reset(course, stamp="t1")
    assert changed == ["notebooks/00_setup.ipynb", "notebooks/01_dp_vs_ddp.ipynb"]
    assert (course / "notebooks" / "00_setup.ipynb").read_text() == "course 00\n"
    assert (course / "notebooks" / "01_dp_vs_ddp.ipynb").read_text() == "course 01\n"
    assert (folder / "notebooks" / "00_setup.ipynb").read_text() == "my answers\n"
    assert (course / "notebooks" / "mine.ipynb").read_text() == "my own notebook\n"   # not the course's: untouched
    assert (course / "README.md").read_text() == "my readme\n"                         # outside notebooks/: untouched
    assert notebook_reset.reset(course, stamp="t2") == ([], None)


def test_reset_outside_a_git_clone_says_what_to_do(tmp_path, capsys):
    assert notebook_reset.main(["--root", str(tmp_path)]) == 2
    assert "git clone" in capsys.readouterr().err
