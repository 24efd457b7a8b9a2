"""Deck 03's figures: DistributedSampler partitions and where a step's time goes, from a ci run."""
from __future__ import annotations


def make(save):
    from labsrc import launch
    from labsrc.core.plan import make_plan
    from labsrc.lessons.data_loading.lab import Throughput, Uneven
    from labsrc.lessons.data_loading import plots
    plan = make_plan()
    result = launch.run("data_loading", nproc=plan.world_size, timeout=300, global_batch=plan.global_batch)
    save("partitions_set_epoch", plots.partitions(result, set_epoch=True).figure)
    save("partitions_no_set_epoch", plots.partitions(result, set_epoch=False).figure)
    save("partitions_drop_last", plots.partitions(result, set_epoch=True, drop_last=True).figure)
    save("step_split", plots.step_split(result).figure)
    for row in result.of(Throughput, rank=0):  # the numbers the deck's table quotes
        print(f"  {row.label}: mean data {1000 * row.data_s:.2f} ms, mean compute {1000 * row.compute_s:.2f} ms")
    for row in result.of(Uneven):
        print(f"  rank {row.rank} join={row.join}: {row.steps}/{row.planned} steps, waited {row.waited_s:.2f} s, "
              f"{row.error_type}")
