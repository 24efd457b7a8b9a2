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
