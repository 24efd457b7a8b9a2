"""Deck 00's figure: what one launch starts and what it leaves behind (a diagram)."""
from __future__ import annotations

from makers.diagrams import arrow, box, canvas


def launch_diagram():
    figure, axes = canvas(11, 4.2, "launch.run(\"setup\", nproc=2): one cell, a process per rank, records back")
    cell = box(axes, 0.2, 1.7, 2.0, 0.8, "notebook cell\nlaunch.run(...)")
    agent = box(axes, 2.9, 1.7, 2.1, 0.8, "torchrun --standalone\n(loopback, free port)")
    arrow(axes, (2.2, 2.1), (2.9, 2.1))
    ranks = [box(axes, 5.8, 2.9 - 1.4 * r, 2.0, 0.9, f"rank {r}\nsetup() · all_reduce\nrecords.write(...)",
                 kind="compute", fontsize=8) for r in range(2)]
    for r, centre in enumerate(ranks):
        arrow(axes, (5.0, 2.1), (5.8, centre[1]))
        box(axes, 8.5, 3.0 - 1.4 * r, 2.3, 0.6, f"runs/setup/<run_id>/\nrank{r}.jsonl", kind="data", fontsize=8)
        arrow(axes, (7.8, centre[1]), (8.5, 3.3 - 1.4 * r))
    box(axes, 8.5, 0.3, 2.3, 0.6, "summary.json (rank 0)\nlauncher.log", kind="data", fontsize=8)
    arrow(axes, (7.8, ranks[1][1] - 0.3), (8.5, 0.6))
    result = box(axes, 2.9, 0.2, 2.1, 0.8, "RunResult\nsummary · of() · run_dir", kind="process", fontsize=8)
    arrow(axes, (8.5, 0.45), (5.0, result[1]), "read back when the ranks end", offset=(0, 0.05))
    arrow(axes, (2.9, result[1]), (1.2, 1.7), curve=-0.3)
    return figure


def make(save):
    save("launch", launch_diagram(), measured=False)
