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
    title = "Alpha-beta model with stated link inputs (lines)" + (" and measurements (stars)" if references else "")
    ax = new_axes(title, "GPUs", "scaling efficiency", ax)
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


def ring_bytes(nodes: int, gpus_per_node: int, node_link_bytes: dict[str, dict[int, float]], axes=None):
    """Left: one flat ring through nodes x gpus_per_node GPUs, each edge labelled with the bytes it carries (in
    units of the all-reduced size S), the edges that leave a node in red. Right: bytes leaving a node per
    all-reduce against the GPU count, per algorithm ({name: {gpus: bytes / S}}, from the models).
    """
    import math

    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ring, chart = axes
    n = nodes * gpus_per_node
    share = 2 * (n - 1) / n
    spots = [(node * (gpus_per_node + 1) + local, 0.0) for node in range(nodes) for local in range(gpus_per_node)]
    for node in range(nodes):
        left = node * (gpus_per_node + 1) - 0.45
        ring.add_patch(Rectangle((left, -0.5), gpus_per_node - 0.1, 1.0, fill=False, linestyle=":"))
        ring.text(left + (gpus_per_node - 0.1) / 2, 0.62, f"node {node}", ha="center")
    for rank, (x, y) in enumerate(spots):
        ring.plot(x, y, "o", markersize=18, color="tab:blue")
        ring.text(x, y, str(rank), ha="center", va="center", color="white")
    for rank in range(n):
        (x0, y0), (x1, y1) = spots[rank], spots[(rank + 1) % n]
        crosses = rank // gpus_per_node != ((rank + 1) % n) // gpus_per_node
        bend = -0.35 if (rank + 1) % n == 0 else 0.0
        ring.add_patch(FancyArrowPatch((x0, y0), (x1, y1), connectionstyle=f"arc3,rad={bend}", arrowstyle="-|>",
                                       mutation_scale=12, shrinkA=10, shrinkB=10,
                                       color="tab:red" if crosses else "gray"))
        label_y = -0.8 if bend else 0.22
        ring.text((x0 + x1) / 2, label_y, f"{share:.2f} S", ha="center", fontsize=8,
                  color="tab:red" if crosses else "dimgray")
    ring.set_xlim(-0.8, spots[-1][0] + 0.8)
    ring.set_ylim(-1.2, 1.0)
    ring.axis("off")
    ring.set_title(f"Flat ring, {nodes} nodes x {gpus_per_node} GPUs: every edge carries 2(n-1)/n S", fontsize=9)
    for name, points in node_link_bytes.items():
        gpus = sorted(points)
        chart.plot(gpus, [points[g] for g in gpus], "o-", label=name)
    chart.set_xscale("log", base=2)
    chart.set_xlabel("GPUs (8 per node)")
    chart.set_ylabel("bytes leaving a node / S")
    chart.set_ylim(0, math.ceil(max(max(p.values()) for p in node_link_bytes.values())) + 0.2)
    chart.set_title("What one all-reduce sends out of each node", fontsize=9)
    chart.legend(fontsize=8)
    return axes
