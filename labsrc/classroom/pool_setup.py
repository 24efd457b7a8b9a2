"""Create a class server's pool (the instructor's side of labsrc.core.leases), or show it as JSON.

    python -m labsrc.classroom.pool_setup init /srv/labsrc-pool --gpus 8 --gpus-per-run 2
    python -m labsrc.classroom.pool_setup init /srv/labsrc-pool --cores 32 --cores-per-run 2
    python -m labsrc.classroom.pool_setup status /srv/labsrc-pool
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from labsrc.core.leases import (CONFIG_FILE, COUNTER_FILE, GUARD_FILE, POOL_ENV, QUEUE_DIR, Pool, PoolError, load,
                                plural, status)


def _shared_file(path: Path, mode: int = 0o666) -> None:
    """Create an empty file every user of the server may open and lock (the umask would narrow it)."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, mode)
    os.fchmod(fd, mode)
    os.close(fd)


def init(directory, gpus: int = 0, cores: int = 0, gpus_per_run: int = 0, cores_per_run: int = 1,
         fake_gpus: bool = False, visible_gpus: int | None = None) -> Pool:
    """Create (or reshape, while nothing is leased) a pool; its GPUs must exist here unless fake_gpus."""
    if gpus < 0 or cores < 0 or gpus + cores == 0:
        raise PoolError(f"a pool lends GPUs, cores or both: give --gpus N and/or --cores N (got {gpus}, {cores}).")
    if visible_gpus is None and gpus and not fake_gpus:
        import torch
        visible_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and not fake_gpus and gpus > visible_gpus:
        raise PoolError(f"--gpus {gpus}, but this machine shows {visible_gpus} GPU(s): lend at most those "
                        f"(--fake-gpus only for rehearsals on a machine without them).")
    usable = sorted(os.sched_getaffinity(0))
    if cores > len(usable):
        raise PoolError(f"--cores {cores}, but this process may use {len(usable)} core(s): lend at most those.")
    gpus_per_run = gpus_per_run or gpus
    if gpus and not 1 <= gpus_per_run <= gpus:
        raise PoolError(f"--gpus-per-run must be 1..{gpus} (got {gpus_per_run}).")
    if cores and not 1 <= cores_per_run <= cores:
        raise PoolError(f"--cores-per-run must be 1..{cores} (got {cores_per_run}).")
    directory = Path(directory)
    (directory / QUEUE_DIR).mkdir(parents=True, exist_ok=True)
    os.chmod(directory / QUEUE_DIR, 0o1777)  # everyone queues; only a ticket's owner removes it (sticky)
    if (directory / CONFIG_FILE).exists():
        held = [s for s in status(load(directory))["slots"] if s["held"]]
        if held:
            raise PoolError(f"{len(held)} slot(s) of {directory} are leased right now: reshape it when none is.")
    pool = Pool(directory, gpus, tuple(usable[:cores]), gpus_per_run if gpus else 0,
                cores_per_run if cores else 0, fake_gpus)
    for name in [*pool.slots("gpu"), *pool.slots("core"), GUARD_FILE, COUNTER_FILE]:
        _shared_file(directory / name)
    config = {k: v for k, v in asdict(pool).items() if k != "directory"}
    (directory / CONFIG_FILE).write_text(json.dumps({**config, "cores": list(pool.cores)}, indent=1) + "\n")
    os.chmod(directory / CONFIG_FILE, 0o644)
    return pool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsrc.classroom.pool_setup", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    made = commands.add_parser("init", help="create a pool (or reshape one nobody leases from)")
    made.add_argument("directory")
    made.add_argument("--gpus", type=int, default=0, help="GPUs lent: the machine's GPUs 0..N-1")
    made.add_argument("--gpus-per-run", type=int, default=0, help="the most GPUs one run leases (default all)")
    made.add_argument("--cores", type=int, default=0, help="CPU cores lent (the first N this process may use)")
    made.add_argument("--cores-per-run", type=int, default=1, help="cores each run is pinned to (default 1)")
    made.add_argument("--fake-gpus", action="store_true", help="GPU slots this machine lacks (rehearsals, tests)")
    shown = commands.add_parser("status", help="slots, holders and waiting runs as JSON")
    shown.add_argument("directory")
    options = parser.parse_args(argv)
    try:
        if options.command == "init":
            pool = init(options.directory, options.gpus, options.cores, options.gpus_per_run,
                        options.cores_per_run, options.fake_gpus)
            print(f"pool at {pool.directory}: {plural(pool.gpus, 'GPU')} (at most {pool.gpus_per_run} per run), "
                  f"{plural(len(pool.cores), 'core')} ({pool.cores_per_run} per run). Students' kernels need "
                  f"{POOL_ENV}={pool.directory}.")
        else:
            print(json.dumps(status(load(options.directory)), indent=2))
    except PoolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
