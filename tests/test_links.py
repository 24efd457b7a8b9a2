"""Every relative link in the course's Markdown and notebooks reaches a file that exists (and its anchor, for
``#anchor``), so it resolves both in JupyterLab served from the repository root (``make lab``) and on a rendered page."""
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
EXTERNAL = ("http://", "https://", "mailto:")


def tracked(pattern: str) -> list[Path]:
    listing = subprocess.run(["git", "ls-files", pattern], cwd=ROOT, capture_output=True, text=True).stdout
    paths = [ROOT / line for line in listing.splitlines() if line]
    return paths or sorted(ROOT.glob(f"**/{pattern}"))


def markdown_of(path: Path) -> str:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")
    return path.read_text()


def links(text: str) -> list[str]:
    return LINK.findall(INLINE_CODE.sub("", FENCE.sub("", text)))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"<[^>]+>", "", INLINE_CODE.sub(lambda code: code.group(0).strip("`"), heading))
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The explicit anchors (<a id="...">) of a page: JupyterLab's Markdown viewer scrolls to those, not to
    GitHub's lower-case heading slugs (its heading ids keep the capitals: "Bus-bandwidth"), checked in Chromium."""
    return set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", FENCE.sub("", markdown_of(path))))


def headings(path: Path) -> list[str]:
    return re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", markdown_of(path)), re.M)


SOURCES = [*tracked("*.md"), *tracked("*.ipynb")]


def test_sources_are_found():
    names = {path.relative_to(ROOT).as_posix() for path in SOURCES}
    assert {"README.md", "docs/glossary.md", "notebooks/00_setup.ipynb"} <= names


@pytest.mark.parametrize("source", SOURCES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_its_heading(source):
    broken = []
    for target in links(markdown_of(source)):
        if target.startswith(EXTERNAL):
            continue
        if target.startswith("/"):
            broken.append(f"{target}: absolute (it breaks in JupyterLab and on a rendered page; make it relative)")
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (source.parent / file_part).resolve() if file_part else source
        if not resolved.exists():
            broken.append(f"{target}: no such file {resolved.relative_to(ROOT) if ROOT in resolved.parents else resolved}")
        elif ROOT not in resolved.parents and resolved != ROOT:
            broken.append(f"{target}: outside the repository, which make lab serves")
        elif anchor and resolved.suffix in (".md", ".ipynb") and anchor not in anchors(resolved):
            broken.append(f"{target}: {resolved.name} has no heading with anchor #{anchor}")
    assert not broken, f"{source.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_every_glossary_term_carries_its_anchor():
    """A link to any term works in JupyterLab and on GitHub: each heading holds <a id="its GitHub slug">."""
    page = ROOT / "docs" / "glossary.md"
    missing = [text for text in headings(page) if f'<a id="{slug(text)}"></a>' not in text]
    assert len(headings(page)) > 50 and not missing, missing


def test_slug_matches_githubs_rule():
    assert slug("Bus bandwidth") == "bus-bandwidth"
    assert slug("`no_sync`") == "no_sync" and slug("All-reduce") == "all-reduce"
    assert slug("DistributedSampler (notebook 03)") == "distributedsampler-notebook-03"
    assert slug('<a id="rank"></a>Rank') == "rank"


def test_a_broken_link_is_caught(tmp_path):
    page = ROOT / "docs" / "glossary.md"
    assert "no-such-heading" not in anchors(page) and "rank" in anchors(page)
    assert links("see [a](../docs/x.md#y) and `[b](not/a/link.md)`") == ["../docs/x.md#y"]
