"""The instructor's nbgrader course: its folder and config, the class roster, and each nbgrader step run for them.

A course folder holds nbgrader_config.py, gradebook.db and nbgrader's folders: source/ (generated from the
lessons), release/ (the students' sheets), submitted/ (collected), autograded/, and reports/ (the gradebook CSVs
and the after-class summary). The exchange (where students fetch and submit) is a folder every student can write:
nbgrader's default /srv/nbgrader/exchange on a class server, any folder for an instructor on one machine.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from labsrc.classroom.accounts import AccountError, read_roster as read_accounts
from labsrc.core.paths import REPO, python_path

DEFAULT_EXCHANGE = Path("/srv/nbgrader/exchange")  # nbgrader's own default
CELL_TIMEOUT_S = 300  # the grader's limit on one cell: a checker forks its ranks in seconds; a hang fails the cell
STEP_TIMEOUT_S = 3600  # one nbgrader command (autograding a class of 30: a few seconds per sheet)

CONFIG = '''\
# Written by `python -m labsrc.grading setup`; run it again rather than edit (it rewrites this file).
c = get_config()  # noqa: F821 (nbgrader's config loader defines it)
c.CourseDirectory.course_id = {course_id!r}
c.CourseDirectory.root = {root!r}
c.Exchange.root = {exchange!r}
c.Exchange.path_includes_course = True  # several courses can share one exchange
c.Execute.timeout = {cell_timeout_s}  # seconds per cell when autograding: a hung collective fails its cell
c.Execute.interrupt_on_timeout = True
c.ClearSolutions.code_stub = {{"python": "# YOUR CODE HERE\\nraise NotImplementedError()"}}
'''


@dataclass(frozen=True)
class Student:
    """A roster line: the login (nbgrader's student id) and, optionally, the name and email."""
    id: str
    first_name: str | None = None
    last_name: str | None = None
    email: str | None = None


def read_roster(path: Path) -> list[Student]:
    """The class server's roster (labsrc.classroom.accounts.read_roster, whose rules it keeps: a login is a system
    user's name): `login[,Full Name[,email]]` a line, `#` comments. nbgrader keeps a first and a last name: the full
    name's last word is the last name. A line that is not a roster line raises ValueError, naming it."""
    try:
        accounts = read_accounts(path)
    except AccountError as bad:
        raise ValueError(str(bad)) from None
    students = []
    for account in accounts:
        first, _, last = account.full_name.rpartition(" ")
        first, last = (first, last) if first else (last, "")
        students.append(Student(account.name, first or None, last or None, account.email or None))
    return students


def default_roster() -> Path | None:
    """The roster the class server's settings name (cluster/classroom/classroom.toml), if they load."""
    from labsrc.classroom import settings
    try:
        return (REPO / settings.load().roster).resolve()
    except settings.SettingsError:
        return None


@dataclass(frozen=True)
class Course:
    """An nbgrader course folder."""
    root: Path

    @property
    def config_path(self) -> Path:
        return self.root / "nbgrader_config.py"

    @property
    def reports(self) -> Path:
        return self.root / "reports"

    @property
    def database(self) -> str:
        return f"sqlite:///{self.root / 'gradebook.db'}"

    def require(self) -> None:
        if not self.config_path.exists():
            raise SystemExit(f"{self.root} is not a course folder (no nbgrader_config.py): run "
                             "`python -m labsrc.grading setup --course-id NAME` first")

    def write_config(self, course_id: str, exchange: Path, cell_timeout_s: int = CELL_TIMEOUT_S) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        # the instructor's alone: source/ holds the solutions, submitted/ and autograded/ every student's work, and
        # the default folder (grading/ in the checkout) sits where a class server's students can read
        self.root.chmod(0o700)
        self.config_path.write_text(CONFIG.format(course_id=course_id, root=str(self.root.resolve()),
                                                  exchange=str(exchange.resolve()), cell_timeout_s=cell_timeout_s))

    @contextlib.contextmanager
    def gradebook(self):
        """nbgrader's Gradebook of this course (it runs `alembic` from PATH: this Python's scripts are put first)."""
        from nbgrader.api import Gradebook
        before = os.environ.get("PATH")
        os.environ["PATH"] = tools_path()
        try:
            with Gradebook(self.database) as gradebook:
                yield gradebook
        finally:
            if before is None:
                del os.environ["PATH"]
            else:
                os.environ["PATH"] = before

    def add_students(self, students: list[Student]) -> None:
        with self.gradebook() as gradebook:
            for student in students:
                gradebook.update_or_create_student(student.id, first_name=student.first_name,
                                                   last_name=student.last_name, email=student.email)

    def nbgrader(self, *arguments: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """One nbgrader command in the course folder; its output shown; SystemExit naming the step if it fails."""
        command = [sys.executable, "-m", "nbgrader", *arguments]
        print("$", "nbgrader", *arguments, flush=True)
        environment = {**os.environ, "PATH": tools_path(), **(env or {})}
        process = subprocess.Popen(command, cwd=self.root, env=environment, text=True, start_new_session=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            output, _ = process.communicate(timeout=STEP_TIMEOUT_S)
        except BaseException:  # a timeout or an interrupt: the step and its kernels end with it
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise SystemExit(f"nbgrader {arguments[0]} stopped (over {STEP_TIMEOUT_S} s, or interrupted); "
                             "its kernels too") from None
        print(output, end="", flush=True)
        if process.returncode != 0:
            raise SystemExit(f"nbgrader {arguments[0]} failed (exit {process.returncode}): see its output above")
        return subprocess.CompletedProcess(command, process.returncode, output)


def tools_path() -> str:
    """PATH with this Python's scripts first: nbgrader runs `alembic` by name."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def prepare_exchange(exchange: Path) -> None:
    """The exchange folder every student writes into: world-writable with the sticky bit, as nbgrader expects."""
    exchange.mkdir(parents=True, exist_ok=True)
    try:
        exchange.chmod(0o1777)
    except PermissionError:
        if not os.access(exchange, os.W_OK | os.X_OK):
            raise SystemExit(f"{exchange} is not writable and its mode cannot be set: as root, "
                             f"`mkdir -p {exchange} && chmod 1777 {exchange}`, or pass --exchange DIR") from None


def grading_env() -> dict[str, str]:
    """What the autograder's kernels run with: the ci profile (exercises, not class-scale runs), no windows, this
    checkout's labsrc."""
    return {"LABSRC_PROFILE": "ci", "LABSRC_HEADLESS": "1", "MPLBACKEND": "Agg", "PYTHONPATH": python_path()}
