"""Deck 01's figures: the sync experiment's plots from a ci run, and DataParallel vs DDP as a diagram."""
from __future__ import annotations

from makers.diagrams import arrow, box, canvas, label


def dataparallel_side(axes):
    label(axes, 2.6, 5.6, "DataParallel: one process", fontsize=11, weight="bold")
    box(axes, 0.2, 4.4, 2.2, 0.7, "batch (N, ...) on GPU 0", kind="data")
    for g in range(2):
        x = 0.2 + 2.6 * g
        replica = box(axes, x, 2.6, 2.2, 0.9, f"GPU {g}: replica\nthread {g}, chunk N/2", kind="compute", fontsize=8)
        arrow(axes, (1.3, 4.4), (replica[0], 3.5), "scatter" if g else "", offset=(0.5, -0.1))
    box(axes, 2.8, 4.4, 2.2, 0.7, "module replicated\nto every GPU, every step", kind="bad", fontsize=8)
    gathered = box(axes, 0.2, 0.9, 2.2, 0.8, "outputs gathered on\nGPU 0: ONE mean loss", kind="communication", fontsize=8)
    for g in range(2):
        arrow(axes, (1.3 + 2.6 * g, 2.6), (gathered[0], 1.7), "gather" if g else "", offset=(0.4, 0))
    box(axes, 2.8, 0.9, 2.2, 0.8, "replica gradients summed\ninto GPU 0 (no ÷ n)", kind="communication", fontsize=8)
    arrow(axes, (2.4, 1.3), (2.8, 1.3))


def ddp_side(axes, left: float):
    label(axes, left + 2.6, 5.6, "DDP: one process per device", fontsize=11, weight="bold")
    for r in range(2):
        x = left + 0.2 + 2.8 * r
        box(axes, x, 4.4, 2.2, 0.7, f"rank {r}: its shard N/2", kind="data", fontsize=8)
        box(axes, x, 2.6, 2.2, 0.9, f"rank {r}: forward, loss\nbackward", kind="compute", fontsize=8)
        arrow(axes, (x + 1.1, 4.4), (x + 1.1, 3.5))
        box(axes, x, 0.2, 2.2, 0.7, f"rank {r}: optimizer.step()", kind="compute", fontsize=8)
    box(axes, left + 0.2, 1.3, 5.0, 0.8, "each gradient ÷ n into its bucket, then\nall-reduce(SUM), bucket by bucket, in backward",
        kind="communication", fontsize=8)
    for r in range(2):
        x = left + 1.3 + 2.8 * r
        arrow(axes, (x, 2.6), (x, 2.1))
        arrow(axes, (x, 1.3), (x, 0.9))


def sync_diagram():
    figure, axes = canvas(11.4, 6.0)
    dataparallel_side(axes)
    ddp_side(axes, 5.8)
    axes.plot([5.6, 5.6], [0.1, 5.9], color="#9ca3af", linewidth=1)
    return figure


def make(save):
    from labsrc import launch
    from labsrc.core.plan import make_plan
    from labsrc.lessons.dp_vs_ddp import plots
    plan = make_plan()
    result = launch.run("dp_vs_ddp", nproc=plan.world_size, timeout=600, global_batch=plan.global_batch)
    save("loss_curves", plots.loss_curves(result)[0].figure)
    save("buffer_spread", plots.buffer_spread(result).figure)
    save("step_breakdown", plots.step_breakdown(result).figure)
    save("dp_vs_ddp", sync_diagram(), measured=False)
