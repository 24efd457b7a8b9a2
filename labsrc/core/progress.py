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


ENDINGS = ("done", "failed", "stopped")


class PlainProgress:
    """Plain lines, one when the counts changed and a few seconds passed, and one at the end (CI logs stay short).

    `[progress] pipeline_parallel: rank0 12/40 micro-batches | rank1 10/40 micro-batches`, then
    `[progress] pipeline_parallel: done (rank0 40/40 micro-batches | ...)`.
    """

    def __init__(self, name: str, nproc: int, run_dir: Path, every_s: float = 5.0):
        self.name, self.nproc = name, nproc
        self.tail = RecordTail(run_dir)
        self.state: dict[int, tuple[int, int, str]] = {}
        """{rank: (done, total, unit)} from each rank's last progress record."""
        self.every_s = every_s
        self.ending: str | None = None
        self._last_print = time.perf_counter()
        self._printed_state: dict = {}

    def _read(self) -> bool:
        changed = False
        for record in self.tail.new_records():
            if record.get("kind") == "progress":
                self.state[record["rank"]] = (record["step"], record["total"], record.get("unit", "steps"))
                changed = True
        return changed

    def counts(self) -> str:
        return " | ".join(f"rank{r} {done}/{total} {unit}" for r, (done, total, unit) in sorted(self.state.items()))

    def pool_message(self, message: str) -> None:
        """News of the class server's pool before the run starts: "waiting for 2 GPUs: 3 runs ahead"."""
        print(f"[pool] {self.name}: {message}", flush=True)

    def update(self) -> None:
        self._read()
        due = time.perf_counter() - self._last_print >= self.every_s
        if self.state and self.state != self._printed_state and due:
            print(f"[progress] {self.name}: {self.counts()}", flush=True)
            self._printed_state = dict(self.state)
            self._last_print = time.perf_counter()

    def close(self, ending: str = "done") -> None:
        """The run ended: `ending` is "done", "failed", "stopped" or "stopped (timeout)"."""
        self._read()
        self.ending = ending
        counts = f" ({self.counts()})" if self.state else ""
        print(f"[progress] {self.name}: {ending}{counts}", flush=True)


class WidgetProgress(PlainProgress):
    """One ipywidgets bar per rank, each with what it counts; the header and labels end on done/failed/stopped."""

    STYLES = {"done": "success", "failed": "danger", "stopped": "warning"}

    def __init__(self, name: str, nproc: int, run_dir: Path):
        super().__init__(name, nproc, run_dir)
        import ipywidgets as widgets
        from IPython.display import display
        self.bars = [widgets.IntProgress(value=0, min=0, max=1, description=f"rank {r}") for r in range(nproc)]
        self.labels = [widgets.Label("starting") for _ in range(nproc)]
        self.header = widgets.HTML(self._header("starting"))
        rows = [widgets.HBox([bar, label]) for bar, label in zip(self.bars, self.labels)]
        self.box = widgets.VBox([self.header, *rows])
        display(self.box)

    def _header(self, status: str) -> str:
        return f"<b>{self.name}</b> on {self.nproc} rank(s): <span class='labsrc-progress-state'>{status}</span>"

    def _draw(self) -> None:
        for rank, (done, total, unit) in self.state.items():
            if rank < self.nproc:
                self.bars[rank].max, self.bars[rank].value = max(1, total), min(done, max(1, total))
                self.labels[rank].value = f"{done}/{total} {unit}"

    def pool_message(self, message: str) -> None:
        self.header.value = self._header(message)

    def update(self) -> None:
        if self._read():
            self.header.value = self._header("running")
            self._draw()

    def close(self, ending: str = "done") -> None:
        self._read()
        self.ending = ending
        self._draw()
        style = self.STYLES[ending.split()[0]]
        for rank, (bar, label) in enumerate(zip(self.bars, self.labels)):
            done, total, unit = self.state.get(rank, (0, 0, ""))
            if ending == "done":
                bar.max, bar.value = max(1, total), max(1, total)
            if rank in self.state:
                label.value = f"{ending}: {done}/{total} {unit}"
            else:
                label.value = ending if ending == "done" else f"{ending} (no progress reported)"
            bar.bar_style = style
        self.header.value = self._header(ending)


def make_progress(name: str, nproc: int, run_dir: Path):
    if in_notebook():
        try:
            return WidgetProgress(name, nproc, run_dir)
        except ImportError:
            pass
    return PlainProgress(name, nproc, run_dir)
