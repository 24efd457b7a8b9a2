"""Lesson 09's per-parameter FSDP written by hand, on the small transformer: its records and its experiment.

Part of the memory_sharding lab (one launch); kept apart so each file stays short.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from labsrc.core.runs import Record
from labsrc.lessons.memory_sharding import fsdp2_runs
from labsrc.lessons.memory_sharding.transformer import token_batches

# (run, compute dtype, optimizer, learning rate, tolerance on gradients and parameters against one process)
HAND_FSDP_RUNS = (("fp32 AdamW", None, "adamw", 1e-3, 1e-6),
                  ("fp16 SGD", torch.float16, "sgd", 0.5, 1e-4))


@dataclass
class HandFsdpStep(Record):
    """One step of the hand-written per-parameter FSDP against one process on whole batches."""

    KIND: ClassVar[str] = "hand_fsdp_step"
    run: str
    step: int
    tolerance: float
    gradient_gap: float
    """Largest |averaged gradient (gathered to full size) - one process's gradient| before the step."""
    gap: float
    """Largest |parameter (gathered) - one process's parameter| after the step."""
    after_forward: int
    """Bytes of gathered full weights still in memory between forward and backward (measured storages)."""
    after_backward: int
    grads_match: bool
    """Every parameter the optimizer sees has a .grad of its own shape, in fp32."""


@dataclass
class HandFsdpTraffic(Record):
    """Bytes this rank sent over a hand-FSDP run, per collective, and the sizes they are held against."""

    KIND: ClassVar[str] = "hand_fsdp_traffic"
    run: str
    steps: int
    compute_bytes: int
    all_gather: int
    reduce_scatter: int
    all_reduce: int
    sharded: int
    """Elements of the sharded parameters (Embedding, Linear)."""
    padded: int
    """The same with every dim 0 padded up to a multiple of n."""
    replicated: int
    """Elements of the parameters every rank keeps whole (RMSNorm weights)."""
    peak_gathered: int
    """The most bytes of gathered full weights alive at once during forward (measured)."""
    largest_unit: int
    """Elements of the largest wrapped module's parameters (padded)."""


def hand_fsdp2(ctx, records, batch: int, steps: int, seed: int) -> list[str]:
    """Each run of HAND_FSDP_RUNS on this rank's slice of token batches; returns the full state dict's names."""
    batches = token_batches(steps, batch, seed=seed)
    names = []
    for run, dtype, optimizer, lr, tolerance in HAND_FSDP_RUNS:
        reference = fsdp2_runs.reference_run(batches, dtype, optimizer, lr)
        result = fsdp2_runs.hand_fsdp_run(ctx, batches, dtype, optimizer, lr, reference)
        for step, row in enumerate(result["steps"]):
            records.write(HandFsdpStep(run, step, tolerance, row["gradient_gap"], row["gap"], row["after_forward"],
                                       row["after_backward"], row["grads_match"]))
        sent = result["sent"]
        records.write(HandFsdpTraffic(run, steps, 2 if dtype is not None else 4, sent.get("all_gather", 0),
                                      sent.get("reduce_scatter", 0), sent.get("all_reduce", 0), result["sharded"],
                                      result["padded"], result["replicated"], result["peak_gathered"],
                                      result["largest_unit"]))
        names = result["names"]
    return names
