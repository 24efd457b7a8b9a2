"""Figures of notebook 09, drawn from the lab's records: bytes per rank beside the formula, checkpointing against k."""
from __future__ import annotations

import matplotlib.pyplot as plt

CATEGORIES = ("parameters", "gradients", "optimizer")
COLOURS = {"parameters": "#2563eb", "gradients": "#f59e0b", "optimizer": "#10b981", "activations": "#9ca3af"}


def memory_bars(rows, activation_bytes: int = 0):
    """Stacked bars per ZeRO stage: measured (left) and formula (right), per rank, in kB."""
    figure, axis = plt.subplots(figsize=(8, 3.6))
    for index, row in enumerate(sorted(rows, key=lambda r: r.stage)):
        for offset, prefix in ((-0.18, ""), (0.18, "formula_")):
            bottom = 0.0
            for category in CATEGORIES:
                value = getattr(row, prefix + category) / 1e3
                axis.bar(index + offset, value, 0.34, bottom=bottom, color=COLOURS[category],
                         alpha=1.0 if not prefix else 0.45, label=category if index == 0 and not prefix else None)
                bottom += value
            if activation_bytes:
                axis.bar(index + offset, activation_bytes / 1e3, 0.34, bottom=bottom, color=COLOURS["activations"],
                         label="activations" if index == 0 and not prefix else None)
    axis.set_xticks(range(len(rows)), [f"stage {r.stage}\n{r.layout}" for r in sorted(rows, key=lambda r: r.stage)])
    axis.set_ylabel("kB per rank (measured | formula)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def checkpoint_curve(rows):
    """Saved activations and step time against the number of segments k (k = 0: no checkpointing)."""
    rows = sorted(rows, key=lambda r: r.segments)
    figure, (memory_axis, time_axis) = plt.subplots(1, 2, figsize=(9, 3.2))
    ks = [r.segments for r in rows]
    memory_axis.plot(ks, [r.saved_bytes / 1e3 for r in rows], "o-", label="measured")
    memory_axis.plot(ks, [r.predicted_bytes / 1e3 for r in rows], "x--", label="k + n/k blocks")
    memory_axis.set_xlabel("segments k (0: none)")
    memory_axis.set_ylabel("saved activations (kB)")
    memory_axis.legend(fontsize=8)
    time_axis.bar([str(k) for k in ks], [1e3 * r.seconds for r in rows], color="#9a3412")
    time_axis.set_xlabel("segments k")
    time_axis.set_ylabel("forward + backward (ms)")
    figure.tight_layout()
    return figure


def fsdp_settings(rows):
    """Per FSDP2 setting: bytes held between forward and backward, and seconds per step."""
    figure, (memory_axis, time_axis) = plt.subplots(1, 2, figsize=(9, 3.2))
    labels = [r.setting for r in rows]
    memory_axis.bar(labels, [r.between_bytes / 1e3 for r in rows], color="#2563eb")
    memory_axis.set_ylabel("parameters held after forward (kB)")
    time_axis.bar(labels, [1e3 * r.step_s for r in rows], color="#9a3412")
    time_axis.set_ylabel("ms per step (noisy on CPU)")
    figure.tight_layout()
    return figure


def zero_ownership(world_size: int = 4, bytes_per_parameter=(("parameters", 2), ("gradients", 2), ("optimizer", 12))):
    """ZeRO's ownership: for each stage (rows) and rank (columns), the model states that rank holds.

    Each state is a bar as long as its bytes per parameter (2 + 2 + 12), cut into world_size shards; a shard the
    rank keeps is filled, one it does not keep is an empty outline. The text under each cell is its bytes per
    parameter, the formula of that stage (ZeRO paper, Figure 1).
    """
    stages = {0: "stage 0 (DDP)", 1: "stage 1: optimizer state", 2: "stage 2: + gradients", 3: "stage 3: + parameters"}
    figure, axes = plt.subplots(len(stages), world_size, figsize=(2.3 * world_size, 4.6), sharex=True)
    total = sum(size for _, size in bytes_per_parameter)
    for stage, title in stages.items():
        for rank in range(world_size):
            axis, kept = axes[stage][rank], 0.0
            for row, (category, size) in enumerate(bytes_per_parameter):
                sharded = stage >= {"optimizer": 1, "gradients": 2, "parameters": 3}[category]
                width = size / world_size
                for shard in range(world_size):
                    mine = not sharded or shard == rank
                    axis.barh(row, width, left=shard * width, height=0.7, color=COLOURS[category] if mine else "white",
                              edgecolor=COLOURS[category], linewidth=0.8)
                    kept += width if mine else 0.0
            axis.set_xlim(0, total * 0.78)
            axis.set_ylim(2.6, -0.6)
            axis.set_yticks([])
            axis.set_xticks([])
            axis.text(total * 0.76, 0.5, f"{kept:.0f} B" if kept == int(kept) else f"{kept:.1f} B",
                      ha="right", fontsize=8)
            if stage == 0:
                axis.set_title(f"rank {rank}", fontsize=9)
            if rank == 0:
                axis.set_ylabel(title, rotation=0, ha="right", va="center", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[c]) for c, _ in bytes_per_parameter]
    figure.legend(handles, [f"{c} ({size} B)" for c, size in bytes_per_parameter], loc="lower center", ncol=3,
                  fontsize=8, frameon=False)
    figure.suptitle("Who holds what: filled = kept by this rank (bytes per parameter, n = %d)" % world_size,
                    fontsize=10)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    return figure
