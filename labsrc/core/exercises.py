"""Exercises: the learner writes a function, a checker runs it (on forked ranks where it is distributed) and says what is wrong.

A lesson's checkers live in `labsrc/lessons/<lesson>/exercises.py`; each is `check_<name>(learner_function)` and
either prints what passed or raises ExerciseFailed with a message that points at the mistake. Reference
solutions live apart in `solutions/<lesson>.py`; tests/test_exercises.py runs every checker with its
solution and with a planted wrong answer that it must reject.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable

from labsrc.core.feedback import Feedback
from labsrc.core.forked import RankError, run_ranks
from labsrc.core.paths import REPO


class ExerciseFailed(Feedback, AssertionError):
    """The learner's answer is wrong; the message says how, and what to look at."""


def passed(message: str) -> None:
    """Say what the learner's answer got right."""
    print(f"passed: {message}")


def on_ranks(check_rank: Callable[..., str | None], world_size: int, args: tuple = (),
             timeout_s: float = 60.0) -> list[Any]:
    """Run check_rank(ctx, *args) on forked gloo ranks; a rank returns None if fine, else what is wrong.

    Raises ExerciseFailed with the first rank's complaint (or its exception, or a hang past timeout_s:
    a collective one rank never joined).
    """
    try:
        verdicts = run_ranks(check_rank, world_size, args, timeout_s=timeout_s)
    except RankError as exc:
        raise ExerciseFailed(f"your code raised or hung on a rank:\n{exc}") from None
    for rank, verdict in enumerate(verdicts):
        if verdict:
            raise ExerciseFailed(f"rank {rank}: {verdict}")
    return verdicts


def solutions_root() -> Path:
    return REPO / "solutions"


def load_solution(lesson: str, name: str) -> Callable:
    """The reference solution `name` from solutions/<lesson>.py (for CI and instructors, not for notebooks)."""
    path = solutions_root() / f"{lesson}.py"
    spec = importlib.util.spec_from_file_location(f"solutions_{lesson}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)
