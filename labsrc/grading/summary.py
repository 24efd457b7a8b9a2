"""After class: who passed which exercise (from nbgrader's gradebook) and, per exercise, the commonest checker message.

The scores come from the gradebook nbgrader's autograde filled; the messages from the autograded notebooks'
test cells (the error a checker raised: ExerciseFailed with what is wrong, or the exception the student's code
raised, e.g. NotImplementedError for a stub left as it was). Nothing is parsed from logs.
"""
from __future__ import annotations

import csv
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import nbformat

from labsrc.grading.course import Course

MESSAGE_CHARACTERS = 300  # a summary cell holds the message's first line, cut here


@dataclass(frozen=True)
class Outcome:
    """One student's result on one exercise (one autograder test cell)."""
    student: str
    assignment: str
    exercise: str      # the test cell's grade_id: the checker's name without check_
    score: float
    max_score: float
    message: str       # the error the test cell raised ("" when it passed; "not submitted" when nothing came)


@dataclass(frozen=True)
class ExerciseSummary:
    """One exercise over the class."""
    assignment: str
    exercise: str
    passed: int
    failed: int
    not_submitted: int
    commonest_message: str
    commonest_count: int


def _first_line(text: str) -> str:
    """The message's first line; when it ends with ':' (a rank's traceback follows), its last line too."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    said = lines[0] if not lines[0].endswith(":") or len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return said[:MESSAGE_CHARACTERS]


def test_cell_messages(notebook: Path) -> dict[str, str]:
    """grade_id -> the error its test cell raised, for every test cell of an autograded notebook that failed."""
    messages, earlier = {}, ""
    for cell in nbformat.read(notebook, as_version=4).cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code":
            continue
        if meta.get("solution"):  # an answer cell: what an earlier one raised no longer explains what follows
            earlier = ""
        for output in cell.get("outputs", []):
            if output.get("output_type") != "error":
                continue
            said = _first_line(f"{output['ename']}: {output['evalue']}" if output["evalue"].strip()
                               else output["ename"])
            if meta.get("grade"):
                messages[meta["grade_id"]] = said + earlier
            else:  # an answer cell that raised (or ran past the time limit) explains the tests after it
                earlier = f" (after cell {meta.get('grade_id', '?')} raised {said})"
    return messages


def outcomes(course: Course, assignment: str) -> list[Outcome]:
    """Every roster student's result on every exercise of the assignment; a missing submission scores 0."""
    from nbgrader.api import MissingEntry
    found = []
    with course.gradebook() as gradebook:
        try:
            record = gradebook.find_assignment(assignment)
        except MissingEntry:
            raise SystemExit(f"{assignment} is not in the gradebook: generate it first") from None
        tests = [(notebook.name, cell.name, cell.max_score) for notebook in record.notebooks
                 for cell in notebook.grade_cells]
        for student in sorted(gradebook.students, key=lambda student: student.id):
            try:
                submission = gradebook.find_submission(assignment, student.id)
            except MissingEntry:
                found += [Outcome(student.id, assignment, name, 0.0, points, "not submitted")
                          for _, name, points in tests]
                continue
            for notebook in submission.notebooks:
                path = course.root / "autograded" / student.id / assignment / f"{notebook.name}.ipynb"
                messages = test_cell_messages(path) if path.exists() else None
                for grade in notebook.grades:
                    message = "not autograded" if messages is None else messages.get(grade.name, "")
                    found.append(Outcome(student.id, assignment, grade.name, float(grade.score or 0),
                                         float(grade.max_score), message))
    return found


def summarise(results: list[Outcome]) -> list[ExerciseSummary]:
    by_exercise: dict[tuple[str, str], list[Outcome]] = {}
    for outcome in results:
        by_exercise.setdefault((outcome.assignment, outcome.exercise), []).append(outcome)
    summaries = []
    for (assignment, exercise), group in by_exercise.items():
        missing = [o for o in group if o.message == "not submitted"]
        passed = [o for o in group if o.score >= o.max_score and o not in missing]
        failures = Counter(o.message or "no error shown, score below full" for o in group
                           if o not in passed and o not in missing)
        message, count = failures.most_common(1)[0] if failures else ("", 0)
        summaries.append(ExerciseSummary(assignment, exercise, len(passed), len(group) - len(passed) - len(missing),
                                         len(missing), message, count))
    return summaries


def write_csv(rows: list, path: Path, kind: type) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[field.name for field in fields(kind)])
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)


def markdown(summaries: list[ExerciseSummary]) -> str:
    lines = ["| assignment | exercise | passed | failed | not submitted | commonest message (students) |",
             "|---|---|---|---|---|---|"]
    for s in summaries:
        said = f"{s.commonest_message.replace('|', '/')} ({s.commonest_count})" if s.commonest_count else ""
        lines.append(f"| {s.assignment} | {s.exercise} | {s.passed} | {s.failed} | {s.not_submitted} | {said} |")
    return "\n".join(lines) + "\n"


def report(course: Course, assignment: str) -> tuple[list[Outcome], list[ExerciseSummary]]:
    """reports/<assignment>_exercises.csv (one row per student and exercise), _summary.csv and _summary.md."""
    results = outcomes(course, assignment)
    summaries = summarise(results)
    write_csv(results, course.reports / f"{assignment}_exercises.csv", Outcome)
    write_csv(summaries, course.reports / f"{assignment}_summary.csv", ExerciseSummary)
    text = markdown(summaries)
    (course.reports / f"{assignment}_summary.md").write_text(f"# {assignment}: per exercise\n\n{text}")
    print(text, end="")
    return results, summaries
