"""Numbers lesson 08 asserts, from the lab's records: timelines, measured idle fractions, activation peaks."""
from __future__ import annotations

from labsrc.pipeline_parallel import schedules


def timeline_of(timings: list, schedule: str, micro_batches: int, repeat: int = 0) -> list[list[dict]]:
    """Per stage, its actions in the order they ran: [{"action", "micro_batch", "virtual_stage", "start", "end"}].

    timings: ActionTiming records (objects with schedule, micro_batches, repeat, stage, action, ...).
    Times are made relative to the first start on any stage.
    """
    chosen = [t for t in timings if (t.schedule, t.micro_batches, t.repeat) == (schedule, micro_batches, repeat)]
    if not chosen:
        raise KeyError(f"no timings of {schedule} with m={micro_batches}, repeat {repeat}")
    origin = min(t.start for t in chosen)
    stages = max(t.stage for t in chosen) + 1
    timeline: list[list[dict]] = [[] for _ in range(stages)]
    for t in sorted(chosen, key=lambda t: t.start):
        timeline[t.stage].append({"action": t.action, "micro_batch": t.micro_batch, "virtual_stage": t.virtual_stage,
                                  "start": t.start - origin, "end": t.end - origin})
    return timeline


def bubble_sweep(timings: list, schedule: str = "gpipe") -> dict[int, dict]:
    """{m: {"repeats", "spans", "kept", "measured", "formula"}} over the timed steps of one schedule.

    repeats: each repeat's idle fraction (mean over stages of schedules.idle_fractions); spans: its span
    (seconds). Load from other work can only lengthen a span (no box is shorter than its box_ms, no message
    arrives before it is sent), so the repeat with the shortest span is the least disturbed one: kept is
    its index, measured its idle fraction; formula is (p-1)/(m+p-1) (the other schedules' formulas are in
    pipeline_parallel.chunked).
    """
    sweep: dict[int, dict] = {}
    for m in sorted({t.micro_batches for t in timings if t.schedule == schedule}):
        repeats = sorted({t.repeat for t in timings if (t.schedule, t.micro_batches) == (schedule, m)})
        fractions, spans = [], []
        for repeat in repeats:
            timeline = timeline_of(timings, schedule, m, repeat)
            fractions.append(sum(schedules.idle_fractions(timeline)) / len(timeline))
            spans.append(max(e["end"] for events in timeline for e in events))
        kept = spans.index(min(spans))
        sweep[m] = {"repeats": fractions, "spans": spans, "kept": kept, "measured": fractions[kept],
                    "formula": schedules.bubble_formula(len(timeline), m)}
    return sweep


def ideal_timeline(schedule: str, stages: int, micro_batches: int, box_s: float) -> list[list[dict]]:
    """The schedule's timeline with every box box_s long and messages free (schedules.simulate)."""
    lists = [schedules.actions_for(schedule, s, stages, micro_batches) for s in range(stages)]
    return schedules.simulate(lists, box_s, box_s)


def activation_peaks(peaks: list) -> dict[tuple[str, int], dict]:
    """{(schedule, stage): {"peak_bytes", "micro_batches_alive", "expected"}} from MemoryPeak records.

    micro_batches_alive: the peak in units of one micro-batch's saved bytes; expected: m for GPipe,
    min(m, p - stage) for 1F1B.
    """
    table = {}
    for record in peaks:
        expected = (record.micro_batches if record.schedule == "gpipe"
                    else min(record.micro_batches, record.stages - record.stage))
        table[(record.schedule, record.stage)] = {
            "peak_bytes": record.peak_bytes, "micro_batches_alive": record.peak_bytes / record.micro_batch_bytes,
            "expected": expected, "cuda_peak_bytes": record.cuda_peak_bytes}
    return table
