"""A class server's pool of GPUs and cores: each run leases its slots (a flock the kernel drops when the holder dies).

    python -m labsrc.classroom.pool_setup init /srv/labsrc-pool --gpus 8 --gpus-per-run 2   # once
    export LABSRC_POOL_DIR=/srv/labsrc-pool     # every student's kernel (JupyterHub: the spawner's environment)

A pool is a directory: `pool.json` (what it lends), one lock file per slot (`gpu0`..`gpu7`, `core0`..), a
`queue/` of waiting runs' tickets and the `queue.lock` that guards it. A run takes every slot it needs at once
or none (fcntl.flock, LOCK_EX | LOCK_NB), keeps the files open for its lifetime and closes them at its end;
when the holder dies however it dies, the kernel drops its locks, so no lease outlives its run. Waiting runs
hold a locked ticket each and take slots in ticket order (a dead waiter's ticket is unlocked, hence ignored).
"""
from __future__ import annotations

import fcntl
import getpass
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

POOL_ENV = "LABSRC_POOL_DIR"
CONFIG_FILE = "pool.json"
QUEUE_DIR = "queue"
GUARD_FILE = "queue.lock"
COUNTER_FILE = "counter"
POLL_S = 0.1


class PoolError(ValueError):
    """A pool that is missing, malformed or asked for more than it has; the message says what to do."""


class PoolTimeout(TimeoutError):
    """The wait for a lease outlived its deadline: `ahead` runs were still ahead."""

    def __init__(self, need: "Need", ahead: int, waited_s: float):
        super().__init__(f"waited {waited_s:.1f} s for {need.describe()} with {plural(ahead, 'run')} ahead")
        self.need, self.ahead, self.waited_s = need, ahead, waited_s


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


@dataclass(frozen=True)
class Pool:
    """What a pool lends: its GPUs (the machine's indices 0..gpus-1) and the CPU cores it pins runs to."""

    directory: Path
    gpus: int
    """GPU slots gpu0..gpu<gpus-1>, numbered as nvidia-smi numbers the devices (CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    cores: tuple[int, ...]
    """CPU core ids lent as slots core<id>; empty: runs are not pinned."""
    gpus_per_run: int
    """The most GPUs one run may lease (the plan a lesson makes sees no more)."""
    cores_per_run: int
    """Cores every run leases when the pool lends cores."""
    fake_gpus: bool = False
    """Slots for GPUs this machine does not have (tests and rehearsals on a CPU machine)."""

    def slots(self, kind: str) -> list[str]:
        return [f"gpu{i}" for i in range(self.gpus)] if kind == "gpu" else [f"core{c}" for c in self.cores]


@dataclass(frozen=True)
class Need:
    """The slots one run asks for."""

    gpus: int = 0
    cores: int = 0

    def __bool__(self) -> bool:
        return self.gpus > 0 or self.cores > 0

    def describe(self) -> str:
        parts = [plural(self.gpus, "GPU")] * bool(self.gpus) + [plural(self.cores, "core")] * bool(self.cores)
        return " and ".join(parts) or "nothing"


def load(directory) -> Pool:
    """The pool in `directory`; PoolError naming the init command when there is none."""
    path = Path(directory) / CONFIG_FILE
    try:
        data = json.loads(path.read_text())
        return Pool(Path(directory), int(data["gpus"]), tuple(int(c) for c in data["cores"]),
                    int(data["gpus_per_run"]), int(data["cores_per_run"]), bool(data.get("fake_gpus", False)))
    except FileNotFoundError:
        raise PoolError(f"{POOL_ENV}={directory} holds no pool ({path} is missing): create it with "
                        f"`python -m labsrc.classroom.pool_setup init {directory} --gpus N` or unset "
                        f"{POOL_ENV}.") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise PoolError(f"{path} is not a pool's configuration ({exc}): create it again with "
                        f"`python -m labsrc.classroom.pool_setup init {directory} ...`.") from None


def configured(environ=None) -> Pool | None:
    """The pool LABSRC_POOL_DIR names, None when it is unset (a learner's own machine: nothing changes)."""
    directory = (os.environ if environ is None else environ).get(POOL_ENV, "").strip()
    return load(directory) if directory else None


def _holder(label: str) -> dict:
    return {"pid": os.getpid(), "user": getpass.getuser(), "since": time.time(), "label": label}


def _is_held(path: Path) -> bool:
    """True while some process holds path's lock (a shared probe, released at once)."""
    try:
        with open(path, "rb") as probe:
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
    except BlockingIOError:
        return True
    except FileNotFoundError:
        return False


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


class Lease:
    """Slots held for one run: open, locked files. `environment()` is what the run's processes see."""

    def __init__(self, gpus: list[int], cores: list[int], files: list):
        self.gpus, self.cores, self._files = gpus, cores, files

    @property
    def fds(self) -> tuple[int, ...]:
        """The lock files' descriptors: a child given them keeps the lease alive while it runs."""
        return tuple(f.fileno() for f in self._files if not f.closed)

    def environment(self, ranks: int) -> dict:
        env = {}
        if self.gpus:
            env.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=",".join(map(str, self.gpus)))
        if self.cores:
            env["OMP_NUM_THREADS"] = str(max(1, len(self.cores) // ranks))
        return env

    def pin(self) -> None:
        """Pin this process (a child about to exec) to the leased cores; its children inherit them."""
        if self.cores:
            os.sched_setaffinity(0, self.cores)

    def release(self) -> None:
        for handle in self._files:
            if not handle.closed:
                handle.truncate(0)  # the holder's note goes with the lock
                handle.close()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *_) -> None:
        self.release()


def _take(pool: Pool, need: Need, label: str) -> Lease | None:
    """All the slots `need` asks for, or None (releasing any taken)."""
    taken: dict[str, list] = {"gpu": [], "core": []}
    try:
        for kind, count in (("gpu", need.gpus), ("core", need.cores)):
            for name in pool.slots(kind):
                if len(taken[kind]) == count:
                    break
                handle = open(pool.directory / name, "r+")
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    handle.close()
                    continue
                taken[kind].append((int(name[len(kind):]), handle))
            if len(taken[kind]) < count:
                return None
        note = json.dumps(_holder(label))
        for _, handle in taken["gpu"] + taken["core"]:
            handle.seek(0)
            handle.truncate()
            handle.write(note)
            handle.flush()
        lease = Lease([i for i, _ in taken["gpu"]], [i for i, _ in taken["core"]],
                      [h for _, h in taken["gpu"] + taken["core"]])
        taken = {}
        return lease
    finally:
        for _, handle in [pair for pairs in taken.values() for pair in pairs]:
            handle.close()


class _Guard:
    """The queue's own lock, held for a few milliseconds at a time."""

    def __init__(self, pool: Pool):
        self.path = pool.directory / GUARD_FILE

    def __enter__(self):
        self.handle = open(self.path, "rb")
        fcntl.flock(self.handle, fcntl.LOCK_EX)

    def __exit__(self, *_):
        self.handle.close()


def _tickets(pool: Pool) -> list[tuple[Path, dict]]:
    """Live tickets in queue order (the guard held); dead waiters' tickets are removed where allowed, else skipped."""
    live = []
    for path in sorted((pool.directory / QUEUE_DIR).glob("*.ticket")):
        if _is_held(path):
            live.append((path, _read(path)))
            continue
        try:
            path.unlink()
        except OSError:
            pass  # another user's dead ticket in the sticky queue: ignored, as it is unlocked
    return live


def _new_ticket(pool: Pool, need: Need, label: str):
    """A locked ticket at the end of the queue (the guard held): its open file."""
    with open(pool.directory / COUNTER_FILE, "r+") as counter:
        number = int(counter.read().strip() or 0) + 1
        counter.seek(0)
        counter.truncate()
        counter.write(str(number))
    path = pool.directory / QUEUE_DIR / f"{number:012d}.ticket"
    handle = os.fdopen(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644), "r+")
    fcntl.flock(handle, fcntl.LOCK_EX)
    handle.write(json.dumps({**_holder(label), "need": asdict(need)}))
    handle.flush()
    return path, handle


def _holders(pool: Pool, need: Need) -> int:
    """How many runs hold slots of the kinds `need` asks for."""
    kinds = ["gpu"] * bool(need.gpus) + ["core"] * bool(need.cores)
    held = [pool.directory / name for kind in kinds for name in pool.slots(kind)]
    held = [path for path in held if _is_held(path)]
    return len({json.dumps(_read(path)) if _read(path) else str(path) for path in held})  # one note per lease


def acquire(pool: Pool, need: Need, timeout_s: float, on_wait: Callable[[str, int], None] | None = None,
            label: str = "") -> Lease:
    """Lease `need` from `pool`, waiting in order: on_wait(message, ahead) whenever the wait changes.

    ahead counts the runs holding the slots asked for plus those queued before this one. Raises PoolTimeout
    after timeout_s, PoolError when the pool could never lend that much; an interrupt leaves the queue at once.
    """
    if need.gpus > pool.gpus_per_run or need.cores > len(pool.cores) or (need.cores and not pool.cores):
        raise PoolError(f"{need.describe()} asked, but the pool at {pool.directory} lends at most "
                        f"{plural(pool.gpus_per_run, 'GPU')} and {plural(len(pool.cores), 'core')} per run.")
    started, ticket, shown = time.monotonic(), None, None
    try:
        while True:
            with _Guard(pool):
                queue = _tickets(pool)
                mine = next((i for i, (path, _) in enumerate(queue) if ticket and path == ticket[0]), len(queue))
                if mine == 0:
                    lease = _take(pool, need, label)
                    if lease is not None:
                        return lease
                if ticket is None:
                    ticket = _new_ticket(pool, need, label)
            ahead = mine + _holders(pool, need)
            if on_wait is not None and ahead != shown:
                on_wait(f"waiting for {need.describe()}: {plural(ahead, 'run')} ahead", ahead)
                shown = ahead
            if time.monotonic() - started > timeout_s:
                raise PoolTimeout(need, ahead, time.monotonic() - started)
            time.sleep(POLL_S)
    finally:
        if ticket is not None:
            ticket[1].close()
            ticket[0].unlink(missing_ok=True)


def status(pool: Pool) -> dict:
    """Slots, who holds each and since when, and who waits: what the doctor reports."""
    slots = []
    for name in pool.slots("gpu") + pool.slots("core"):
        held = _is_held(pool.directory / name)
        slots.append({"name": name, "held": held, **(_read(pool.directory / name) if held else {})})
    with _Guard(pool):
        waiting = [note for _, note in _tickets(pool)]
    config = {k: v for k, v in asdict(pool).items() if k != "directory"}
    return {"directory": str(pool.directory), **config, "cores": list(pool.cores), "slots": slots,
            "waiting": waiting}

