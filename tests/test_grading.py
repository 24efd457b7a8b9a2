"""The grading flow end to end: two students fetch lesson 06's exercise sheet, answer it (one right; one wrong, with
an answer that never ends, stopped by the grader's per-cell limit) and submit through the exchange; a third on the
roster never submits. The instructor collects, autogrades, exports: the gradebook and the summary say who passed
what, and the summary's commonest message is the checker's verdict on the wrong answer.

As root (CI) the students are real system users, created here and removed at teardown, each fetching and
submitting as themselves from their own home. Otherwise (a learner's machine) both students are the current
account under two nbgrader identities (its user name replaced in nbgrader's own lookup): fetch and submit still go
through the exchange folder, collect and autograde are unchanged (LABSRC_GRADING_SYSTEM_USERS=0 runs this way as
root too).
"""
from __future__ import annotations

import csv
import grp
import inspect
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

pytest.importorskip("nbgrader", reason="nbgrader is an extra: pip install -r requirements-classroom.txt")
nbformat = pytest.importorskip("nbformat")

from labsrc.core.exercises import ExerciseFailed, load_solution  # noqa: E402
from labsrc.grading import __main__ as grading  # noqa: E402
from labsrc.grading.course import REPO, Course  # noqa: E402
from labsrc.grading.exercises import read_lesson  # noqa: E402
from labsrc.grading.summary import report  # noqa: E402
from labsrc.lessons.performance_scaling.exercises import check_predict_step_time  # noqa: E402

LESSON = "06_performance_scaling"  # three exercises whose checkers are arithmetic: the sheet grades in seconds
AS_ROOT = os.geteuid() == 0 and os.environ.get("LABSRC_GRADING_SYSTEM_USERS") != "0"  # 0: the fallback, as root too
ROOT = Path(__file__).resolve().parents[1]
TAG = uuid.uuid4().hex[:6]
RIGHT, WRONG, ABSENT = f"right{TAG}", f"wrong{TAG}", f"absent{TAG}"  # ABSENT: on the roster, never submits

WRONG_PREDICT = '''\
def predict_step_time(compute_s, gradient_bytes, n, link, overlap):
    communication = 2 * n * (link.alpha_s + gradient_bytes / n * link.beta_s_per_byte)  # n messages, not n - 1
    return compute_s + communication - overlap * min(compute_s, communication)
'''


def solution_source(name: str) -> str:
    return "import math\n\n\n" + inspect.getsource(load_solution("performance_scaling", name))


CELL_TIMEOUT_S = 30  # the autograder's limit on one cell, here: its checkers take well under a second

ANSWERS = {  # per student: answer cell grade_id -> what the student wrote (None: the stub left as it was)
    # the wrong student: a wrong formula, a right one, and an answer that never ends
    RIGHT: {f"answer_{name}": solution_source(name) for name in ("predict_step_time", "ring_vs_tree", "largest_world")},
    WRONG: {"answer_predict_step_time": WRONG_PREDICT, "answer_ring_vs_tree": solution_source("ring_vs_tree"),
            "answer_largest_world": "import time\n\ntime.sleep(600)  # never ends: the grader's cell limit stops it"},
}


class Students:
    """Two students with homes of their own, running nbgrader as themselves (root) or as an nbgrader identity."""

    def __init__(self, base: Path):
        self.base = base
        self.homes: dict[str, Path] = {}

    def add(self, name: str) -> None:
        if AS_ROOT:
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True)
            self.homes[name] = Path(pwd.getpwnam(name).pw_dir)
            self.open_way(name)
        else:
            self.homes[name] = self.base / name
            self.homes[name].mkdir()

    def open_way(self, name: str) -> None:
        """Let the student pass through the folders above this Python and the checkout (/root, a clone in a 0700
        temporary folder): ACL entries for their own group, revoked by remove(), as the class server grants them."""
        from labsrc.classroom.accounts import blocked_directories, grant_access
        for _ in range(16):  # one blocked folder a path per pass: the next may lie below it
            blocked = blocked_directories([Path(sys.prefix), Path(sys.base_prefix), ROOT], name)
            if not blocked:
                return
            grant_access(blocked, name, self.base)
        raise AssertionError(f"{name} still cannot reach this Python or the checkout: {blocked}")

    def remove(self) -> None:
        from labsrc.classroom.accounts import revoke_access
        for name in self.homes:
            if AS_ROOT:
                revoke_access(name, self.base)
                subprocess.run(["userdel", "--remove", name], check=False, capture_output=True)
                try:
                    grp.getgrnam(name)
                    subprocess.run(["groupdel", name], check=False, capture_output=True)
                except KeyError:
                    pass

    def give(self, name: str, path: Path) -> None:
        if AS_ROOT:
            entry = pwd.getpwnam(name)
            for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
                os.chown(item, entry.pw_uid, entry.pw_gid)

    def nbgrader(self, name: str, *arguments: str) -> str:
        """nbgrader run by the student, in their home, with their own ~/.jupyter config and nothing of ours.

        In a child forked from this process: as root it becomes the student (uid, gid, groups) once nbgrader is
        loaded, since this machine's Python lives under /root, which other users cannot enter (on a class server
        students run nbgrader from their own JupyterLab). Otherwise nbgrader's user-name lookup answers `name`.
        """
        import nbgrader.apps.nbgraderapp as app  # loaded here, while the Python's own files can still be read
        import nbgrader.exchange.default  # noqa: F401
        home, log = self.homes[name], self.base / f"{name}-{arguments[0]}.log"
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                with log.open("w") as out:
                    os.dup2(out.fileno(), 1)
                    os.dup2(out.fileno(), 2)
                if AS_ROOT:
                    entry = pwd.getpwnam(name)
                    os.setgroups([])
                    os.setgid(entry.pw_gid)
                    os.setuid(entry.pw_uid)
                else:
                    import nbgrader.utils
                    nbgrader.utils.get_osusername = lambda: name
                os.environ.update(HOME=str(home), USER=name, LOGNAME=name)
                os.environ.pop("JUPYTER_CONFIG_DIR", None)
                os.chdir(home)
                sys.argv = ["nbgrader", *arguments]
                app.NbGraderApp.launch_instance()
                code = 0
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else 1
            except BaseException:  # onto the log's descriptor itself: pytest has replaced sys.stderr
                import traceback
                os.write(2, traceback.format_exc().encode())
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        output = log.read_text()
        assert os.waitstatus_to_exitcode(status) == 0, f"{name}: nbgrader {arguments[0]} failed:\n{output}"
        return output


def answer(path: Path, answers: dict[str, str | None]) -> None:
    """Write a student's answers into their fetched sheet, cell by cell, as they would in JupyterLab."""
    notebook = nbformat.read(path, as_version=4)
    found = set()
    for cell in notebook.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            found.add(grade_id)
            assert "raise NotImplementedError()" in cell.source, f"{grade_id}: the released sheet shows the solution"
            if answers[grade_id] is not None:
                cell.source = answers[grade_id]
    assert found == set(answers), f"the sheet's answer cells are {found}, expected {set(answers)}"
    nbformat.write(notebook, path)


@pytest.fixture
def exchange_folder():
    """A folder the students can reach (pytest's tmp_path is its owner's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="labsrc-exchange-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def students(tmp_path):
    made = Students(tmp_path / "homes")
    made.base.mkdir()
    try:
        for name in (RIGHT, WRONG):
            made.add(name)
        yield made
    finally:
        made.remove()


def test_grading_flow_end_to_end(tmp_path, exchange_folder, students, capsys):
    course_dir, exchange = tmp_path / "course", exchange_folder / "exchange"
    roster = tmp_path / "roster.txt"
    roster.write_text(f"# login, full name, email\n{RIGHT},Ada Right\n{WRONG},Bob Wrong,b@example.org\n"
                      f"{ABSENT}\n")
    run = lambda *steps: grading.main(["--course-dir", str(course_dir), *steps])  # noqa: E731
    run("setup", "--course-id", "dtc", "--exchange", str(exchange), "--roster", str(roster),
        "--cell-timeout", str(CELL_TIMEOUT_S))
    run("generate", LESSON)
    run("release", LESSON)

    for name in (RIGHT, WRONG):
        config = students.homes[name] / ".jupyter" / "nbgrader_config.py"
        config.parent.mkdir()
        shutil.copy(course_dir / "student_nbgrader_config.py", config)
        students.give(name, config.parent)
        students.nbgrader(name, "fetch_assignment", LESSON)
        sheet = students.homes[name] / "dtc" / LESSON / f"{LESSON}.ipynb"
        answer(sheet, ANSWERS[name])
        students.give(name, sheet)
        students.nbgrader(name, "submit", LESSON)
    inbound = sorted(path.name.split("+")[0] for path in (exchange / "dtc" / "inbound").iterdir())
    assert inbound == sorted([RIGHT, WRONG]), f"the exchange's inbound holds {inbound}"
    if AS_ROOT:  # each submission is its student's own file
        owners = {pwd.getpwuid(path.stat().st_uid).pw_name for path in (exchange / "dtc" / "inbound").iterdir()}
        assert owners == {RIGHT, WRONG}

    capsys.readouterr()
    run("after-class", LESSON)  # collect, autograde, export, summary
    printed = capsys.readouterr().out

    course = Course(course_dir)
    with (course.reports / "grades.csv").open() as handle:
        totals = {row["student_id"]: (float(row["score"]), float(row["max_score"])) for row in csv.DictReader(handle)}
    assert totals == {RIGHT: (3.0, 3.0), WRONG: (1.0, 3.0), ABSENT: (0.0, 3.0)}, f"nbgrader's export: {totals}"
    with (course.reports / f"{LESSON}_exercises.csv").open() as handle:
        scores = {(row["student"], row["exercise"]): float(row["score"]) for row in csv.DictReader(handle)}
    assert scores == {(RIGHT, "predict_step_time"): 1, (RIGHT, "ring_vs_tree"): 1, (RIGHT, "largest_world"): 1,
                      (WRONG, "predict_step_time"): 0, (WRONG, "ring_vs_tree"): 1, (WRONG, "largest_world"): 0,
                      (ABSENT, "predict_step_time"): 0, (ABSENT, "ring_vs_tree"): 0, (ABSENT, "largest_world"): 0}

    with pytest.raises(ExerciseFailed) as verdict:  # what the checker says to the wrong answer, here in-process
        namespace = {}
        exec(WRONG_PREDICT, namespace)
        check_predict_step_time(namespace["predict_step_time"])
    _, summaries = report(course, LESSON)
    by_exercise = {summary.exercise: summary for summary in summaries}
    counts = {name: (summary.passed, summary.failed, summary.not_submitted) for name, summary in by_exercise.items()}
    assert counts == {"predict_step_time": (1, 1, 1), "ring_vs_tree": (2, 0, 1), "largest_world": (1, 1, 1)}
    assert by_exercise["predict_step_time"].commonest_message == f"ExerciseFailed: {verdict.value}".splitlines()[0]
    assert by_exercise["largest_world"].commonest_message == (
        "NameError: name 'largest_world' is not defined (after cell answer_largest_world raised CellTimeoutError)")
    assert by_exercise["ring_vs_tree"].commonest_count == 0
    assert str(verdict.value).splitlines()[0][:80] in printed, "the summary printed names the checker's message"
    assert (course.reports / f"{LESSON}_summary.md").read_text().count("|") > 10


def test_every_lesson_with_exercises_becomes_a_sheet():
    """All lessons' sheets build: one autograder test per checker call, solutions only between the markers."""
    from labsrc.grading.exercises import gradable_lessons
    from labsrc.grading.sheets import build_sheet
    lessons, skipped = gradable_lessons(REPO / "notebooks")
    assert len(lessons) >= 14 and set(skipped) <= {"01b_your_ddp_script"}, skipped
    for lesson in lessons:
        cells = build_sheet(lesson).cells
        tests = [cell for cell in cells if cell.metadata["nbgrader"]["grade"]]
        assert [cell.metadata["nbgrader"]["grade_id"] for cell in tests] == [e.grade_id for e in lesson.exercises]
        assert all(cell.metadata["nbgrader"]["locked"] and "load_solution" not in cell.source for cell in tests)
        answers = [cell for cell in cells if cell.metadata["nbgrader"]["solution"]]
        assert answers and all("### BEGIN SOLUTION" in cell.source for cell in answers), lesson.name
        assert not any("load_solution" in cell.source for cell in cells), f"{lesson.name}: a way to the reference"
        texts = [cell.source for cell in cells if cell.cell_type == "markdown"]
        assert not [text for text in texts if "reference" in text and "untouched" in text], lesson.name
        assert len(texts) >= 1 + len(lesson.exercises) * 2, f"{lesson.name}: an exercise without its statement"
    assert read_lesson(REPO / "notebooks" / f"{LESSON}.ipynb").exercises[0].checker == "check_predict_step_time"


def test_a_roster_line_that_is_not_a_login_is_named(tmp_path):
    from labsrc.grading.course import read_roster
    roster = tmp_path / "roster.txt"
    roster.write_text("# class of 2\nada, Ada Lovelace, ada@example.org\n\nbob smith\n")
    with pytest.raises(ValueError, match=r"roster.txt:4: 'bob smith' is not a valid username"):
        read_roster(roster)
    for line, why in (("Ada.L, Ada", "'Ada.L' is not a valid username"),  # the server could not create it
                      ("ada, Lovelace, Ada, ada@example.org", "more than three fields"), ("ada\nada", "listed twice")):
        roster.write_text(line + "\n")
        with pytest.raises(ValueError, match=why):
            read_roster(roster)
    roster.write_text("ada, Ada King Lovelace, ada@example.org\nbob  # no name given\ncy, Cy\n")
    assert [(s.id, s.first_name, s.last_name, s.email) for s in read_roster(roster)] == [
        ("ada", "Ada King", "Lovelace", "ada@example.org"), ("bob", None, None, None), ("cy", "Cy", None, None)]
    from labsrc.classroom.accounts import read_roster as accounts
    assert [(s.name, s.full_name) for s in accounts(roster)] == [("ada", "Ada King Lovelace"), ("bob", ""), ("cy", "Cy")]


def test_a_sheet_grades_the_reference_right_and_the_stub_wrong(capsys, monkeypatch):
    """`verify` on lesson 13 (one arithmetic exercise): the reference passes its test, the released stub fails it;
    a sheet whose test checked the reference instead of the student's function is caught."""
    from labsrc.grading import sheets
    grading.main(["verify", "13"])
    assert "13_capstone: OK" in capsys.readouterr().out
    monkeypatch.setattr(sheets, "test_source", lambda exercise: "from labsrc.core.exercises import load_solution\n"
                        f"{exercise.checker}(load_solution('capstone', 'learning_rate'))")
    with pytest.raises(SystemExit, match="cannot grade"):
        grading.main(["verify", "13"])
    assert "13_capstone: NOT READY: with the stub, test learning_rate passed" in capsys.readouterr().out


def test_setup_keeps_the_course_folder_from_students(tmp_path):
    """The course folder holds the solutions (source/) and every student's work: setup closes it to others even
    when it already exists open (the default, grading/ in a checkout every student reads)."""
    course = tmp_path / "course"
    course.mkdir(mode=0o755)
    course.chmod(0o755)
    roster = tmp_path / "roster.txt"
    roster.write_text("ada,Ada Lovelace\n")
    grading.main(["--course-dir", str(course), "setup", "--course-id", "c", "--exchange", str(tmp_path / "exchange"),
                  "--roster", str(roster)])
    assert course.stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "exchange").stat().st_mode & 0o7777 == 0o1777
