"""Deck 09's figures from a ci run: bytes per rank beside the ZeRO formulas, checkpointing, FSDP2 settings."""
from __future__ import annotations


def make(save):
    from labsrc import launch
    from labsrc.core.plan import make_plan
    from labsrc.lessons.memory_sharding.lab import CheckpointRow, FsdpRow, MemoryRow
    from labsrc.lessons.memory_sharding import plots
    plan = make_plan()
    result = launch.run("memory_sharding", nproc=plan.world_size, timeout=600, backend="gloo")
    save("memory_bars", plots.memory_bars(sorted(result.of(MemoryRow, rank=0), key=lambda r: r.stage)))
    save("checkpoint_curve", plots.checkpoint_curve(result.of(CheckpointRow)))
    save("fsdp_settings", plots.fsdp_settings(result.of(FsdpRow, rank=0)))
