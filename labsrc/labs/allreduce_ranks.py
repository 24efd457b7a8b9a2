"""Every rank contributes its rank id to one all_reduce; the sum must be 0+1+...+(n-1).

    torchrun --nproc-per-node 2 -m labsrc.labs.allreduce_ranks
Options to watch a run being stopped (--hold-s) or a rank crashing (--fail-rank).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from labsrc.labs.common import base_parser, run_lab


class PlantedCrash(RuntimeError):
    """The failure --fail-rank asks for, so a learner can see how a crashed rank is reported."""


def allreduce_rank_ids(ctx, records, args) -> dict:
    value = torch.tensor([float(ctx.rank)], device=ctx.device)
    if ctx.distributed:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    total = int(value.item())
    records.write("allreduce", contributed=ctx.rank, received=total)
    print(f"contributed {ctx.rank}, all_reduce gave {total}")
    for second in range(int(args.hold_s)):
        if ctx.rank == args.fail_rank and second == args.fail_after_s:
            raise PlantedCrash(f"rank {ctx.rank} crashed on purpose after {second} s (--fail-rank)")
        records.progress(second, int(args.hold_s))
        time.sleep(1.0)
    if ctx.rank == args.fail_rank:
        raise PlantedCrash(f"rank {ctx.rank} crashed on purpose (--fail-rank)")
    if args.hold_s:
        records.progress(int(args.hold_s), int(args.hold_s))
    return {"sum": total, "expected": ctx.world_size * (ctx.world_size - 1) // 2}


def launch_rank_sum(nproc: int = 2, timeout: float = 120.0, profile: str | None = None, **lab_options):
    """Launch this lab on nproc ranks from a notebook; lab_options become flags (hold_s=3 -> --hold-s 3)."""
    from labsrc import launch
    args = []
    for key, value in lab_options.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return launch.run("allreduce_ranks", nproc=nproc, args=args, timeout=timeout, profile=profile)


def main(argv=None):
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--hold-s", type=float, default=0, help="seconds to keep running afterwards")
    parser.add_argument("--fail-rank", type=int, default=-1, help="this rank raises (default: none)")
    parser.add_argument("--fail-after-s", type=int, default=0, help="seconds into --hold-s to raise")
    return run_lab("allreduce_ranks", allreduce_rank_ids, parser.parse_args(argv))


if __name__ == "__main__":
    main()
