"""Which exercises a lesson notebook holds, read from its cells: the learner's stub, the checker that grades it, the solution.

A lesson's checker cells call `check_<name>(<function> if written else load_solution("<lesson>", "<solution>"))`
(or bind that choice to a name first and pass the name). Each such call is one graded exercise; the function it
checks is defined, as a stub that raises NotImplementedError, in an earlier code cell (the answer cell). Where the
checkers live is read from the notebook's own import of them (`from labsrc.lessons.<lesson>.exercises import
check_<name>`), so a sheet imports them from where the lesson does.
"""
from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import nbformat

from labsrc.core.exercises import solutions_root


@dataclass(frozen=True)
class Answer:
    """One function the learner writes: its name in the notebook and in solutions/<lesson>.py."""
    function: str      # the stub's name in the notebook, e.g. "my_learning_rate"
    solution: str      # the reference's name in solutions/<lesson>.py, e.g. "learning_rate"


@dataclass(frozen=True)
class Exercise:
    """One checker call: one graded exercise, worth `points` (a checker passes or names the first mistake)."""
    checker: str                 # e.g. "check_mean_over_ranks", defined in the lesson's exercises.py
    answers: tuple[Answer, ...]  # the functions passed to it, in order
    answer_cells: tuple[int, ...]  # notebook cell indices of the stubs, in order, without repeats
    points: int = 1

    @property
    def grade_id(self) -> str:
        return self.checker.removeprefix("check_")


@dataclass(frozen=True)
class Lesson:
    """A lesson notebook's graded exercises."""
    name: str                    # "06_performance_scaling": the assignment's name
    module: str                  # "performance_scaling": the solutions' module, solutions/<module>.py
    notebook: Path
    exercises: tuple[Exercise, ...]
    checkers: str                # "labsrc.lessons.performance_scaling.exercises": where the notebook imports them

    @property
    def checkers_file(self) -> Path:
        return module_file(self.checkers)


def _solution_choice(node: ast.AST, bound: dict[str, ast.AST]) -> tuple[str, str, str] | None:
    """(function, lesson module, solution name) from `f if written else load_solution("lesson", "name")`."""
    if isinstance(node, ast.Name) and node.id in bound:
        node = bound[node.id]
    if not (isinstance(node, ast.IfExp) and isinstance(node.body, ast.Name) and isinstance(node.orelse, ast.Call)):
        return None
    call = node.orelse
    if not (isinstance(call.func, ast.Name) and call.func.id == "load_solution" and len(call.args) == 2
            and all(isinstance(arg, ast.Constant) for arg in call.args)):
        return None
    return node.body.id, call.args[0].value, call.args[1].value


def _checker_calls(source: str) -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """(checker, the name it is called through, choices) for every `check_x(...)` call in a cell whose arguments all
    choose between the learner's function and a solution: `check_x(...)` is called through "check_x",
    `checks.check_x(...)` through "checks"."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a cell with IPython magics: not an exercise cell
        return []
    bound = {target.id: statement.value for statement in ast.walk(tree) if isinstance(statement, ast.Assign)
             for target in statement.targets if isinstance(target, ast.Name)}
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name):
            name = through = node.func.id
        elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
            name, through = node.func.attr, node.func.value.id
        else:
            continue
        if not name.startswith("check_") or not node.args:
            continue
        choices = [_solution_choice(arg, bound) for arg in node.args]
        if all(choices):
            calls.append((name, through, choices))
    return calls


def imported_names(sources: list[str]) -> dict[str, str]:
    """{local name: the dotted name it was imported as} over a notebook's code cells (`from a.b import c as d`:
    d -> a.b.c)."""
    names = {}
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.update({alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names})
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    names[alias.asname or top] = alias.name if alias.asname else top
    return names


def module_file(module: str) -> Path:
    """The source file of a dotted module, found without importing it (its packages are imported)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ValueError(f"no module {module} to import checkers from")
    return Path(spec.origin)


def defined_functions(source: str) -> set[str]:
    try:
        return {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
    except SyntaxError:
        return set()


def top_level_names(path: Path) -> set[str]:
    return {node.name for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def read_lesson(notebook: Path) -> Lesson:
    """The graded exercises of one lesson notebook; ValueError says why a notebook has none that can be graded."""
    cells = nbformat.read(notebook, as_version=4).cells
    imported = imported_names([cell.source for cell in cells if cell.cell_type == "code"])
    exercises, modules, checker_modules = [], set(), set()
    for index, cell in enumerate(cells):
        if cell.cell_type != "code":
            continue
        for checker, through, choices in _checker_calls(cell.source):
            if through not in imported:
                raise ValueError(f"{notebook.name}: {checker} is called through {through!r}, which no cell imports")
            checker_modules.add(imported[through].rsplit(".", 1)[0] if through == checker else imported[through])
            answers, answer_cells = [], []
            for function, module, solution in choices:
                stubs = [i for i in range(index, -1, -1)
                         if cells[i].cell_type == "code" and function in defined_functions(cells[i].source)]
                if not stubs:
                    raise ValueError(f"{notebook.name}: {checker} checks {function}, which no cell above defines")
                answers.append(Answer(function, solution))
                if stubs[0] not in answer_cells:
                    answer_cells.append(stubs[0])
                modules.add(module)
            exercises.append(Exercise(checker, tuple(answers), tuple(answer_cells)))
    if not exercises:
        raise ValueError(f"{notebook.name}: no checker cell of the form check_x(f if written else "
                         "load_solution(lesson, name)): nothing to grade")
    if len(modules) != 1:
        raise ValueError(f"{notebook.name}: exercises from several solution modules {sorted(modules)}")
    if len(checker_modules) != 1:
        raise ValueError(f"{notebook.name}: checkers imported from several modules {sorted(checker_modules)}")
    lesson = Lesson(notebook.stem, modules.pop(), notebook, tuple(exercises), checker_modules.pop())
    _check_sources(lesson)
    return lesson


def _check_sources(lesson: Lesson) -> None:
    """Every checker and every solution exists where the sheet will import it from."""
    notebook, exercises = lesson.notebook, lesson.exercises
    checkers, solutions = lesson.checkers_file, solutions_root() / f"{lesson.module}.py"
    for path in (checkers, solutions):
        if not path.exists():
            raise ValueError(f"{notebook.name}: {path} is missing")
    have_checkers, have_solutions = top_level_names(checkers), top_level_names(solutions)
    for exercise in exercises:
        if exercise.checker not in have_checkers:
            raise ValueError(f"{notebook.name}: {exercise.checker} is not defined in {checkers}")
        for answer in exercise.answers:
            if answer.solution not in have_solutions:
                raise ValueError(f"{notebook.name}: {answer.solution} is not defined in {solutions}")


def gradable_lessons(notebooks: Path) -> tuple[list[Lesson], dict[str, str]]:
    """Every lesson notebook with graded exercises, and why each other one has none."""
    lessons, skipped = [], {}
    for notebook in sorted(notebooks.glob("[0-9]*.ipynb")):
        try:
            lessons.append(read_lesson(notebook))
        except ValueError as reason:
            skipped[notebook.stem] = str(reason)
    return lessons, skipped
