"""Boxes and arrows drawn with matplotlib, for the mechanism diagrams of the slide decks."""
from __future__ import annotations

PALETTE = {"compute": "#dbeafe", "communication": "#fed7aa", "data": "#dcfce7", "process": "#f3f4f6",
           "decision": "#fef9c3", "bad": "#fecaca"}


def canvas(width: float, height: float, title: str = ""):
    """A figure with one Axes in data units 0..width x 0..height, no frame; returns (figure, axes)."""
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(width, height))
    axes.set_xlim(0, width)
    axes.set_ylim(0, height)
    axes.set_aspect("equal")
    axes.axis("off")
    if title:
        axes.set_title(title, fontsize=12)
    return figure, axes


def box(axes, x: float, y: float, width: float, height: float, text: str, kind: str = "process",
        fontsize: float = 9, **style):
    """A rounded box with its lower-left corner at (x, y), text centred; returns its centre."""
    from matplotlib.patches import FancyBboxPatch
    axes.add_patch(FancyBboxPatch((x, y), width, height, boxstyle="round,pad=0.02,rounding_size=0.08",
                                  facecolor=PALETTE.get(kind, kind), edgecolor="#374151", linewidth=1, **style))
    axes.text(x + width / 2, y + height / 2, text, ha="center", va="center", fontsize=fontsize)
    return x + width / 2, y + height / 2


def diamond(axes, x: float, y: float, width: float, height: float, text: str, fontsize: float = 9):
    """A decision diamond centred on (x, y)."""
    from matplotlib.patches import Polygon
    corners = [(x, y + height / 2), (x + width / 2, y), (x, y - height / 2), (x - width / 2, y)]
    axes.add_patch(Polygon(corners, closed=True, facecolor=PALETTE["decision"], edgecolor="#374151"))
    axes.text(x, y, text, ha="center", va="center", fontsize=fontsize)


def arrow(axes, start: tuple, end: tuple, text: str = "", color: str = "#374151", fontsize: float = 8,
          curve: float = 0.0, offset: tuple = (0.0, 0.12)):
    """An arrow from start to end, optionally curved, with a label near its middle."""
    axes.annotate("", xy=end, xytext=start, arrowprops={
        "arrowstyle": "-|>", "color": color, "linewidth": 1.3, "shrinkA": 2, "shrinkB": 2,
        "connectionstyle": f"arc3,rad={curve}"})
    if text:
        middle = ((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1])
        axes.text(*middle, text, ha="center", va="bottom", fontsize=fontsize, color=color)


def label(axes, x: float, y: float, text: str, fontsize: float = 10, **style):
    axes.text(x, y, text, ha="center", va="center", fontsize=fontsize, **style)
