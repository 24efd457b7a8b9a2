"""The slide decks: every figure they show exists and was drawn by a maker; each deck renders in headless Chromium
with every slide's content present, its images loaded and nothing overflowing the slide."""
from __future__ import annotations

import base64
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLIDES = ROOT / "slides"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
LESSONS_WITH_FIGURES = tuple(sorted(path.stem for path in SLIDES.glob("[0-9][0-9]*_*.md")))  # every deck (NN_, NNb_)


def slides_module(name: str):
    if str(SLIDES) not in sys.path:
        sys.path.insert(0, str(SLIDES))
    return importlib.import_module(name)


def deck_paths() -> list[Path]:
    return sorted(SLIDES.glob("[0-9][0-9]*_*.md"))


def test_every_figure_a_deck_shows_is_committed_and_made_by_its_maker():
    figures = slides_module("figures")
    assert figures.missing_figures() == [], "run python slides/figures.py"
    for stem in LESSONS_WITH_FIGURES:
        number, lesson = stem.split("_", 1)
        shown = figures.referenced_figures(SLIDES / f"{stem}.md")
        assert shown, f"{stem} shows no figure"
        assert all(Path(f).name.startswith(number + "_") for f in shown), f"{stem}: figures are named {number}_<name>.png"
        assert figures.maker(lesson) is not None, f"slides/makers/{lesson}.py is missing"
        maker_text = (SLIDES / "makers" / f"{lesson}.py").read_text()
        for figure in shown:
            name = Path(figure).stem[len(number) + 1:]
            assert f'"{name}"' in maker_text, f"{figure} is not drawn by slides/makers/{lesson}.py"


def test_ring_diagram_follows_the_ring_and_ends_with_every_sum():
    ring = slides_module("makers.collectives")
    states = ring.ring_states(4)
    assert len(states) == 2 * (4 - 1) + 1
    title, held, sent = states[1]
    assert sent == [3, 0, 1, 2], "reduce-scatter step 2: rank r sends chunk (r - 1)"
    assert held[1][0] == frozenset({0, 1}), "after step 1, rank 1 holds chunk 0 summed with rank 0's"


def test_a_missing_figure_fails_the_build(tmp_path):
    build = slides_module("build")
    deck = tmp_path / "99_broken.md"
    deck.write_text("# broken\n\n---\n\n![gone](figures/99_gone.png)\n")
    with pytest.raises(build.MissingFigure, match="slides/figures.py"):
        build.build_deck(deck, tmp_path / "out")


# --- a real browser, through the Chrome DevTools protocol -------------------------------------------------

MEASURE = """
(() => {
  const slides = [...document.querySelectorAll('section')];
  return JSON.stringify(slides.map((section, index) => {
    slides.forEach((s, k) => s.classList.toggle('current', k === index));
    const images = [...section.querySelectorAll('img')];
    return {text: section.innerText.trim().length, images: images.length,
            loaded: images.filter(i => i.complete && i.naturalWidth > 0).length,
            scrollHeight: section.scrollHeight, clientHeight: section.clientHeight,
            scrollWidth: section.scrollWidth, clientWidth: section.clientWidth};
  }));
})()
"""


class Browser:
    """Headless Chromium driven over its DevTools websocket (websocket-client, installed with Jupyter)."""

    def __init__(self, executable: str, profile: Path, width: int = 1280, height: int = 720):
        import websocket
        self.process = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--remote-debugging-port=0", "--remote-allow-origins=*",
             f"--window-size={width},{height}",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file, deadline = profile / "DevToolsActivePort", time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.monotonic() < deadline and self.process.poll() is None, "chromium did not start"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as answer:
            page = next(t for t in json.load(answer) if t["type"] == "page")
        self.socket = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30)
        self.calls = 0
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, **params) -> dict:
        self.calls += 1
        self.socket.send(json.dumps({"id": self.calls, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == self.calls:
                assert "error" not in message, message
                return message["result"]

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def open(self, path: Path) -> None:
        self.call("Page.navigate", url=path.as_uri())
        deadline = time.monotonic() + 30
        while self.evaluate("document.readyState + ':' + [...document.images].every(i => i.complete)") != "complete:true":
            assert time.monotonic() < deadline, f"{path.name} did not finish loading"
            time.sleep(0.1)

    def screenshot(self, target: Path) -> None:
        target.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self.socket.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    executable = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)
    if executable is None:
        pytest.skip("no chromium installed: `apt-get install -y chromium` (Debian) to render the decks")
    pytest.importorskip("websocket", reason="websocket-client (a Jupyter dependency) drives the browser")
    session = Browser(executable, tmp_path_factory.mktemp("chromium-profile"))
    yield session
    session.close()


def images_per_slide(deck: Path) -> list[int]:
    build = slides_module("build")
    return [len(re.findall(r"!\[[^\]]*\]\([^)]+\)", part)) for part in build.split_slides(deck.read_text())]


@pytest.mark.parametrize("deck", deck_paths(), ids=lambda p: p.stem)
def test_deck_renders_every_slide_whole_in_a_browser(deck, browser, tmp_path):
    build = slides_module("build")
    page = build.build_deck(deck, tmp_path)
    browser.open(page)
    slides = json.loads(browser.evaluate(MEASURE))
    expected = images_per_slide(deck)
    assert len(slides) == len(expected)
    for number, (slide, images) in enumerate(zip(slides, expected), start=1):
        where = f"{deck.name}, slide {number}"
        assert slide["text"] > 0, f"{where} is empty"
        assert slide["images"] == images and slide["loaded"] == images, f"{where}: {slide['loaded']} of {images} images shown"
        assert slide["scrollHeight"] <= slide["clientHeight"], f"{where} overflows downwards: {slide}"
        assert slide["scrollWidth"] <= slide["clientWidth"], f"{where} overflows sideways: {slide}"
    screenshots = os.environ.get("SLIDES_SCREENSHOTS")
    if screenshots:
        for number, images in enumerate(expected, start=1):
            if images:
                browser.evaluate(f"show({number - 1})")
                browser.screenshot(Path(screenshots) / f"{deck.stem}_slide{number}.png")
