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


def timings_by_algorithm(result) -> dict[str, list[Timing]]:
    """{algorithm: rank 0's Timing records, smallest message first} (every rank records the slowest rank's)."""
    series: dict[str, list[Timing]] = {}
    for record in result.of(Timing, rank=0):
        series.setdefault(record.algorithm, []).append(record)
    return {name: sorted(rows, key=lambda r: r.bytes) for name, rows in series.items()}


def sweep_with_fits(result, ax=None, figsize=(6.4, 3.6)):
    """Fastest repeat per size (points), every repeat (faint dots), each whole-collective fit a + S b (lines), log-log.

    A dotted line marks where dist.all_reduce's two costs are equal (S b = a): latency-bound to its left,
    bandwidth-bound to its right.
    """
    import numpy as np
    ax = new_axes(f"All-reduce on {result.nproc} ranks ({result.summary['backend']})",
                  "message size S (bytes)", "time per call (s)", ax, figsize=figsize)
    for index, (name, rows) in enumerate(timings_by_algorithm(result).items()):
        color = f"C{index}"
        sizes = [r.bytes for r in rows]
        for row in rows:
            ax.plot([row.bytes] * len(row.repeats_s), row.repeats_s, ".", color=color, alpha=0.2, markersize=3)
        ax.plot(sizes, [r.seconds for r in rows], "o", color=color, label=name)
        fit = AlphaBeta(**result.summary["fits"][name])
        grid = np.logspace(np.log10(min(sizes)), np.log10(max(sizes)), 50)
        ax.plot(grid, [fit.time_s(b) for b in grid], "-", color=color)
    torch_fit = AlphaBeta(**result.summary["fits"]["dist.all_reduce"])
    if torch_fit.alpha_s > 0 and torch_fit.beta_s_per_byte > 0:
        ax.axvline(torch_fit.alpha_s / torch_fit.beta_s_per_byte, color="gray", linestyle=":",
                   label="S·b = a (dist.all_reduce)")
        ax.text(0.02, 0.97, "latency-bound", transform=ax.transAxes, va="top", fontsize=8, color="gray")
        ax.text(0.98, 0.03, "bandwidth-bound", transform=ax.transAxes, ha="right", fontsize=8, color="gray")
    ax.plot([], [], "-", color="black", label="fit: a + S·b")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, 0.9))
    return ax


def bus_bandwidth(result, ax=None):
    """algbw (dashed) and busbw (solid), nccl-tests' definitions, per message size; one line each on 2 ranks,
    where the factor 2(n-1)/n is 1 and the two are equal."""
    ax = new_axes(f"Bandwidth on {result.nproc} ranks", "message size S (bytes)", "GB/s", ax)
    for index, (name, rows) in enumerate(timings_by_algorithm(result).items()):
        sizes = [r.bytes for r in rows]
        same = result.nproc == 2
        ax.plot(sizes, [r.busbw / 1e9 for r in rows], "o-", color=f"C{index}",
                label=f"{name} busbw = algbw" if same else f"{name} busbw")
        if not same:
            ax.plot(sizes, [r.algbw / 1e9 for r in rows], ".--", color=f"C{index}", alpha=0.6, label=f"{name} algbw")
    ax.set_xscale("log")
    ax.legend(fontsize=7)
    return ax


def bus_factor(result, ax=None, max_ranks: int = 16):
    """The sweep's largest dist.all_reduce on a ring of 2 to max_ranks ranks whose links stay as fast as measured:
    busbw stays at the measured busbw, algbw = busbw n / (2(n-1)) falls toward half of it (bytes only: every
    step's fixed cost left out). The measured pair is drawn at the n it ran on."""
    import numpy as np
    largest = timings_by_algorithm(result)["dist.all_reduce"][-1]
    link = largest.busbw / 1e9
    ranks = np.arange(2, max_ranks + 1)
    ax = new_axes(f"All-reduce of {largest.bytes / 2**20:.0f} MiB, links as fast as measured", "ranks n", "GB/s", ax)
    ax.plot(ranks, np.full(len(ranks), link), "-", color="C0", label="busbw: what each link carries")
    ax.plot(ranks, link * ranks / (2 * (ranks - 1)), "--", color="C1", label="algbw = S / time")
    ax.plot([result.nproc], [link], "o", color="C0", markersize=6, label=f"measured busbw, {result.nproc} ranks")
    ax.plot([result.nproc], [largest.algbw / 1e9], "o", color="C1", markerfacecolor="none", markersize=11,
            label=f"measured algbw, {result.nproc} ranks")
    ax.set_ylim(0, 1.25 * link)
    ax.legend(fontsize=7, loc="lower left")
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
    _, (left, right) = plt.subplots(1, 2, figsize=(12.8, 3.6))
    sweep_with_fits(result, left)
    bus_bandwidth(result, right)
    plt.tight_layout()
    plt.show()
    print(fits_table(result))


def ring_states(world_size: int) -> list[tuple[str, list[list[frozenset]], list[int]]]:
    """(title, held, sent) at the start of each reduce-scatter step, after that phase, at the start of each
    all-gather step, at the end.

    held[rank][chunk]: the ranks whose values that chunk holds, summed; sent[rank]: the chunk it sends right
    (empty between the phases and at the end). Steps count s = 0, 1, ..., n - 2 and chunk indices are mod n.
    Reduce-scatter step s: rank r sends chunk (r - s) and adds what arrives. All-gather step s: rank r sends
    chunk (r + 1 - s) and stores what arrives.
    """
    held = [[frozenset({rank}) for _ in range(world_size)] for rank in range(world_size)]
    states = []
    for phase, offset, after in (("reduce-scatter", 0, "after reduce-scatter"), ("all-gather", 1, "done")):
        for step in range(world_size - 1):
            sent = [(rank + offset - step) % world_size for rank in range(world_size)]
            states.append((f"{phase}, s = {step}", [row[:] for row in held], sent))
            for rank, chunk in enumerate(sent):
                right = (rank + 1) % world_size
                arrived = held[rank][chunk]
                held[right][chunk] = held[right][chunk] | arrived if offset == 0 else arrived
        states.append((after, [row[:] for row in held], []))
    return states


def ring_steps(world_size: int = 3):
    """The ring all-reduce step by step: reduce-scatter on the top row, all-gather below; a panel at the start of each
    step s = 0, 1, ..., a row per rank, a column per chunk. A cell lists the ranks summed into that chunk; outlined:
    the chunk sent to rank + 1 in that step."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    states = ring_states(world_size)
    figure, rows = plt.subplots(2, world_size, figsize=(6.4, 4.2))
    shades = plt.get_cmap("Oranges")
    for ax, (title, held, sent) in zip(rows.flat, states):
        for rank in range(world_size):
            y = world_size - 1 - rank
            for chunk in range(world_size):
                cell, sending = held[rank][chunk], bool(sent) and sent[rank] == chunk
                ax.add_patch(Rectangle((chunk, y), 0.94, 0.9, facecolor=shades(0.08 + 0.55 * len(cell) / world_size),
                                       edgecolor="#b91c1c" if sending else "white", linewidth=2.2 if sending else 0.5))
                ax.text(chunk + 0.47, y + 0.45, "+".join(str(r) for r in sorted(cell)), ha="center", va="center",
                        fontsize=8 if len(cell) < 3 else 6.5)
        ax.set_xlim(0, world_size)
        ax.set_ylim(0, world_size)
        ax.set_xticks([c + 0.47 for c in range(world_size)], [str(c) for c in range(world_size)], fontsize=7)
        ax.set_xlabel("chunk", fontsize=7, labelpad=1)
        ax.set_yticks([world_size - 1 - r + 0.45 for r in range(world_size)], [f"rank {r}" for r in range(world_size)],
                      fontsize=7)
        ax.tick_params(length=0)
        ax.set_frame_on(False)
        ax.set_aspect("equal")
        ax.set_title(title, fontsize=9)
    figure.suptitle(f"Ring all-reduce on {world_size} ranks: each panel at the start of step s.\n"
                    "Red: the chunk each rank sends to rank + 1 in that step.", fontsize=9.5)
    figure.text(0.5, 0.01, "A cell: the ranks whose values it holds, summed. Reduce-scatter adds what arrives, "
                "all-gather copies it.", ha="center", fontsize=7.5)
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    return figure
