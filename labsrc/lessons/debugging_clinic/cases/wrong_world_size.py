"""A script that hard-codes its world size: launched on fewer ranks, initialisation waits for a peer that never comes.

    python -m labsrc.launch --nproc 2 labsrc.lessons.debugging_clinic.cases.wrong_world_size -- --claimed-world-size 3
"""
from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

from labsrc.core import runs
from labsrc.lessons.debugging_clinic.lab import Joined


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--claimed-world-size", type=int, default=0,
                        help="the world size the script hard-codes (0: torchrun's WORLD_SIZE, the fix)")
    parser.add_argument("--init-timeout-s", type=float, default=5.0,
                        help="seconds init_process_group waits for every rank to arrive")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    rank, torchrun_world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    asked = args.claimed_world_size or torchrun_world_size
    records = runs.RecordWriter(os.environ.get(runs.RUN_DIR_ENV, "."), rank)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=asked,
                                timeout=datetime.timedelta(seconds=args.init_timeout_s))
        records.write(Joined(asked_world_size=asked, torchrun_world_size=torchrun_world_size))
        value = torch.tensor([1.0])
        dist.all_reduce(value)
        print(f"all {int(value.item())} ranks joined")
        dist.destroy_process_group()
    finally:
        records.close()


if __name__ == "__main__":
    main()
