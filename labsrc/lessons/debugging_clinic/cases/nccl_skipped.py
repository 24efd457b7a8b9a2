"""A skipped collective on NCCL (2 GPUs): the call returns at once, the wait is elsewhere, the watchdog ends it.

    TORCH_FR_BUFFER_SIZE=200 TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_FR_DUMP_TEMP_FILE=/tmp/fr/trace_ \
        torchrun --standalone --nproc-per-node=2 -m labsrc.lessons.debugging_clinic.cases.nccl_skipped --events /tmp/fr

Rank 1 skips the third all_reduce (a metric "only rank 0 logs") and sleeps. Rank 0's third all_reduce is only
enqueued on the GPU's stream: the Python call returns at once, and rank 0 blocks later, where it needs the value
(`.item()`). Nothing raises in Python: after the timeout NCCL's watchdog thread finds the collective timed out,
dumps the flight recorder (TORCH_NCCL_DUMP_ON_TIMEOUT) and, with TORCH_NCCL_ASYNC_ERROR_HANDLING at its default
(3), tears the process down (SIGABRT). Each rank appends what it reached to <events>/events<rank>.jsonl.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist


def note(folder: str, rank: int, **event) -> None:
    with open(os.path.join(folder, f"events{rank}.jsonl"), "a") as events:
        events.write(json.dumps(event) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", required=True, help="folder for each rank's events<rank>.jsonl")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="the NCCL group's collective timeout")
    args = parser.parse_args(argv)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=args.timeout_s))
    for step in range(3):
        if step == 2 and rank == 1:
            note(args.events, rank, event="skipped", step=step)
            time.sleep(6 * args.timeout_s)  # alive, so rank 0 sees a timeout, not a dead peer; torchrun ends it
            break
        value = torch.ones(4, device=device)
        started = time.perf_counter()
        dist.all_reduce(value)
        note(args.events, rank, event="returned", step=step, seconds=time.perf_counter() - started)
        total = value.sum().item()  # the wait happens here: the host needs the reduced value
        note(args.events, rank, event="synced", step=step, seconds=time.perf_counter() - started, total=total)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
