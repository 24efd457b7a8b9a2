"""Deck 02's figures: the all-reduce sweep and bandwidths from a ci run, and the ring's steps as a diagram."""
from __future__ import annotations

from makers.diagrams import canvas, label

RANKS = 3


def ring_states(world_size: int) -> list[tuple[str, list[list[frozenset]], list[int]]]:
    """(title, held[rank][chunk] = ranks summed in, chunk each rank sends) before each step, then at the end.

    The schedule of labsrc.techniques.collectives.ring_all_reduce: reduce-scatter step s, rank r sends chunk (r - s)
    and adds the one it receives; all-gather step s, rank r passes on chunk (r + 1 - s).
    """
    held = [[frozenset({rank}) for _ in range(world_size)] for rank in range(world_size)]
    states = []
    for step in range(world_size - 1):
        sent = [(rank - step) % world_size for rank in range(world_size)]
        states.append((f"reduce-scatter {step + 1}", [row[:] for row in held], sent))
        for rank, chunk in enumerate(sent):
            right = (rank + 1) % world_size
            held[right][chunk] = held[right][chunk] | held[rank][chunk]
    for step in range(world_size - 1):
        sent = [(rank + 1 - step) % world_size for rank in range(world_size)]
        states.append((f"all-gather {step + 1}", [row[:] for row in held], sent))
        for rank, chunk in enumerate(sent):
            held[(rank + 1) % world_size][chunk] = held[rank][chunk]
    everyone = frozenset(range(world_size))
    assert all(cell == everyone for row in held for cell in row), "the ring must leave every sum on every rank"
    states.append(("done: all sums", held, []))
    return states


def draw_state(axes, left: float, title: str, held, sent, world_size: int):
    """One panel: rows are ranks, columns chunks; a cell lists the ranks summed into it; sent cells outlined."""
    from matplotlib.patches import Rectangle
    label(axes, left + world_size * 0.25, world_size + 0.3, title, fontsize=9, weight="bold")
    for rank in range(world_size):
        y = world_size - 1 - rank
        for chunk in range(world_size):
            cell = held[rank][chunk]
            shade = 0.15 + 0.85 * len(cell) / world_size
            sending = bool(sent) and sent[rank] == chunk
            axes.add_patch(Rectangle((left + chunk * 0.5, y), 0.5, 0.9, facecolor=(0.96, 0.6, 0.2, shade),
                                     edgecolor="#b91c1c" if sending else "white", linewidth=2.2 if sending else 1))
            axes.text(left + chunk * 0.5 + 0.25, y + 0.45, "+".join(str(r) for r in sorted(cell)),
                      ha="center", va="center", fontsize=8,
                      rotation=90 if len(cell) > 2 else 0)
        if left == 0:
            axes.text(-0.1, y + 0.45, f"rank {rank}", ha="right", va="center", fontsize=8)


def ring_diagram(world_size: int = RANKS):
    states = ring_states(world_size)
    width = len(states) * (world_size * 0.5 + 0.35)
    figure, axes = canvas(width + 0.8, world_size + 1.2)
    axes.set_xlim(-0.8, width)
    for index, (title, held, sent) in enumerate(states):
        draw_state(axes, index * (world_size * 0.5 + 0.35), title, held, sent, world_size)
    axes.text(width / 2, -0.15, f"{world_size} ranks, the tensor cut into {world_size} chunks (columns). "
              "A cell lists the ranks summed into that chunk; outlined: the chunk the rank sends to rank + 1 "
              f"this step. {2 * (world_size - 1)} steps, each rank sends 2(n-1)/n of the tensor.",
              ha="center", va="top", fontsize=8, wrap=True)
    return figure


def make(save):
    from labsrc import launch
    from labsrc.core.plan import make_plan
    from labsrc.lessons.collectives import plots
    result = launch.run("collectives", nproc=make_plan().world_size, timeout=300)
    save("sweep", plots.sweep_with_fits(result).figure)
    save("bandwidth", plots.bus_bandwidth(result).figure)
    save("ring", ring_diagram(), measured=False)
