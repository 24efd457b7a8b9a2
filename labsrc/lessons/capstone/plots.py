"""Figures of notebook 13 (the capstone), drawn from records and the scaling report only."""
from __future__ import annotations

from labsrc.core.figures import bars, curves


def schedules(series: dict[str, list[float]], ax=None):
    """One learning-rate curve per label: {label: [rate at step 0, 1, ...]}."""
    return curves({label: (list(range(len(rates))), rates) for label, rates in series.items()},
                  "Warm-up from the base rate, cosine down from the scaled peak", "optimizer step",
                  "learning rate", ax=ax, styles={label: {} for label in series})


def accuracy_curves(evaluations: dict[str, list], target: float | None = None, ax=None):
    """Held-out accuracy against training seconds, one line per run: {label: [Evaluation, ...]}."""
    ax = curves({label: ([row.train_seconds for row in rows], [row.accuracy for row in rows])
                 for label, rows in evaluations.items()},
                "Held-out accuracy while training", "training seconds (evaluation excluded)", "accuracy", ax=ax)
    if target is not None:
        ax.axhline(target, color="black", linestyle="--", linewidth=0.8)
    return ax


def scaling_bars(report: dict[int, dict], references: list[dict] | None = None, axes=None):
    """Throughput and efficiency per world size (this machine), reference runs' throughput beside them."""
    import matplotlib.pyplot as plt
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    throughput = {f"{n} rank(s)": row["images_per_s"] for n, row in report.items()}
    for reference in references or []:
        for row in reference.get("rows", []):
            name = reference.get("provenance", {}).get("device_name", "reference")
            throughput[f"{name}\n{row['world_size']} GPU(s)"] = row["images_per_s"]
    bars(throughput, "Throughput", "images / s", ax=axes[0], annotate="{:.0f}")
    bars({f"{n} rank(s)": row["efficiency"] for n, row in report.items()}, "Scaling efficiency (here)",
         "speed-up / ranks", ax=axes[1], annotate="{:.2f}")
    return axes
