"""Checker for notebook 10b's exercise: resume from the snapshot on disk, whatever the restart counter says.

    check_resume(resume_or_start)   # resume_or_start(run, path) -> the step to start from

A two-rank job trains and snapshots; then, at world size 1 as after a lost node, the learner's function meets the
four starts an elastic job has: the returning node's new agent (counter 0, a snapshot on disk), the survivor (counter
1, a snapshot), the first start (counter 0, none) and a failure before the first snapshot (counter 1, none).
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import torch

from labsrc.core.exercises import ExerciseFailed, on_ranks, passed
from labsrc.core.processes import environment_set
from labsrc.core.world import RankContext
from labsrc.elastic_fault_tolerance import Setup, Training, load_snapshot, part_fingerprints, save_snapshot

SETUP = Setup(samples=48, global_batch=8, epochs=1)
STEPS_BEFORE = 3
"""Steps the two-rank job takes before its snapshot: 24 of the epoch's 48 samples."""
COUNTER = "TORCHELASTIC_RESTART_COUNT"
STATE = ("model", "optimizer", "scheduler", "scaler", "sampler", "step")
"""What must come back from the snapshot (the RNG cannot: two ranks saved it, one resumes, so it is re-seeded)."""


def _train_and_snapshot(ctx, path: str) -> None:
    """On 2 forked gloo ranks: STEPS_BEFORE steps, then the lab's snapshot (rank 0 writes it, both ranks' RNG)."""
    run = Training.build(ctx, SETUP)
    for _ in range(STEPS_BEFORE):
        run.step()
    save_snapshot(run, path)
    return None


def _one_rank() -> Training:
    return Training.build(RankContext(0, 0, 1, torch.device("cpu"), "gloo"), SETUP)


def _state(run: Training) -> dict[str, str]:
    return {part: value for part, value in part_fingerprints(run).items() if part in STATE}


def _start(resume_or_start: Callable, path: Path, counter: str, what: str) -> tuple[Training, int]:
    """The learner's function on a fresh world-size-1 run, with TORCHELASTIC_RESTART_COUNT=counter."""
    run = _one_rank()
    with environment_set({COUNTER: counter}):
        try:
            step = resume_or_start(run, path)
        except FileNotFoundError as error:
            raise ExerciseFailed(f"{what}: there is no snapshot yet, and your function raised {error!r}: when no "
                                 f"file is there, start from step 0 with the fresh state.") from None
    if isinstance(step, bool) or not isinstance(step, int):
        raise ExerciseFailed(f"{what}: return the step to start from (an int), not {step!r}.")
    return run, step


def check_resume(resume_or_start: Callable) -> None:
    """resume_or_start(run, path) -> int: load the snapshot at path into run if one is there and return its step;
    otherwise leave run as built and return 0. Whatever TORCHELASTIC_RESTART_COUNT says."""
    with tempfile.TemporaryDirectory() as folder:
        snapshot, missing = Path(folder) / "snapshot.pt", Path(folder) / "none.pt"
        on_ranks(_train_and_snapshot, 2, (str(snapshot),), timeout_s=60)
        saved = _one_rank()
        load_snapshot(saved, snapshot)
        expected, fresh = _state(saved), _state(_one_rank())

        for counter, what in (("0", "the returning node (its new agent's TORCHELASTIC_RESTART_COUNT is 0)"),
                              ("1", "the surviving node (TORCHELASTIC_RESTART_COUNT 1)")):
            run, step = _start(resume_or_start, snapshot, counter, what)
            got = _state(run)
            if got == fresh and step == 0:
                raise ExerciseFailed(f"{what}: the snapshot of step {STEPS_BEFORE} was on disk, and your function "
                                     f"started from scratch. Did it trust the counter? Decide from the file: "
                                     f"this rank would train other weights than its peer.")
            wrong = [part for part in STATE if got[part] != expected[part]]
            if wrong:
                raise ExerciseFailed(f"{what}: after your function, {', '.join(wrong)} differ from the snapshot's "
                                     f"(eft.load_snapshot(run, path) puts every part back).")
            if step != STEPS_BEFORE:
                raise ExerciseFailed(f"{what}: the snapshot is of step {STEPS_BEFORE}; your function returned "
                                     f"{step} (return run.steps_done after loading).")
            seen = []
            while run.steps_done < SETUP.steps_per_epoch:   # the rest of the epoch, now alone, at the same global batch
                seen += run.step()[1]
            trained = run.sampler.order(0)[:STEPS_BEFORE * SETUP.global_batch].tolist()   # by the two ranks
            if sorted(trained + seen) != list(range(SETUP.samples)):
                raise ExerciseFailed(f"{what}: after the resume the epoch did not see each sample once (the two "
                                     f"ranks trained on {sorted(trained)}, the resumed run on {sorted(seen)}).")

        for counter, what in (("0", "the first start (TORCHELASTIC_RESTART_COUNT 0, no snapshot)"),
                              ("1", "a restart before the first snapshot (TORCHELASTIC_RESTART_COUNT 1, no "
                                    "snapshot)")):
            run, step = _start(resume_or_start, missing, counter, what)
            if step != 0 or _state(run) != fresh:
                raise ExerciseFailed(f"{what}: nothing to resume from, so the run must start at step 0 with the "
                                     f"state it was built with; your function returned {step} and changed "
                                     f"{', '.join(p for p in STATE if _state(run)[p] != fresh[p]) or 'nothing'}.")
    passed(f"with the counter at 0 or 1 alike, your function resumed from the 2-rank snapshot of step {STEPS_BEFORE} "
           f"whenever it was there (the run, now alone, then saw the epoch's other {SETUP.samples // 2} samples "
           f"once each) and started fresh whenever it was not")
