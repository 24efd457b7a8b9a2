"""Reference solutions of notebook 08's exercises (pipeline parallel)."""
from __future__ import annotations


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """Stage `stage` of `stages`: p - 1 - stage forwards, then forward/backward pairs, then the remaining backwards."""
    warmup = min(stages - 1 - stage, micro_batches)
    actions = [("F", j) for j in range(warmup)]
    next_backward = 0
    for j in range(warmup, micro_batches):
        actions += [("F", j), ("B", next_backward)]
        next_backward += 1
    actions += [("B", j) for j in range(next_backward, micro_batches)]
    return actions


def idle_fraction(timeline: list[list[dict]]) -> list[float]:
    """Per stage, 1 - busy / span, the span from the earliest start anywhere to the latest end anywhere."""
    starts = [event["start"] for events in timeline for event in events]
    ends = [event["end"] for events in timeline for event in events]
    span = max(ends) - min(starts)
    return [1 - sum(event["end"] - event["start"] for event in events) / span for events in timeline]
