"""A lesson's exercise sheet as an nbgrader source notebook, built from the lesson notebook and solutions/ each time.

The sheet holds, in order: a read-only set-up cell (the names the reference solutions use, and the checkers);
per exercise the lesson's task text, the answer cell (the stub with the reference solution between
`### BEGIN SOLUTION` / `### END SOLUTION`: `nbgrader generate_assignment` hands students the stub) and a
read-only autograder test cell worth the exercise's points that calls the checker on the student's function,
never on the reference. Nothing is copied by hand: edit the lesson or solutions/, then generate again.
"""
from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import nbformat

from labsrc.core.exercises import solutions_root
from labsrc.grading.exercises import Exercise, Lesson

SCHEMA_VERSION = 3  # nbgrader's cell metadata schema (nbgrader 0.9)
HIDDEN_IMPORTS = {"load_solution"}  # names an answer cell must not hand the student


def _nbgrader(cell, grade_id: str, *, solution: bool = False, grade: bool = False, locked: bool = False,
              points: int | None = None):
    cell.metadata["nbgrader"] = {"grade": grade, "solution": solution, "locked": locked, "grade_id": grade_id,
                                 "schema_version": SCHEMA_VERSION, **({"points": points} if points else {})}
    return cell


def _segment(source: str, node: ast.AST) -> str:
    return "\n".join(source.splitlines()[node.lineno - 1:node.end_lineno])


def _hint(stub: ast.FunctionDef) -> tuple[list[str], str | None]:
    """The stub's statements before its `raise NotImplementedError(hint)`, and the hint."""
    kept, hint = [], None
    for statement in stub.body:
        if (isinstance(statement, ast.Raise) and isinstance(statement.exc, ast.Call)
                and getattr(statement.exc.func, "id", "") == "NotImplementedError"):
            args = statement.exc.args
            hint = args[0].value if args and isinstance(args[0], ast.Constant) else None
            break
        kept.append(statement)
    return kept, hint


class _Solutions:
    """solutions/<module>.py parsed: its functions, its helpers and its module-level imports and constants."""

    def __init__(self, module: str):
        self.path = solutions_root() / f"{module}.py"
        self.source = self.path.read_text()
        self.tree = ast.parse(self.source)
        self.definitions = {node.name: node for node in self.tree.body
                            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}

    def preamble(self) -> list[str]:
        """Imports and constants (not `from __future__`): the set-up cell gives them to every answer."""
        return [_segment(self.source, node) for node in self.tree.body
                if (isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", "") != "__future__")
                or isinstance(node, ast.Assign)]

    def helpers_of(self, name: str, taken: set[str]) -> list[ast.AST]:
        """Module-level functions and classes (not exercises) the solution `name` uses: part of its answer."""
        used = {node.id for node in ast.walk(self.definitions[name]) if isinstance(node, ast.Name)}
        return [self.definitions[helper] for helper in sorted(used) if helper in self.definitions
                and helper not in taken and helper != name]

    def body(self, name: str, indent: str, taken: set[str]) -> str:
        """The solution's body (its helpers defined first, inside it), indented to sit under the stub's def."""
        function = self.definitions[name]
        statements = list(function.body)  # the stub keeps its own def line: only the body is the solution's
        docstring = [statements.pop(0)] if ast.get_docstring(function) is not None and len(statements) > 1 else []
        parts = [_segment(self.source, node) for node in docstring]
        parts += [_segment(self.source, helper) for helper in self.helpers_of(name, taken)]
        lines = self.source.splitlines()
        parts.append("\n".join(lines[statements[0].lineno - 1:function.end_lineno]))
        return textwrap.indent("\n\n".join(textwrap.dedent(part) for part in parts), indent)


def answer_source(stub_source: str, exercise_functions: dict[str, str], solutions: _Solutions) -> str:
    """The answer cell: the stub cell's imports and stubs, each stub's body the solution between the markers.

    exercise_functions maps a stub's name to its solution's name. Other statements of the lesson's cell (its
    checker call, its fallback to the reference) are left out: the sheet's test cell grades the answer.
    """
    tree = ast.parse(stub_source)
    taken = set(exercise_functions.values())
    imports, functions = [], []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [alias.name for alias in node.names]
            if not set(names) & HIDDEN_IMPORTS:
                imports.append(_segment(stub_source, node))
        elif isinstance(node, ast.FunctionDef) and node.name in exercise_functions:
            functions.append(_answer_function(stub_source, node, exercise_functions[node.name], solutions, taken))
    return "\n\n\n".join(["\n".join(imports)] * bool(imports) + functions)


def _answer_function(source: str, stub: ast.FunctionDef, solution: str, solutions: _Solutions, taken: set) -> str:
    stub_arguments = [argument.arg for argument in stub.args.args]
    solution_arguments = [argument.arg for argument in solutions.definitions[solution].args.args]
    if stub_arguments != solution_arguments:
        raise ValueError(f"{stub.name}{tuple(stub_arguments)} in the lesson but {solution}{tuple(solution_arguments)} "
                         f"in {solutions.path}: make the signatures match")
    lines = source.splitlines()
    header = "\n".join(lines[stub.lineno - 1:stub.body[0].lineno - 1])
    indent = " " * stub.body[0].col_offset
    kept, hint = _hint(stub)
    comments = []
    if hint:
        comments += [f"{indent}# {line}" for line in textwrap.wrap(hint, 100)]
    if kept:
        comments.append(f"{indent}# the lesson's code, to change:")
        comments += [f"{indent}# {line[len(indent):]}" for statement in kept
                     for line in _segment(source, statement).splitlines()]
    body = solutions.body(solution, indent, taken)
    return "\n".join([header, *comments, f"{indent}### BEGIN SOLUTION", body, f"{indent}### END SOLUTION"])


_IN_SENTENCE = r"(?:[^.]|\.(?!\s|$))*"  # up to a full stop that ends a sentence (not one in `solutions/x.py`)
FALLBACK_SENTENCE = re.compile(rf"{_IN_SENTENCE}(?:untouched|still raises?|In CI){_IN_SENTENCE}"
                               rf"(?:reference|solutions/){_IN_SENTENCE}\.(?:\s+|$)")
EXERCISE_HEADING = re.compile(r"^#+ .*(exercise|your turn)", re.IGNORECASE | re.MULTILINE)


def _task_text(cells, answer_cell: int, names: list[str], used: set[int]) -> list[str]:
    """The lesson's statement of an exercise: the markdown cells right above its answer cell that name it (or say
    "exercise"), from the exercises' heading at most, without the lesson's sentences about falling back to the
    reference."""
    found = []
    index = answer_cell - 1
    while index >= 0 and cells[index].cell_type == "markdown" and index not in used:
        text = cells[index].source
        heading = EXERCISE_HEADING.search(text)
        if heading:
            found.insert(0, text[heading.start():])
            used.add(index)
            break
        if text.lstrip().startswith("#") or not (re.search("exercise", text, re.IGNORECASE)
                                                 or any(f"`{name}" in text for name in names)):
            break
        found.insert(0, text)
        used.add(index)
        index -= 1
    return [FALLBACK_SENTENCE.sub("", text).strip() for text in found]


def _checked(lesson: Lesson, exercise: Exercise) -> str:
    """What the checker checks, from its docstring."""
    tree = ast.parse(lesson.checkers_file.read_text())
    checker = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == exercise.checker)
    said = " ".join((ast.get_docstring(checker) or "").split())
    if len(exercise.answers) == 1 and checker.args.args:  # the checker's name for the function -> the student's
        said = re.sub(rf"\b{checker.args.args[0].arg}\(", f"{exercise.answers[0].function}(", said)
    return f"**`{exercise.grade_id}`**, {exercise.points} point{'s' * (exercise.points > 1)}. The checker: {said}"


def _intro(lesson: Lesson, title: str) -> str:
    total = sum(exercise.points for exercise in lesson.exercises)
    listing = "\n".join(f"* `{exercise.grade_id}` ({exercise.points} point{'s' * (exercise.points > 1)}): "
                        f"{', '.join(f'`{answer.function}`' for answer in exercise.answers)}"
                        for exercise in lesson.exercises)
    return (f"# Exercises of {lesson.name}: {title}\n\n"
            f"The exercises at the end of notebook `{lesson.notebook.name}`, graded. Write each function where its "
            "cell says `YOUR CODE HERE` (replace the `raise`). The cell after each answer runs the lesson's checker "
            "on **your** function and says what is wrong; in this sheet it never falls back to the reference "
            f"solution. Each checker passes or names the first mistake, so an exercise is all or nothing: {total} "
            f"point{'s' * (total > 1)} in all.\n\n{listing}\n\n"
            "Run every cell (Kernel > Restart and Run All) before you submit: the grader runs the sheet from the "
            "top in a fresh kernel, with each cell under a time limit.")


def build_sheet(lesson: Lesson) -> nbformat.NotebookNode:
    """The nbgrader source notebook of a lesson's exercises."""
    notebook = nbformat.read(lesson.notebook, as_version=4)
    cells, solutions = notebook.cells, _Solutions(lesson.module)
    title = next((cell.source.splitlines()[0].lstrip("# ") for cell in cells
                  if cell.cell_type == "markdown" and cell.source.startswith("#")), lesson.name)
    checkers = sorted({exercise.checker for exercise in lesson.exercises})
    stubs = "\n".join(cells[index].source for exercise in lesson.exercises for index in exercise.answer_cells)
    setup = "\n".join(["# the names the exercises use, and the checkers that grade them (read-only)",
                       *dict.fromkeys([*solutions.preamble(), *lesson_imports_named_in(cells, stubs)]), "",
                       f"from {lesson.checkers} import {', '.join(checkers)}"])
    sheet = [_nbgrader(nbformat.v4.new_markdown_cell(_intro(lesson, title)), "intro", locked=True),
             _nbgrader(nbformat.v4.new_code_cell(setup), "setup", locked=True)]
    used: set[int] = set()
    written: set[int] = set()
    for exercise in lesson.exercises:
        for index in exercise.answer_cells:
            if index in written:  # one cell can define the stubs of two exercises
                continue
            written.add(index)
            stubs = defined_here(cells[index].source, lesson)
            texts = _task_text(cells, index, list(stubs), used)
            texts += [_checked(lesson, other) for other in lesson.exercises if index in other.answer_cells]
            for position, text in enumerate(texts):
                sheet.append(_nbgrader(nbformat.v4.new_markdown_cell(text), f"task_{index}_{position}", locked=True))
            sheet.append(_nbgrader(nbformat.v4.new_code_cell(answer_source(cells[index].source, stubs, solutions)),
                                   f"answer_{'_'.join(stubs)}", solution=True))
        sheet.append(_nbgrader(nbformat.v4.new_code_cell(test_source(exercise)), exercise.grade_id,
                               grade=True, locked=True, points=exercise.points))
    out = nbformat.v4.new_notebook(cells=sheet)
    out.metadata = {key: notebook.metadata[key] for key in ("kernelspec", "language_info") if key in notebook.metadata}
    return out


def lesson_imports_named_in(cells, text: str) -> list[str]:
    """The lesson's own imports of names its stubs mention as `name.` (a hint saying `eft.capture_rng()`)."""
    found = []
    for cell in cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                    re.search(rf"(?<![\w.]){re.escape((alias.asname or alias.name).split('.')[0])}\.", text)
                    for alias in node.names):
                segment = _segment(cell.source, node)
                if segment not in found:
                    found.append(segment)
    return found


def defined_here(source: str, lesson: Lesson) -> dict[str, str]:
    """The exercise stubs a cell defines: stub name -> solution name."""
    names = {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
    return {answer.function: answer.solution for exercise in lesson.exercises for answer in exercise.answers
            if answer.function in names}


def test_source(exercise: Exercise) -> str:
    arguments = ", ".join(answer.function for answer in exercise.answers)
    return (f"# {exercise.points} point{'s' * (exercise.points > 1)}: the checker on your "
            f"{' and '.join(answer.function for answer in exercise.answers)} (read-only)\n"
            f"{exercise.checker}({arguments})")


def write_source(lesson: Lesson, source_dir: Path) -> Path:
    """source/<lesson>/<lesson>.ipynb under the course directory, rewritten from the lesson and solutions/."""
    folder = source_dir / lesson.name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{lesson.name}.ipynb"
    nbformat.write(build_sheet(lesson), path)
    return path
