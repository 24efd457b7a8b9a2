"""The hand-written all-reduces against dist.all_reduce on the same inputs, and a ring with the wrong neighbours."""
from __future__ import annotations

import datetime
import re

import torch.distributed as dist

from labsrc.techniques.collectives import (ALGORITHMS, BYTES_FORMULAS, rank_values, ring_all_reduce,
                                           tensor_device)


def check_sizes(world_size: int) -> list[int]:
    """Sizes that divide evenly by the world size and sizes that do not (including fewer than n elements)."""
    return sorted({1, world_size - 1 or 1, world_size + 1, 1000 * world_size, 1000 * world_size + 1, 4099})


def check_algorithms(ctx, sizes, timeout_s: float = 20.0) -> list[dict]:
    """Every algorithm against dist.all_reduce on the same inputs: largest error and bytes sent per size.

    Inputs are (size,) rank_values. The ring waits at most timeout_s for a message, so a ring with a
    wrong neighbour fails the check within that time instead of hanging.
    """
    device, rows = tensor_device(ctx), []
    algorithms = {**ALGORITHMS, "ring": lambda tensor, rank, world_size: ring_all_reduce(
        tensor, rank, world_size, datetime.timedelta(seconds=timeout_s))}
    for size in sizes:
        expected = rank_values(ctx.rank, size, device)
        dist.all_reduce(expected)
        for name, algorithm in algorithms.items():
            mine = rank_values(ctx.rank, size, device)
            sent = algorithm(mine, ctx.rank, ctx.world_size)
            formula = BYTES_FORMULAS.get(name)
            rows.append({"rank": ctx.rank, "algorithm": name, "size": size, "bytes": size * 4, "bytes_sent": sent,
                         "bytes_formula": formula(size, ctx.rank, ctx.world_size) if formula else None,
                         "max_error": (mine - expected).abs().max().item()})
    return rows


def broken_ring_error(ctx, neighbours_of, size: int, timeout_s: float) -> float:
    """The ring with other neighbours on (size,) rank_values: its largest error against dist.all_reduce.

    A ring whose messages never arrive raises after timeout_s instead of returning.
    """
    tensor = rank_values(ctx.rank, size, tensor_device(ctx))
    expected = tensor.clone()
    dist.all_reduce(expected)
    ring_all_reduce(tensor, ctx.rank, ctx.world_size, datetime.timedelta(seconds=timeout_s), neighbours_of)
    return (tensor - expected).abs().max().item()


def last_line(error: BaseException) -> str:
    """An error's last line, without the C++ source location gloo puts in front ("[/.../file.cc:129] ")."""
    return re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\] ", "", str(error).strip().splitlines()[-1])
