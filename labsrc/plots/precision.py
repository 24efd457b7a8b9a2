"""Figures of notebook 05 (mixed precision), drawn from measured results."""
from __future__ import annotations

from labsrc.plots import bars, new_axes


def scale_trace(trace: list[dict], ax=None):
    """The loss scale per step (log2), skipped steps and injected overflows marked."""
    import math
    ax = new_axes("GradScaler: the loss scale grows, and halves at every overflow", "step", "log2(loss scale)", ax)
    ax.step([r["step"] for r in trace], [math.log2(r["scale"]) for r in trace], where="post", color="#2563eb",
            label="scale used")
    skipped = [r for r in trace if r["skipped"]]
    ax.plot([r["step"] for r in skipped], [math.log2(r["scale"]) for r in skipped], "rx", markersize=10,
            label="optimizer step skipped (inf/NaN gradients)")
    ax.legend(fontsize=8)
    return ax


def underflow_bars(result: dict, ax=None):
    values = {name: 100 * row["lost_fraction"] for name, row in result.items()}
    return bars(values, "Gradient elements flushed to zero by fp16", "% of non-zero fp32 gradients lost", ax=ax,
                annotate="{:.2f}%")


def mode_costs(rows: list[dict], ax_time=None, ax_bytes=None):
    """Step time and activation bytes per precision mode, from the lab's "mode" records."""
    import matplotlib.pyplot as plt
    if ax_time is None or ax_bytes is None:
        _, (ax_time, ax_bytes) = plt.subplots(1, 2, figsize=(10, 3.4))
    bars({r["mode"]: 1000 * r["step_s"] for r in rows}, "Step time (median)", "ms", ax=ax_time)
    bars({r["mode"]: r["activation_bytes"] / 2**20 for r in rows}, "Activations kept for backward", "MiB", ax=ax_bytes)
    return ax_time, ax_bytes
