"""Scaling on n ranks: DDP step time and the same step without communication, per batch size, and an all-reduce fit.

    launch.run("performance_scaling", nproc=2, batches=(32, 64), steps=5)
    torchrun --nproc-per-node 2 -m labsrc.lessons.performance_scaling.lab --profile ci --batches 32 64
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc.core.lab import resolve_profile, run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.runs import Record
from labsrc.core.world import RankContext, RequestError
from labsrc.lessons.performance_scaling import scaling
from labsrc.techniques import alpha_beta, collectives
from labsrc.training import data
from labsrc.training.models import build_model


WARMUP_STEPS = 2  # untimed steps before the timed ones (first calls allocate and warm caches)


@dataclass
class Options(LabOptions):
    """Step times with and without DDP's all-reduce at each per-rank batch, then an all-reduce sweep."""

    batches: tuple[int, ...] = (8, 16)
    """Per-rank batch sizes to time (each rank trains on this many images per step)."""
    steps: int = 5
    """Timed steps per measurement, after two untimed ones; the fastest counts."""

    def validate(self) -> None:
        super().validate()
        if not self.batches:
            raise RequestError("batches needs at least one per-rank batch size, e.g. batches=(8, 16).")
        for batch in self.batches:
            positive("batches", batch)
        positive("steps", self.steps)


@dataclass
class Scaling(Record):
    """One rank's fastest DDP step and fastest step under no_sync (no all-reduce, no buffer broadcast) at one batch."""

    KIND: ClassVar[str] = "scaling"
    world_size: int
    per_rank_batch: int
    step_s: float
    local_step_s: float
    gradient_bytes: int
    allreduced_bytes: int
    """Bytes DDP handed to all-reduce in all the DDP steps this rank ran (counted by a comm hook)."""
    ddp_steps: int
    """DDP steps run (untimed ones included); the no_sync steps in between must add no bytes."""
    ddp_broadcasts: int
    """DDP's buffer broadcasts (_sync_buffers calls) in the timed DDP steps: one each, if the model has buffers."""
    no_sync_broadcasts: int
    """The same in the timed no_sync steps: none, or the no_sync step is not the step without communication."""
    timed_steps: int
    """Timed steps of each kind."""


@dataclass
class AllReduceTime(Record):
    """Seconds per dist.all_reduce of this many bytes (fastest timed loop of the profile's repeats, slowest rank)."""

    KIND: ClassVar[str] = "allreduce"
    bytes: int
    seconds: float


def counting_allreduce(state: dict, bucket):
    """DDP's default all-reduce hook, counting the bytes of every bucket it sends into state["bytes"]."""
    buffer = bucket.buffer()
    state["bytes"] += buffer.numel() * buffer.element_size()
    return default_hooks.allreduce_hook(None, bucket)


def measure(ctx, profile, per_rank_batch: int, steps: int, seed: int = 0, ddp: bool = True) -> dict:
    """Fastest step time of this rank at this per-rank batch: with DDP, and without communication.

    With DDP, also the bytes its all-reduces carried over the DDP steps run (warm-up included).
    """
    torch.manual_seed(seed)
    model = build_model(profile.model).to(ctx.device)
    wrapped = DDP(model) if ddp else model
    counted = {"bytes": 0}
    phase, broadcasts = {}, {"ddp": 0, "no_sync": 0}
    if ddp:
        wrapped.register_comm_hook(counted, counting_allreduce)
        sync_buffers = wrapped._sync_buffers   # DDP's broadcast of BatchNorm's buffers (a private method)

        def counting_sync_buffers():
            if phase.get("timed"):
                broadcasts[phase["kind"]] += 1
            return sync_buffers()

        wrapped._sync_buffers = counting_sync_buffers
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=profile.lr, momentum=0.9)
    dataset = data.synthetic_images(max(profile.num_samples, 4 * per_rank_batch), profile.image_size, seed=seed)
    own_data = RankContext(0, 0, 1, ctx.device, "")  # every rank draws from its whole copy: no sharding
    batches = iter(data.DeviceBatches(dataset, per_rank_batch, own_data, seed=seed))
    if ddp:
        step_s, local_s, ddp_steps = scaling.paired_step_times(wrapped, batches, optimizer, ctx.device, steps,
                                                               wrapped.no_sync, warmup=WARMUP_STEPS, phase=phase)
    else:
        step_s = local_s = scaling.step_times(wrapped, batches, optimizer, ctx.device, steps)
        ddp_steps = 0
    return {"per_rank_batch": per_rank_batch, "step_s": step_s, "local_step_s": local_s,
            "gradient_bytes": scaling.gradient_bytes(model), "allreduced_bytes": counted["bytes"],
            "ddp_steps": ddp_steps, "ddp_broadcasts": broadcasts["ddp"],
            "no_sync_broadcasts": broadcasts["no_sync"], "timed_steps": WARMUP_STEPS + steps}


def scaling_lab(ctx, records, options: Options) -> dict:
    profile = resolve_profile(options)
    total = len(options.batches) + 1
    for index, batch in enumerate(options.batches):
        records.write(Scaling(world_size=ctx.world_size, **measure(ctx, profile, batch, options.steps, options.seed)))
        records.progress(index + 1, total, unit="measurements")
    points = []
    for size in profile.sweep_sizes:
        seconds = collectives.time_algorithm(collectives.torch_all_reduce, size, ctx, profile.repeats)
        points.append((4 * size, seconds))
        records.write(AllReduceTime(bytes=4 * size, seconds=seconds))
    fit = alpha_beta.fit(*zip(*points))
    records.progress(total, total, unit="measurements")
    gc.collect()  # DDP's reducers (held in reference cycles) go now, while the process group they use still exists
    return {"profile": profile.name, "model": profile.model,
            "fit": {"alpha_s": fit.alpha_s, "beta_s_per_byte": fit.beta_s_per_byte, "r2": fit.r2}}


def main(argv=None):
    return run_lab("performance_scaling", scaling_lab, Options, argv)


if __name__ == "__main__":
    main()
