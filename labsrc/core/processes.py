"""The processes of a run: tie a child to its parent's life, find every process a run left, end them all."""
from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

RUN_ID_ENV = "LABSRC_RUN_ID"
GRACE_S = 5.0


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (PR_SET_PDEATHSIG); elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


def terminate_with_parent() -> None:
    """A Popen preexec_fn: the child (a torchrun agent) gets SIGTERM if the launcher dies, and ends its ranks."""
    die_with_parent(signal.SIGTERM)


def processes_of_run(run_id: str, root_pids=None) -> list:
    """Every live process of a run: the roots' descendants and anything carrying the run's LABSRC_RUN_ID tag.

    root_pids: one pid, a list of pids (one torchrun agent per simulated node), or None for the tag alone.
    """
    import psutil
    if isinstance(root_pids, int):
        root_pids = [root_pids]
    found = {}
    for root_pid in root_pids or []:
        try:
            root = psutil.Process(root_pid)
            for proc in [root, *root.children(recursive=True)]:
                found[proc.pid] = proc
        except psutil.NoSuchProcess:
            pass
    for proc in psutil.process_iter():
        if proc.pid in found or proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(RUN_ID_ENV) == run_id and proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = proc
        except (psutil.Error, OSError):
            continue
    return list(found.values())


def end_run(run_id: str, root_pids=None, grace_s: float = GRACE_S) -> int:
    """Terminate every process of a run, kill what is left after the grace period; return how many there were."""
    import psutil
    procs = processes_of_run(run_id, root_pids)
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    alive += [p for p in processes_of_run(run_id, None) if p not in alive]
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=2)
    return len(procs)


@contextmanager
def environment_set(values: dict[str, str | None]):
    """os.environ updated with `values` inside the block (a None removes the variable; the children started there
    inherit them), restored after."""
    before = {key: os.environ.get(key) for key in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def sigterm_ignored():
    """SIGTERM ignored inside the block (main thread only), restored after.

    A rank writing its error report must finish it: torchrun's agent SIGTERMs the survivors once one rank
    dies, and an error file cut mid-write makes the agent itself crash on parsing it (no report, no restart).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
