"""Checker for notebook 13's exercise: the warm-up + cosine learning-rate schedule scaled to the global batch."""
from __future__ import annotations

import math
from typing import Callable

from labsrc.core.exercises import ExerciseFailed, passed
from labsrc.lessons.capstone.recipe import Schedule, learning_rate

CASES = (Schedule(0.1, 256, 1024, 5, 30, 0.0), Schedule(0.05, 64, 128, 3, 20, 0.001), Schedule(0.2, 512, 512, 0, 10, 0.0),
         Schedule(0.4, 256, 64, 4, 16, 0.0))  # the last: a global batch below base_batch, the peak below base_lr


def _verdict(rates: list[float], schedule: Schedule) -> str | None:
    """What is off in rates (one per step) against the reference schedule, or None."""
    expected = [learning_rate(step, schedule) for step in range(schedule.total_steps)]
    if all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12) for a, b in zip(rates, expected)):
        return None
    peak, warmup = schedule.peak_lr, schedule.warmup_steps
    first = min(schedule.base_lr, peak)
    if warmup and not math.isclose(rates[0], first, rel_tol=1e-6):
        return (f"step 0 has {rates[0]:.4g}: this exercise's warm-up starts from base_lr = {schedule.base_lr:.4g} "
                f"(Goyal et al.), or from the peak {peak:.4g} when that is lower (a global batch below base_batch), so "
                f"{first:.4g}. (A ramp from 0, as Hugging Face's and torchtitan's linear warm-ups do, is another "
                "convention, not wrong in itself; here the schedule is Goyal's.)")
    if not math.isclose(max(rates), peak, rel_tol=1e-6):
        return (f"the peak is {max(rates):.4g}, expected {peak:.4g} = base_lr x global_batch / base_batch "
                f"(the linear scaling rule).")
    reached = next(step for step, rate in enumerate(rates) if math.isclose(rate, peak, rel_tol=1e-6))
    if first < peak and reached != warmup:
        return f"the peak is reached at step {reached}: the warm-up length must be {warmup} steps (the peak at step {warmup})."
    if not math.isclose(rates[-1], schedule.end_lr, rel_tol=1e-6, abs_tol=1e-12):
        return f"the end value at the last step ({schedule.total_steps - 1}) is {rates[-1]:.4g}, expected end_lr = {schedule.end_lr:.4g}."
    worst = max(range(len(rates)), key=lambda step: abs(rates[step] - expected[step]))
    return f"step {worst}: {rates[worst]:.4g}, expected {expected[worst]:.4g} (the shape of the cosine between peak and end)."


def check_learning_rate(learner: Callable) -> None:
    """learner(step, base_lr, base_batch, global_batch, warmup_steps, total_steps, end_lr) -> the rate at step."""
    for schedule in CASES:
        rates = [float(learner(step, schedule.base_lr, schedule.base_batch, schedule.global_batch,
                               schedule.warmup_steps, schedule.total_steps, schedule.end_lr))
                 for step in range(schedule.total_steps)]
        verdict = _verdict(rates, schedule)
        if verdict:
            raise ExerciseFailed(f"{schedule}: {verdict}")
    passed("warm-up from the base rate to the scaled peak, then a cosine to the end value, on every schedule tried")
