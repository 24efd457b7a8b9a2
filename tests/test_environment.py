"""environment.yml and requirements.txt pin the same packages; the slides build offline."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pins(lines):
    return {line.split("==")[0].strip().lower(): line.split("==")[1].strip()
            for line in lines if "==" in line and not line.strip().startswith("#")}


def test_environment_yml_matches_requirements():
    requirements = pins((ROOT / "requirements.txt").read_text().splitlines())
    pip_section = [re.sub(r"^\s*-\s*", "", line) for line in (ROOT / "environment.yml").read_text().splitlines()
                   if re.match(r"^\s{4,}-\s", line)]
    assert requirements and pins(pip_section) == requirements


def test_every_notebook_has_a_slide_deck_and_decks_build(tmp_path):
    import sys
    sys.path.insert(0, str(ROOT / "slides"))
    import build
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    decks = sorted(p.stem for p in (ROOT / "slides").glob("[0-9][0-9]_*.md"))
    assert notebooks and notebooks == decks
    for deck in decks:
        page = build.build_deck(ROOT / "slides" / f"{deck}.md", tmp_path).read_text()
        assert page.count("<section>") >= 3
        assert "http://" not in page and "https://cdn" not in page
