"""Checkers for notebook 09b's exercise: which rows of a parameter FSDP2 gives each rank."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from labsrc.core.exercises import ExerciseFailed, passed
from labsrc.core.forked import run_ranks

ROWS = (1, 2, 3, 5, 7, 8, 10, 37)  # 5 rows on 4 ranks: 2, 2, 1, 0 in FSDP2; tensor_split would give 2, 1, 1, 1


def _fsdp2_rows(ctx) -> dict[int, tuple[int, int]]:
    """{rows: (start, length)} of this rank's local shard, read from fully_shard itself: row i holds the value i."""
    found = {}
    for rows in ROWS:
        layer = nn.Linear(1, rows, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.arange(rows, dtype=torch.float32).unsqueeze(1))
        fully_shard(layer)
        local = layer.weight.to_local()
        found[rows] = (int(local[0, 0]) if local.shape[0] else rows, local.shape[0])
    return found


def check_local_rows(local_rows: Callable) -> None:
    """local_rows(rows, rank, world_size) -> (start, length): the rows of a (rows, ...) parameter rank r holds."""
    for world_size in (2, 3, 4):
        truth = run_ranks(_fsdp2_rows, world_size)
        for rank, expected in enumerate(truth):
            for rows, (start, length) in expected.items():
                got = local_rows(rows, rank, world_size)
                if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(v, int) for v in got)):
                    raise ExerciseFailed(f"rows={rows}, rank {rank} of {world_size}: return a tuple (start, length) "
                                         f"of two ints, not {got!r}.")
                if length == 0 and got[1] == 0:
                    continue  # an empty shard: any start will do
                if got == (start, length):
                    continue
                size = -(-rows // world_size)
                hint = ""
                if got[1] == size and length < size:
                    hint = (" The length is the padded size: the optimizer sees only real rows (FSDP2 keeps the "
                            "padding apart and hands out a narrow view).")
                elif sum(local_rows(rows, r, world_size)[1] for r in range(world_size)) == rows:
                    hint = (" Your split spreads the remainder over the ranks (torch.tensor_split); FSDP2 gives "
                            "every rank ceil(rows / n) rows until they run out (torch.chunk), so the last ranks "
                            "get fewer, or none.")
                raise ExerciseFailed(f"rows={rows}, rank {rank} of {world_size}: you said start {got[0]}, length "
                                     f"{got[1]}; fully_shard gave start {start}, length {length}.{hint}")
    passed("every (rows, rank, world size) matches fully_shard's own shards, 2 to 4 ranks")
