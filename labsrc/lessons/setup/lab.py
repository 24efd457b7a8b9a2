"""Every rank contributes its rank + 1 to one all_reduce; the sum must be 1+2+...+n = n(n+1)/2.

Rank + 1, not the rank: with 0 and 1 on 2 ranks, rank 1's own number already equals the sum, so a reduce to
rank 0 or a MAX would pass for an all_reduce. With 1 and 2, both leave a rank holding 2 instead of 3.

    python -m labsrc.launch --nproc 2 setup -- --hold-s 3
    torchrun --nproc-per-node 2 -m labsrc.lessons.setup.lab
Options to watch a run being stopped (hold_s), a rank crashing (fail_rank) and a restart (fail_attempts).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from labsrc.core.lab import run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.runs import Record, current_attempt
from labsrc.core.world import RequestError


@dataclass
class Options(LabOptions):
    """The first lab launch: an all_reduce of every rank's rank + 1, then optionally a hold or a planted crash."""

    hold_s: float = 0
    """Seconds to keep running after the all_reduce (to watch a run being stopped)."""
    fail_rank: int = -1
    """This rank raises on purpose (-1: none)."""
    fail_after_s: int = 0
    """Seconds into hold_s at which fail_rank raises."""
    fail_attempts: int = 0
    """fail_rank raises only on the first this-many attempts (0: on every attempt), to watch a restart."""

    def validate(self) -> None:
        super().validate()
        positive("hold_s", self.hold_s, allow_zero=True)
        positive("fail_after_s", self.fail_after_s, allow_zero=True)
        positive("fail_attempts", self.fail_attempts, allow_zero=True)
        if self.fail_rank < -1:
            raise RequestError(f"fail_rank must be a rank (0, 1, ...) or -1 for none (got {self.fail_rank}).")


@dataclass
class AllReduce(Record):
    """What one rank put into the all_reduce (its rank + 1) and what came back."""

    KIND: ClassVar[str] = "allreduce"
    contributed: int
    received: int


class PlantedCrash(RuntimeError):
    """The failure fail_rank asks for, so a learner can see how a crashed rank is reported."""


def crashes_now(ctx, options: Options) -> bool:
    """Is this the rank, and the attempt (torchrun's restart count), that fail_rank/fail_attempts plant a crash in?"""
    early_enough = options.fail_attempts == 0 or current_attempt() < options.fail_attempts
    return ctx.rank == options.fail_rank and early_enough


def allreduce_rank_ids(ctx, records, options: Options) -> dict:
    mine = ctx.rank + 1  # a different number on every rank: 1, 2, ..., n
    value = torch.tensor([float(mine)], device=ctx.device)
    if ctx.world_size > 1:  # a rank alone has nothing to add
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    total = int(value.item())
    records.write(AllReduce(contributed=mine, received=total))
    print(f"contributed {mine}, all_reduce gave {total}")
    for second in range(int(options.hold_s)):
        if crashes_now(ctx, options) and second == options.fail_after_s:
            raise PlantedCrash(f"rank {ctx.rank} crashed on purpose after {second} s (fail_rank)")
        records.progress(second, int(options.hold_s), unit="seconds")
        time.sleep(1.0)
    if crashes_now(ctx, options):
        raise PlantedCrash(f"rank {ctx.rank} crashed on purpose (fail_rank)")
    if options.hold_s:
        records.progress(int(options.hold_s), int(options.hold_s), unit="seconds")
    return {"sum": total, "expected": ctx.world_size * (ctx.world_size + 1) // 2}


def main(argv=None):
    return run_lab("setup", allreduce_rank_ids, Options, argv)


if __name__ == "__main__":
    main()
