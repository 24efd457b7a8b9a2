"""Figures of notebook 04 (DDP internals), drawn from the ddp_internals lab's records."""
from __future__ import annotations

from labsrc.core.figures import gantt, new_axes
from labsrc.lessons.ddp_internals.inside_ddp import SPAN_LABELS
from labsrc.lessons.ddp_internals.lab import BucketSweep, HandmadeSchedule, ProfiledStep


def bucket_sweep(result, ax=None):
    """All-reduce calls per step (bars) and step time (line) against bucket_cap_mb."""
    rows = sorted(result.of(BucketSweep, rank=0), key=lambda r: r.cap_mb)
    ax = new_axes("torch DDP: bucket_cap_mb swept", "bucket_cap_mb", "all-reduce calls per step", ax)
    ticks = [f"{r.cap_mb:g}" for r in rows]
    ax.bar(ticks, [r.allreduce_calls for r in rows], color="#c2410c", label="all-reduce calls (comm hook count)")
    ax.plot(ticks, [r.predicted_buckets for r in rows], "k^", label="buckets predicted from parameter sizes")
    twin = ax.twinx()
    twin.plot(ticks, [1000 * r.step_s for r in rows], "o-", color="#2563eb", label="step time")
    twin.set_ylabel("step time (ms, median)")
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
