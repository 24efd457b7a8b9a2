"""Data loading on n ranks: shards per epoch, uneven inputs with and without Join, and where a step's time goes.

    python -m labsrc.launch --nproc 2 data_loading -- --cost-ms 2 --workers 0 2
    torchrun --nproc-per-node 2 -m labsrc.lessons.data_loading.lab --profile ci
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from labsrc.core.lab import resolve_profile, run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.plan import split_global_batch
from labsrc.core.runs import Record
from labsrc.core.world import RequestError
from labsrc.lessons.data_loading import sampling
from labsrc.training import data
from labsrc.training.loop import step
from labsrc.training.models import build_model

PARTITIONS = ((True, False), (False, False), (True, True))  # (set_epoch, drop_last) of each partition demo
SOURCES = {"slow_transform": "slow transform", "plain": "no slow transform", "resident": "resident on the device"}


@dataclass
class Options(LabOptions):
    """Sampler shards, uneven inputs with and without Join, and the loader timed against the step."""

    dataset_size: int = 11
    """Samples in the partition demo: small enough to read every index, and prime, so no world size from 2 to
    10 divides it and padding and drop_last both have work to do."""
    epochs: int = 3
    """Epochs in the partition demo."""
    uneven_base: int = 3
    """Rank r gets uneven_base + r batches in the Join demo."""
    join_timeout_s: float = 1.5
    """Collective timeout that ends the no-Join hang (a real job whose finished rank waits in another collective
    hangs until the process-group timeout: 10 min on NCCL, 30 on gloo by default)."""
    joined_timeout_s: float = 10.0
    """Collective timeout of the run inside Join: long enough for a loaded machine, and a Join that failed to
    shadow the collectives ends in a recorded error after it instead of a hang."""
    cost_ms: float = 2.0
    """Milliseconds the slow transform takes per sample (a JPEG decode and augmentation)."""
    workers: tuple[int, ...] = ()
    """num_workers values to sweep (empty: 0, 2 and the profile's)."""
    steps: int = 16
    """Timed batches per loader arm, after one warm-up batch: enough that the batches the workers prefetched
    during the warm-up (prefetch_factor 2 each) are used up and the mean is the steady state."""
    global_batch: int = 0
    """Samples per step over all ranks in the loader sweep (0: the profile's); must split over the ranks."""

    def validate(self) -> None:
        super().validate()
        for name in ("dataset_size", "epochs", "uneven_base", "join_timeout_s", "joined_timeout_s", "steps"):
            positive(name, getattr(self, name))
        positive("cost_ms", self.cost_ms, allow_zero=True)
        positive("global_batch", self.global_batch, allow_zero=True)
        if any(count < 0 for count in self.workers):
            raise RequestError(f"workers are num_workers values, 0 or more (got {list(self.workers)}).")


@dataclass
class Partition(Record):
    """The indices this rank read in each epoch, with or without sampler.set_epoch, padded or drop_last."""

    KIND: ClassVar[str] = "partition"
    set_epoch: bool
    drop_last: bool
    epochs: list  # [[index, ...] read in epoch 0, [...] in epoch 1, ...]


@dataclass
class Uneven(Record):
    """Uneven DDP (rank r has uneven_base + r batches) with or without Join: steps done, what a collective
    raised (None when the rank finished), how long it waited, when each step ended and when the rank left the
    loop (seconds from a barrier just before the first step), and the final weight (1, 4) flattened."""

    KIND: ClassVar[str] = "uneven"
    join: bool
    steps: int
    planned: int
    error_type: str | None
    error: str | None
    waited_s: float
    timeout_s: float
    step_end_s: list
    left_s: float
    weight: list


@dataclass
class Throughput(Record):
    """One loader arm: mean seconds per step waiting for data and computing (forward, backward, update), and
    every timed step's two phases."""

    KIND: ClassVar[str] = "throughput"
    source: str  # a key of SOURCES
    num_workers: int
    pin_memory: bool
    label: str  # for display only
    batch: int
    transform_cost_s: float
    steps: int
    data_s: float
    compute_s: float
    data_steps_s: list
    compute_steps_s: list


@dataclass
class Skipped(Record):
    """An arm that does not apply on this machine, and why."""

    KIND: ClassVar[str] = "skipped"
    arm: str
    reason: str


def default_workers(profile) -> list[int]:
    """num_workers values to sweep: none, two, and the profile's own count."""
    return sorted({0, 2, profile.num_workers})


def arm_label(source: str, num_workers: int, pin_memory: bool) -> str:
    """'slow transform, 2 worker(s)', 'no slow transform, 0 worker(s), pin_memory', ..."""
    if source == "resident":
        return SOURCES[source]
    return f"{SOURCES[source]}, {num_workers} worker(s)" + (", pin_memory" if pin_memory else "")


def sweep_arms(ctx, dataset, cost_s: float, workers: list[int]) -> list[dict]:
    """The loaders to time: the slow transform with each num_workers, then without it (pin_memory on and off
    where there is a GPU), each arm as {source, dataset, num_workers, pin_memory, transform_cost_s}."""
    slow = sampling.SlowTransform(dataset, cost_s)
    arms = [{"source": "slow_transform", "dataset": slow, "num_workers": count, "pin_memory": False,
             "transform_cost_s": cost_s} for count in workers]
    pins = [False, True] if ctx.device.type == "cuda" else [False]
    arms += [{"source": "plain", "dataset": dataset, "num_workers": 0, "pin_memory": pin, "transform_cost_s": 0.0}
             for pin in pins]
    return arms


def write_throughput(records, arm: dict, batch: int, timing: dict) -> None:
    label = arm_label(arm["source"], arm["num_workers"], arm["pin_memory"])
    records.write(Throughput(source=arm["source"], num_workers=arm["num_workers"], pin_memory=arm["pin_memory"],
                             label=label, batch=batch, transform_cost_s=arm["transform_cost_s"], **timing))


def throughput_sweep(ctx, records, profile, batch: int, cost_s: float, workers: list[int], steps: int,
                     seed: int) -> None:
    """Per-step data wait vs compute for each loader arm, then for batches resident on the device."""
    dataset = data.synthetic_images(profile.num_samples, profile.image_size, seed=seed)
    model = build_model(profile.model).to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=profile.lr)
    train_step = lambda images, labels: step(model, optimizer, images, labels)
    if ctx.device.type != "cuda":
        where = "this rank runs on the CPU" if torch.cuda.is_available() else "there is no GPU here"
        records.write(Skipped(arm="pin_memory", reason="pin_memory page-locks host memory for fast copies "
                                                       f"to a GPU; {where}"))
    arms = sweep_arms(ctx, dataset, cost_s, workers)
    for index, arm in enumerate(arms):
        loader, sampler = data.make_loader(arm["dataset"], batch, ctx, num_workers=arm["num_workers"],
                                           seed=seed, pin_memory=arm["pin_memory"])
        write_throughput(records, arm, batch,
                         sampling.time_batches(data.forever(loader, sampler), steps, ctx.device, train_step))
        records.progress(index + 1, len(arms) + 1, unit="loaders timed")
        del loader, sampler  # ends this arm's worker processes before the next arm is timed
    resident = data.DeviceBatches(dataset, batch, ctx, seed=seed)
    arm = {"source": "resident", "num_workers": 0, "pin_memory": False, "transform_cost_s": 0.0}
    write_throughput(records, arm, batch, sampling.time_batches(resident, steps, ctx.device, train_step))
    records.progress(len(arms) + 1, len(arms) + 1, unit="loaders timed")


def data_loading_lab(ctx, records, options: Options) -> dict:
    profile = resolve_profile(options)
    batch = split_global_batch(options.global_batch, profile, ctx.world_size) // ctx.world_size
    for set_epoch, drop_last in PARTITIONS:
        orders = sampling.rank_epoch_orders(options.dataset_size, ctx.rank, ctx.world_size, options.epochs,
                                                set_epoch=set_epoch, drop_last=drop_last, seed=options.seed)
        records.write(Partition(set_epoch=set_epoch, drop_last=drop_last, epochs=orders))
    batches = [options.uneven_base + rank for rank in range(ctx.world_size)]
    if ctx.world_size > 1:
        for join, timeout_s in ((False, options.join_timeout_s), (True, options.joined_timeout_s)):
            records.write(Uneven(**sampling.train_uneven(ctx, batches, join, timeout_s, options.seed)))
    else:
        records.write(Skipped(arm="uneven", reason="one rank has nothing to be uneven with: launch 2 or more"))
    workers = list(options.workers) or default_workers(profile)
    throughput_sweep(ctx, records, profile, batch, options.cost_ms / 1000, workers, options.steps, options.seed)
    return {"profile": profile.name, "dataset_size": options.dataset_size, "epochs": options.epochs,
            "cost_ms": options.cost_ms, "workers": workers, "steps": options.steps, "batch_per_rank": batch,
            "batches_per_rank": batches, "join_timeout_s": options.join_timeout_s,
            "joined_timeout_s": options.joined_timeout_s}


def main(argv=None):
    return run_lab("data_loading", data_loading_lab, Options, argv)


if __name__ == "__main__":
    main()
