"""Per-rank records (JSONL), the run directory, timers and run summaries."""
from __future__ import annotations

import json
import math
import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

RUN_DIR_ENV = "LABSRC_RUN_DIR"
RUNS_ROOT_ENV = "LABSRC_RUNS"


def runs_root() -> Path:
    """Where runs are kept: $LABSRC_RUNS, else runs/ at the top of the course checkout."""
    if os.environ.get(RUNS_ROOT_ENV):
        return Path(os.environ[RUNS_ROOT_ENV])
    return Path(__file__).resolve().parents[1] / "runs"


def new_run_dir(lab: str, root: Path | None = None) -> Path:
    """A fresh runs/<lab>/<run_id>/ directory; the id sorts by time and never collides."""
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    path = Path(root or runs_root()) / lab / run_id
    path.mkdir(parents=True, exist_ok=False)
    return path


def _plain(value):
    """JSON-safe numbers: tensors become Python numbers, NaN and inf become strings."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class RecordWriter:
    """Appends one JSON object a line to runs/<lab>/<run_id>/rank<r>.jsonl."""

    def __init__(self, run_dir: Path | str, rank: int):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.path = self.run_dir / f"rank{rank}.jsonl"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self._start = time.perf_counter()

    def write(self, kind: str, **fields) -> dict:
        record = {"kind": kind, "rank": self.rank, "t": round(time.perf_counter() - self._start, 6)}
        record.update(_plain(fields))
        self._file.write(json.dumps(record) + "\n")
        return record

    def progress(self, step: int, total: int, **fields) -> dict:
        """A progress record: the launcher draws one bar per rank from these."""
        return self.write("progress", step=step, total=total, **fields)

    def close(self) -> None:
        self._file.close()


def read_records(run_dir: Path | str) -> dict[int, list[dict]]:
    """{rank: [record, ...]} for every rank<r>.jsonl in a run directory."""
    records = {}
    for path in sorted(Path(run_dir).glob("rank*.jsonl")):
        rank = int(path.stem[len("rank"):])
        with open(path) as handle:
            records[rank] = [json.loads(line) for line in handle if line.strip()]
    return dict(sorted(records.items()))


def write_summary(run_dir: Path | str, summary: dict) -> Path:
    path = Path(run_dir) / "summary.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_plain(summary), indent=2))
    tmp.replace(path)
    return path


def read_summary(run_dir: Path | str) -> dict | None:
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def write_error(run_dir: Path | str, rank: int, exc: BaseException, formatted: str) -> Path:
    """rank<r>.error.json: the exception a rank died of, for the launcher to report."""
    path = Path(run_dir) / f"rank{rank}.error.json"
    path.write_text(json.dumps({"rank": rank, "type": type(exc).__name__, "message": str(exc),
                                "traceback": formatted, "time": time.time()}))
    return path


def read_errors(run_dir: Path | str) -> dict[int, dict]:
    errors = {}
    for path in sorted(Path(run_dir).glob("rank*.error.json")):
        data = json.loads(path.read_text())
        errors[int(data["rank"])] = data
    return errors


def synchronize(device) -> None:
    """Wait for queued GPU work so a host timer measures it (no-op on the CPU)."""
    import torch
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(device=None):
    """`with timed(device) as t: ...` then t["s"] holds seconds, GPU work included."""
    result = {"s": float("nan")}
    synchronize(device)
    start = time.perf_counter()
    try:
        yield result
    finally:
        synchronize(device)
        result["s"] = time.perf_counter() - start
