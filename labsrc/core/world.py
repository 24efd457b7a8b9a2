"""One rank's context (rank, local_rank, world_size, device, backend): choosing it, setting it up, tearing it down."""
from __future__ import annotations

import datetime
import os
import signal
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labsrc.core.feedback import Feedback
from labsrc.core.processes import die_with_parent

BACKEND_ENV = "LABSRC_BACKEND"


class RequestError(Feedback, ValueError):
    """A launch request this machine cannot meet; the message says what to do instead."""


@dataclass(frozen=True)
class RankContext:
    """Everything a lab needs to know about its own rank. Passed in, never global."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def gpu_count() -> int:
    """CUDA devices visible to this process (0 when CUDA is absent)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def max_cpu_ranks(cpu_count: int | None = None) -> int:
    """The most gloo ranks worth running here: beyond two per core every rank just waits for a core."""
    if cpu_count is None:
        from labsrc.core.hardware import cpu_cores
        cpu_count = cpu_cores()
    return max(4, 2 * cpu_count)


def choose_backend(local_world_size: int, gpus: int, requested: str | None = None) -> tuple[str, str]:
    """(backend, device kind) for ranks on one machine: NCCL when every rank gets its own GPU, else gloo."""
    requested = (requested or "").strip().lower() or None
    if requested not in (None, "nccl", "gloo"):
        raise RequestError(f"backend {requested!r} is unknown: use 'nccl', 'gloo' or leave it unset.")
    if requested == "nccl":
        if gpus == 0:
            raise RequestError("NCCL needs CUDA GPUs and this machine has none: use backend='gloo'.")
        if local_world_size > gpus:
            raise RequestError(
                f"NCCL needs one GPU per rank: {local_world_size} ranks asked, {gpus} GPU(s) here. "
                f"Use nproc<={gpus}, or backend='gloo' to share GPUs between ranks."
            )
        return "nccl", "cuda"
    if requested == "gloo":
        return "gloo", "cuda" if gpus > 0 else "cpu"
    if gpus > 0 and local_world_size <= gpus:
        return "nccl", "cuda"
    return "gloo", "cuda" if gpus > 0 else "cpu"


def validate_request(nproc: int, backend: str | None = None, gpus: int | None = None,
                     cpu_count: int | None = None) -> tuple[str, str]:
    """Check a launch before anything starts; return (backend, device kind) or raise RequestError."""
    if not isinstance(nproc, int) or nproc < 1:
        raise RequestError(f"nproc must be a whole number of ranks, 1 or more (got {nproc!r}).")
    gpus = gpu_count() if gpus is None else gpus
    chosen, device_kind = choose_backend(nproc, gpus, backend)
    limit = max_cpu_ranks(cpu_count)
    if chosen == "gloo" and nproc > limit:  # gloo ranks sharing GPUs still each need a core
        where = "CPU ranks" if device_kind == "cpu" else f"gloo ranks sharing {gpus} GPU(s)"
        raise RequestError(
            f"{nproc} {where} would only queue for cores (at most {limit} here, two per core). "
            f"Use nproc<={limit}, or run on a machine with more cores."
        )
    return chosen, device_kind


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def setup(backend: str | None = None, timeout_s: float = 120.0, seed: int | None = None) -> RankContext:
    """Join the process group torchrun described in the environment, or run alone as rank 0 of 1.

    The same script runs with and without torchrun: without RANK/WORLD_SIZE it is a world of one and
    no process group is created.
    """
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    gpus = gpu_count()
    chosen, device_kind = choose_backend(local_world_size, gpus, backend or os.environ.get(BACKEND_ENV))
    device = torch.device("cuda", local_rank % gpus) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent(signal.SIGKILL)  # no rank outlives its launcher
    if seed is not None:
        torch.manual_seed(seed)
    if world_size > 1 or "MASTER_ADDR" in os.environ:
        kwargs = {"backend": chosen, "timeout": datetime.timedelta(seconds=timeout_s)}
        if chosen == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    return RankContext(rank, local_rank, world_size, device, chosen)


def teardown(ctx: RankContext | None = None, wait_for_peers: bool = False) -> None:
    """Leave the process group cleanly (no-op for a world of one).

    Objects that hold the group (DDP's reducer sits in reference cycles) are collected first, while the
    group still exists; with wait_for_peers the ranks also leave together. Only after success: a rank
    that failed must not wait for peers that may be gone.
    """
    if dist.is_available() and dist.is_initialized():
        import gc
        gc.collect()
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()


@contextmanager
def rank_context(backend: str | None = None, timeout_s: float = 120.0, seed: int | None = None):
    """`with rank_context() as ctx:` sets up, yields the context and always tears down."""
    ctx = setup(backend=backend, timeout_s=timeout_s, seed=seed)
    finished = False
    try:
        yield ctx
        finished = True
    finally:
        teardown(ctx, wait_for_peers=finished)
