"""The instructor's grading flow, one command a step: python -m labsrc.grading {setup,lessons,generate,release,...}.

    setup --course-id NAME [--exchange DIR] [--roster FILE]   course folder, nbgrader_config.py, students
    lessons                                                  the gradable lessons, their exercises and points
    generate [LESSON ...]                                    exercise sheets from the lessons (all by default)
    verify [LESSON ...]                                      each sheet graded with the reference and with the stubs
    release LESSON                                           students can fetch it
    collect LESSON / autograde LESSON / export / summary LESSON
    after-class LESSON                                       collect + autograde + export + summary
LESSON is a notebook's name or its number (`06_performance_scaling` or `06`).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from labsrc.grading.course import (CELL_TIMEOUT_S, DEFAULT_EXCHANGE, REPO, Course, default_roster, grading_env,
                                   prepare_exchange, read_roster)
from labsrc.grading.exercises import Lesson, gradable_lessons

NOTEBOOKS = REPO / "notebooks"
STUDENT_CONFIG = '''\
# The students' side of course {course_id!r}: where to fetch and submit (install as /etc/jupyter/nbgrader_config.py)
c = get_config()  # noqa: F821
c.CourseDirectory.course_id = {course_id!r}
c.Exchange.root = {exchange!r}
c.Exchange.path_includes_course = True
'''


def find_lesson(name: str) -> Lesson:
    lessons, skipped = gradable_lessons(NOTEBOOKS)
    matches = [lesson for lesson in lessons if lesson.name == name or lesson.name.split("_")[0] == name]
    if len(matches) != 1:
        why = f" ({skipped[name]})" if name in skipped else ""
        raise SystemExit(f"no gradable lesson {name!r}{why}; one of: {', '.join(l.name for l in lessons)}")
    return matches[0]


def setup(course: Course, arguments) -> None:
    exchange = Path(arguments.exchange)
    prepare_exchange(exchange)
    course.write_config(arguments.course_id, exchange, arguments.cell_timeout)
    student_config = course.root / "student_nbgrader_config.py"
    student_config.write_text(STUDENT_CONFIG.format(course_id=arguments.course_id, exchange=str(exchange.resolve())))
    if arguments.install_student_config:
        target = Path("/etc/jupyter/nbgrader_config.py")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(student_config.read_text())
        print(f"students' config installed: {target}")
    roster = Path(arguments.roster) if arguments.roster else default_roster()
    if roster is not None and roster.exists():
        try:
            students = read_roster(roster)
        except ValueError as bad:
            raise SystemExit(str(bad)) from None
        course.add_students(students)
        print(f"{len(students)} students from {roster}")
    elif arguments.roster:
        raise SystemExit(f"no roster at {roster}: one login a line, `login[,Full Name[,email]]`")
    else:
        print(f"no roster at {roster}: students join the gradebook when their first submission is autograded")
    print(f"course {arguments.course_id!r} in {course.root} (mode 0700: yours alone); exchange {exchange}; "
          f"students' config {student_config}")


def generate(course: Course, names: list[str]) -> None:
    from labsrc.grading.sheets import write_source
    if names:
        lessons = [find_lesson(name) for name in names]
    else:
        lessons, skipped = gradable_lessons(NOTEBOOKS)
        for name, reason in skipped.items():
            print(f"skipped {name}: {reason}")
    for lesson in lessons:
        path = write_source(lesson, course.root / "source")
        print(f"{path.relative_to(course.root)}: {len(lesson.exercises)} exercises, "
              f"{sum(exercise.points for exercise in lesson.exercises)} points")
        course.nbgrader("generate_assignment", lesson.name, "--force")


def list_lessons() -> None:
    lessons, skipped = gradable_lessons(NOTEBOOKS)
    for lesson in lessons:
        listing = ", ".join(f"{exercise.grade_id} ({exercise.points})" for exercise in lesson.exercises)
        print(f"{lesson.name}: {listing}")
    for name, reason in skipped.items():
        print(f"{name}: not graded: {reason}")


def verify_sheets(names: list[str]) -> None:
    from labsrc.grading.verify import describe, verify
    lessons = [find_lesson(name) for name in names] if names else gradable_lessons(NOTEBOOKS)[0]
    verdicts = []
    for lesson in lessons:
        verdicts.append(verify(lesson))
        print(describe(verdicts[-1]), flush=True)
    if not all(verdict.ok for verdict in verdicts):
        raise SystemExit("some sheets cannot grade: see above")


def autograde(course: Course, lesson: Lesson) -> None:
    course.nbgrader("autograde", lesson.name, "--force", env=grading_env())


def export(course: Course) -> None:
    course.reports.mkdir(parents=True, exist_ok=True)
    course.nbgrader("export", "--to", str(course.reports / "grades.csv"))


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m labsrc.grading", description=__doc__.splitlines()[0])
    top.add_argument("--course-dir", default=os.environ.get("LABSRC_COURSE_DIR", str(REPO / "grading")),
                     help="the course folder (default: $LABSRC_COURSE_DIR, else grading/ in the course's checkout)")
    steps = top.add_subparsers(dest="step", required=True)
    made = steps.add_parser("setup", help="course folder, nbgrader_config.py, exchange, roster")
    made.add_argument("--course-id", required=True)
    made.add_argument("--exchange", default=str(DEFAULT_EXCHANGE),
                      help=f"the folder students fetch from and submit to (default {DEFAULT_EXCHANGE})")
    made.add_argument("--roster", help="login[,Full Name[,email]] a line (default: the class server's roster)")
    made.add_argument("--cell-timeout", type=int, default=CELL_TIMEOUT_S, help="autograder seconds per cell")
    made.add_argument("--install-student-config", action="store_true",
                      help="write the students' config to /etc/jupyter/nbgrader_config.py (class server, as root)")
    steps.add_parser("lessons", help="the gradable lessons, their exercises and points")
    steps.add_parser("generate", help="exercise sheets from the lessons").add_argument("lessons", nargs="*")
    steps.add_parser("verify", help="run each sheet with the reference (all pass) and the stubs (all fail)"
                     ).add_argument("lessons", nargs="*")
    for step in ("release", "collect", "autograde", "summary", "after-class"):
        steps.add_parser(step).add_argument("lesson")
    steps.add_parser("export", help="reports/grades.csv from the gradebook")
    return top


def main(argv: list[str] | None = None) -> None:
    arguments = parser().parse_args(argv)
    course = Course(Path(arguments.course_dir).resolve())
    if arguments.step == "lessons":
        return list_lessons()
    if arguments.step == "verify":
        return verify_sheets(arguments.lessons)
    if arguments.step == "setup":
        return setup(course, arguments)
    course.require()
    if arguments.step == "generate":
        return generate(course, arguments.lessons)
    if arguments.step == "export":
        return export(course)
    from labsrc.grading.summary import report
    lesson = find_lesson(arguments.lesson)
    if arguments.step == "release":
        course.nbgrader("release_assignment", lesson.name, "--force")
    if arguments.step in ("collect", "after-class"):
        course.nbgrader("collect", lesson.name, "--update")
    if arguments.step in ("autograde", "after-class"):
        autograde(course, lesson)
    if arguments.step == "after-class":
        export(course)
    if arguments.step in ("summary", "after-class"):
        report(course, lesson.name)


if __name__ == "__main__":
    main(sys.argv[1:])
