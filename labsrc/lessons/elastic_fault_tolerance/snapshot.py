"""A snapshot file that is whole or refused: written atomically with a digest, loaded with weights_only=True.

    save_atomic(state, folder / "snapshot.pt")   # temp file in the same folder, fsync, os.replace, fsync the folder
    state = load_checked(folder / "snapshot.pt") # SnapshotCorrupt if torn or changed, never half-loaded
    crash_mid_write(save_atomic, state, path)    # the same save in a child SIGKILLed half-way through its write
    save_keeping(state, folder, step, keep=2)    # snapshot-<step>.pt, the older ones beyond `keep` removed
    state, path, refused = load_latest(folder)   # the newest whole one; a refused one falls back to the previous

Layout of the file: the bytes of torch.save(state), then a 32-byte SHA-256 of those bytes, then MAGIC.
A file cut short by a crash loses its trailer (or its digest no longer matches) and is refused.
"""
from __future__ import annotations

import builtins
import hashlib
import io
import os
import signal
from pathlib import Path
from typing import Callable

import torch

from labsrc.core import forked

MAGIC = b"LABSRC-SNAPSHOT-1"
DIGEST_BYTES = 32
TEMP_SUFFIX = ".tmp"


class SnapshotCorrupt(RuntimeError):
    """A snapshot file that is torn (cut short mid-write) or changed since it was written: it is not loaded."""


def encode(state: dict) -> bytes:
    """torch.save bytes of `state`, then their SHA-256, then MAGIC."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    return payload + hashlib.sha256(payload).digest() + MAGIC


def temp_path(path: Path) -> Path:
    """Where a snapshot is written before it is renamed into place: the same folder, so os.replace is atomic."""
    return path.with_name(path.name + TEMP_SUFFIX)


def write_bytes_durably(path: Path, data: bytes) -> None:
    """Write, flush Python's buffer, then os.fsync: the bytes are on disk before anything is renamed."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def save_atomic(state: dict, path: Path | str) -> Path:
    """Write `state` to path atomically: a reader sees the previous snapshot or this one, never a torn file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temp_path(path)
    write_bytes_durably(temporary, encode(state))
    os.replace(temporary, path)  # atomic on POSIX within one file system
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself survives a power cut
    finally:
        os.close(folder)
    return path


def decode(data: bytes, name: str = "snapshot") -> dict:
    """The state in `data`, or SnapshotCorrupt saying what is wrong with it."""
    if not data.endswith(MAGIC) or len(data) < len(MAGIC) + DIGEST_BYTES:
        raise SnapshotCorrupt(f"{name} ({len(data)} bytes) has no end marker: it was cut short mid-write. "
                              f"It is not loaded; resume from an older snapshot or from the start.")
    payload = data[:-(len(MAGIC) + DIGEST_BYTES)]
    digest = data[-(len(MAGIC) + DIGEST_BYTES):-len(MAGIC)]
    if hashlib.sha256(payload).digest() != digest:
        raise SnapshotCorrupt(f"{name}: its SHA-256 does not match the one written with it (changed or torn "
                              f"on disk). It is not loaded.")
    return torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")


def load_checked(path: Path | str) -> dict:
    """Load a snapshot with weights_only=True after checking its digest; SnapshotCorrupt if torn or changed."""
    path = Path(path)
    return decode(path.read_bytes(), str(path))


SNAPSHOT_GLOB = "snapshot-*.pt"


def snapshot_path(folder: Path | str, step: int) -> Path:
    return Path(folder) / f"snapshot-{step:08d}.pt"


def snapshots(folder: Path | str) -> list[Path]:
    """The snapshots in folder, newest (highest step) first; temporary files are not snapshots."""
    return sorted(Path(folder).glob(SNAPSHOT_GLOB), reverse=True)


def save_keeping(state: dict, folder: Path | str, step: int, keep: int = 2) -> Path:
    """save_atomic to snapshot-<step>.pt, then remove all but the newest `keep` (never the one just written)."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (got {keep})")
    path = save_atomic(state, snapshot_path(folder, step))
    for old in snapshots(folder)[keep:]:
        old.unlink(missing_ok=True)
    return path


def load_latest(folder: Path | str) -> tuple[dict | None, Path | None, list[str]]:
    """(state, its path, what was refused on the way): the newest snapshot that loads whole, trying older ones
    when a newer one is refused; (None, None, refusals) when none is left."""
    refused = []
    for path in snapshots(folder):
        try:
            return load_checked(path), path, refused
        except SnapshotCorrupt as exc:
            refused.append(str(exc))
    return None, None, refused


def die_mid_write(fraction: float = 0.5) -> None:
    """From now on in this process, the next file opened for writing receives the first `fraction` of the bytes
    of its first write, and then the process is SIGKILLed: a crash in the middle of whatever save runs next."""
    real_open = builtins.open

    def dying_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if not any(flag in mode for flag in "wax+"):
            return handle
        real_write = handle.write

        def write(data):
            real_write(data[:int(len(data) * fraction)])
            handle.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        handle.write = write
        return handle

    builtins.open = io.open = dying_open


def _save_and_die(save: Callable, state: dict, path: Path) -> None:
    die_mid_write()
    save(state, path)
    os._exit(3)  # the save wrote nothing through open(): not killed


def crash_mid_write(save: Callable, state: dict, path: Path | str, timeout_s: float = 60.0) -> int:
    """Run save(state, path) in a child process that is SIGKILLed half-way through writing; its exit status
    (-9 when the kill happened). What the crash leaves on disk is what the next attempt finds."""
    child = forked.process(_save_and_die, (save, state, Path(path)))
    child.start()
    child.join(timeout_s)
    if child.is_alive():
        child.kill()
        child.join()
        raise TimeoutError(f"save did not write within {timeout_s:g} s")
    return child.exitcode
