"""Matplotlib figures drawn from run results only (records and summaries, never log text).

Shared figures live here; each lesson's own figures live in labsrc/lessons/<lesson>/plots.py.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence


def new_axes(title: str, xlabel: str, ylabel: str, ax=None, figsize=(6.4, 3.6)):
    """An Axes with title and labels (a new figure unless ax is given)."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return ax


def curves(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], title: str, xlabel: str,
           ylabel: str, ax=None, logx: bool = False, logy: bool = False, styles: Mapping | None = None):
    """One line per label: {label: (x values, y values)}."""
    ax = new_axes(title, xlabel, ylabel, ax)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, label=label, **(styles or {}).get(label, {"marker": "."}))
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.legend()
    return ax


def bars(values: Mapping[str, float], title: str, ylabel: str, ax=None, annotate: str = "{:.3g}"):
    """A labelled bar per entry, its value printed on top."""
    ax = new_axes(title, "", ylabel, ax)
    names, heights = list(values), [values[n] for n in values]
    drawn = ax.bar(names, heights, color="#c2410c")
    for bar, height in zip(drawn, heights):
        ax.annotate(annotate.format(height), (bar.get_x() + bar.get_width() / 2, height),
                    ha="center", va="bottom", fontsize=8)
    return ax


def gantt(spans: Iterable[Mapping], title: str, ax=None, unit: str = "ms", colors: Mapping | None = None):
    """A timeline: each span {"lane": str, "name": str, "start": float, "end": float} drawn as a bar.

    Lanes are rows (a rank, a stream, a pipeline stage); names pick the colour and the legend.
    """
    import matplotlib.pyplot as plt
    spans = list(spans)
    lanes = list(dict.fromkeys(span["lane"] for span in spans))
    names = list(dict.fromkeys(span["name"] for span in spans))
    palette = plt.get_cmap("tab10")
    colors = dict(colors or {})
    for index, name in enumerate(names):
        colors.setdefault(name, palette(index % 10))
    ax = new_axes(title, f"time ({unit})", "", ax, figsize=(8, 0.6 + 0.5 * len(lanes)))
    for span in spans:
        row = lanes.index(span["lane"])
        ax.barh(row, span["end"] - span["start"], left=span["start"], height=0.6,
                color=colors[span["name"]], edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[name]) for name in names]
    ax.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=min(6, len(names)))
    return ax


def mean_over_ranks(result, kind: str, key: str, index: str = "step") -> tuple[list, list]:
    """(x, y): the mean of `key` over ranks at each `index` value, from a RunResult's records."""
    by_index: dict = {}
    for record in result.of_kind(kind):
        by_index.setdefault(record[index], []).append(record[key])
    xs = sorted(by_index)
    return xs, [sum(by_index[x]) / len(by_index[x]) for x in xs]
