"""Reference solution of notebook 10's exercise: a snapshot's save and load that make a resumed run equal an uninterrupted one."""
import os
from pathlib import Path

import torch

from labsrc.lessons.elastic_fault_tolerance.resume import capture_rng, restore_rng


def save(run, path):
    """Everything the next step depends on, written to a temp file in the same folder, fsynced, renamed, and the
    folder fsynced (the rename is an entry in the folder: without it a power cut can undo it)."""
    state = {"step": run.steps_done, "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
             "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(),
             "sampler": run.sampler.state_dict(), "rng": capture_rng()}
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def load(run, path):
    """Put every part back, the RNG states last (nothing after it may draw a random number)."""
    state = torch.load(path, weights_only=True)
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    run.sampler.load_state_dict(state["sampler"])
    run.steps_done = state["step"]
    restore_rng(state["rng"])
