"""Lesson 00's picture: what all_reduce(SUM) does to the ranks' tensors."""
from __future__ import annotations

from typing import Sequence

BEFORE, AFTER, SUM = "#dbeafe", "#fde68a", "#c2410c"


def _box(ax, x: float, y: float, text: str, color: str, width: float = 2.2, height: float = 0.7) -> None:
    from matplotlib.patches import FancyBboxPatch
    ax.add_patch(FancyBboxPatch((x - width / 2, y - height / 2), width, height, boxstyle="round,pad=0.05",
                                facecolor=color, edgecolor="black", linewidth=0.8))
    ax.text(x, y, text, ha="center", va="center", fontsize=10)


def _arrow(ax, start: tuple[float, float], end: tuple[float, float]) -> None:
    ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "->", "color": "0.3", "linewidth": 1.0})


def all_reduce_picture(values: Sequence[int] = (1, 2), ax=None):
    """Each rank's process holds one tensor (its value from `values`), before and after all_reduce(SUM).

    Left: what every rank puts in. Middle: the sum all_reduce computes. Right: every rank's own tensor, now
    holding that sum. One row per rank. The middle is the idea, not the route: a footnote says real backends
    add the tensors peer to peer.
    """
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.6))
    total = sum(values)
    rows = [len(values) - 1 - rank for rank in range(len(values))]  # rank 0 on top
    middle = (len(values) - 1) / 2
    for rank, (value, y) in enumerate(zip(values, rows)):
        _box(ax, 1.2, y, f"rank {rank}: [{value}]", BEFORE)
        _box(ax, 8.8, y, f"rank {rank}: [{total}]", AFTER)
        _arrow(ax, (2.35, y), (4.4, middle))
        _arrow(ax, (5.6, middle), (7.65, y))
    sum_text = " + ".join(str(v) for v in values) + f" = {total}"
    ax.text(5.0, middle, "SUM", ha="center", va="center", fontsize=10, color=SUM, fontweight="bold",
            bbox={"boxstyle": "circle,pad=0.5", "facecolor": "white", "edgecolor": SUM, "linewidth": 1.5})
    ax.text(5.0, middle - 0.6, sum_text, ha="center", va="top", fontsize=10, color=SUM)
    for x, label in ((1.2, "before: each rank's tensor"), (5.0, "all_reduce"), (8.8, "after: every rank's tensor")):
        ax.text(x, max(rows) + 0.75, label, ha="center", va="bottom", fontsize=9, color="0.25")
    bottom = min(min(rows) - 0.6, middle - 1.3)
    ax.text(5.0, bottom - 0.1, "Real backends add peer to peer (a ring or a tree): no process holds the whole sum "
            "first.\nNotebook 02 shows how.", ha="center", va="top", fontsize=8, color="0.35")
    ax.set_xlim(-0.2, 10.2)
    ax.set_ylim(bottom - 0.5, max(rows) + 1.2)
    ax.axis("off")
    ax.set_title(f"all_reduce(SUM) on {len(values)} ranks: every rank ends with the same sum", fontsize=11)
    return ax
