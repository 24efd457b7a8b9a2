"""Checker for notebook 10's exercise: the learner's snapshot save/load, through a run killed mid-write and resumed.

    check_snapshot(save, load)   # save(run, path) / load(run, path), run an resume.Training
"""
from __future__ import annotations

import copy
import io
import json
import os
import signal
import stat
import tempfile
import traceback
from pathlib import Path
from typing import Callable
from unittest import mock

import torch

from labsrc.core import forked
from labsrc.core.exercises import ExerciseFailed, passed
from labsrc.core.world import RankContext
from labsrc.lessons.elastic_fault_tolerance.resume import Setup, Training, capture_rng, parameters_equal

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


class _FileCalls:
    """Records os.fsync / os.replace / os.rename calls, in order, with the file's size on disk at each, then does
    them: [fsync, file|folder, path, size] and [replace|rename, source, target, source size]."""

    def __init__(self):
        self.calls: list[list] = []
        self.fsync, self.replace, self.rename = os.fsync, os.replace, os.rename

    def install(self) -> None:
        def fsync(fd):
            fd_number = fd if isinstance(fd, int) else fd.fileno()
            status = os.fstat(fd_number)
            kind = "folder" if stat.S_ISDIR(status.st_mode) else "file"
            self.calls.append(["fsync", kind, os.readlink(f"/proc/self/fd/{fd_number}"), status.st_size])
            return self.fsync(fd)

        def moved(real, name):
            def move(src, dst, *args, **kwargs):
                self.calls.append([name, os.path.realpath(src), os.path.realpath(dst), os.stat(src).st_size])
                return real(src, dst, *args, **kwargs)
            return move

        os.fsync, os.replace, os.rename = fsync, moved(self.replace, "replace"), moved(self.rename, "rename")

    def uninstall(self) -> None:
        os.fsync, os.replace, os.rename = self.fsync, self.replace, self.rename


def file_calls(save: Callable, *args) -> list[list]:
    """The fsync / replace / rename calls save(*args) makes in this process (see _FileCalls), for durability_mistakes."""
    calls = _FileCalls()
    calls.install()
    try:
        save(*args)
    finally:
        calls.uninstall()
    return calls.calls


def _train_then_die(save: Callable, path: Path, report: Path) -> None:
    """In a child process: train with a snapshot every 2 steps, and die half-way through writing step 8's.

    Writes to `report` (JSON) the file calls of the last whole save, or the exception save() raised."""
    torch.set_num_threads(1)  # the parent's OpenMP thread pool does not survive fork
    calls = _FileCalls()
    calls.install()
    run = Training.build(_context(), Setup())
    try:
        while True:
            run.step()
            if run.steps_done == KILLED_AT:
                torch.save = _killed_mid_write(torch.save)
            if run.steps_done % SNAPSHOT_EVERY == 0:
                calls.calls.clear()
                save(run, path)
                report.write_text(json.dumps({"step": run.steps_done, "calls": calls.calls}))
            if run.steps_done > KILLED_AT:
                os._exit(3)  # the kill did not happen: torch.save was never called
    except BaseException as exc:
        report.write_text(json.dumps({"step": run.steps_done, "error": f"{type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc(limit=-3)}))
        os._exit(4)


def durability_mistakes(calls: list[list], path: Path) -> list[str]:
    """What one whole save did wrong on disk, from its recorded fsync/replace calls (empty when right)."""
    moves = [c for c in calls if c[0] in ("replace", "rename") and c[2] == os.path.realpath(path)]
    if not moves:
        return [f"no os.replace onto {path.name}: write a temporary file, then os.replace it onto the real path "
                f"(the rename is what makes the write atomic)"]
    _, source, target, size = moves[-1]
    at = calls.index(moves[-1])
    wrong = []
    if os.path.dirname(source) != os.path.dirname(target):
        wrong.append(f"the temporary file is in another folder ({os.path.dirname(source)}): os.replace is atomic "
                     f"only within one file system, and across two it fails; put it next to the snapshot "
                     f"(Path(str(path) + '.tmp'))")
    synced = [c[3] for c in calls[:at] if c[:3] == ["fsync", "file", source]]
    if not synced:
        wrong.append("no os.fsync of the temporary file before os.replace: after a power cut the new name can "
                     "point at a file whose bytes never reached the disk (handle.flush(); "
                     "os.fsync(handle.fileno()))")
    elif max(synced) < size:
        wrong.append(f"the temporary file was fsynced when it held {max(synced)} of its {size} bytes: the rest "
                     f"were written (or left in Python's buffer) after the fsync. Write everything, "
                     f"handle.flush(), then os.fsync(handle.fileno())")
    if not any(c[:2] == ["fsync", "folder"] and c[2] == os.path.dirname(target) for c in calls[at + 1:]):
        wrong.append("no os.fsync of the folder after os.replace: the rename is an entry in the folder, and after "
                     "a power cut it can be lost (fd = os.open(folder, os.O_RDONLY); os.fsync(fd); os.close(fd))")
    return wrong


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
    resume with the learner's load in a fresh state; name every part that differs and every missing fsync, a
    temporary file in another folder or no rename (from the calls save() made), then compare the end."""
    setup = Setup()
    reference = Training.build(_context(), setup)
    expected = None
    while reference.steps_done < setup.total_steps:
        reference.step()
        if reference.steps_done == LAST_GOOD:
            expected = _state_at(reference)
    with tempfile.TemporaryDirectory() as folder:
        path, report = Path(folder) / "snapshot.pt", Path(folder) / "report.json"
        child = forked.process(_train_then_die, (save, path, report))  # fresh where a GPU is visible (see forked)
        child.start()
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
            child.join()
            raise ExerciseFailed("the training run with your save() did not reach step 8 in 60 s.")
        told = json.loads(report.read_text()) if report.exists() else {}
        if "error" in told:
            raise ExerciseFailed(f"save() raised {told['error']} at the snapshot after step {told['step']}:\n"
                                 f"{told['traceback']}")
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
    unsafe = durability_mistakes(told.get("calls", []), path)
    if unsafe:
        raise ExerciseFailed("the resume worked, but a power cut could still lose the snapshot: " + "; ".join(unsafe))
    while resumed.steps_done < setup.total_steps:
        resumed.step()
    if not parameters_equal(reference.parameters(), resumed.parameters()):
        raise ExerciseFailed("the resumed run's final parameters differ from the uninterrupted run's.")
    passed("killed mid-write at step 8, resumed from step 6's whole snapshot, and ended bit-for-bit equal to "
           "the uninterrupted run; the temporary file was in the snapshot's folder and fsynced before os.replace, "
           "the folder after it. Not tested: a real power cut (the fsyncs are checked by their calls), several "
           "ranks (one process here), the GradScaler's state (fp32: leaving it out changes nothing)")
