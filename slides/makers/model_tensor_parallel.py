"""Deck 07's figures from one ci run of the lab: shard layout, naive split's busy timeline, bytes, cost."""
from __future__ import annotations


def make(save):
    from labsrc import launch
    from labsrc.core.plan import make_plan
    from labsrc.lessons.model_tensor_parallel import plots
    plan = make_plan()
    result = launch.run("model_tensor_parallel", nproc=plan.world_size, timeout=180)
    save("shard_layout", plots.shard_layout(result, "mlp"))
    save("busy_timeline", plots.busy_timeline(result).figure)
    save("bytes_formula", plots.bytes_against_formula(result).figure)
    save("cost_comparison", plots.cost_comparison(result).figure)
