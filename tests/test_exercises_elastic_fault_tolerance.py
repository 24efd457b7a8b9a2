"""Notebook 10's exercise checker accepts the reference save/load and names each planted mistake."""
import os
from pathlib import Path

import pytest
import torch

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.elastic_fault_tolerance.exercises import check_snapshot
from labsrc.lessons.elastic_fault_tolerance.resume import capture_rng

save = load_solution("elastic_fault_tolerance", "save")
load = load_solution("elastic_fault_tolerance", "load")


def test_the_solution_passes(capsys):
    check_snapshot(save, load)
    assert "passed" in capsys.readouterr().out


def state_of(run, leave_out=()):
    state = {"step": run.steps_done, "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
             "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(),
             "sampler": run.sampler.state_dict(), "rng": capture_rng()}
    return {k: v for k, v in state.items() if k not in leave_out}


def atomic(state, path, fsync_file=True, fsync_folder=True, temporary=None):
    """The reference's write, with each durability step removable (the planted mistakes below)."""
    temporary = temporary or Path(str(path) + ".tmp")
    with open(temporary, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        if fsync_file:
            os.fsync(handle.fileno())
    os.replace(temporary, path)
    if fsync_folder:
        folder = os.open(Path(path).parent, os.O_RDONLY)
        os.fsync(folder)
        os.close(folder)


def save_without(part):
    return lambda run, path: atomic(state_of(run, (part,)), path)


def load_tolerant(run, path):
    state = torch.load(path, weights_only=True)
    run.model.load_state_dict(state["model"])
    for part in ("optimizer", "scheduler", "scaler", "sampler"):
        if part in state:
            getattr(run, part).load_state_dict(state[part])
    run.steps_done = state.get("step", 0)
    if "rng" in state:
        from labsrc.lessons.elastic_fault_tolerance.resume import restore_rng
        restore_rng(state["rng"])


def save_in_place(run, path):
    torch.save(state_of(run), path)


def save_with_the_old_hint(run, path):
    atomic(state_of(run), path, temporary=path + ".tmp")  # str + on a Path: TypeError in the child


def save_without_fsync(run, path):
    atomic(state_of(run), path, fsync_file=False)


def save_without_folder_fsync(run, path):
    atomic(state_of(run), path, fsync_folder=False)


def save_synced_before_writing(run, path):
    temporary = Path(str(path) + ".tmp")
    with open(temporary, "wb") as handle:
        os.fsync(handle.fileno())  # too early: the bytes come after it
        torch.save(state_of(run), handle)
    os.replace(temporary, path)
    folder = os.open(Path(path).parent, os.O_RDONLY)
    os.fsync(folder)
    os.close(folder)


def save_elsewhere(run, path):
    # another folder, on the same file system here (so os.replace works, and only the check can see it)
    other = Path(path).parent / "elsewhere"
    other.mkdir(exist_ok=True)
    atomic(state_of(run), path, temporary=other / "snapshot.tmp")


@pytest.mark.parametrize("wrong_save, named", [
    (save_without("rng"), "RNG state"),
    (save_without("sampler"), "sampler position"),
    (save_without("optimizer"), "optimizer state"),
    (save_without("step"), "step counter"),
    (save_in_place, "not atomic"),
    (save_with_the_old_hint, "save\\(\\) raised TypeError"),
    (save_without_fsync, "no os.fsync of the temporary file"),
    (save_without_folder_fsync, "no os.fsync of the folder"),
    (save_synced_before_writing, "fsynced when it held 0 of its"),
    (save_elsewhere, "in another folder"),
])
def test_planted_mistakes_are_named(wrong_save, named):
    with pytest.raises(ExerciseFailed, match=named):
        check_snapshot(wrong_save, load_tolerant)
