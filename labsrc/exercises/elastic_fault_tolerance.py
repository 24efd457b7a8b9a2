"""Checker for notebook 10's exercise: the learner's snapshot save/load, through a run killed mid-write and resumed.

    check_snapshot(save, load)   # save(run, path) / load(run, path), run an elastic_fault_tolerance.Training
"""
from __future__ import annotations

import copy
import io
import os
import signal
import tempfile
from pathlib import Path
from typing import Callable
from unittest import mock

import torch

from labsrc.core import forked
from labsrc.core.exercises import ExerciseFailed, passed
from labsrc.core.world import RankContext
from labsrc.elastic_fault_tolerance import Setup, Training, capture_rng, parameters_equal

SNAPSHOT_EVERY = 2
KILLED_AT = 8  # the save after step 8 is cut short by a SIGKILL: the last whole snapshot is step 6's
LAST_GOOD = 6


def _context() -> RankContext:
    return RankContext(0, 0, 1, torch.device("cpu"), "gloo")


def _killed_mid_write(real_save):
    """torch.save that writes the first half of its bytes, then kills this process (a crash mid-write)."""
    def save(state, target, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(state, buffer, *args, **kwargs)
        data = buffer.getvalue()[: len(buffer.getvalue()) // 2]
        if isinstance(target, (str, os.PathLike)):
            with open(target, "wb") as handle:
                handle.write(data)
        else:
            target.write(data)
            target.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return save


def _train_then_die(save: Callable, path: Path) -> None:
    """In a child process: train with a snapshot every 2 steps, and die half-way through writing step 8's."""
    torch.set_num_threads(1)  # the parent's OpenMP thread pool does not survive fork
    run = Training.build(_context(), Setup())
    while True:
        run.step()
        if run.steps_done == KILLED_AT:
            torch.save = _killed_mid_write(torch.save)
        if run.steps_done % SNAPSHOT_EVERY == 0:
            save(run, path)
        if run.steps_done > KILLED_AT:
            os._exit(3)  # the kill did not happen: torch.save was never called


def _state_at(run: Training) -> dict:
    """Copies (state_dict() hands out the live tensors, which later steps change)."""
    return copy.deepcopy({"step": run.steps_done, "parameters": run.parameters(), "rng": capture_rng(),
                          "optimizer": run.optimizer.state_dict(), "sampler": run.sampler.state_dict(),
                          "scheduler": run.scheduler.state_dict()})


def _tensors_equal(first, second) -> bool:
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) and torch.equal(first, second)
    if isinstance(first, dict) and isinstance(second, dict):
        return first.keys() == second.keys() and all(_tensors_equal(first[k], second[k]) for k in first)
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)):
        return len(first) == len(second) and all(_tensors_equal(a, b) for a, b in zip(first, second))
    return first == second


def what_differs(expected: dict, got: dict) -> list[str]:
    """The parts of the resumed state that are not what the uninterrupted run had at the same step."""
    wrong = []
    if got["step"] != expected["step"]:
        wrong.append(f"step counter: resumed at {got['step']}, the last whole snapshot was after step "
                     f"{expected['step']} (save run.steps_done and set it back)")
    if not parameters_equal(expected["parameters"], got["parameters"]):
        wrong.append("parameters (model.state_dict())")
    if not _tensors_equal(expected["optimizer"]["state"], got["optimizer"]["state"]):
        wrong.append("optimizer state (AdamW's moments and step counts: optimizer.state_dict())")
    if not _tensors_equal(expected["scheduler"], got["scheduler"]):
        wrong.append("LR scheduler (scheduler.state_dict())")
    if got["sampler"] != expected["sampler"]:
        wrong.append(f"sampler position: resumed at {got['sampler']}, expected {expected['sampler']} "
                     f"(save sampler.state_dict(): epoch and position)")
    if not _tensors_equal(expected["rng"]["torch"], got["rng"]["torch"]) \
            or expected["rng"]["python"] != got["rng"]["python"]:
        wrong.append("RNG state (dropout draws from torch's RNG, the input jitter from python's random: "
                     "save capture_rng() and restore_rng() it last)")
    return wrong


def check_snapshot(save: Callable, load: Callable) -> None:
    """Train 18 steps uninterrupted; train again with the learner's save every 2 steps, killed mid-write at step 8;
    resume with the learner's load in a fresh state; name every part that differs, then compare the end."""
    setup = Setup()
    reference = Training.build(_context(), setup)
    expected = None
    while reference.steps_done < setup.total_steps:
        reference.step()
        if reference.steps_done == LAST_GOOD:
            expected = _state_at(reference)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "snapshot.pt"
        child = forked.process(_train_then_die, (save, path))  # fresh where a GPU is visible (see forked)
        child.start()
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
            child.join()
            raise ExerciseFailed("the training run with your save() did not reach step 8 in 60 s.")
        if child.exitcode != -signal.SIGKILL:
            raise ExerciseFailed(f"the run with your save() ended with status {child.exitcode} before it could be "
                                 f"killed mid-write: does save() call torch.save?")
        resumed = Training.build(_context(), setup)  # a fresh process re-seeds everything
        try:
            with mock.patch("torch.load", wraps=torch.load) as loader:
                load(resumed, path)
        except Exception as exc:
            raise ExerciseFailed(f"load() raised {type(exc).__name__}: {exc}. The kill mid-write tore the file at "
                                 f"{path.name}: your save is not atomic. Write to a temporary file in the same "
                                 f"folder, flush and os.fsync it, then os.replace it onto the real path.") from None
    if any(call.kwargs.get("weights_only") is False for call in loader.call_args_list):
        raise ExerciseFailed("load with weights_only=True: a snapshot holds only tensors and plain containers.")
    wrong = what_differs(expected, _state_at(resumed))
    if wrong:
        raise ExerciseFailed("after load(), these differ from the uninterrupted run at step 6: " + "; ".join(wrong))
    while resumed.steps_done < setup.total_steps:
        resumed.step()
    if not parameters_equal(reference.parameters(), resumed.parameters()):
        raise ExerciseFailed("the resumed run's final parameters differ from the uninterrupted run's.")
    passed("killed mid-write at step 8, resumed from step 6's whole snapshot, and ended bit-for-bit equal to "
           "the uninterrupted run")
