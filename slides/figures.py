"""Draw every deck's figures into slides/figures/ from a `ci` run, with the course's own plot functions.

`python slides/figures.py [lesson ...]` runs, for each deck slides/NN_<lesson>.md that has a maker
(slides/makers/<lesson>.py, see its package docstring), the lesson's lab in the ci profile and writes
slides/figures/NN_<name>.png; then it lists any figure a deck references that is still missing.
The PNGs are committed, so `python slides/build.py` builds every deck offline without running anything.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import tempfile
from pathlib import Path

from labsrc.core.processes import environment_set

HERE = Path(__file__).resolve().parent
FIGURES = HERE / "figures"
REFERENCE = re.compile(r"!\[[^\]]*\]\((figures/[^)\s]+)\)")


def ci_environment(runs_folder: Path):
    """The ci profile, no widgets, and runs kept in runs_folder; the previous environment restored after."""
    return environment_set({"LABSRC_PROFILE": "ci", "LABSRC_HEADLESS": "1", "LABSRC_RUNS": str(runs_folder)})


DECKS = "[0-9][0-9]*_*.md"  # NN_<lesson>.md, and NNb_<lesson>.md for a lesson between two numbers


def deck_number(deck: Path) -> str:
    """"06b" for slides/06b_across_nodes.md: what its figures' names start with."""
    return deck.stem.split("_", 1)[0]


def decks() -> dict[str, Path]:
    """{lesson: deck path} for every slides/NN_<lesson>.md (and NNb_<lesson>.md)."""
    return {path.stem.split("_", 1)[1]: path for path in sorted(HERE.glob(DECKS))}


def referenced_figures(deck: Path) -> list[str]:
    """The figures/... paths a deck's Markdown shows, in order."""
    return REFERENCE.findall(deck.read_text())


def measured_note() -> str:
    import torch
    return (f"measured: ci profile, gloo ranks on {os.cpu_count()} shared CPU cores, torch {torch.__version__}"
            " (python slides/figures.py)")


def saver(number: str, out: Path, written: list[Path]):
    """save(name, figure, measured=True): the PNG out/NN_<name>.png, stamped with where its numbers came from."""
    import matplotlib.pyplot as plt

    def save(name: str, figure, measured: bool = True) -> Path:
        note = measured_note() if measured else "diagram drawn in code by slides/makers (not a measurement)"
        figure.text(0.995, -0.01, note, ha="right", va="top", fontsize=7, color="#6b7280")
        path = out / f"{number}_{name}.png"
        figure.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
        plt.close(figure)
        written.append(path)
        print(f"  wrote {path.relative_to(HERE)}")
        return path
    return save


def maker(lesson: str):
    """slides/makers/<lesson>.py, or None when that deck has no maker yet."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    try:
        return importlib.import_module(f"makers.{lesson}")
    except ModuleNotFoundError as missing:
        if missing.name == f"makers.{lesson}":
            return None
        raise


def make_figures(lessons: list[str], out: Path = FIGURES) -> list[Path]:
    """Run each lesson's maker in the ci profile; returns the PNGs written."""
    import matplotlib
    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    available = decks()
    with tempfile.TemporaryDirectory(prefix="slides-runs-") as runs_folder, ci_environment(Path(runs_folder)):
        for lesson in lessons:
            module = maker(lesson)
            if module is None:
                print(f"{available[lesson].name}: no slides/makers/{lesson}.py, nothing drawn")
                continue
            print(f"{available[lesson].name}:")
            module.make(saver(deck_number(available[lesson]), out, written))
    return written


def missing_figures(out: Path = FIGURES) -> list[str]:
    """'deck: figure' for every figure a deck references that is not on disk."""
    return [f"{deck.name}: {figure}" for deck in decks().values() for figure in referenced_figures(deck)
            if not (out.parent / figure).exists()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lessons", nargs="*", help="lessons to draw (default: every deck with a maker)")
    options = parser.parse_args(argv)
    unknown = sorted(set(options.lessons) - set(decks()))
    if unknown:
        parser.error(f"no deck for {unknown}; decks: {sorted(decks())}")
    make_figures(options.lessons or list(decks()))
    missing = missing_figures()
    for line in missing:
        print(f"missing: {line}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
