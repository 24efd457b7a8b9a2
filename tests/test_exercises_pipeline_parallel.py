"""Notebook 08's checkers accept the reference solutions and reject planted mistakes, naming each one."""
import re

import pytest

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.pipeline_parallel import exercises as checkers, schedules


def test_one_f_one_b_solution_passes():
    checkers.check_one_f_one_b(load_solution("pipeline_parallel", "one_f_one_b"))


def _backward_first(stage, stages, m):
    actions = schedules.one_f_one_b_actions(stage, stages, m)
    if stage == 1 and m > 2:
        actions.remove(("B", 2))
        actions.insert(0, ("B", 2))
    return actions


def _skips_last(stage, stages, m):
    return [a for a in schedules.one_f_one_b_actions(stage, stages, m) if a != ("F", m - 1)]


def _strictly_alternating(stage, stages, m):
    return [a for j in range(m) for a in (("F", j), ("B", j))]


def _warmup_by_stage(stage, stages, m):
    warmup = min(stage, m)
    actions = [("F", j) for j in range(warmup)]
    for j in range(warmup, m):
        actions += [("F", j), ("B", j - warmup)]
    return actions + [("B", j) for j in range(m - warmup, m)]


def _uncapped_warmup(stage, stages, m):
    warmup = stages - 1 - stage   # the stub's hint without min(..., m): wrong once m < p - 1
    actions = [("F", j) for j in range(warmup)]
    for j in range(warmup, m):
        actions += [("F", j), ("B", j - warmup)]
    return actions + [("B", j) for j in range(max(m - warmup, 0), m)]


@pytest.mark.parametrize("wrong,message", [
    (_uncapped_warmup, "p=4, m=2: stage 0 names micro-batch(es) [2], outside 0..1; with m < p - 1"),
    (schedules.gpipe_actions, "stage 0 keeps 4 micro-batches alive"),
    (_backward_first, "micro-batch 2's backward comes before its forward on stage 1"),
    (_skips_last, "stage 0 never runs F of micro-batch 0"),
    (_strictly_alternating, "takes 2(m+p-1) = 10"),
    (_warmup_by_stage, "the stages wait on each other forever"),
])
def test_one_f_one_b_mistakes_are_named(wrong, message):
    with pytest.raises(ExerciseFailed, match=re.escape(message)):
        checkers.check_one_f_one_b(wrong)


def test_idle_fraction_solution_passes():
    checkers.check_idle_fraction(load_solution("pipeline_parallel", "idle_fraction"))


def _span_from_zero(timeline):
    last = max(e["end"] for events in timeline for e in events)
    return [1 - sum(e["end"] - e["start"] for e in events) / last for events in timeline]


def _span_per_stage(timeline):
    return [1 - sum(e["end"] - e["start"] for e in events) / (events[-1]["end"] - events[0]["start"])
            for events in timeline]


def _busy(timeline):
    return [1 - value for value in load_solution("pipeline_parallel", "idle_fraction")(timeline)]


def _counts_boxes(timeline):
    return [1 - len(events) / 2 / (len(events) / 2 + len(timeline) - 1) for events in timeline]


@pytest.mark.parametrize("wrong,message", [
    (_span_from_zero, "not at time 0"),
    (_span_per_stage, "not each stage's own first-to-last"),
    (_busy, "busy fraction"),
    (_counts_boxes, "this timeline is not ideal"),
])
def test_idle_fraction_mistakes_are_named(wrong, message):
    with pytest.raises(ExerciseFailed, match=message):
        checkers.check_idle_fraction(wrong)


def test_idle_fraction_returning_one_number_is_named():
    solution = load_solution("pipeline_parallel", "idle_fraction")
    with pytest.raises(ExerciseFailed, match="not one number"):
        checkers.check_idle_fraction(lambda timeline: sum(solution(timeline)) / len(timeline))


def _rounded(timeline):
    return [round(value, 1) for value in load_solution("pipeline_parallel", "idle_fraction")(timeline)]


def test_an_unnamed_mistake_shows_expected_and_got():
    with pytest.raises(ExerciseFailed, match="expected .* got"):
        checkers.check_idle_fraction(_rounded)
