"""Figures of notebook 03 (data loading), drawn from the data_loading lab's records."""
from __future__ import annotations

from labsrc.core.figures import new_axes
from labsrc.lessons.data_loading import sampling
from labsrc.lessons.data_loading.lab import PARTITIONS, Partition, Throughput, Uneven


def _shard_grid(ax, result, set_epoch: bool, drop_last: bool, row_labels: bool = True) -> None:
    """Draw one arm's records on `ax`: a row per (epoch, rank), a box per position, coloured by the sample (the
    same colour for a sample everywhere), padded positions hatched."""
    import numpy as np
    from matplotlib.patches import Rectangle
    chosen = sorted((r for r in result.of(Partition) if (r.set_epoch, r.drop_last) == (set_epoch, drop_last)),
                    key=lambda r: r.rank)
    world_size, size = len(chosen), result.summary["dataset_size"]
    rows = sorted((epoch, record.rank, order) for record in chosen for epoch, order in enumerate(record.epochs))
    width = max(len(order) for _, _, order in rows)
    grid = np.full((len(rows), width), np.nan)
    for row, (_, _, order) in enumerate(rows):
        grid[row, :len(order)] = order
    ax.imshow(grid, cmap="tab20", vmin=0, vmax=19, aspect="auto", alpha=0.8)
    for row, (_, rank, order) in enumerate(rows):
        for item, index in enumerate(order):
            ax.text(item, row, str(index), ha="center", va="center", fontsize=8)
            if not drop_last and rank + item * world_size >= size:  # past the order's end: a padded copy
                ax.add_patch(Rectangle((item - 0.5, row - 0.5), 1, 1, fill=False, hatch="///", linewidth=0))
    ax.set_yticks(range(len(rows)), [f"epoch {epoch}, rank {rank}" for epoch, rank, _ in rows] if row_labels
                  else [""] * len(rows))
    ax.set_xticks(range(width))
    ax.tick_params(length=0)
    ax.grid(False)


def partitions(result, set_epoch: bool = True, drop_last: bool = False, ax=None):
    """Which sample each rank reads at each position, one row per (epoch, rank), with or without set_epoch,
    padded (the padded positions hatched) or with drop_last."""
    rows = len(result.of(Partition)) // len(PARTITIONS) * result.summary["epochs"]
    title = (f"DistributedSampler {'with' if set_epoch else 'without'} set_epoch"
             f"{', drop_last' if drop_last else ''}: sample read at each position")
    ax = new_axes(title, "position in the rank's epoch", "", ax, figsize=(6.4, 0.4 * rows + 1))
    _shard_grid(ax, result, set_epoch, drop_last)
    return ax


def partition_panels(result):
    """The lab's three sampler runs side by side: with set_epoch, without it, and with drop_last."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    widths = [max(len(order) for r in result.of(Partition) if (r.set_epoch, r.drop_last) == arm
                  for order in r.epochs) for arm in PARTITIONS]
    rows = len(result.of(Partition)) // len(PARTITIONS) * result.summary["epochs"]
    figure, axes = plt.subplots(1, len(PARTITIONS), figsize=(6.4, 0.3 * rows + 1.5), sharey=True,
                                gridspec_kw={"width_ratios": widths})
    titles = {(True, False): "set_epoch", (False, False): "no set_epoch", (True, True): "set_epoch, drop_last"}
    for column, (ax, arm) in enumerate(zip(axes, PARTITIONS)):
        _shard_grid(ax, result, *arm, row_labels=column == 0)
        ax.set_title(titles[arm], fontsize=10)
        ax.tick_params(axis="x", labelsize=7)
    axes[len(axes) // 2].set_xlabel("position in the rank's epoch")
    figure.suptitle(f"What each rank read: {result.summary['dataset_size']} samples, three runs", fontsize=11)
    figure.legend(handles=[Patch(facecolor="white", hatch="///", edgecolor="black", label="padding (a repeat)")],
                  loc="lower right", fontsize=8, frameon=False)
    figure.tight_layout()
    return axes


def step_split(result, rank: int = 0, ax=None):
    """Per arm: mean milliseconds waiting for data and computing, stacked, data-bound where the wait is longer;
    on the slow-transform rows, the loader's floor: the wait's with no workers, the whole step's with workers."""
    rows = result.of(Throughput, rank=rank)
    ax = new_axes(f"Where a step's time goes (rank {rank})", "ms per step (mean)", "", ax,
                  figsize=(7, 0.6 * len(rows) + 1.6))
    data_ms = [1000 * r.data_s for r in rows]
    compute_ms = [1000 * r.compute_s for r in rows]
    ax.barh([r.label for r in rows], data_ms, color="#c2410c", label="waiting for data")
    ax.barh([r.label for r in rows], compute_ms, left=data_ms, color="#2563eb", label="forward + backward + step")
    marks = {}
    for index, row in enumerate(rows):
        bound = "data-bound" if sampling.data_bound(row.data_s, row.compute_s) else "compute-bound"
        ax.text(data_ms[index] + compute_ms[index], index, f" {bound}", va="center", fontsize=8)
        if row.transform_cost_s <= 0:
            continue
        floor_ms = 1000 * sampling.transform_floor_s(row.batch, row.transform_cost_s, row.num_workers)
        style, label = (("--", "no workers: the wait is at least batch x cost") if row.num_workers == 0 else
                        (":", "workers: a step takes at least batch x cost / workers"))
        marks[style] = label
        ax.plot([floor_ms, floor_ms], [index - 0.45, index + 0.45], color="black", linestyle=style, linewidth=1.6)
    for style, label in marks.items():
        ax.plot([], [], color="black", linestyle=style, label=label)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.18 * max(d + c for d, c in zip(data_ms, compute_ms)))
    ax.legend(loc="upper center", bbox_to_anchor=(0.4, -0.2), ncol=2, fontsize=8, frameon=False)
    return ax


def uneven_timeline(result, join: bool, ax=None):
    """Each rank's steps in the uneven run, in ms from a barrier just before the first step. Without Join the
    longer rank's last all-reduce waits until the timeout, while the finished rank waits in the lab's next
    collective; with Join the finished rank answers the others' all-reduces until every rank is done."""
    from matplotlib.patches import Patch
    records = sorted((r for r in result.of(Uneven) if r.join == join), key=lambda r: r.rank)
    ax = new_axes(f"Rank r has {records[0].planned} + r batches, {'with' if join else 'without'} Join",
                  "ms since the first step began", "", ax, figsize=(6.4, 0.6 * len(records) + 1.6))
    colours = {"step": "#2563eb", "stuck": "#c2410c", "barrier": "#d1d5db", "joined": "#059669",
               "leaving": "#d1d5db"}
    end_ms = 1000 * max(r.left_s for r in records)
    last_step_ms = 1000 * max(r.step_end_s[-1] for r in records if r.step_end_s)
    bar = lambda row, start, stop, key: ax.barh(row, stop - start, left=start, height=0.6, color=colours[key])
    for row, record in enumerate(records):
        ends = [1000 * end for end in record.step_end_s]
        for start, end in zip([0.0] + ends[:-1], ends):
            ax.barh(row, end - start, left=start, height=0.6, color=colours["step"], edgecolor="white")
        last, left = (ends[-1] if ends else 0.0), 1000 * record.left_s
        if record.error:
            bar(row, last, left, "stuck")
            ax.text(0.02 * end_ms, row, f"{record.steps} steps by {last:.0f} ms, then step {record.steps + 1}'s "
                    "all-reduce has no partner", va="center", fontsize=8, color="white")
            ax.text(left, row, " error", va="center", fontsize=8)
        elif join:
            bar(row, last, max(last, min(left, last_step_ms)), "joined")
            bar(row, max(last, last_step_ms), left, "leaving")
        else:
            bar(row, left, end_ms, "barrier")
            ax.text(0.02 * end_ms, row, f"{record.steps} steps by {last:.0f} ms, then waits at a barrier",
                    va="center", fontsize=8)
    ax.set_yticks(range(len(records)), [f"rank {r.rank}: {r.steps} of {r.planned}" for r in records])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.12 * end_ms)
    ax.grid(False, axis="y")
    labels = {"step": "a training step", "stuck": "all-reduce with no partner, until the timeout",
              "barrier": "done, waiting in the next collective", "joined": "joined: answers all-reduces with zeros",
              "leaving": "leaving Join: the model is broadcast"}
    shown = ["step", "joined", "leaving"] if join else ["step", "stuck", "barrier"]
    ax.legend(handles=[Patch(color=colours[key], label=labels[key]) for key in shown], loc="upper center",
              bbox_to_anchor=(0.45, -0.28), ncol=2, fontsize=8, frameon=False)
    return ax


RANK_COLOURS = ("#2563eb", "#c2410c", "#059669", "#7c3aed")


def padded_order(dataset_size: int, world_size: int, epoch: int, seed: int = 0) -> list[int]:
    """One epoch's padded order as torch's DistributedSampler deals it: position p goes to rank p mod n.

    Read back from the samplers themselves (rank r's item i sits at position r + i*n), so the picture shows
    torch's choices, not a copy of its rules.
    """
    shards = [torch_shard(dataset_size, rank, world_size, epoch, seed) for rank in range(world_size)]
    return [shards[position % world_size][position // world_size]
            for position in range(sum(len(shard) for shard in shards))]


def torch_shard(dataset_size: int, rank: int, world_size: int, epoch: int, seed: int = 0) -> list[int]:
    """The indices torch's DistributedSampler (shuffle, padding) gives `rank` after set_epoch(epoch)."""
    from torch.utils.data import DistributedSampler
    sampler = DistributedSampler(sampling.IndexDataset(dataset_size), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def sampler_shards(dataset_size: int = 11, world_size: int = 2, epochs: tuple[int, ...] = (0, 1), seed: int = 0,
                   ax=None):
    """The concept: each epoch's shuffled order, padded to a multiple of the ranks, dealt out like cards.

    One block per epoch: the padded order (each box coloured by the rank that reads it; padding hatched), then
    each rank's shard. A new epoch (after set_epoch) draws a new order.
    """
    from matplotlib.patches import Patch, Rectangle
    width = -(-dataset_size // world_size) * world_size
    rows = len(epochs) * (world_size + 1) + len(epochs) - 1
    ax = new_axes(f"DistributedSampler: {dataset_size} samples dealt to {world_size} ranks", "", "", ax)
    ax.grid(False)
    ticks, labels = [], []

    def box(x, y, value, colour, padded=False):
        ax.add_patch(Rectangle((x + 0.05, -y - 0.45), 0.9, 0.9, facecolor=colour, alpha=0.35 if padded else 0.75,
                               hatch="///" if padded else None, edgecolor="black", linewidth=0.5))
        ax.text(x + 0.5, -y, str(value), ha="center", va="center", fontsize=9)

    y = 0
    for epoch in epochs:
        order = padded_order(dataset_size, world_size, epoch, seed)
        for position, index in enumerate(order):
            box(position, y, index, RANK_COLOURS[position % world_size % len(RANK_COLOURS)],
                padded=position >= dataset_size)
        for extra in range(width - dataset_size):  # each padded box copies the order's start
            ax.annotate("", xy=(dataset_size + extra + 0.5, -y + 0.45), xytext=(extra + 0.5, -y + 0.45),
                        arrowprops={"arrowstyle": "->", "color": "black", "linewidth": 0.8,
                                    "connectionstyle": "arc3,rad=-0.12"})
        ticks.append(-y)
        labels.append(f"epoch {epoch}: order" if epoch == epochs[0] else f"set_epoch({epoch}): order")
        for rank in range(world_size):
            y += 1
            shard = order[rank::world_size]
            for item, index in enumerate(shard):
                box(item, y, index, RANK_COLOURS[rank % len(RANK_COLOURS)],
                    padded=rank + item * world_size >= dataset_size)
            ticks.append(-y)
            labels.append(f"rank {rank} reads")
        y += 2
    ax.set_xlim(0, width)
    ax.set_ylim(-rows + 0.4, 1.4)
    ax.set_yticks(ticks, labels)
    ax.set_xticks([position + 0.5 for position in range(width)], [str(p) for p in range(width)], fontsize=8)
    ax.set_xlabel("position")
    ax.tick_params(length=0)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    handles = [Patch(facecolor=RANK_COLOURS[r], alpha=0.75, label=f"rank {r}") for r in range(world_size)]
    handles.append(Patch(facecolor="white", hatch="///", edgecolor="black", label="padding: the order's start again"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=world_size + 1, fontsize=8,
              frameon=False)
    return ax
