"""A training script with torchrun's error propagation: `main` is decorated with `@record`.

    torchrun --standalone --nproc-per-node=2 -m labsrc.lessons.debugging_clinic.cases.recorded_failure --fail-rank 1

torchrun gives each rank a file to write its error to (TORCHELASTIC_ERROR_FILE). `@record` catches the exception
that leaves `main`, writes it there (message, traceback, time) and raises it again; torchrun's report then shows
that traceback among its failures, with the rank and its exit code (and as the "Root Cause (first observed
failure)" when its whole-second stamp is the earliest: notebook 12, section 8b). Without `@record`
the report says only "exitcode: 1" and "To enable traceback see: .../elastic/errors.html".
"""
from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fail-rank", type=int, default=-1, help="this rank raises at step 1 (-1: nobody fails)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=20.0, help="the process group's collective timeout")
    return parser.parse_args(argv)


def load_batch(rank: int, step: int, fail_rank: int) -> torch.Tensor:
    if rank == fail_rank and step == 1:
        raise ValueError(f"planted: rank {rank} read a corrupt batch at step {step}")
    return torch.full((4,), float(rank))


@record
def main(argv=None) -> None:
    args = parse(argv)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        for step in range(args.steps):
            batch = load_batch(rank, step, args.fail_rank)
            dist.all_reduce(batch)
        if rank == 0:
            print(f"{args.steps} steps done", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
