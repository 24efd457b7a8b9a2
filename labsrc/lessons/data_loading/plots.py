"""Figures of notebook 03 (data loading), drawn from the data_loading lab's records."""
from __future__ import annotations

from labsrc.core.figures import new_axes
from labsrc.lessons.data_loading import sampling
from labsrc.lessons.data_loading.lab import Partition, Throughput


def partitions(result, set_epoch: bool = True, drop_last: bool = False, ax=None):
    """Which sample each rank reads at each position, one row per (epoch, rank), with or without set_epoch,
    padded or with drop_last."""
    import numpy as np
    rows, labels = [], []
    chosen = [r for r in result.of(Partition) if (r.set_epoch, r.drop_last) == (set_epoch, drop_last)]
    for record in sorted(chosen, key=lambda r: r.rank):
        for epoch, order in enumerate(record.epochs):
            rows.append((epoch, record.rank, order))
    rows.sort()
    width = max(len(order) for _, _, order in rows)
    grid = np.full((len(rows), width), -1)
    for row, (epoch, rank, order) in enumerate(rows):
        grid[row, :len(order)] = order
        labels.append(f"epoch {epoch}, rank {rank}")
    title = (f"DistributedSampler {'with' if set_epoch else 'without'} set_epoch"
             f"{', drop_last' if drop_last else ''}: sample read at each position")
    ax = new_axes(title, "position in the rank's epoch", "", ax,
                  figsize=(6.4, 0.4 * len(rows) + 1))
    ax.imshow(grid, cmap="tab20", aspect="auto")
    for (row, column), value in np.ndenumerate(grid):
        ax.text(column, row, str(value), ha="center", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), labels)
    ax.grid(False)
    return ax


def step_split(result, rank: int = 0, ax=None):
    """Per arm: median milliseconds waiting for data and computing, stacked; data-bound where the wait is longer."""
    rows = result.of(Throughput, rank=rank)
    ax = new_axes(f"Where a step's time goes (rank {rank})", "ms per step", "", ax, figsize=(7, 0.6 * len(rows) + 1))
    data_ms = [1000 * r.data_s for r in rows]
    compute_ms = [1000 * r.compute_s for r in rows]
    ax.barh([r.label for r in rows], data_ms, color="#c2410c", label="waiting for data (median)")
    ax.barh([r.label for r in rows], compute_ms, left=data_ms, color="#2563eb",
            label="forward + backward + step (median)")
    for index, row in enumerate(rows):
        bound = "data-bound" if sampling.data_bound(row.data_s, row.compute_s) else "compute-bound"
        ax.text(data_ms[index] + compute_ms[index], index, f" {bound}", va="center", fontsize=8)
        floor_ms = 1000 * sampling.transform_floor_s(row.batch, row.transform_cost_s, row.num_workers)
        if floor_ms > 0:
            ax.plot([floor_ms, floor_ms], [index - 0.4, index + 0.4], color="black", linestyle="--")
    ax.plot([], [], color="black", linestyle="--", label="batch x cost / workers")
    ax.invert_yaxis()
    ax.legend(loc="lower right")
    return ax
