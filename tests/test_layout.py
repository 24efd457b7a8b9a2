"""The package's layout and its import rule (COURSE.md, "Architecture"): folders by floor, one folder per lesson,
imports that only point down, read from the code's own imports (function-level ones included)."""
import ast
import re
from pathlib import Path

import pytest

from labsrc.core.paths import LESSONS, PACKAGE, REPO
from labsrc.launch.request import course_labs

# Each folder of labsrc/ and the folders its modules may import (itself included): every arrow points down.
FLOORS = ("core", "nodes", "launch", "training", "techniques", "lessons")
MAY_IMPORT = {folder: set(FLOORS[:index + 1]) for index, folder in enumerate(FLOORS)}
MAY_IMPORT["classroom"] = {"core", "launch", "classroom"}
MAY_IMPORT["grading"] = {"core", "classroom", "grading"}
MAY_IMPORT["doctor"] = MAY_IMPORT["bench"] = set(FLOORS)
TOP_FILES = {"__init__.py", "doctor.py", "bench.py"}
LAUNCH_INSIDE = re.compile(r"labsrc\.launch\.")  # a module of the launcher's own, not its face (labsrc.launch)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The labsrc modules a file imports, at its top or inside functions: `from a import b` counts as a.b when a.b is
    a module, else as a; relative imports are resolved against the file's package."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {name for name in found if name.split(".")[0] == "labsrc"}


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(path, set(modules)) for name, path in modules.items()}


def folder_of(module: str) -> str:
    """labsrc.lessons.zero.lab -> "lessons"; labsrc.doctor -> "doctor"; labsrc -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def lesson_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "lessons" else None


def role(module: str) -> str:
    """'lab', 'plots', 'exercises' (exercises.py or <notebook word>_exercises.py) or 'mechanism'."""
    leaf = module.rsplit(".", 1)[-1]
    if leaf == "lab" or leaf.startswith("lab_"):
        return "lab"
    if leaf == "plots":
        return "plots"
    if leaf == "exercises" or leaf.endswith("_exercises"):
        return "exercises"
    return "mechanism"


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for name in graph.get(todo.pop(), ()):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles: each found once, as a path that ends where it began."""
    found, state = [], {}

    def visit(name, path):
        state[name] = "open"
        for other in sorted(graph.get(name, ())):
            if state.get(other) == "open":
                found.append(path[path.index(other):] + [other])
            elif other in graph and other not in state:
                visit(other, path + [other])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return found


def broken_rules(graph: dict[str, set[str]]) -> list[str]:
    """Every import that breaks COURSE.md's rule, said in a line each; [] when the layout holds."""
    broken = []
    above_lab = {module for module in graph if lesson_of(module) and role(module) != "lab"
                 and any(role(other) == "lab" and lesson_of(other) == lesson_of(module)
                         for other in reaches(graph, module))}
    for module, imported in sorted(graph.items()):
        folder, lesson = folder_of(module), lesson_of(module)
        for target in sorted(imported):
            target_folder, target_lesson = folder_of(target), lesson_of(target)
            if folder and target_folder and target_folder not in MAY_IMPORT.get(folder, set()):
                broken.append(f"{module} imports {target}: {folder}/ may import only "
                              f"{', '.join(sorted(MAY_IMPORT.get(folder, set())))}")
            if folder == "lessons" and LAUNCH_INSIDE.match(target):
                broken.append(f"{module} imports {target}: a lesson imports the launcher as labsrc.launch")
            if target_lesson is None or module == target:
                continue
            if role(target) in ("plots", "exercises"):
                broken.append(f"{module} imports {target}: nothing in labsrc imports a lesson's {role(target)}")
            elif lesson == target_lesson and role(module) == "exercises" and (role(target) == "lab"
                                                                               or target in above_lab):
                broken.append(f"{module} imports {target}: exercises import the lesson's mechanisms only")
            elif lesson and lesson != target_lesson and (role(target) == "lab" or target in above_lab):
                broken.append(f"{module} imports {target}: another lesson is imported through its mechanisms only")
    lessons = {}
    for module, imported in graph.items():
        for target in imported:
            if lesson_of(module) and lesson_of(target) and lesson_of(module) != lesson_of(target):
                lessons.setdefault(lesson_of(module), set()).add(lesson_of(target))
    broken += [f"import circle: {' -> '.join(circle)}" for circle in cycles(graph)]
    broken += [f"lessons import each other in a circle: {' -> '.join(circle)}" for circle in cycles(lessons)]
    return broken


def test_the_package_keeps_the_import_rule():
    assert broken_rules(import_graph()) == []


def test_nothing_lies_loose_at_the_top_of_the_package():
    loose = sorted(path.name for path in PACKAGE.iterdir()
                   if path.suffix == ".py" and path.name not in TOP_FILES)
    assert loose == [], f"modules belong in a folder of labsrc/ (COURSE.md, Architecture): {loose}"
    folders = sorted(path.name for path in PACKAGE.iterdir() if path.is_dir() and path.name != "__pycache__")
    assert set(folders) == set(MAY_IMPORT) - {"doctor", "bench"}, folders
    for folder in PACKAGE.rglob("*"):
        if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py")):
            assert (folder / "__init__.py").is_file(), f"{folder} has modules but no __init__.py"


def lesson_folder(notebook: Path) -> Path:
    """notebooks/NN_<lesson>.ipynb -> labsrc/lessons/<lesson>; a lesson's second notebook (NNb_<word>) lives in NN's."""
    number, name = notebook.stem.split("_", 1)
    if (LESSONS / name).is_dir() or not number.endswith("b"):
        return LESSONS / name
    first = next(REPO.glob(f"notebooks/{number[:-1]}_*.ipynb"))
    return LESSONS / first.stem.split("_", 1)[1]


@pytest.mark.parametrize("notebook", sorted(REPO.glob("notebooks/[0-9]*.ipynb")), ids=lambda path: path.stem)
def test_every_notebook_finds_its_code_in_one_lesson_folder(notebook):
    folder = lesson_folder(notebook)
    assert (folder / "lab.py").is_file() and (folder / "exercises.py").is_file(), \
        f"{notebook.name}: its lab and exercises belong in {folder.relative_to(REPO)}/"
    text = notebook.read_text()
    assert f"labsrc.lessons.{folder.name}" in text, f"{notebook.name} does not use its lesson's folder"


def test_every_lab_is_a_lesson_folders_lab_file():
    labs = course_labs()
    folders = sorted(path.name for path in LESSONS.iterdir() if (path / "lab.py").is_file())
    assert set(folders) <= set(labs)
    for name, module in labs.items():
        assert module.startswith("labsrc.lessons.") and role(module) == "lab", (name, module)


PLANTED = {
    "labsrc.core.world": {"labsrc.launch"},                                       # core reaching up
    "labsrc.lessons.alpha.lab": {"labsrc.lessons.alpha.mechanism"},
    "labsrc.lessons.alpha.mechanism": set(),
    "labsrc.lessons.alpha.analysis": {"labsrc.lessons.alpha.lab"},                  # reads the lab's records: fine
    "labsrc.lessons.alpha.exercises": {"labsrc.lessons.alpha.analysis"},            # exercises above the lab
    "labsrc.lessons.beta.lab": {"labsrc.lessons.alpha.lab", "labsrc.launch.running"},  # another lesson's lab
    "labsrc.lessons.beta.mechanism": {"labsrc.lessons.beta.plots"},               # a mechanism drawing
    "labsrc.lessons.beta.plots": set(),
    "labsrc.launch": set(),
    "labsrc.launch.running": set(),
}


def test_the_rule_names_each_kind_of_planted_break():
    said = "\n".join(broken_rules(PLANTED))
    assert "labsrc.core.world imports labsrc.launch: core/ may import only core" in said
    assert "alpha.exercises imports labsrc.lessons.alpha.analysis: exercises import" in said
    assert "beta.lab imports labsrc.lessons.alpha.lab: another lesson" in said
    assert "beta.lab imports labsrc.launch.running: a lesson imports the launcher as labsrc.launch" in said
    assert "beta.mechanism imports labsrc.lessons.beta.plots: nothing in labsrc imports" in said
    assert "alpha.analysis" not in said.replace("imports labsrc.lessons.alpha.analysis", "")
    circle = {"labsrc.core.a": {"labsrc.core.b"}, "labsrc.core.b": {"labsrc.core.a"}}
    assert broken_rules(circle) == ["import circle: labsrc.core.a -> labsrc.core.b -> labsrc.core.a"]
