"""Figures of notebook 05 (mixed precision), drawn from measured results."""
from __future__ import annotations

import math

from labsrc.core.figures import bars, curves, new_axes


def scale_trace(trace: list[dict], expected: list[float] | None = None, ax=None):
    """The loss scale per step (log2), skipped steps and injected overflows marked, the rule's prediction dashed."""
    ax = new_axes("GradScaler: the loss scale grows, and halves at every overflow", "step", "log2(loss scale)", ax)
    steps = [r["step"] for r in trace]
    ax.step(steps, [math.log2(r["scale"]) for r in trace], where="post", color="#2563eb", label="scale used")
    if expected is not None:
        ax.step(steps, [math.log2(s) for s in expected], where="post", color="black", linestyle="--",
                linewidth=0.8, label="the rule's prediction")
    skipped = [r for r in trace if not r["parameters_changed"]]
    ax.plot([r["step"] for r in skipped], [math.log2(r["scale"]) for r in skipped], "rx", markersize=10,
            label="optimizer step skipped (parameters unchanged)")
    injected = [r["step"] for r in trace if r["injected_overflow"]]
    for step in injected:
        ax.axvline(step, color="#dc2626", alpha=0.2, linewidth=6)
    ax.legend(fontsize=8)
    return ax


def underflow_bars(result: dict, ax=None):
    """Per mode, the % of gradient elements that are exactly zero (fp32 shows the natural zeros)."""
    values = {name.replace(", ", "\n"): 100 * row["zero_fraction"] for name, row in result.items()}
    return bars(values, "Gradient elements exactly zero (small loss)", "% of all gradient elements", ax=ax,
                annotate="{:.1f}%")


def mode_costs(rows: list, ax_time=None, ax_bytes=None):
    """Step time and activation bytes per precision mode, from the lab's ModeCost records (one rank's)."""
    import matplotlib.pyplot as plt
    if ax_time is None or ax_bytes is None:
        _, (ax_time, ax_bytes) = plt.subplots(1, 2, figsize=(10, 3.4))
    bars({r.mode: 1000 * r.step_s for r in rows}, "Step time (median)", "ms", ax=ax_time)
    bars({r.mode: r.activation_bytes / 2**20 for r in rows}, "Kept for backward", "MiB", ax=ax_bytes)
    return ax_time, ax_bytes


def beside_reference(mine: dict, references: list[dict], ax=None):
    """Step time per mode: this machine's beside each reference GPU run's (summary["modes"] of each)."""
    import matplotlib.pyplot as plt
    runs = {"yours": mine, **{r["provenance"].get("device_name", f"reference {i}"): r["modes"]
                              for i, r in enumerate(references)}}
    modes = list(dict.fromkeys(m for run in runs.values() for m in run))
    ax = new_axes("Step time per mode: yours beside GPUs", "", "ms (log scale)", ax, figsize=(8, 3.6))
    width = 0.8 / len(runs)
    palette = plt.get_cmap("tab10")
    for index, (name, run) in enumerate(runs.items()):
        xs = [m + index * width for m, mode in enumerate(modes) if mode in run]
        ax.bar(xs, [1000 * run[mode]["step_s"] for mode in modes if mode in run], width, label=name,
               color=palette(index))
    ax.set_xticks([m + 0.4 - width / 2 for m in range(len(modes))], modes)
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    return ax


def amp_ddp_losses(steps: list, ax=None):
    """Loss per optimizer step of AMP + DDP + accumulation, averaged over ranks, from one rank's AmpStep records."""
    label = f"{steps[0].mode} autocast, DDP, no_sync accumulation"
    return curves({label: ([r.step for r in steps], [r.mean_loss for r in steps])},
                  "AMP under DDP with gradient accumulation", "optimizer step", "loss (mean over ranks)", ax=ax)
