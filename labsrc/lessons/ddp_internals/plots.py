"""Figures of notebook 04 (DDP internals): the overlap idea drawn as a schematic, the rest from the lab's records."""
from __future__ import annotations

from labsrc.core.figures import gantt, new_axes
from labsrc.lessons.ddp_internals.inside_ddp import SPAN_LABELS
from labsrc.lessons.ddp_internals.lab import BucketSweep, HandmadeSchedule, ProfiledStep


CONCEPT_LAYERS = 6  # layers of the drawn model; backward delivers their gradients last layer first
CONCEPT_BUCKETS = 3  # buckets of two layers each


def concept_schedules(backward: float = 1.0, reduce: float = 1.3) -> dict:
    """{"after backward" | "buckets from hooks": (backward spans, all-reduce spans)}, spans (start, end, text).

    Time in units of one layer's backward. Every bucket's all-reduce takes `reduce`; one runs at a time.
    After backward: they start once the last gradient is ready. From hooks: each starts once its bucket is full.
    """
    layers = [(i * backward, (i + 1) * backward, f"L{CONCEPT_LAYERS - i}") for i in range(CONCEPT_LAYERS)]
    per_bucket = CONCEPT_LAYERS // CONCEPT_BUCKETS
    end = CONCEPT_LAYERS * backward
    after = [(end + b * reduce, end + (b + 1) * reduce, f"bucket {b}") for b in range(CONCEPT_BUCKETS)]
    hooked, free = [], 0.0
    for b in range(CONCEPT_BUCKETS):
        start = max((b + 1) * per_bucket * backward, free)  # full once its last layer's gradient is ready
        hooked.append((start, start + reduce, f"bucket {b}"))
        free = start + reduce
    return {"after backward": (layers, after), "buckets from hooks": (layers, hooked)}


def overlap_concept(ax=None):
    """Schematic: all-reduce after backward (the processor waits for the network) vs buckets launched from hooks."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.6))
    colors = {"backward": "#bfdbfe", "all-reduce": "#fdba74"}
    per_bucket = CONCEPT_LAYERS // CONCEPT_BUCKETS
    for y, (name, (layers, reduces)) in zip((3.2, 0.4), concept_schedules().items()):
        end = reduces[-1][1]
        ax.text(0, y + 2.0, f"{name}: the step ends at {end:.1f}", fontsize=10, weight="bold")
        for row, (spans, kind) in enumerate(((layers, "backward"), (reduces, "all-reduce"))):
            top = y + (1 - row) * 0.9
            ax.text(-0.15, top + 0.35, kind, ha="right", va="center", fontsize=9)
            for index, (start, stop, text) in enumerate(spans):
                if kind == "all-reduce":  # which layers the bucket holds
                    text += f"\nL{CONCEPT_LAYERS - per_bucket * index}, L{CONCEPT_LAYERS - per_bucket * index - 1}"
                ax.add_patch(Rectangle((start, top), stop - start, 0.7, facecolor=colors[kind], edgecolor="#374151"))
                ax.text((start + stop) / 2, top + 0.35, text, ha="center", va="center", fontsize=7)
        done = layers[-1][1]  # backward is over: the optimizer waits for the last all-reduce
        ax.add_patch(Rectangle((done, y + 0.9), end - done, 0.7, facecolor="white", edgecolor="#9ca3af", hatch="//"))
        ax.text((done + end) / 2, y + 1.25, "waits", ha="center", va="center", fontsize=8, color="#374151",
                backgroundcolor="white")
    ax.set_xlim(-2.2, 10.2)
    ax.set_ylim(0.2, 5.5)
    ax.set_xticks(range(0, 11, 2))
    ax.set_xlabel("time (unit: one layer's backward)")
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    return ax


def launch_order_diagram():
    """Schematic: two ranks fill their buckets in opposite orders; what each all-reduce sums, as filled or in order."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    figure, panels = plt.subplots(1, 2, figsize=(6.4, 3.0), sharey=True)
    branch = {0: "b", 1: "a"}  # bucket 0 holds the parameters registered last: branch b
    filled = {0: [0, 1], 1: [1, 0]}  # rank 0 fills bucket 0 first, rank 1 bucket 1
    colors = {0: "#bfdbfe", 1: "#fdba74"}
    for panel, (title, order) in zip(panels, (("launched as they fill", filled), ("launched in index order",
                                                                                {0: [0, 1], 1: [0, 1]}))):
        panel.set_title(title, fontsize=10)
        for rank in (0, 1):
            y = 1.4 - 1.1 * rank
            for call, bucket in enumerate(order[rank]):
                panel.add_patch(Rectangle((call, y), 0.8, 0.6, facecolor=colors[bucket], edgecolor="#374151"))
                panel.text(call + 0.4, y + 0.3, f"bucket {bucket}\nbranch {branch[bucket]}", ha="center",
                           va="center", fontsize=8)
        for call in (0, 1):
            same = order[0][call] == order[1][call]
            panel.text(call + 0.4, -0.35, "same bucket:\nright sum" if same else "a + b:\nwrong sum", ha="center",
                       va="center", fontsize=8, color="#15803d" if same else "#b91c1c")
        panel.set_xticks([0.4, 1.4], ["1st all-reduce", "2nd all-reduce"], fontsize=8)
        panel.tick_params(axis="y", length=0)
        panel.set_xlim(-0.1, 1.9)
        panel.set_ylim(-0.75, 2.2)
        for side in ("right", "top", "left"):
            panel.spines[side].set_visible(False)
    panels[0].set_yticks([1.7, 0.6], ["rank 0", "rank 1"])
    panels[1].text(0.9, 1.15, "rank 1 filled bucket 1 first: it waits for bucket 0", ha="center", va="center",
                   fontsize=7, color="#4b5563")
    figure.tight_layout()
    return figure


def bucket_sweep(result, ax=None):
    """All-reduce calls per step (bars) and step time (grey line: noise on a shared CPU) against bucket_cap_mb."""
    rows = sorted(result.of(BucketSweep, rank=0), key=lambda r: r.cap_mb)
    ax = new_axes("torch DDP: bucket_cap_mb swept", "bucket_cap_mb", "all-reduce calls per step", ax)
    ticks = [f"{r.cap_mb:g}" for r in rows]
    ax.bar(ticks, [r.allreduce_calls for r in rows], color="#c2410c", label="all-reduce calls (comm hook count)")
    ax.plot(ticks, [r.predicted_buckets for r in rows], "k^", label="buckets predicted from parameter sizes")
    twin = ax.twinx()
    twin.plot(ticks, [1000 * r.step_s for r in rows], "o--", color="#9ca3af", label="step time (noisy on a CPU)")
    twin.set_ylabel("step time (ms, median)", color="#6b7280")
    twin.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=8)
    twin.legend(loc="center right", fontsize=8)
    return ax


def profiler_timeline(result, rank: int = 0, ax=None):
    """The profiled DDP step: backward ops, all-reduces launched and running, on one timeline (ms)."""
    spans = result.of(ProfiledStep, rank=rank)[0].spans
    lanes = [{"lane": SPAN_LABELS[s["kind"]], "name": SPAN_LABELS[s["kind"]], "start": s["start"],
              "end": max(s["end"], s["start"] + 0.02)} for s in spans]
    return gantt(lanes, f"One DDP step (rank {rank}, torch.profiler): all-reduces during backward", ax=ax)


def handmade_schedule(result, rank: int = 0, ax=None):
    """The handmade bucketed DDP's schedule: when each gradient hook fired and each bucket's all-reduce began."""
    events = result.of(HandmadeSchedule, rank=rank)[0].events
    ax = new_axes("Handmade buckets: all-reduces launched while backward runs", "ms from the first gradient", "", ax,
                  figsize=(8, 2.2))
    hooks = [e["ms"] for e in events if e["kind"] == "hook"]
    launches = [e["ms"] for e in events if e["kind"] == "all_reduce"]
    ax.plot(hooks, [1] * len(hooks), "|", markersize=18, color="#2563eb", label="gradient ready (hook)")
    ax.plot(launches, [0] * len(launches), "v", markersize=10, color="#c2410c", label="bucket all-reduce launched")
    ax.set_yticks([0, 1], ["all-reduce", "backward"])
    ax.set_ylim(-0.6, 2.1)
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    return ax
