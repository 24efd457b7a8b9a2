"""Deck 03's figures: DistributedSampler partitions and where a step's time goes, from a ci run."""
from __future__ import annotations


def make(save):
    from labsrc import launch
    from labsrc.core.plan import make_plan
    from labsrc.plots import data_loading as plots
    plan = make_plan()
    result = launch.run("data_loading", nproc=plan.world_size, timeout=300, global_batch=plan.global_batch)
    save("partitions_set_epoch", plots.partitions(result, set_epoch=True).figure)
    save("partitions_no_set_epoch", plots.partitions(result, set_epoch=False).figure)
    save("step_split", plots.step_split(result).figure)
