"""Figures of notebook 08 (pipeline parallel): schedule Gantt charts and the bubble against its formula."""
from __future__ import annotations

from labsrc.core.figures import new_axes

COLOURS = {"F": "#2563eb", "B": "#ea580c", "W": "#16a34a"}


def gantt(timeline: list[list[dict]], title: str, ax=None, unit: str = "ms", scale: float = 1000.0):
    """Stage x time: one box per action, forward blue, backward orange, weight gradient (W) green, its micro-batch
    number on it (a prime: the rank's second model chunk, interleaved).

    timeline: per stage [{"action", "micro_batch", "start", "end"}, optionally "virtual_stage"] (seconds times
    scale gives unit).
    """
    ax = new_axes(title, f"time ({unit})", "stage", ax)
    for stage, events in enumerate(timeline):
        for event in events:
            left, width = event["start"] * scale, (event["end"] - event["start"]) * scale
            ax.broken_barh([(left, width)], (stage - 0.4, 0.8), facecolors=COLOURS[event["action"]],
                           edgecolors="white")
            chunk = max(event.get("virtual_stage", -1), 0) // len(timeline)   # interleaved: 0 or 1, marked '
            ax.text(left + width / 2, stage, str(event["micro_batch"]) + "'" * chunk, ha="center", va="center",
                    color="white", fontsize=8)
    ax.set_yticks(range(len(timeline)))
    ax.invert_yaxis()
    ax.grid(False)
    return ax


def show_schedules(pairs: dict[str, tuple[list, list]], box_s: float):
    """One row per schedule: measured timeline (ms) beside the ideal one (in boxes of box_s)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    figure, axes = plt.subplots(len(pairs), 2, figsize=(12, 2.2 * len(pairs)), squeeze=False)
    for row, (name, (measured, ideal)) in enumerate(pairs.items()):
        gantt(measured, f"{name}: measured", axes[row][0])
        gantt(ideal, f"{name}: ideal (boxes of {box_s * 1000:g} ms, free messages)", axes[row][1])
    # beside the axes, not on them: a Gantt chart has boxes in every corner
    keys = [Patch(color=COLOURS["F"], label="F: forward"), Patch(color=COLOURS["B"], label="B: backward"),
            Patch(color=COLOURS["W"], label="W: weight gradient")]
    axes[0][1].legend(handles=keys, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    figure.tight_layout()
    return figure


def show_bubble(sweep: dict[int, dict], stages: int, tolerance: float):
    """Idle fraction against m: every repeat (faint), the kept one, and (p-1)/(m+p-1) with a band of ± tolerance."""
    ax = new_axes(f"GPipe bubble on {stages} stages", "micro-batches m", "idle fraction")
    ms = sorted(sweep)
    formula = [sweep[m]["formula"] for m in ms]
    ax.fill_between(ms, [f - tolerance for f in formula], [f + tolerance for f in formula], color="grey",
                    alpha=0.2, label=f"formula ± {tolerance:g}")
    ax.plot(ms, formula, "k--", label="(p-1)/(m+p-1)")
    for m in ms:
        ax.plot([m] * len(sweep[m]["repeats"]), sweep[m]["repeats"], ".", color="#2563eb", alpha=0.3)
    ax.plot(ms, [sweep[m]["measured"] for m in ms], "o-", color="#2563eb", label="measured (kept repeat)")
    ax.legend()
    return ax


def show_ideal(timelines: dict[str, list], unit: str = "boxes"):
    """One Gantt chart per schedule, times in units of one box."""
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(len(timelines), 1, figsize=(8, 1.9 * len(timelines)), squeeze=False)
    for row, (name, timeline) in enumerate(timelines.items()):
        gantt(timeline, f"{name}: ideal", axes[row][0], unit=unit, scale=1.0)
    figure.tight_layout()
    return figure
