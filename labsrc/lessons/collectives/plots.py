"""Figures and tables of notebook 02 (collectives), drawn from the collectives lab's records."""
from __future__ import annotations

from labsrc.core.figures import new_axes
from labsrc.lessons.collectives.lab import Holding, Timing
from labsrc.techniques.alpha_beta import AlphaBeta


def _cell(values: list) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"


def holdings_table(result) -> str:
    """What every rank held before and after each collective: one small table per collective."""
    by_collective: dict[str, list[Holding]] = {}
    for record in result.of(Holding):
        by_collective.setdefault(record.collective, []).append(record)
    lines = []
    for rows in by_collective.values():
        lines += [rows[0].label, f"  {'rank':<6}{'before':<24}after"]
        for row in sorted(rows, key=lambda r: r.rank):
            lines.append(f"  {row.rank:<6}{_cell(row.before):<24}{_cell(row.after)}")
        lines.append("")
    return "\n".join(lines)


def bytes_table(rows_by_world: dict) -> str:
    """Bytes each rank sent per hand-written algorithm against the formula; rows_by_world: {n: [Check, ...]}."""
    lines = [f"{'ranks':>5} {'algorithm':>9} {'size':>6} {'bytes':>7}  sent by rank 0..n-1 (formula)"]
    for world_size, rows in sorted(rows_by_world.items()):
        keys = sorted({(r.algorithm, r.size) for r in rows if r.bytes_formula is not None})
        for name, size in keys:
            per_rank = sorted((r for r in rows if (r.algorithm, r.size) == (name, size)), key=lambda r: r.rank)
            sent = " ".join(f"{r.bytes_sent}({r.bytes_formula})" for r in per_rank)
            lines.append(f"{world_size:>5} {name:>9} {size:>6} {4 * size:>7}  {sent}")
    return "\n".join(lines)


def timings_by_algorithm(result) -> dict[str, list[Timing]]:
    """{algorithm: rank 0's Timing records, smallest message first} (every rank records the slowest rank's)."""
    series: dict[str, list[Timing]] = {}
    for record in result.of(Timing, rank=0):
        series.setdefault(record.algorithm, []).append(record)
    return {name: sorted(rows, key=lambda r: r.bytes) for name, rows in series.items()}


def sweep_with_fits(result, ax=None):
    """Fastest repeat per size (points), every repeat (faint dots), each whole-collective fit a + S b (lines), log-log."""
    import numpy as np
    ax = new_axes(f"All-reduce on {result.nproc} ranks ({result.summary['backend']}): measured and alpha-beta fit",
                  "message size (bytes)", "time per call (s)", ax, figsize=(7.5, 4.2))
    for index, (name, rows) in enumerate(timings_by_algorithm(result).items()):
        color = f"C{index}"
        sizes = [r.bytes for r in rows]
        for row in rows:
            ax.plot([row.bytes] * len(row.repeats_s), row.repeats_s, ".", color=color, alpha=0.25)
        ax.plot(sizes, [r.seconds for r in rows], "o", color=color, label=f"{name} (fastest repeat)")
        fit = AlphaBeta(**result.summary["fits"][name])
        grid = np.logspace(np.log10(min(sizes)), np.log10(max(sizes)), 50)
        ax.plot(grid, [fit.time_s(b) for b in grid], "-", color=color,
                label=f"T(S) = a + S b: a {fit.alpha_s * 1e6:.0f} us, 1/b {fit.bandwidth_bytes_per_s / 1e9:.2f} GB/s"
                      f" (R² {fit.r2:.2f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    return ax


def bus_bandwidth(result, ax=None):
    """algbw (dashed) and busbw (solid), nccl-tests' definitions, per message size."""
    ax = new_axes(f"Bandwidth on {result.nproc} ranks", "message size (bytes)", "GB/s", ax)
    for index, (name, rows) in enumerate(timings_by_algorithm(result).items()):
        sizes = [r.bytes for r in rows]
        ax.plot(sizes, [r.busbw / 1e9 for r in rows], "o-", color=f"C{index}", label=f"{name} busbw")
        ax.plot(sizes, [r.algbw / 1e9 for r in rows], ".--", color=f"C{index}", alpha=0.6,
                label=f"{name} algbw")
    ax.set_xscale("log")
    ax.legend(fontsize=7)
    return ax


def fits_table(result) -> str:
    """One line per algorithm: a, 1/b and R^2 of its whole-collective fit, and R^2 of the same fit on the medians."""
    lines = [f"{'algorithm':<16} {'a (us)':>10} {'1/b (GB/s)':>14} {'R^2':>6} {'R^2 on medians':>15}"]
    for name, fit in result.summary["fits"].items():
        lines.append(f"{name:<16} {fit['alpha_s'] * 1e6:>10.1f} {1 / fit['beta_s_per_byte'] / 1e9:>14.2f}"
                     f" {fit['r2']:>6.3f} {result.summary['fits_median'][name]['r2']:>15.3f}")
    return "\n".join(lines)


def show_sweep(result) -> None:
    """What the notebook shows after a sweep (its default cell and its controls): both figures, the fits."""
    import matplotlib.pyplot as plt
    _, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
    sweep_with_fits(result, left)
    bus_bandwidth(result, right)
    plt.tight_layout()
    plt.show()
    print(fits_table(result))
