"""Resuming a real data loader mid-epoch: torch's DistributedSampler has no position, a stateful loader has one.

    plain = distributed_sampler_resume(stop_after=3)   # a plain DataLoader + DistributedSampler: the epoch restarts
    plain.replayed                                     # samples a rank trains on twice in that epoch
    kept = stateful_loader_resume(stop_after=3, folder=...)  # torchdata's StatefulDataLoader, its state in the snapshot
    kept.replayed, kept.lost                           # 0 and 0: the epoch carries on at the next batch

Each rank is simulated in this process (DistributedSampler takes num_replicas and rank explicitly), so no process
group is needed: what each rank would iterate is exactly what it iterates under torchrun.
"""
from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import DataLoader, DistributedSampler

from labsrc.lessons.elastic_fault_tolerance.snapshot import load_checked, save_atomic

SAMPLES, WORLD_SIZE, BATCH, SEED = 48, 2, 4, 0  # 6 batches per rank and epoch


@dataclass
class LoaderResume:
    """One rank's epoch 0, crashed after `stop_after` batches and resumed: what it trained on, counted."""

    loader: str
    stop_after: int
    before: list[int]
    """Sample ids of the batches trained on before the crash."""
    after: list[int]
    """Sample ids the resumed loader handed out for the rest of epoch 0."""
    shard: list[int]
    """This rank's whole share of epoch 0 (what an uninterrupted epoch trains on)."""

    @property
    def replayed(self) -> int:
        """Samples trained on twice in the epoch: in `after` although already in `before`."""
        return sum((Counter(self.before) & Counter(self.after)).values())

    @property
    def lost(self) -> int:
        """Samples of the shard never trained on in the epoch."""
        return sum((Counter(self.shard) - Counter(self.before) - Counter(self.after)).values())


def _sampler(rank: int) -> DistributedSampler:
    sampler = DistributedSampler(range(SAMPLES), num_replicas=WORLD_SIZE, rank=rank, shuffle=True, seed=SEED)
    sampler.set_epoch(0)
    return sampler


def _ids(batches) -> list[int]:
    return [int(i) for batch in batches for i in batch]


def distributed_sampler_resume(stop_after: int = 3, rank: int = 0) -> LoaderResume:
    """The 01b script's loader: a DataLoader over a DistributedSampler. A resume can only set_epoch(0) again."""
    shard = list(_sampler(rank))
    first = iter(DataLoader(range(SAMPLES), batch_size=BATCH, sampler=_sampler(rank)))
    before = _ids(next(first) for _ in range(stop_after))
    # the crash; the new process has the snapshot's epoch (0) and nothing else the sampler could take back
    after = _ids(DataLoader(range(SAMPLES), batch_size=BATCH, sampler=_sampler(rank)))
    return LoaderResume("DataLoader + DistributedSampler", stop_after, before, after, shard)


def stateful_loader(rank: int):
    """torchdata's StatefulDataLoader over the same DistributedSampler: state_dict() holds its position."""
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, which torch 2.14 marks deprecated
        warnings.simplefilter("ignore", UserWarning)
        from torchdata.stateful_dataloader import StatefulDataLoader
        return StatefulDataLoader(range(SAMPLES), batch_size=BATCH, sampler=_sampler(rank))


def _batches(loader, count: int | None = None) -> list[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        iterator = iter(loader)
        return _ids(iterator if count is None else (next(iterator) for _ in range(count)))


def stateful_loader_resume(folder: Path, stop_after: int = 3, rank: int = 0) -> LoaderResume:
    """StatefulDataLoader: its state_dict() goes into the snapshot (save_atomic) after `stop_after` batches; a fresh
    loader in the resumed process load_state_dict()s it and hands out the rest of the epoch."""
    shard = list(_sampler(rank))
    loader = stateful_loader(rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        iterator = iter(loader)
        before = _ids(next(iterator) for _ in range(stop_after))
        path = save_atomic({"step": stop_after, "loader": loader.state_dict()}, Path(folder) / "loader.pt")
    resumed = stateful_loader(rank)
    resumed.load_state_dict(load_checked(path)["loader"])
    return LoaderResume("StatefulDataLoader", stop_after, before, _batches(resumed), shard)
