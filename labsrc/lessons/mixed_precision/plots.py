"""Figures of notebook 05 (mixed precision): the formats' ranges, gradients on fp16's number line, measured results."""
from __future__ import annotations

import math

from labsrc.core.figures import bars, curves, new_axes


def format_ranges(ranges: dict[str, dict], marks: dict[str, float] | None = None, ax=None):
    """Each format's range on a log scale: subnormals light, normal numbers dark, from formats.format_ranges().

    marks: {label: value} drawn as dashed vertical lines (a small gradient, a large activation).
    """
    ax = new_axes("What each format can hold", "magnitude (log scale)", "", ax)
    for row, (name, r) in enumerate(ranges.items()):
        ax.barh(row, r["smallest_normal"] - r["smallest_subnormal"], left=r["smallest_subnormal"], height=0.5,
                color="#93c5fd", label="subnormals (fewer bits)" if row == 0 else None)
        ax.barh(row, r["max"] - r["smallest_normal"], left=r["smallest_normal"], height=0.5, color="#1d4ed8",
                label="normal numbers" if row == 0 else None)
        ax.annotate(f"max {r['max']:.2g}", (r["max"] * 30, row), va="center", fontsize=8)
    for index, (label, value) in enumerate((marks or {}).items()):  # labels in the gap above the last row
        ax.axvline(value, color="#dc2626", linestyle="--", linewidth=1)
        ax.text(value, len(ranges) - 1.5, f" {label} ", va="center", ha="right" if index % 2 == 0 else "left",
                fontsize=8, color="#dc2626")
    ax.set_xscale("log")
    ax.set_xlim(1e-47, 1e55)
    ax.set_ylim(len(ranges) - 0.4, -0.6)
    ax.set_yticks(range(len(ranges)), [f"{name}\neps {r['eps']:.0e}" for name, r in ranges.items()])
    ax.legend(fontsize=8, loc="lower left")
    ax.figure.tight_layout()
    return ax


def gradients_on_fp16_line(gradients, scale: float, fp16: dict, ax=None, what: str = "Gradients of a small loss"):
    """Histogram of |gradient| (fp32, non-zero) and of |gradient| x scale, over fp16's zones from format_ranges().

    gradients: a tensor or a list of tensors; what: the title's start.
    """
    import torch
    gradients = [gradients] if isinstance(gradients, torch.Tensor) else gradients
    values = torch.cat([g.reshape(-1) for g in gradients]).abs()
    values = values[values > 0].double()
    ax = new_axes(f"{what}, and the same x {scale:g}", "|gradient| (log scale)", "elements", ax)
    low, high = float(values.min()) / 4, float(values.max() * scale) * 4
    ax.axvspan(low, fp16["smallest_subnormal"] / 2, color="#fecaca", label="fp16 rounds to 0")
    ax.axvspan(fp16["smallest_subnormal"] / 2, fp16["smallest_normal"], color="#fde68a", label="fp16 subnormals")
    ax.axvspan(fp16["smallest_normal"], high, color="#bbf7d0", label="fp16 normal numbers")
    bins = torch.logspace(torch.log10(torch.tensor(low)).item(), torch.log10(torch.tensor(high)).item(), 60).tolist()
    ax.hist(values.tolist(), bins=bins, color="#1d4ed8", alpha=0.8, label="gradients")
    ax.hist((values * scale).tolist(), bins=bins, color="#15803d", alpha=0.8, label=f"x {scale:g} (loss scale)")
    ax.set_xscale("log")
    ax.set_xlim(low, high)
    ax.legend(fontsize=8, loc="upper center")  # the middle of fp16's line, between the two histograms
    ax.figure.tight_layout()
    return ax


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
    fp32 = rows[0].step_s
    bars({f"{r.mode}\n{r.step_s / fp32:.2g}x fp32": 1000 * r.step_s for r in rows}, "Step time (median, log scale)",
         "ms", ax=ax_time, annotate="{:,.4g} ms")
    ax_time.set_yscale("log")  # a CPU without fast fp16 kernels can be 50x slower: a linear axis hides the rest
    bars({r.mode: r.activation_bytes / 2**20 for r in rows}, "Kept for backward", "MiB", ax=ax_bytes)
    ax_time.figure.tight_layout()
    return ax_time, ax_bytes


def amp_ddp_losses(steps: list, ax=None):
    """Loss per optimizer step of AMP + DDP + accumulation, averaged over ranks, from one rank's AmpStep records."""
    label = f"{steps[0].mode} autocast, DDP, no_sync accumulation"
    return curves({label: ([r.step for r in steps], [r.mean_loss for r in steps])},
                  "AMP under DDP with gradient accumulation", "optimizer step", "loss (mean over ranks)", ax=ax)
