"""Where the checkout's folders are: one root for every module, however deep it sits in labsrc/."""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The checkout's top: labsrc/, notebooks/, solutions/, cluster/, results/, runs/ and data/ sit in it."""
PACKAGE = REPO / "labsrc"
"""The package's own folder (ranks and holders get REPO on PYTHONPATH so they import it from here)."""
LESSONS = PACKAGE / "lessons"
"""One folder per lesson: labsrc/lessons/<lesson>/ (lab.py, plots.py, exercises.py and its mechanisms)."""


def python_path() -> str:
    """A PYTHONPATH for a child process: this checkout first (its labsrc wins), then the one this process has."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
