"""Figures of notebook 01: the DDP and DataParallel steps as pictures, and the dp_vs_ddp lab's records plotted."""
from __future__ import annotations

from labsrc.core.figures import bars, curves
from labsrc.lessons.dp_vs_ddp import sync
from labsrc.lessons.dp_vs_ddp.lab import Buffers, DdpStep, SingleStep, StepTiming

PHASE_LABELS = {"forward": "forward", "backward": "backward", "all_reduce": "all-reduce\nnot hidden",
                "optimizer": "optimizer"}


def loss_curves(result, axes=None):
    """Two panels: without BatchNorm, and with it (per-rank vs global statistics), each beside one process."""
    import matplotlib.pyplot as plt
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    ddp_steps, single_steps = result.of(DdpStep), result.of(SingleStep, rank=0)
    ddp = {v.key: sync.mean_loss_per_step(r for r in ddp_steps if r.variant == v.key)
           for v in sync.VARIANTS}
    single = {norm: sync.mean_loss_per_step(r for r in single_steps if r.batch_norm == norm)
              for norm in (False, True)}
    wide, dashed = {"linewidth": 4, "alpha": 0.4}, {"linestyle": "--", "marker": "."}
    alone = "one process, whole global batch"
    plain = {f"DDP, {result.nproc} ranks": ddp["plain"], alone: single[False]}
    curves(plain, "No BatchNorm: the same curve", "step", "training loss", ax=axes[0],
           styles=dict(zip(plain, [wide, dashed])))
    normed = {f"DDP, {v.label}": ddp[v.key] for v in sync.VARIANTS if v.batch_norm}
    normed[alone] = single[True]
    curves(normed, "BatchNorm: global statistics close the gap", "step", "training loss", ax=axes[1],
           styles=dict(zip(normed, [{"marker": "x"}, wide, dashed])))
    for ax in axes:  # below the axes, not on them: the curves run through every corner
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
    axes[0].figure.tight_layout()
    return axes


def step_breakdown(result, ax=None):
    """A bar per phase of the timed DDP step (sync.step_breakdown_ms)."""
    phases = sync.step_breakdown_ms(result.of(StepTiming))
    title = f"DDP step of {result.summary['model']} on {result.nproc} ranks, median per phase"
    return bars({PHASE_LABELS[name]: ms for name, ms in phases.items()}, title, "ms", ax=ax)


def step_comparison(dataparallel_ms: float, ddp_ms: float, result, ax=None):
    """DataParallel's step on every GPU beside DDP's, same model and global batch."""
    values = {"DataParallel, 1 process": dataparallel_ms, f"DDP, {result.nproc} processes": ddp_ms}
    return bars(values, f"{result.summary['model']}, global batch {result.summary['global_batch']}: step time",
                "ms per step", ax=ax)


def buffer_spread(result, ax=None):
    """How far the ranks' BatchNorm running statistics are apart, as each forward sees them."""
    values = {f"buffer sync {'on' if r.buffer_sync else 'off'}": r.spread_seen_by_forward
              for r in result.of(Buffers, rank=0)}
    return bars(values, "BatchNorm running stats: max gap between ranks at forward", "max |rank - rank 0|",
                ax=ax)


DATA, COMPUTE, TALK = "#dcfce7", "#dbeafe", "#fed7aa"  # samples, work on one device, communication


def _box(ax, x: float, y: float, text: str, colour: str, width: float = 1.2, height: float = 0.66) -> None:
    from matplotlib.patches import FancyBboxPatch
    ax.add_patch(FancyBboxPatch((x - width / 2, y - height / 2), width, height, boxstyle="round,pad=0.04",
                                facecolor=colour, edgecolor="0.25", linewidth=0.8))
    ax.text(x, y, text, ha="center", va="center", fontsize=8)


def _arrow(ax, start: tuple[float, float], end: tuple[float, float], text: str = "") -> None:
    ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "->", "color": "0.3", "linewidth": 1.0})
    if text:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.08, text, ha="center", va="bottom",
                fontsize=7, color="0.3")


def _canvas(ax, title: str, width: float, rows: int):
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.set_xlim(-0.2, width)
    ax.set_ylim(-1.15, rows - 0.2)
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    return ax


def ddp_step_picture(world_size: int = 2, ax=None):
    """The concept of one DDP step: every rank its own shard, forward and backward alone, one all-reduce of the
    gradients, then the same optimizer step everywhere. One row per rank (rank 0 on top)."""
    ax = _canvas(ax, f"One DDP step on {world_size} ranks: one process each", 9.3, world_size)
    rows = [world_size - 1 - rank for rank in range(world_size)]
    middle = (world_size - 1) / 2
    for rank, y in enumerate(rows):
        ax.text(-0.15, y, f"rank {rank}", ha="right", va="center", fontsize=8)
        _box(ax, 0.7, y, f"its shard:\nG/{world_size} samples", DATA, width=1.3)
        _box(ax, 2.25, y, "forward,\nits loss", COMPUTE, width=1.1)
        _box(ax, 3.7, y, "backward,\nits gradient", COMPUTE, width=1.3)
        _arrow(ax, (1.37, y), (1.68, y))
        _arrow(ax, (2.82, y), (3.03, y))
        _arrow(ax, (4.37, y), (4.8, middle + 0.3 * (y - middle)))
        _arrow(ax, (6.5, middle + 0.3 * (y - middle)), (6.9, y))
        _box(ax, 7.45, y, "optimizer\n.step()", COMPUTE, width=1.1)
        _box(ax, 8.75, y, "same\nweights", DATA, width=0.95)
        _arrow(ax, (8.02, y), (8.25, y))
    _box(ax, 5.65, middle, "all-reduce:\nevery rank gets\nthe average\ngradient", TALK, width=1.7,
         height=0.45 + 0.9 * (world_size - 1))
    ax.text(4.6, -0.8, "DDP(model) first copies rank 0's weights to every rank (a broadcast), so all start equal.\n"
            "Equal start + equal gradient + equal step: the weights never drift apart.",
            ha="center", va="center", fontsize=8, color="0.25")
    return ax


def dataparallel_picture(ax=None):
    """The concept of one DataParallel step on 2 GPUs: one process scatters the batch, copies the model to every
    GPU, gathers the outputs on GPU 0 for one loss, and sums the copies' gradients back onto GPU 0."""
    ax = _canvas(ax, "One DataParallel step on 2 GPUs: one process drives both", 9.3, 2)
    top, bottom = 1, 0
    for x, step in ((1.5, "scatter,\ncopy model"), (3.75, "forward"), (5.2, "gather"), (6.6, "backward"),
                    (8.35, "reduce")):
        ax.text(x, 1.45, step, ha="center", va="bottom", fontsize=7, color="0.3")
    _box(ax, 0.5, top, "whole\nbatch", DATA, width=0.85)
    for y, name in ((top, "GPU 0"), (bottom, "GPU 1")):
        ax.text(-0.15, y, name, ha="right", va="center", fontsize=8)
        _box(ax, 2.3, y, "model copy,\nhalf batch", DATA, width=1.3)
        _box(ax, 3.75, y, "forward", COMPUTE, width=0.95)
        _arrow(ax, (2.97, y), (3.25, y))
        _box(ax, 6.6, y, "backward", COMPUTE, width=0.95)
    _arrow(ax, (0.95, top), (1.62, top))
    _arrow(ax, (0.95, top - 0.2), (1.62, bottom + 0.2))
    _box(ax, 5.2, top, "outputs to\nGPU 0:\none loss", TALK, width=1.1, height=0.8)
    _arrow(ax, (4.25, top), (4.62, top))
    _arrow(ax, (4.25, bottom + 0.15), (4.65, top - 0.3))
    _arrow(ax, (5.78, top), (6.1, top))
    _arrow(ax, (5.6, top - 0.42), (6.1, bottom + 0.15))
    _box(ax, 8.35, top, "sum gradients\non GPU 0,\nthen step", TALK, width=1.45, height=0.8)
    _arrow(ax, (7.1, top), (7.6, top))
    _arrow(ax, (7.1, bottom + 0.15), (7.62, top - 0.3))
    ax.text(4.6, -0.8, "The next step copies the model to every GPU again.\n"
            "DDP keeps one process and one model per device; its weights never move.",
            ha="center", va="center", fontsize=8, color="0.25")
    return ax


SCRIPT_STEP, SCRIPT_COLLECTIVE, SCRIPT_RANK0 = "#dbeafe", "#c2410c", "#fde68a"


def script_timeline(world_size: int = 2, ax=None):
    """Notebook 01b's picture: the life of the DDP script on each rank, left to right, each step with its TODO.

    torchrun starts one process per rank. Each rank picks its device (TODO 1), joins the group (2), takes its shard
    (3) and wraps the model (4). Every epoch it reshuffles (5), trains on its shard with DDP's all-reduce in each
    backward, and all-reduces the loss (6). Rank 0 alone writes the checkpoint; after the barrier every rank reads
    it (7). Then each rank leaves the group (8). Orange lines are collectives: every rank takes part.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.6))
    lanes = {rank: 2.0 * (world_size - 1 - rank) for rank in range(world_size)}  # rank 0 on top
    low, high = min(lanes.values()), max(lanes.values())
    steps = [("device", 1, 1.0), ("join", 2, 1.0), ("shard", 3, 1.0), ("DDP", 4, 1.0), ("set\nepoch", 5, 1.0),
             ("train on\nits shard", None, 2.6), ("loss", 6, 1.0), ("save", 7, 1.0), ("load", 7, 1.0),
             ("leave", 8, 1.0)]
    left, x = {}, 0.0
    for name, _, width in steps:
        left[name] = x
        x += width + 0.15
    for rank, y in lanes.items():
        for name, todo, width in steps:
            blank = name == "save" and rank != 0
            ax.add_patch(FancyBboxPatch((left[name], y - 0.4), width, 0.8, boxstyle="round,pad=0.03",
                                        facecolor="white" if blank else SCRIPT_RANK0 if name == "save" else SCRIPT_STEP,
                                        edgecolor="0.6" if blank else "0.3", linewidth=0.7))
            label = "waits" if blank else name.replace("its shard", f"shard {rank}")
            ax.text(left[name] + width / 2, y, label, ha="center", va="center", fontsize=7.5,
                    color="0.5" if blank else "black")
            if todo is not None and rank == world_size - 1:
                ax.text(left[name] + width / 2, low - 0.55, str(todo), ha="center", va="top", fontsize=8,
                        color="0.3")
        ax.text(-0.2, y, f"rank {rank}", ha="right", va="center", fontsize=8.5)
    ax.text(-0.2, low - 0.55, "TODO", ha="right", va="top", fontsize=8, color="0.3")

    def collective(x, text):
        ax.plot([x, x], [low + 0.4, high - 0.4], color=SCRIPT_COLLECTIVE, linewidth=1.8)
        ax.text(x, (low + high) / 2, text, ha="center", va="center", fontsize=6.5, color=SCRIPT_COLLECTIVE,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})

    collective(left["join"] + 0.5, "rendez-\nvous")
    collective(left["DDP"] + 0.5, "broad-\ncast")
    for step in range(6):  # DDP's gradient all-reduce in every backward
        ax.plot([left["train on\nits shard"] + 0.3 + 0.4 * step] * 2, [low + 0.4, high - 0.4],
                color=SCRIPT_COLLECTIVE, linewidth=0.7, alpha=0.8)
    ax.text(left["train on\nits shard"] + 1.3, (low + high) / 2, "gradient\nall-reduce", ha="center", va="center",
            fontsize=6.5, color=SCRIPT_COLLECTIVE, bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    collective(left["loss"] + 0.5, "all-\nreduce")
    collective(left["load"] - 0.075, "barrier")
    first, last = left["set\nepoch"], left["loss"] + 1.0
    ax.annotate("", xy=(first, high + 0.65), xytext=(last, high + 0.65),
                arrowprops={"arrowstyle": "<->", "color": "0.4", "linewidth": 0.8})
    ax.text((first + last) / 2, high + 0.75, "once per epoch", ha="center", va="bottom", fontsize=7.5, color="0.3")
    ax.text(0.0, high + 0.75, f"torchrun starts {world_size} processes", ha="left", va="bottom", fontsize=7.5,
            color="0.3")
    ax.set_xlim(-1.3, x)
    ax.set_ylim(low - 1.1, high + 1.3)
    ax.axis("off")
    ax.set_title(f"Your DDP script on {world_size} ranks; orange: every rank takes part", fontsize=10)
    return ax
