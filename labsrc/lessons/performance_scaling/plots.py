"""Figures of notebook 06 (performance and scaling), drawn from benchmark and lab results."""
from __future__ import annotations

from labsrc.core.figures import curves, gantt, new_axes

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


def scaling_curves(strong: dict, weak: dict, axes=None):
    """Speedup and efficiency against world size for strong and weak scaling, each beside its ideal.

    strong, weak: {world size: {"speedup": s, "efficiency": e}} from scaling.strong_scaling / weak_scaling.
    """
    import matplotlib.pyplot as plt
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    sizes = sorted(strong)
    labels = {"strong scaling (fixed global batch)": strong, "weak scaling (fixed batch per rank)": weak}
    for ax, key, ideal in ((axes[0], "speedup", sizes), (axes[1], "efficiency", [1.0] * len(sizes))):
        series = {"ideal": (sizes, ideal), **{label: (sizes, [table[n][key] for n in sizes])
                                             for label, table in labels.items()}}
        curves(series, f"Scaling {key} measured here", "ranks", key, ax=ax,
               styles={"ideal": {"linestyle": "--", "color": "gray"}})
        ax.set_xticks(sizes)
    return axes


def lr_schedules(schedules: dict[str, list[float]], ax=None):
    series = {label: (list(range(len(values))), values) for label, values in schedules.items()}
    return curves(series, "Learning rate: linear scaling rule with warm-up", "step", "learning rate", ax=ax,
                  styles={label: {} for label in schedules})


def extrapolation(predictions: dict[str, dict[str, list[dict]]], references: list[dict] | None = None, ax=None):
    """Predicted scaling efficiency per workload and all-reduce algorithm ({workload: {"ring"|"tree": rows}}).

    rows: [{"gpus": n, "efficiency": e}, ...] from scaling.extrapolate; a reference is a results/
    file with "scaling" points and the "provenance" of the runs that measured them, drawn as stars.
    """
    import matplotlib.pyplot as plt
    ax = new_axes("Alpha-beta model with stated link inputs (lines) and measurements (stars)", "GPUs",
                  "scaling efficiency", ax)
    markers = {"ring": "o-", "tree": "s--"}
    for index, (workload, by_algorithm) in enumerate(predictions.items()):
        color = plt.get_cmap("tab10")(index)
        for algorithm, rows in by_algorithm.items():
            ax.plot([r["gpus"] for r in rows], [r["efficiency"] for r in rows], markers.get(algorithm, "o-"),
                    color=color, label=f"{workload}: {algorithm}")
    for reference in references or []:
        points = reference.get("scaling", [])
        ax.plot([p["gpus"] for p in points], [p["efficiency"] for p in points], "k*", markersize=12,
                label=f"measured: {reference['provenance'].get('device_name', '?')} {reference.get('model', '')}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    return ax
