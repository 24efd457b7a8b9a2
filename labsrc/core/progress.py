"""Live progress of a run, drawn from its ranks' progress records: widgets in Jupyter, plain lines elsewhere."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

HEADLESS_ENV = "LABSRC_HEADLESS"


def in_notebook() -> bool:
    """True inside a Jupyter kernel that a person is watching (not under LABSRC_HEADLESS=1)."""
    if os.environ.get(HEADLESS_ENV) == "1":
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class RecordTail:
    """Reads the records each rank appended since the last call."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._offsets: dict[Path, int] = {}

    def new_records(self) -> list[dict]:
        found = []
        for path in self.run_dir.glob("rank*.jsonl"):
            offset = self._offsets.get(path, 0)
            with open(path) as handle:
                handle.seek(offset)
                chunk = handle.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            self._offsets[path] = offset + len(complete.encode())
            found += [json.loads(line) for line in complete.splitlines() if line.strip()]
        return found


class PlainProgress:
    """One line every few seconds: `[progress] lab: rank0 5/12 | rank1 5/12`."""

    def __init__(self, name: str, nproc: int, run_dir: Path, every_s: float = 3.0):
        self.name, self.nproc = name, nproc
        self.tail = RecordTail(run_dir)
        self.state: dict[int, tuple[int, int]] = {}
        self.every_s = every_s
        self._last_print = time.perf_counter()
        self._printed_state: dict = {}

    def update(self, force: bool = False) -> None:
        for record in self.tail.new_records():
            if record.get("kind") == "progress":
                self.state[record["rank"]] = (record["step"], record["total"])
        due = time.perf_counter() - self._last_print >= self.every_s
        if self.state and self.state != self._printed_state and (due or force):
            parts = [f"rank{r} {s}/{t}" for r, (s, t) in sorted(self.state.items())]
            print(f"[progress] {self.name}: " + " | ".join(parts), flush=True)
            self._printed_state = dict(self.state)
            self._last_print = time.perf_counter()

    def close(self) -> None:
        self.update(force=True)


class WidgetProgress(PlainProgress):
    """One ipywidgets progress bar per rank, updated in place."""

    def __init__(self, name: str, nproc: int, run_dir: Path):
        super().__init__(name, nproc, run_dir)
        import ipywidgets as widgets
        from IPython.display import display
        self.bars = [widgets.IntProgress(value=0, min=0, max=1, description=f"rank {r}")
                     for r in range(nproc)]
        self.labels = [widgets.Label("waiting") for _ in range(nproc)]
        rows = [widgets.HBox([bar, label]) for bar, label in zip(self.bars, self.labels)]
        display(widgets.VBox([widgets.HTML(f"<b>{name}</b> on {nproc} rank(s)"), *rows]))

    def update(self, force: bool = False) -> None:
        for record in self.tail.new_records():
            if record.get("kind") != "progress" or record["rank"] >= self.nproc:
                continue
            bar = self.bars[record["rank"]]
            bar.max, bar.value = max(1, record["total"]), record["step"]
            self.labels[record["rank"]].value = f"{record['step']}/{record['total']}"

    def close(self) -> None:
        self.update()


def make_progress(name: str, nproc: int, run_dir: Path):
    if in_notebook():
        try:
            return WidgetProgress(name, nproc, run_dir)
        except ImportError:
            pass
    return PlainProgress(name, nproc, run_dir)
