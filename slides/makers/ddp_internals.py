"""Deck 04's figures: bucket sweep, profiler timeline and hand-made schedule from a ci run; buckets overlapping backward."""
from __future__ import annotations

from makers.diagrams import PALETTE, canvas, label

LAYERS = 6   # layers of the drawn model; gradients arrive last layer first
BUCKETS = ((6, 5), (4, 3), (2, 1))   # layers per bucket, in the order their gradients are ready


def lane(axes, y: float, spans, text: str):
    """Boxes [(start, end, text, kind)] on one row at height y, the row named on the left."""
    from matplotlib.patches import Rectangle
    axes.text(-0.2, y + 0.3, text, ha="right", va="center", fontsize=9)
    for start, end, name, kind in spans:
        axes.add_patch(Rectangle((start, y), end - start, 0.6, facecolor=PALETTE[kind], edgecolor="#374151"))
        axes.text((start + end) / 2, y + 0.3, name, ha="center", va="center", fontsize=7)


def schedules(backward: float = 1.0, reduce: float = 1.2, optimizer: float = 0.8) -> tuple[dict, float]:
    """({name: (backward spans, all-reduce spans, end)}, optimizer): all-reduces after backward, or per bucket once full."""
    layers = [(i * backward, (i + 1) * backward, f"grad L{LAYERS - i}", "compute") for i in range(LAYERS)]
    end = LAYERS * backward
    after = [(end + b * reduce, end + (b + 1) * reduce, f"bucket {b}", "communication") for b in range(len(BUCKETS))]
    overlapped, free = [], 0.0
    for index, bucket in enumerate(BUCKETS):
        ready = (LAYERS - min(bucket) + 1) * backward
        start = max(ready, free)
        overlapped.append((start, start + reduce, f"bucket {index}", "communication"))
        free = start + reduce
    return {"sequential": (layers, after, after[-1][1]), "overlapped": (layers, overlapped, free)}, optimizer


def overlap_diagram():
    drawn, optimizer = schedules()
    span = max(end for _, _, end in drawn.values()) + optimizer + 0.3
    figure, axes = canvas(span + 2.4, 5.4)
    axes.set_xlim(-2.2, span + 0.2)
    rows = {"sequential": (3.4, "all-reduce after backward"), "overlapped": (0.6, "bucketed, launched from hooks")}
    for name, (layers, reduces, end) in drawn.items():
        y, title = rows[name]
        label(axes, span / 2, y + 1.75, f"{title}: step ends at {end + optimizer:.1f} units", fontsize=10,
              weight="bold")
        lane(axes, y + 0.8, layers, "backward")
        lane(axes, y, reduces + [(end, end + optimizer, "optimizer", "data")], "all-reduce")
    axes.text(span / 2, 0.1, f"Schematic: {LAYERS} layers, gradients ready last layer first, {len(BUCKETS)} buckets of "
              "2 layers; each bucket's all-reduce starts when its last gradient is ready.",
              ha="center", va="center", fontsize=8)
    return figure


def make(save):
    from labsrc import launch
    from labsrc.core.plan import make_plan
    from labsrc.lessons.ddp_internals import plots
    plan = make_plan()
    result = launch.run("ddp_internals", nproc=plan.world_size, timeout=300, global_batch=plan.global_batch)
    save("bucket_sweep", plots.bucket_sweep(result).figure)
    save("profiler_timeline", plots.profiler_timeline(result).figure)
    save("handmade_schedule", plots.handmade_schedule(result).figure)
    save("overlap", overlap_diagram(), measured=False)
