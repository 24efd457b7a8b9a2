"""send/recv and the four collectives of data parallelism, each on a tiny tensor: what every rank held, before and
after."""
from __future__ import annotations

import torch
import torch.distributed as dist

from labsrc.techniques.collectives import all_gather, reduce_scatter, tensor_device


def five_collectives(rank: int, n: int, device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Run send/recv, broadcast, all_reduce, reduce_scatter and all_gather on n ranks: {key: (before, after)}.

    Every rank calls every collective (send/recv only on ranks 0 and 1), each with its own tensor.
    """
    held = {}

    x = torch.tensor([float(rank)], device=device)
    before = x.clone()
    if rank == 0:
        dist.send(torch.tensor([42.0], device=device), dst=1)  # point to point: rank 0 to rank 1
    elif rank == 1:
        dist.recv(x, src=0)                                    # only the receiver changes
    held["send_recv"] = before, x

    x = torch.tensor([float(rank)], device=device)
    before = x.clone()
    dist.broadcast(x, src=0)                                   # every rank ends with rank 0's x
    held["broadcast"] = before, x

    x = torch.tensor([float(rank + 1)], device=device)
    before = x.clone()
    dist.all_reduce(x)                                         # every rank ends with the sum (op=SUM)
    held["all_reduce"] = before, x

    full = torch.arange(n, dtype=torch.float32, device=device) + 10 * rank  # n parts, one per rank
    part = torch.empty(1, device=device)
    reduce_scatter(part, full)                                 # rank r keeps part r of the sum
    held["reduce_scatter"] = full, part

    x = torch.tensor([float(rank)], device=device)
    gathered = torch.empty(n, device=device)
    all_gather(gathered, x)                                    # every rank ends with every x, in rank order
    held["all_gather"] = x, gathered
    return held


LABELS = {"send_recv": "send/recv (rank 0 sends 42 to rank 1)", "broadcast": "broadcast from rank 0",
          "all_reduce": "all_reduce (sum)", "reduce_scatter": "reduce_scatter (sum, one element each)",
          "all_gather": "all_gather"}
"""What a table shows for each collective."""


def collective_tables(ctx) -> list[dict]:
    """five_collectives on this rank, as rows for a table.

    A row: collective (the key: send_recv, broadcast, all_reduce, reduce_scatter, all_gather), label
    (what a table shows), ran_as (which operation ran: the key, or all_reduce_then_slice), before, after.
    """
    if ctx.world_size < 2:
        raise ValueError("the collectives' tables need at least two ranks: send/recv goes from rank 0 to rank 1")
    device = tensor_device(ctx)
    ran_as = reduce_scatter(torch.empty(1, device=device), torch.zeros(ctx.world_size, device=device))
    rows = []
    for key, (before, after) in five_collectives(ctx.rank, ctx.world_size, device).items():
        how = ran_as if key == "reduce_scatter" else key
        label = LABELS[key] + (f"; ran as {how}" if how != key else "")
        rows.append({"collective": key, "label": label, "ran_as": how, "before": before.tolist(),
                     "after": after.tolist()})
    return rows
