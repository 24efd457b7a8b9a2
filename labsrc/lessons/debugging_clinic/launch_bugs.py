"""Launch-level bugs of notebook 12: a busy rendezvous port, two ranks on one GPU, and reading a failed launch's records."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from labsrc.core import runs


@contextmanager
def busy_port():
    """A loopback port something already listens on (yields the port; closed after the block)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


def torchrun_on_port(port: int, timeout_s: float = 60.0) -> dict:
    """Plain torchrun (static rendezvous, one rank of lab `setup`) told to use `port`: its exit code and stderr tail."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--nnodes=1",
               "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "labsrc.lessons.setup.lab"]
    started = time.perf_counter()
    finished = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in finished.stderr.splitlines() if line.strip()]
    return {"returncode": finished.returncode, "last_line": lines[-1] if lines else "",
            "seconds": time.perf_counter() - started}


# -- two ranks on one GPU ----------------------------------------------------------------------------------------

def device_report(ctx, device_index: int | None = None) -> dict:
    """This rank's (host, device) as all ranks see it: every rank's report, gathered with all_gather_object.

    device_index: the GPU this rank selects (None: its local rank, the right choice). With fewer GPUs than
    ranks (none, or one GPU shared by gloo ranks on purpose) the device is "cpu": the check has nothing to catch.
    """
    if torch.cuda.device_count() >= ctx.world_size:
        index = ctx.local_rank if device_index is None else device_index
        torch.cuda.set_device(index)
        device = str(torch.cuda.get_device_properties(index).uuid)
    else:
        device = "cpu"
    mine = {"rank": ctx.rank, "host": socket.gethostname(), "device": device}
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return {"reports": everyone}


def shared_devices(reports: list[dict]) -> dict[str, list[int]]:
    """{host/device: [ranks]} for every GPU that more than one rank uses ("cpu" is meant to be shared)."""
    users: dict[str, list[int]] = {}
    for report in reports:
        if report["device"] != "cpu":
            users.setdefault(f"{report['host']}/{report['device']}", []).append(report["rank"])
    return {device: ranks for device, ranks in users.items() if len(ranks) > 1}


# -- reading a failed launch -------------------------------------------------------------------------------------

def rank_fates(run_dir) -> dict[int, str]:
    """{rank: 'finished' | 'raised <Exception>' | 'exited <code>' | 'vanished'} for the last attempt of a run.

    'vanished': the rank started (attempts.jsonl) but left neither an exit note nor an error: it was killed
    by a signal it could not catch (SIGKILL: the out-of-memory killer, a `kill -9`), or its node was lost.
    """
    starts = runs.read_attempts(run_dir)
    if not starts:
        return {}
    last = max(start["attempt"] for start in starts)
    exits = {e["rank"]: e["exit_code"] for e in runs.read_attempts(run_dir, runs.EXITS_FILE) if e["attempt"] == last}
    errors = {rank: e for rank, e in runs.read_errors(run_dir).items() if e.get("attempt", 0) == last}
    fates = {}
    for rank in sorted({start["rank"] for start in starts if start["attempt"] == last}):
        if rank in errors:
            fates[rank] = f"raised {errors[rank]['type']}"
        elif rank in exits:
            fates[rank] = "finished" if exits[rank] == 0 else f"exited {exits[rank]}"
        else:
            fates[rank] = "vanished"
    return fates
