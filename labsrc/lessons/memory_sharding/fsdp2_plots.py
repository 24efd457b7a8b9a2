"""Figures of notebook 09b: FSDP's gather-compute-free, drawn from the hooks' own trace of one training step."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

PHASES = {"forward": "#2563eb", "backward": "#f59e0b"}


def held_intervals(trace) -> list[tuple[str, str, int, int]]:
    """(module, phase, first event, last event) for every stretch a module held its full weights.

    trace: [(event, module, gathered bytes alive after it)] in the order the hooks ran; an all-gather opens a
    stretch, the module's last free closes it; a stretch that ends in a reduce-scatter is backward.
    """
    opened, intervals = {}, []
    for index, (event, module, _) in enumerate(trace):
        if event == "all-gather":
            opened[module] = index
        elif module in opened:
            phase = "backward" if event.startswith("reduce-scatter") else "forward"
            start = opened[module]
            intervals = [i for i in intervals if not (i[0] == module and i[2] == start)]  # a later free extends it
            intervals.append((module, phase, start, index))
    return intervals


def gather_compute_free(trace, title: str = "One step of FSDP by hand: gather, compute, free"):
    """Top: each module's full weights, held from its all-gather to its free (forward blue, backward orange).
    Bottom: the bytes of gathered weights alive after each event, as the hooks measured them."""
    modules = list(dict.fromkeys(module for _, module, _ in trace))
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.4), sharex=True, height_ratios=(3, 1))
    for module, phase, start, end in held_intervals(trace):
        row = modules.index(module)
        top.barh(row, end - start + 0.6, left=start - 0.3, color=PHASES[phase], height=0.6)
        top.text(start - 0.4, row, "AG", ha="right", va="center", fontsize=6)
        if phase == "backward":
            top.text(end + 0.4, row, "RS", ha="left", va="center", fontsize=6)
    top.set_yticks(range(len(modules)), modules, fontsize=7)
    top.invert_yaxis()
    top.set_xlim(-3, len(trace) + 2)
    top.set_title(title)
    handles = [Patch(color=colour, label=f"{phase}: full weights held") for phase, colour in PHASES.items()]
    top.legend(handles=handles, fontsize=8, loc="lower left")  # patches: an empty barh keeps no colour
    bottom.step(range(len(trace)), [alive / 1e3 for _, _, alive in trace], where="post", color="#111827")
    bottom.set_ylabel("gathered kB")
    bottom.set_xlabel("hook events in order (AG = all-gather, RS = reduce-scatter)")
    figure.tight_layout()
    return figure
