"""Before class: every sheet run twice as the grader runs it, with the reference answers (every test must pass) and
as released (the stubs: every test must fail, and nothing else may), so a sheet that cannot grade is found first.
"""
from __future__ import annotations

import copy
import tempfile
import time
from dataclasses import dataclass

from labsrc.core.processes import environment_set
from labsrc.grading.course import CELL_TIMEOUT_S, grading_env
from labsrc.grading.exercises import Lesson
from labsrc.grading.sheets import build_sheet


@dataclass(frozen=True)
class Verdict:
    lesson: str
    reference_failed: dict[str, str]   # grade_id -> error, for cells that raised with the reference answers
    stub_passed: list[str]             # test cells that passed with the stubs (they grade nothing)
    stub_broken: dict[str, str]        # non-test cells that raised with the stubs (the sheet breaks before grading)
    seconds: float

    @property
    def ok(self) -> bool:
        return not (self.reference_failed or self.stub_passed or self.stub_broken)


def _errors(notebook) -> dict[str, str]:
    return {cell.metadata["nbgrader"]["grade_id"]: f"{output['ename']}: {output['evalue']}".splitlines()[0]
            for cell in notebook.cells if cell.cell_type == "code"
            for output in cell.get("outputs", []) if output.get("output_type") == "error"}


def _run(notebook, folder: str, cell_timeout_s: int):
    from nbclient import NotebookClient
    NotebookClient(notebook, timeout=cell_timeout_s, allow_errors=True,
                   resources={"metadata": {"path": folder}}).execute()
    return notebook


def verify(lesson: Lesson, cell_timeout_s: int = CELL_TIMEOUT_S) -> Verdict:
    from nbgrader.preprocessors import ClearSolutions
    started = time.perf_counter()
    source = build_sheet(lesson)
    released, _ = ClearSolutions().preprocess(copy.deepcopy(source), {})
    tests = {cell.metadata["nbgrader"]["grade_id"] for cell in source.cells
             if cell.metadata.get("nbgrader", {}).get("grade")}
    with environment_set(grading_env()), tempfile.TemporaryDirectory(prefix="labsrc-verify-") as folder:
        reference_errors = _errors(_run(source, folder, cell_timeout_s))
        stub_errors = _errors(_run(released, folder, cell_timeout_s))
    return Verdict(lesson.name, reference_errors, sorted(tests - set(stub_errors)),
                   {grade_id: error for grade_id, error in stub_errors.items() if grade_id not in tests},
                   time.perf_counter() - started)


def describe(verdict: Verdict) -> str:
    if verdict.ok:
        return f"{verdict.lesson}: OK ({verdict.seconds:.0f} s: the reference passes every test, the stubs fail each)"
    problems = [f"with the reference, {cell} raised {error}" for cell, error in verdict.reference_failed.items()]
    problems += [f"with the stub, test {cell} passed: it grades nothing" for cell in verdict.stub_passed]
    problems += [f"with the stubs, {cell} raised {error} before any test" for cell, error in verdict.stub_broken.items()]
    return f"{verdict.lesson}: NOT READY: " + "; ".join(problems)
