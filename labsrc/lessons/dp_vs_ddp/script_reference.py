"""Notebook 01b's yardstick: a DDP script loaded as a module, and one process training on the same global batches."""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from labsrc.core.exercises import ExerciseFailed, solutions_root
from labsrc.core.paths import REPO

LOSS_TOLERANCE = 1e-4  # |DDP - one process| per epoch: float rounding of the all-reduce, far below a changed step
PARAMETER_TOLERANCE = 1e-4  # largest |checkpoint - one process's final weights|
TODO = re.compile(r"raise NotImplementedError\(\"TODO (\d+)|pass  # TODO (\d+)")


def reference_path(needed_for: str | None = None) -> Path:
    """solutions/ddp_script.py. needed_for: what it is needed for, said in an ExerciseFailed when an instructor has
    withheld solutions/ (then your own file has to be written)."""
    path = solutions_root() / "ddp_script.py"
    if needed_for and not path.is_file():
        raise ExerciseFailed(f"{needed_for}, and the reference solution is not on this machine: write it, then run "
                             "this cell again.")
    return path


def load_script(path, name: str = "ddp_script_under_test"):
    """A DDP script as a module, its `if __name__ == "__main__"` part not run: its functions and constants."""
    spec = importlib.util.spec_from_file_location(name, Path(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def course_script():
    """The data, model, optimizer and constants every copy of the script shares, as a module: the reference script,
    or the outline in notebooks/ where solutions/ is withheld (its given part is the same, line for line)."""
    path = reference_path()
    return load_script(path if path.is_file() else REPO / "notebooks" / "your_ddp_script.py", "course_ddp_script")


def todos_left(path) -> list[int]:
    """The TODOs of your_ddp_script.py's outline still in a script: those that raise, and TODO 8's `pass`."""
    return sorted(int(raised or passed) for raised, passed in TODO.findall(Path(path).read_text()))


def parameter_checksum(state: dict) -> float:
    """One number for a state_dict: the float64 sum of every tensor (equal states give equal sums)."""
    return float(sum(tensor.detach().double().sum().item() for tensor in state.values()))


@dataclass
class Reference:
    """One process training on each step's whole global batch (the union of the ranks' batches)."""

    epoch_losses: list[float]
    """Per epoch: the mean loss over every sample of the epoch (what rank 0 should print)."""
    rank_losses: list[list[float]]
    """[rank][epoch]: the mean loss over that rank's own samples."""
    state: dict
    """The final weights (a state_dict on the CPU)."""


def rank_shards(dataset, world_size: int, seed: int, epoch: int) -> list[list[int]]:
    """[rank] -> the dataset indices DistributedSampler gives that rank in `epoch` (shuffled, padded evenly)."""
    shards = []
    for rank in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


def reference_run(world_size: int, reshuffle: bool = True) -> Reference:
    """Train the course's model in this one process on the global batches world_size DDP ranks would see.

    reshuffle=False replays epoch 0's order every epoch: what ranks see when set_epoch is never called.
    """
    course = course_script()
    dataset, model = course.make_dataset(), course.make_model()
    optimizer = course.make_optimizer(model)
    features, labels = dataset.tensors
    batch = course.BATCH_PER_RANK
    epoch_losses, rank_losses = [], [[] for _ in range(world_size)]
    for epoch in range(course.EPOCHS):
        shards = rank_shards(dataset, world_size, course.SEED, epoch if reshuffle else 0)
        sums = torch.zeros(world_size, dtype=torch.float64)
        for start in range(0, len(shards[0]), batch):
            indices = torch.cat([torch.tensor(shard[start:start + batch]) for shard in shards])
            optimizer.zero_grad()
            per_sample = torch.nn.functional.cross_entropy(model(features[indices]), labels[indices], reduction="none")
            per_sample.mean().backward()  # the global batch's mean: what DDP's averaged gradient equals
            optimizer.step()
            sums += per_sample.detach().double().view(world_size, -1).sum(dim=1)
        samples = len(shards[0])
        for rank in range(world_size):
            rank_losses[rank].append(float(sums[rank] / samples))
        epoch_losses.append(float(sums.sum() / (samples * world_size)))
    return Reference(epoch_losses, rank_losses, {k: v.detach().clone() for k, v in model.state_dict().items()})
