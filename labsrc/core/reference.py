"""Reference results measured on real GPUs by our own runs, kept under results/ with their provenance."""
from __future__ import annotations

import json
from pathlib import Path

from labsrc.core.paths import REPO


def results_root() -> Path:
    return REPO / "results"


def load_reference(name: str) -> list[dict]:
    """Every results/<name>/*.json (one run each, with hardware and versions); [] when none exist yet."""
    folder = results_root() / name
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))] if folder.is_dir() else []
