"""Notebook 13's exercise checker accepts the reference schedule and rejects planted mistakes, naming them."""
import math

import pytest

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.capstone import exercises as checkers

solution = load_solution("capstone", "learning_rate")


def test_solution_passes(capsys):
    checkers.check_learning_rate(solution)
    assert "passed" in capsys.readouterr().out


def unscaled_peak(step, base_lr, base_batch, global_batch, warmup, total, end):
    return solution(step, base_lr, base_batch, base_batch, warmup, total, end)


def warmup_from_zero(step, base_lr, base_batch, global_batch, warmup, total, end):
    if step < warmup:
        return base_lr * global_batch / base_batch * step / warmup
    return solution(step, base_lr, base_batch, global_batch, warmup, total, end)


def warmup_one_step_long(step, base_lr, base_batch, global_batch, warmup, total, end):
    return solution(step, base_lr, base_batch, global_batch, warmup + 1 if warmup else 0, total, end)


def warmup_from_base_lr_above_the_peak(step, base_lr, base_batch, global_batch, warmup, total, end):
    if step < warmup:
        peak = base_lr * global_batch / base_batch
        return base_lr + (peak - base_lr) * step / warmup
    return solution(step, base_lr, base_batch, global_batch, warmup, total, end)


def ends_at_zero(step, base_lr, base_batch, global_batch, warmup, total, end):
    return solution(step, base_lr, base_batch, global_batch, warmup, total, 0.0)


def linear_decay(step, base_lr, base_batch, global_batch, warmup, total, end):
    if step < warmup:
        return solution(step, base_lr, base_batch, global_batch, warmup, total, end)
    peak = base_lr * global_batch / base_batch
    return peak + (end - peak) * (step - warmup) / max(1, total - 1 - warmup)


@pytest.mark.parametrize("wrong, named", [
    (unscaled_peak, "linear scaling rule"),
    (warmup_from_zero, "starts from base_lr"),
    (warmup_one_step_long, "warm-up length"),
    (warmup_from_base_lr_above_the_peak, "when that is lower"),
    (ends_at_zero, "end value"),
    (linear_decay, "shape of the cosine"),
])
def test_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_learning_rate(wrong)


def test_solution_matches_the_course_schedule():
    from labsrc.lessons.capstone.recipe import Schedule, learning_rate
    for base_batch in (128, 2048):  # the peak above, then below, base_lr
        plan = Schedule(0.1, base_batch, 512, 4, 12, 0.002)
        assert all(math.isclose(solution(s, 0.1, base_batch, 512, 4, 12, 0.002), learning_rate(s, plan))
                   for s in range(12))
