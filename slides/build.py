"""Build every slides/NN_*.md deck into a self-contained HTML file in slides/build/ (no network, no CDN).

A deck is Markdown; a line holding only `---` starts a new slide. Arrow keys, space and PageUp/PageDown
move between slides; `p` prints every slide on its own page. Images are inlined as data URIs: a deck's
figures are the committed slides/figures/NN_*.png, drawn from a ci run by `python slides/figures.py`.
"""
from __future__ import annotations

import argparse
import base64
import html
import mimetypes
import re
import sys
from pathlib import Path

import markdown

HERE = Path(__file__).resolve().parent

STYLE = """
body { margin: 0; font-family: system-ui, sans-serif; background: #1e1e24; }
section { display: none; box-sizing: border-box; width: 100vw; height: 100vh; padding: 4vh 6vw;
  background: #fdfdfd; color: #222; font-size: 2.6vh; overflow: auto; }
section.current { display: block; }
h1 { font-size: 5.5vh; color: #9a3412; } h2 { font-size: 4.2vh; color: #9a3412; }
code, pre { font-family: ui-monospace, monospace; background: #f1f1f4; }
pre { padding: 1.2vh 1.5vw; border-radius: 6px; font-size: 2.1vh; overflow-x: auto; }
table { border-collapse: collapse; } td, th { border: 1px solid #bbb; padding: .4em .8em; }
img { display: block; margin: 1vh auto; max-width: 88%; max-height: 58vh; object-fit: contain; }
footer { position: fixed; bottom: 1vh; right: 2vw; color: #888; font-size: 1.8vh; }
@media print { section { display: block; page-break-after: always; height: auto; } footer { display: none; } }
"""

SCRIPT = """
const slides = [...document.querySelectorAll('section')];
let current = Math.max(0, Math.min(slides.length - 1, parseInt(location.hash.slice(1) || '1') - 1));
function show(i) {
  current = Math.max(0, Math.min(slides.length - 1, i));
  slides.forEach((s, k) => s.classList.toggle('current', k === current));
  document.querySelector('footer').textContent = (current + 1) + ' / ' + slides.length;
  history.replaceState(null, '', '#' + (current + 1));
}
document.addEventListener('keydown', e => {
  if (['ArrowRight', 'ArrowDown', 'PageDown', ' '].includes(e.key)) show(current + 1);
  if (['ArrowLeft', 'ArrowUp', 'PageUp'].includes(e.key)) show(current - 1);
  if (e.key === 'Home') show(0);
  if (e.key === 'End') show(slides.length - 1);
  if (e.key === 'p') window.print();
});
document.addEventListener('click', e => show(current + (e.clientX > innerWidth / 3 ? 1 : -1)));
show(current);
"""


def split_slides(text: str) -> list[str]:
    return [part.strip() for part in re.split(r"^---\s*$", text, flags=re.M) if part.strip()]


class MissingFigure(FileNotFoundError):
    """A deck shows an image that is not on disk."""


def inline_images(body: str, folder: Path) -> str:
    """Replace src="relative.png" with a data URI so the deck is one file; a missing file is an error."""
    def replace(match: re.Match) -> str:
        path = folder / match.group(1)
        if match.group(1).startswith(("http:", "https:", "data:")):
            return match.group(0)
        if not path.exists():
            raise MissingFigure(f"{path} is shown by a slide but missing: draw it with "
                                f"`python slides/figures.py` (slides/makers/ holds each deck's figure maker)")
        kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return f'src="data:{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"'
    return re.sub(r'src="([^"]+)"', replace, body)


def build_deck(source: Path, out_dir: Path) -> Path:
    text = source.read_text()
    title_match = re.search(r"^#\s+(.+)$", text, flags=re.M)
    title = title_match.group(1) if title_match else source.stem
    sections = []
    for part in split_slides(text):
        body = markdown.markdown(part, extensions=["fenced_code", "tables"])
        sections.append(f"<section>{inline_images(body, source.parent)}</section>")
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(sections)}<footer></footer>"
            f"<script>{SCRIPT}</script></body></html>")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / (source.stem + ".html")
    target.write_text(page)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "build", help="output folder")
    parser.add_argument("decks", nargs="*", type=Path, help="decks to build (default: every NN_*.md)")
    options = parser.parse_args(argv)
    decks = options.decks or sorted(HERE.glob("[0-9][0-9]*_*.md"))  # NN_ and NNb_ decks
    for deck in decks:
        target = build_deck(deck, options.out)
        print(f"{deck.name} -> {target} ({len(split_slides(deck.read_text()))} slides)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
