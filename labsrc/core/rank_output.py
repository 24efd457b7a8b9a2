"""A rank's own output channel: whole lines, each prefixed with its rank, appended to the run's output.log."""
from __future__ import annotations

import os
from pathlib import Path

OUTPUT_FILE = "output.log"


def rank_prefix(rank: int, node_rank: int | None = None) -> str:
    """'[rank1] ', or '[node1 rank3] ' when the run spans several (simulated) nodes."""
    return f"[rank{rank}] " if node_rank is None else f"[node{node_rank} rank{rank}] "


class RankPrefixed:
    """Wraps a text stream: every line a rank prints starts with its prefix and goes out whole.

    Text is held until its line ends, then written in one call, so lines from ranks sharing a pipe or an
    appended file never run together.
    """

    def __init__(self, stream, rank: int, prefix: str | None = None):
        self._stream = stream
        self._prefix = prefix or rank_prefix(rank)
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            complete, _, self._pending = self._pending.rpartition("\n")
            lines = [line if line.startswith(self._prefix.rstrip()) else self._prefix + line
                     for line in complete.split("\n")]
            self._stream.write("\n".join(lines) + "\n")
            self._stream.flush()
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self.write("\n")
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


class AppendChannel:
    """A text sink that appends each write to a file with one os.write (O_APPEND): writers never interleave."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, path: Path | str):
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, text: str) -> int:
        data = text.encode(self.encoding, self.errors)
        while data:
            data = data[os.write(self._fd, data):]
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        os.close(self._fd)


class LineTail:
    """Reads the complete lines appended to a file since the last call (the launcher's side of the channel)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._offset = 0

    def new_lines(self) -> list[str]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        return complete.decode("utf-8", "replace").splitlines()
