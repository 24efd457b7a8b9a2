"""Figures of notebook 12, drawn from measured numbers only: what each fix costs, and where the step waits."""
from __future__ import annotations


def draw_costs(ddp_step_s: dict[str, float], data_wait_s: dict[int, float], matmul_s: dict[int, float]):
    """Three panels: DDP seconds per step by variant; seconds waiting per batch by num_workers; a rank's matmul
    seconds by threads per rank (two ranks on the same cores)."""
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    panels = [
        (ddp_step_s, "DDP seconds per step", "variant"),
        ({f"num_workers={k}": v for k, v in data_wait_s.items()}, "seconds waiting for a batch", "loader"),
        ({f"{k} thread(s)/rank": v for k, v in matmul_s.items()}, "seconds for the same matmuls", "threads"),
    ]
    for axis, (values, ylabel, xlabel) in zip(axes, panels):
        axis.bar(list(values), list(values.values()), color="tab:blue")
        axis.set_ylabel(ylabel)
        axis.set_xlabel(xlabel)
        axis.tick_params(axis="x", labelrotation=20)
    figure.tight_layout()
    return figure
