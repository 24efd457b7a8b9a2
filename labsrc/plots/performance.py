"""Figures of notebook 06 (performance and scaling), drawn from benchmark and lab results."""
from __future__ import annotations

from labsrc.plots import curves, gantt, new_axes

PHASES = ("data_s", "forward_s", "backward_s", "communication_s", "optimizer_s")


def step_gantt(results: dict[str, dict], ax=None):
    """One bar per configuration: its median step laid out phase after phase (ms)."""
    spans = []
    for label, result in results.items():
        start = 0.0
        for phase in PHASES:
            length = 1000 * result["split"][phase]
            spans.append({"lane": label, "name": phase[:-2], "start": start, "end": start + length})
            start += length
    return gantt(spans, "Where a training step's time goes (median step)", ax=ax)


def scaling_curves(strong: dict, weak: dict, ax=None):
    """Efficiency against world size for strong and weak scaling, with the ideal."""
    sizes = sorted(strong)
    series = {"ideal": (sizes, [1.0] * len(sizes)),
              "strong scaling (fixed global batch)": (sizes, [strong[n]["efficiency"] for n in sizes]),
              "weak scaling (fixed batch per rank)": (sizes, [weak[n]["efficiency"] for n in sizes])}
    ax = curves(series, "Scaling efficiency measured here", "ranks", "efficiency", ax=ax,
                styles={"ideal": {"linestyle": "--", "color": "gray"}})
    ax.set_xticks(sizes)
    return ax


def lr_schedules(schedules: dict[str, list[float]], ax=None):
    series = {label: (list(range(len(values))), values) for label, values in schedules.items()}
    return curves(series, "Learning rate: linear scaling rule with warm-up", "step", "learning rate", ax=ax,
                  styles={label: {} for label in schedules})


def extrapolation(predictions: dict[str, list[dict]], references: list[dict] | None = None, ax=None):
    """Predicted scaling efficiency at 8-64 GPUs per interconnect; reference measurements drawn when present."""
    ax = new_axes("Predicted by the alpha-beta model (inputs, not measurements)", "GPUs", "scaling efficiency", ax)
    for label, rows in predictions.items():
        ax.plot([r["gpus"] for r in rows], [r["efficiency"] for r in rows], "o-", label=label)
    for reference in references or []:
        points = reference.get("scaling", [])
        ax.plot([p["gpus"] for p in points], [p["efficiency"] for p in points], "k*", markersize=12,
                label=f"measured: {reference['provenance'].get('device_name', '?')}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    return ax
