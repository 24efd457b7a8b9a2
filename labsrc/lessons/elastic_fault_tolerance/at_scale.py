"""Checkpointing at scale: how often (Young/Daly, with a measured snapshot cost) and off the critical path (DCP).

    cost = measure_snapshot_cost(folder, megabytes=32)   # seconds for one save_atomic of that much state, here
    young_daly_interval(cost.seconds, mtbf_s)            # sqrt(2 * C * MTBF): the interval that wastes least
    run_ranks(async_save_demo, 2, args=(folder,))        # dcp.async_save on gloo ranks: staged, written, .metadata last

Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974: the interval tau
minimising the expected waste C / tau + tau / (2 M) per unit of time is sqrt(2 C M), for a checkpoint cost C and a
mean time between failures M. Daly, "A higher order estimate of the optimum checkpoint interval for restart
dumps", FGCS 22(3), 2006, refines it (adding the restart time, valid when C is not small against M); for C << M
both agree.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from labsrc.lessons.elastic_fault_tolerance.snapshot import save_atomic

# Llama 3 (Dubey et al., "The Llama 3 Herd of Models", 2024, section 3.3.4): 419 unexpected interruptions in a
# 54-day snapshot of pre-training on up to 16,384 H100 GPUs, one every 54 * 24 / 419 = 3.1 hours.
LLAMA3_MTBF_S = 54 * 24 * 3600 / 419


@dataclass
class SnapshotCost:
    megabytes: float
    seconds: float
    """Median of the timed saves (write, fsync, rename, folder fsync) on this machine's disk."""

    @property
    def megabytes_per_s(self) -> float:
        return self.megabytes / self.seconds


def measure_snapshot_cost(folder: Path | str, megabytes: float = 32.0, repeats: int = 3) -> SnapshotCost:
    """Time save_atomic of `megabytes` of float32 state into folder (median of `repeats`), removed after."""
    state = {"weights": torch.zeros(int(megabytes * 2**20 / 4))}
    path = Path(folder) / "cost.pt"
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        save_atomic(state, path)
        times.append(time.perf_counter() - start)
    path.unlink()
    return SnapshotCost(megabytes, sorted(times)[len(times) // 2])


def young_daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's optimum interval between checkpoints, sqrt(2 C M) (Daly 2006 agrees when C << M)."""
    if cost_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"cost and MTBF must be positive (got {cost_s}, {mtbf_s})")
    return math.sqrt(2 * cost_s * mtbf_s)


def waste_fraction(interval_s: float, cost_s: float, mtbf_s: float) -> float:
    """Young's first-order expected waste per unit of time: checkpoint time C / tau plus half an interval
    replayed per failure, tau / (2 M)."""
    return cost_s / interval_s + interval_s / (2 * mtbf_s)


def async_save_demo(ctx, folder: str, numbers: int = 4_000_000) -> dict:
    """On each gloo rank: dcp.async_save a replicated state, change it while the write runs, wait on the future,
    load it back. Returns seconds to return and to finish, whether the loaded state is the one at the call, and
    each file's modification time (.metadata, DCP's commit marker, is written last)."""
    import torch.distributed.checkpoint as dcp
    generator = torch.Generator().manual_seed(0)
    state = {"weights": torch.randn(numbers, generator=generator), "step": torch.tensor(7)}
    at_call = state["weights"].clone()
    start = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=folder)
    returned_s = time.perf_counter() - start
    state["weights"].add_(1.0)  # training goes on: async_save staged a copy before it returned
    future.result()
    finished_s = time.perf_counter() - start
    back = {"weights": torch.zeros(numbers), "step": torch.tensor(0)}
    dcp.load(back, checkpoint_id=folder)
    times = {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in os.listdir(folder)}
    return {"returned_s": returned_s, "finished_s": finished_s, "loaded_is_at_call": torch.equal(back["weights"], at_call),
            "step": int(back["step"]), "files": times}
