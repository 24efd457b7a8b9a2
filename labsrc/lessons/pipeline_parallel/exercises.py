"""Checkers for notebook 08's exercises: write the 1F1B action list; compute a timeline's idle fractions."""
from __future__ import annotations

from labsrc.core.exercises import ExerciseFailed, on_ranks, passed
from labsrc.lessons.pipeline_parallel import schedules
from labsrc.lessons.pipeline_parallel.experiments import hand_written_error

CASES = [(2, 1), (2, 4), (3, 2), (3, 6), (4, 8), (4, 2), (4, 1)]
"""(stages p, micro-batches m) every schedule is checked on; (4, 2) and (4, 1) have m < p - 1, where the warm-up
must stop at m."""


def _lists(actions_function, stages: int, micro_batches: int) -> list[list]:
    lists = []
    for stage in range(stages):
        actions = actions_function(stage, stages, micro_batches)
        if not isinstance(actions, list):
            raise ExerciseFailed(f"stage {stage} of {stages}: return a list of ('F', j) / ('B', j), "
                                 f"not {type(actions).__name__}")
        lists.append(actions)
    return lists


def _gradients_on_ranks(ctx, actions_function, micro_batches: int) -> str | None:
    error = hand_written_error(ctx, actions_function, micro_batches)
    if error > 1e-5:
        return f"with your lists the stage's gradients differ from the unsplit model's by {error:.3g}"
    return None


def check_one_f_one_b(actions_function) -> None:
    """actions_function(stage, stages, micro_batches) -> that stage's 1F1B list, e.g. [("F", 0), ("B", 0), ...]."""
    for stages, m in CASES:
        lists = _lists(actions_function, stages, m)
        for stage, actions in enumerate(lists):
            problems = schedules.schedule_problems(actions, stage, m)
            if problems:
                hint = ("; with m < p - 1 the warm-up has fewer micro-batches than p - 1 - stage: cap it, "
                        "min(p - 1 - stage, m)") if m < stages - 1 - stage and any("outside" in problem for problem in problems) else ""
                raise ExerciseFailed(f"p={stages}, m={m}: " + "; ".join(problems) + hint)
        try:
            timeline = schedules.simulate(lists)
        except ValueError as stuck:
            raise ExerciseFailed(f"p={stages}, m={m}: {stuck}") from None
        for stage, actions in enumerate(lists):
            alive, limit = schedules.peak_in_flight(actions), min(m, stages - stage)
            if alive > limit:
                raise ExerciseFailed(f"p={stages}, m={m}: stage {stage} keeps {alive} micro-batches alive; 1F1B "
                                     f"keeps at most p - stage = {limit}: start a backward sooner")
        span = max(event["end"] for events in timeline for event in events)
        best = 2 * (m + stages - 1)
        if span > best:
            raise ExerciseFailed(f"p={stages}, m={m}: with boxes of 1 your schedule takes {span:g}, 1F1B takes "
                                 f"2(m+p-1) = {best}: a stage waits for a backward it could have overlapped; "
                                 f"warm up with p - 1 - stage forwards")
    on_ranks(_gradients_on_ranks, 2, args=(actions_function, 4))
    passed(f"1F1B lists are valid, keep at most p - stage micro-batches alive, take 2(m+p-1) boxes on "
           f"{len(CASES)} (p, m) cases, and give the unsplit model's gradients on 2 ranks")


def _shifted(timeline: list[list[dict]], offset: float) -> list[list[dict]]:
    return [[dict(e, start=e["start"] + offset, end=e["end"] + offset) for e in events] for events in timeline]


def _mistakes(timeline: list[list[dict]]) -> dict[str, list[float]]:
    """What common wrong definitions give, to name the one a learner used."""
    first = min(e["start"] for events in timeline for e in events)
    last = max(e["end"] for events in timeline for e in events)
    busy = [sum(e["end"] - e["start"] for e in events) for events in timeline]
    own = [max(e["end"] for e in events) - min(e["start"] for e in events) for events in timeline]
    return {
        "the span starts at the first start on any stage, not at time 0": [1 - b / last for b in busy],
        "the span is the same for every stage (first start on any stage to last end on any stage), "
        "not each stage's own first-to-last": [1 - b / o for b, o in zip(busy, own)],
        "this is the busy fraction; the idle fraction is 1 minus it": [b / (last - first) for b in busy],
        "this timeline is not ideal (one stage runs late): measure busy time and span, the formula "
        "(p-1)/(m+p-1) holds only for ideal ones": [schedules.bubble_formula(len(timeline), len(events) // 2)
                                                    for events in timeline],
    }


def _late(timeline: list[list[dict]], stage: int, factor: float) -> list[list[dict]]:
    """The timeline with one stage's times stretched by factor: a measured-like, non-ideal pipeline."""
    return [[dict(e, start=e["start"] * factor, end=e["end"] * factor) for e in events] if s == stage else events
            for s, events in enumerate(timeline)]


def check_idle_fraction(idle_fraction) -> None:
    """idle_fraction(timeline) -> [idle fraction of stage 0, 1, ...] for timeline[stage] = [{"start", "end", ...}]."""
    cases = [("gpipe", 2, 4, 1.0), ("1f1b", 3, 6, 1.0), ("gpipe", 4, 1, 1.0), ("gpipe", 2, 3, 1.25)]
    for schedule, stages, m, stretch in cases:
        lists = [schedules.actions_for(schedule, s, stages, m) for s in range(stages)]
        ideal = schedules.simulate(lists, 1.0, 2.0)                       # a backward twice a forward
        timeline = _shifted(_late(ideal, stages - 1, stretch), 100.0)     # starts at t = 100
        expected = schedules.idle_fractions(timeline)
        got = idle_fraction(timeline)
        if not hasattr(got, "__len__"):
            raise ExerciseFailed(f"{schedule} p={stages}, m={m}: return a list, one idle fraction per stage ({stages}), "
                                 f"not one number ({got!r}): the mean over stages is not what is asked")
        if len(got) != stages:
            raise ExerciseFailed(f"{schedule} p={stages}, m={m}: return one fraction per stage ({stages}), got {len(got)}")
        if all(abs(g - e) <= 1e-9 for g, e in zip(got, expected)):
            continue
        for mistake, values in _mistakes(timeline).items():
            if all(abs(g - v) <= 1e-9 for g, v in zip(got, values)):
                raise ExerciseFailed(f"{schedule} p={stages}, m={m}: {mistake}")
        raise ExerciseFailed(f"{schedule} p={stages}, m={m}: expected {[round(e, 4) for e in expected]}, "
                             f"got {[round(float(g), 4) for g in got]}")
    passed(f"idle fractions right on {len(cases)} timelines (GPipe, 1F1B; a backward twice a forward; "
           f"time not starting at 0; a stage running late)")
