"""runs/<lab>/<run_id>/: the run directory, per-rank records (JSONL), the summary and the errors ranks died of."""
from __future__ import annotations

import json
import math
import os
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import ClassVar

from labsrc.core.paths import REPO

RUN_DIR_ENV = "LABSRC_RUN_DIR"
RUNS_ROOT_ENV = "LABSRC_RUNS"
ERROR_RECORDED = "labsrc_error_recorded"  # set on an exception once rank<r>.error.json holds it


def runs_root() -> Path:
    """Where runs are kept: $LABSRC_RUNS, else runs/ at the top of the course checkout."""
    if os.environ.get(RUNS_ROOT_ENV):
        return Path(os.environ[RUNS_ROOT_ENV])
    return REPO / "runs"


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


@dataclass
class Record:
    """A typed record: a lab subclasses it with its fields and a KIND; `rank`, `t` and `attempt` are filled in.

        @dataclass
        class Timing(Record):
            KIND: ClassVar[str] = "timing"
            seconds: float
    """

    KIND: ClassVar[str] = ""
    rank: int = field(default=-1, kw_only=True)
    """The rank that wrote it."""
    t: float = field(default=0.0, kw_only=True)
    """Seconds since the rank's writer opened."""
    attempt: int = field(default=0, kw_only=True)
    """Which attempt of a restarted run wrote it (torchrun's TORCHELASTIC_RESTART_COUNT)."""

    @classmethod
    def from_dict(cls, values: dict):
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


def current_attempt() -> int:
    """0 for the first attempt of a run, 1 after torchrun's first restart, ..."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


class RecordWriter:
    """Appends one JSON object a line to runs/<lab>/<run_id>/rank<r>.jsonl."""

    def __init__(self, run_dir: Path | str, rank: int):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.path = self.run_dir / f"rank{rank}.jsonl"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self._start = time.perf_counter()
        self.attempt = current_attempt()

    def write(self, kind: "str | Record", **values) -> dict:
        """Append one record: a typed Record, or a kind and its fields (for learners' own scripts)."""
        if isinstance(kind, Record):
            values = {k: v for k, v in asdict(kind).items() if k not in ("rank", "t", "attempt")}
            kind = type(kind).KIND
        if not kind:
            raise ValueError("a record needs a kind: set KIND on the Record subclass")
        record = {"kind": kind, "rank": self.rank, "t": round(time.perf_counter() - self._start, 6),
                  "attempt": self.attempt}
        record.update(_plain(values))
        self._file.write(json.dumps(record) + "\n")
        return record

    def progress(self, step: int, total: int, unit: str = "steps", **fields) -> dict:
        """A progress record: `step` of `total` units done ("steps", "micro-batches", "repeats", ...).

        The launcher draws one bar per rank from these, labelled with the unit; report from inside the loop
        so the bar moves while the rank works.
        """
        return self.write("progress", step=step, total=total, unit=unit, **fields)

    def close(self) -> None:
        self._file.close()


def ranks_ready(run_dir: Path | str, ranks: int) -> bool:
    """Has every rank 0..ranks-1 written its first record, the "context" a lab writes once its process group is up?"""
    for rank in range(ranks):
        try:
            with open(Path(run_dir) / f"rank{rank}.jsonl") as records:
                if json.loads(records.readline()).get("kind") != "context":
                    return False
        except (OSError, ValueError):
            return False
    return True


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
    temporary = path.with_name(path.name + ".tmp")  # renamed into place: the launcher never reads half a file
    temporary.write_text(json.dumps({"rank": rank, "type": type(exc).__name__, "message": str(exc),
                                     "traceback": formatted, "time": time.time(), "attempt": current_attempt()}))
    temporary.replace(path)
    return path


def read_errors(run_dir: Path | str) -> dict[int, dict]:
    errors = {}
    for path in sorted(Path(run_dir).glob("rank*.error.json")):
        data = json.loads(path.read_text())
        errors[int(data["rank"])] = data
    return errors


def by_attempt(records: dict[int, list[dict]]) -> dict[int, dict[int, list[dict]]]:
    """{attempt: {rank: [record, ...]}}: a restarted run's records, one attempt apart from the other."""
    split: dict[int, dict[int, list[dict]]] = {}
    for rank, rows in records.items():
        for row in rows:
            split.setdefault(int(row.get("attempt", 0)), {}).setdefault(rank, []).append(row)
    return {attempt: dict(sorted(ranks.items())) for attempt, ranks in sorted(split.items())}


ATTEMPTS_FILE = "attempts.jsonl"


EXITS_FILE = "exits.jsonl"


def note_attempt(run_dir: Path | str, file: str = ATTEMPTS_FILE, **fields) -> None:
    """Append one line to attempts.jsonl as a rank starts (its rank, node, attempt, pid), or to exits.jsonl as
    it ends (its exit status): one write, never torn."""
    line = (json.dumps({"time": time.time(), "attempt": current_attempt(), **fields}) + "\n").encode()
    fd = os.open(Path(run_dir) / file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_attempts(run_dir: Path | str, file: str = ATTEMPTS_FILE) -> list[dict]:
    """Every rank start noted in attempts.jsonl (or exit in exits.jsonl), in the order they happened."""
    path = Path(run_dir) / file
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report_failure(run_dir: Path | str, rank: int, exc: BaseException, formatted: str) -> None:
    """rank<r>.error.json for the course's launcher and torchrun's own error file, both written whole."""
    from labsrc.core.processes import sigterm_ignored
    with sigterm_ignored():
        write_error(run_dir, rank, exc, formatted)
        if "TORCHELASTIC_ERROR_FILE" in os.environ:  # torchrun's report then shows the root cause
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
            ErrorHandler().record_exception(exc)
