"""Numbers lesson 08 asserts, from the lab's records: timelines, measured idle fractions, activation peaks."""
from __future__ import annotations

from labsrc.lessons.pipeline_parallel import schedules


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
    """{m: {"repeats", "spans", "kept", "measured", "formula", "replayed", "overlap", "scheduled_overlap"}} over the
    timed steps of one schedule.

    repeats: each repeat's idle fraction (mean over stages of schedules.idle_fractions); spans: its span
    (seconds). Load from other work can only lengthen a span (no box is shorter than its box_ms, no message
    arrives before it is sent), so the repeat with the shortest span is the least disturbed one: kept is
    its index, measured its idle fraction; formula is (p-1)/(m+p-1) (the other schedules' formulas are in
    pipeline_parallel.chunked). replayed: each repeat's order replayed in box slots (replayed_idle), which load
    cannot change; overlap: the kept repeat's overlap_share on the clock, scheduled_overlap the same of its replay.
    """
    sweep: dict[int, dict] = {}
    for m in sorted({t.micro_batches for t in timings if t.schedule == schedule}):
        repeats = sorted({t.repeat for t in timings if (t.schedule, t.micro_batches) == (schedule, m)})
        fractions, spans, replayed, overlaps, scheduled = [], [], [], [], []
        for repeat in repeats:
            timeline = timeline_of(timings, schedule, m, repeat)
            fractions.append(sum(schedules.idle_fractions(timeline)) / len(timeline))
            spans.append(max(e["end"] for events in timeline for e in events))
            replayed.append(replayed_idle(timeline))
            overlaps.append(overlap_share(timeline))
            scheduled.append(overlap_share(replay(timeline)))
        kept = spans.index(min(spans))
        sweep[m] = {"repeats": fractions, "spans": spans, "kept": kept, "measured": fractions[kept],
                    "formula": schedules.bubble_formula(len(timeline), m), "replayed": replayed,
                    "overlap": overlaps[kept], "scheduled_overlap": scheduled[kept]}
    return sweep


def ran_order(timeline: list[list[dict]]) -> list[list[tuple]]:
    """Per stage, the actions in the order that stage ran them: (kind, j), or (kind, j, virtual stage) when the
    timeline's events name one (interleaved and zero-bubble steps)."""
    chunked = any(e.get("virtual_stage", -1) >= 0 for events in timeline for e in events)
    return [[(e["action"], e["micro_batch"], e["virtual_stage"]) if chunked else (e["action"], e["micro_batch"])
             for e in events] for events in timeline]


def replay(timeline: list[list[dict]]) -> list[list[dict]]:
    """The order the stages ran (ran_order), replayed with boxes of 1 and free messages: the schedule's own timeline.

    Every box waits for the same messages as in the run (F j after F j upstream, B j after B j downstream, W j after
    B j), so this is the step as the ranks' order makes it, in box slots, whatever the clock said.
    """
    from labsrc.lessons.pipeline_parallel import chunked
    lists = ran_order(timeline)
    if any(len(action) == 3 for actions in lists for action in actions):
        virtual_stages = 1 + max(action[2] for actions in lists for action in actions)
        return chunked.simulate(lists, virtual_stages, {"F": 1.0, "B": 1.0, "W": 1.0})
    return schedules.simulate(lists, 1.0, 1.0)


def replayed_idle(timeline: list[list[dict]]) -> float:
    """The idle fraction of the order the stages ran, replayed (mean over stages): the bubble counted in box slots.

    Counted from what each rank recorded running, not from how long it took: a machine busy with other work
    stretches the boxes and the hops between them, never this count. An order that does not overlap its stages
    (one micro-batch through every stage at a time) counts 1 - 1/p.
    """
    replayed = replay(timeline)
    return sum(schedules.idle_fractions(replayed)) / len(replayed)


def overlap_share(timeline: list[list[dict]]) -> float:
    """The share of the stages' box time during which another stage was computing too (mean over stages).

    A pipeline's point, seen on the clock without judging durations: 0 when the stages take turns (no pipelining,
    or m = 1), (m - 1) / m of the box time in a GPipe step on 2 stages with equal boxes and free messages. Load
    from other programs stretches boxes and delays hops; overlapping boxes then overlap a little less, or overlap a
    neighbour's next box instead, but boxes that never overlap cannot come from a pipelined order.
    """
    shares = []
    for stage, events in enumerate(timeline):
        others = sorted((e["start"], e["end"]) for s, evs in enumerate(timeline) if s != stage for e in evs)
        busy = together = 0.0
        for event in events:
            busy += event["end"] - event["start"]
            covered = event["start"]   # others' boxes may overlap each other (3+ stages): count each instant once
            for start, end in others:
                low, high = max(start, covered), min(end, event["end"])
                if high > low:
                    together += high - low
                    covered = high
        shares.append(together / busy if busy > 0 else 0.0)
    return sum(shares) / len(shares)


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
