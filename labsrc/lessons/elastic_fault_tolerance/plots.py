"""Figures of notebook 10: the restart timeline (start x time, steps) and the membership timeline (world size x time)."""
from __future__ import annotations

from labsrc.core.figures import new_axes
from labsrc.lessons.elastic_fault_tolerance import analysis
from labsrc.lessons.elastic_fault_tolerance.lab import Failure, SnapshotSaved


def _origin(result) -> float:
    return min(resume.started_wall for group in analysis.starts(result) for resume, _ in group)


def restart_timeline(result, ax=None):
    """Steps done against seconds since the first start, one colour per start; replayed steps hollow,
    snapshots as ticks, failures as crosses."""
    origin = _origin(result)
    ax = new_axes("Restarts: steps done over time, one colour per start", "seconds since the run started",
                  "steps done", ax, figsize=(7.2, 3.8))
    for segment, group in zip(analysis.segments(result), analysis.starts(result)):
        resume, done = group[0]
        kept = [s for s in done if s.step <= segment.kept_until]
        replayed = [s for s in done if s.step > segment.kept_until]
        line = ax.plot([resume.started_wall - origin] + [s.wall - origin for s in kept],
                       [segment.resumed_from] + [s.step for s in kept], marker=".",
                       label=f"start {segment.start} (world {segment.world_size}, "
                             f"TORCHELASTIC_RESTART_COUNT={segment.restart_count})")[0]
        if replayed:
            ax.plot([s.wall - origin for s in replayed], [s.step for s in replayed], "o", mfc="none",
                    color=line.get_color())
    attempts = sorted(result.records_by_attempt)
    saves = [s for a in attempts for s in result.of(SnapshotSaved, attempt=a)]
    ax.plot([s.wall - origin for s in saves], [s.step for s in saves], "|", color="black", markersize=12,
            label="snapshot written")
    failures = [f for a in attempts for f in result.of(Failure, attempt=a)]
    ax.plot([f.wall - origin for f in failures], [f.step for f in failures], "x", color="red", markersize=10,
            label="planted failure")
    for failure in failures:
        ax.annotate(failure.failure, (failure.wall - origin, failure.step), textcoords="offset points",
                    xytext=(4, 6), color="red")
    ax.legend(fontsize=7, loc="lower right")
    return ax


def membership_timeline(result, ax=None):
    """World size of each start over time (left axis) and steps done (right axis)."""
    origin = _origin(result)
    ax = new_axes("Elastic membership: world size and progress over time", "seconds since the run started",
                  "world size (ranks)", ax, figsize=(7.2, 3.6))
    steps_axis = ax.twinx()
    steps_axis.set_ylabel("steps done")
    segments = analysis.segments(result)
    for segment, group in zip(segments, analysis.starts(result)):
        resume, done = group[0]
        end = max([s.wall for s in done] + [resume.started_wall])
        ax.hlines(segment.world_size, resume.started_wall - origin, end - origin, linewidth=6, alpha=0.6,
                  color=f"C{segment.start}", label=f"start {segment.start}: {segment.world_size} rank(s)")
        steps_axis.plot([s.wall - origin for s in done], [s.step for s in done], ".", color=f"C{segment.start}")
    largest = max(s.world_size for s in segments)
    ax.set_ylim(0, largest + 1)
    ax.set_yticks(range(largest + 2))
    ax.legend(fontsize=7, loc="upper left")
    return ax
