"""The launch's lease step on a class server: what a run asks of the pool, the visible wait, the errors it ends in."""
from __future__ import annotations

import time

from labsrc.core import leases
from labsrc.core.world import RequestError
from labsrc.launch.result import LaunchInterrupted, LaunchTimeout


def pool_limits() -> tuple[leases.Pool | None, int | None, int | None]:
    """The pool LABSRC_POOL_DIR names and the GPUs and cores one run may lease from it (None: as detected)."""
    try:
        pool = leases.configured()
    except leases.PoolError as exc:
        raise RequestError(str(exc)) from None
    if pool is None:
        return None, None, None
    return pool, pool.gpus_per_run if pool.gpus else None, pool.cores_per_run if pool.cores else None


def lease_need(pool: leases.Pool | None, ranks: int, device_kind: str, gpus_here: int | None) -> leases.Need:
    """What a run of `ranks` leases: a GPU per NCCL rank (or every GPU its gloo ranks share), and its cores."""
    if pool is None:
        return leases.Need()
    gpus = min(ranks, gpus_here) if gpus_here and device_kind == "cuda" else 0
    return leases.Need(gpus=gpus, cores=pool.cores_per_run if pool.cores else 0)


def describe(lease: leases.Lease) -> str:
    """"GPU(s) 0,1 core(s) 4,5" """
    parts = [f"GPU(s) {','.join(map(str, lease.gpus))}"] * bool(lease.gpus)
    return " ".join(parts + [f"core(s) {','.join(map(str, lease.cores))}"] * bool(lease.cores))


def take_lease(pool: leases.Pool, need: leases.Need, timeout: float, progress, log, started: float,
               label: str) -> leases.Lease:
    """The run's slots, waiting in order with the wait shown live (progress, launcher.log) under `timeout`.

    A wait past the timeout raises LaunchTimeout, an interrupt (the stop button, Ctrl-C) LaunchInterrupted;
    either way nothing was started and the run's place in the queue is given up.
    """
    name = label.split()[0]
    waited = []

    def shown(message: str, ahead: int) -> None:
        waited.append(message)
        progress.pool_message(message)
        log.write(f"[launch] pool {pool.directory}: {message}\n".encode())
        log.flush()
    try:
        lease = leases.acquire(pool, need, timeout - (time.perf_counter() - started), shown, label)
    except leases.PoolTimeout as exc:
        progress.close("stopped (timeout)")
        raise LaunchTimeout(
            f"{name} timed out waiting for the pool ({pool.directory}): {exc.need.describe()} asked, "
            f"{leases.plural(exc.ahead, 'run')} still ahead when its {timeout:g} s timeout ran out. Nothing was "
            f"started. Run it again when the server is less busy, give it a longer timeout (timeout=..., in "
            f"seconds) or ask for fewer ranks.") from None
    except KeyboardInterrupt:
        progress.close("stopped")
        raise LaunchInterrupted(f"Interrupted while waiting for the pool: nothing of {name} was started.") from None
    if waited:
        progress.pool_message(f"leased {describe(lease)} after {time.perf_counter() - started:.1f} s")
    log.write(f"[launch] pool {pool.directory}: leased {describe(lease)}\n".encode())
    log.flush()
    return lease
