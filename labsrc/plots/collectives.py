"""Figures and tables of notebook 02 (collectives), drawn from the collectives lab's records."""
from __future__ import annotations

from labsrc.alpha_beta import AlphaBeta
from labsrc.plots import new_axes


def holdings_table(result) -> str:
    """What every rank held before and after each collective, one block per collective."""
    by_collective: dict[str, list] = {}
    for record in result.of_kind("table"):
        by_collective.setdefault(record["collective"], []).append(record)
    lines = []
    for name, rows in by_collective.items():
        lines.append(name)
        for row in sorted(rows, key=lambda r: r["rank"]):
            lines.append(f"  rank {row['rank']}: before {row['before']!s:<18} after {row['after']}")
    return "\n".join(lines)


def timings_by_algorithm(result) -> dict[str, list[dict]]:
    series: dict[str, list] = {}
    for record in result.of_kind("timing", rank=0):
        series.setdefault(record["algorithm"], []).append(record)
    return series


def sweep_with_fits(result, ax=None):
    """Measured time per message size (points) and each algorithm's fitted alpha + beta * bytes (lines)."""
    import numpy as np
    ax = new_axes(f"All-reduce on {result.nproc} ranks ({result.summary['backend']}): measured and alpha-beta fit",
                  "message size (bytes)", "time (s)", ax)
    for index, (name, rows) in enumerate(timings_by_algorithm(result).items()):
        color = f"C{index}"
        sizes = [r["bytes"] for r in rows]
        ax.plot(sizes, [r["seconds"] for r in rows], "o", color=color, label=f"{name} (measured)")
        fit = AlphaBeta(**result.summary["fits"][name])
        grid = np.logspace(np.log10(min(sizes)), np.log10(max(sizes)), 50)
        ax.plot(grid, [fit.time_s(b) for b in grid], "-", color=color,
                label=f"fit: {fit.alpha_s * 1e6:.0f} us + bytes / {fit.bandwidth_bytes_per_s / 1e9:.2f} GB/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    return ax


def bus_bandwidth(result, ax=None):
    """busbw (nccl-tests' definition) per message size: where the bandwidth term takes over."""
    ax = new_axes("Bus bandwidth", "message size (bytes)", "busbw (GB/s)", ax)
    for name, rows in timings_by_algorithm(result).items():
        ax.plot([r["bytes"] for r in rows], [r["busbw"] / 1e9 for r in rows], "o-", label=name)
    ax.set_xscale("log")
    ax.legend(fontsize=7)
    return ax
