"""Planted launch bugs for notebook 12: a rank that dies, and the fixed run that restarts (wrong world size: a script).

    python -m labsrc.launch --nproc 2 debugging_clinic -- --case rank_dies --kill-rank 1
    python -m labsrc.launch --nproc 2 labsrc.lessons.debugging_clinic.cases.wrong_world_size -- --claimed-world-size 3
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from labsrc.core.lab import run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.runs import Record, current_attempt
from labsrc.core.world import RequestError

CASES = ("healthy", "rank_dies")


@dataclass
class Options(LabOptions):
    """One planted launch bug (or none): what each rank sees, recorded."""

    case: str = "healthy"
    """healthy, or rank_dies (kill_rank is SIGKILLed after its first all_reduce)."""
    kill_rank: int = 1
    """rank_dies: this rank kills itself with SIGKILL after the first all_reduce, while its peer waits in the second."""
    kill_attempts: int = 0
    """rank_dies: the kill happens only on the first this-many attempts (0: every attempt), to show a restart."""
    steps: int = 3
    """all_reduce steps every rank runs."""
    pg_timeout_s: float = 8.0
    """Seconds a collective (or the initialisation) waits for the other ranks: short, so a planted bug ends."""

    def validate(self) -> None:
        super().validate()
        if self.case not in CASES:
            raise RequestError(f"case {self.case!r} is unknown: use one of {CASES}.")
        positive("kill_attempts", self.kill_attempts, allow_zero=True)
        positive("steps", self.steps)
        if self.kill_rank < 0:
            raise RequestError(f"kill_rank must be a rank (0, 1, ...) (got {self.kill_rank}).")


@dataclass
class Joined(Record):
    """A rank joined the process group: the world size it asked for, and torchrun's."""

    KIND: ClassVar[str] = "joined"
    asked_world_size: int
    torchrun_world_size: int


@dataclass
class StepDone(Record):
    """One all_reduce of rank ids finished with this sum."""

    KIND: ClassVar[str] = "step_done"
    step: int
    total: float


@dataclass
class PeerLost(Record):
    """What a surviving rank saw when its collective failed: the exception class and its first line."""

    KIND: ClassVar[str] = "peer_lost"
    step: int
    exception: str
    message: str
    seconds: float


def dies_now(ctx, options: Options) -> bool:
    early_enough = options.kill_attempts == 0 or current_attempt() < options.kill_attempts
    return options.case == "rank_dies" and ctx.rank == options.kill_rank and early_enough


def allreduce_steps(ctx, records, options: Options) -> dict:
    """steps all_reduces of rank ids; rank kill_rank dies after the first when the case plants it."""
    for step in range(options.steps):
        if step == 1 and dies_now(ctx, options):
            time.sleep(0.5)  # the survivor is inside step 1's all_reduce by now
            print(f"rank {ctx.rank} sends itself SIGKILL (planted)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        value = torch.tensor([float(ctx.rank)], device=ctx.device)  # NCCL reduces only CUDA tensors
        started = time.perf_counter()
        try:  # gloo raises here; on NCCL the call only enqueues the work, the wait is in .item() below, and a
            dist.all_reduce(value)  # timeout ends the process through the watchdog: this except never runs
        except Exception as exc:
            records.write(PeerLost(step=step, exception=type(exc).__name__,
                                   message=str(exc).strip().splitlines()[0][:300],
                                   seconds=time.perf_counter() - started))
            raise
        records.write(StepDone(step=step, total=float(value.item())))
    return {"steps": options.steps, "attempt": current_attempt()}


def main(argv=None):
    return run_lab("debugging_clinic", allreduce_steps, Options, argv)


if __name__ == "__main__":
    main()
