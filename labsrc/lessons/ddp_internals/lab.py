"""DDP internals on n ranks: DDP by hand vs torch DDP, buckets, no_sync, unused parameters, bucket views, compression, overlap.

    python -m labsrc.launch --nproc 2 ddp_internals -- --parts buckets --caps-mb 0.02 0.2 2
    torchrun --nproc-per-node 2 -m labsrc.lessons.ddp_internals.lab --profile ci
"""
from __future__ import annotations

import copy
import os
import statistics
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc.core.lab import resolve_profile, run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.plan import split_global_batch
from labsrc.core.runs import Record
from labsrc.core.world import RequestError
from labsrc.lessons.ddp_internals import handmade_ddp, inside_ddp
from labsrc.lessons.dp_vs_ddp import sync
from labsrc.training.loop import step
from labsrc.training.timing import timed

PARTS = ("equivalence", "buckets", "no_sync", "settings", "overlap")
VERSIONS = {"torch_ddp": "torch DDP", "after_backward": "handmade: all-reduce after backward",
            "buckets": "handmade: buckets from hooks"}


@dataclass
class Options(LabOptions):
    """DDP by hand and torch DDP opened up: which experiments, on which model, with which buckets."""

    width: int = 0
    """Width of the layered model's Linear layers (0: 8 x the profile's image_size)."""
    caps_mb: tuple[float, ...] = (0.05, 0.1, 0.25, 1.0, 25.0)
    """bucket_cap_mb values to sweep."""
    micro_steps: int = 4
    """Micro-batches per optimizer step in the no_sync experiment."""
    parts: tuple[str, ...] = PARTS
    """Experiments to run, any of: equivalence buckets no_sync settings overlap."""
    global_batch: int = 0
    """Samples per step over all ranks (0: the profile's); must split over the ranks."""

    def validate(self) -> None:
        super().validate()
        positive("width", self.width, allow_zero=True)
        positive("micro_steps", self.micro_steps)
        positive("global_batch", self.global_batch, allow_zero=True)
        if not self.caps_mb or any(cap <= 0 for cap in self.caps_mb):
            raise RequestError(f"caps_mb needs one or more bucket sizes in MB, each above 0 (got {self.caps_mb}).")
        unknown = sorted(set(self.parts) - set(PARTS))
        if unknown or not self.parts:
            raise RequestError(f"parts {unknown or '(none)'} unknown: choose from {' '.join(PARTS)}.")


@dataclass
class Equivalence(Record):
    """One DDP version after some SGD steps: largest gaps to one process and to torch DDP, all-reduces counted."""

    KIND: ClassVar[str] = "equivalence"
    version: str  # a key of VERSIONS
    label: str
    steps: int
    params_vs_single_process: float
    params_vs_torch_ddp: float
    grads_vs_single_process: float
    grads_vs_torch_ddp: float
    allreduce_calls_per_step: int | None  # None: torch DDP (counted in the bucket sweep instead)
    parameters: int
    buckets: int | None


@dataclass
class BucketSweep(Record):
    """torch DDP at one bucket_cap_mb: all-reduces per step (step 0 first), bytes, median step time, buckets
    DDP all-reduced in the last step and those predicted (parameter indices per bucket, bucket 0 first)."""

    KIND: ClassVar[str] = "buckets"
    cap_mb: float
    allreduce_calls: int
    calls_per_step: list
    step_s: float
    bytes_per_step: int
    gradient_bytes: int
    predicted_buckets: int
    buckets: list
    predicted: list


@dataclass
class NoSync(Record):
    """Gradient accumulation with no_sync: all-reduces per micro-step, both ways, and the gap to one large batch."""

    KIND: ClassVar[str] = "no_sync"
    micro_steps: int
    calls_per_micro_step: list
    calls_with_forward_outside_no_sync: list
    buckets_per_step: int
    vs_large_batch: float


@dataclass
class UnusedParameters(Record):
    """A model with an unused layer under one DDP setting: did two steps run, and if not what was raised."""

    KIND: ClassVar[str] = "unused_parameters"
    setting: str  # a key of inside_ddp.UNUSED_SETTINGS
    ok: bool
    error_type: str | None
    error: str | None


@dataclass
class BucketView(Record):
    """Gradient storages with gradient_as_bucket_view off or on, measured."""

    KIND: ClassVar[str] = "bucket_view"
    as_view: bool
    grad_storages: int
    bucket_storages: int
    grads_inside_buckets: bool
    distinct_storages: int
    storage_bytes: int
    gradient_bytes: int
    cuda_allocated_bytes: int | None


@dataclass
class Compression(Record):
    """One all-reduce scheme: bytes and calls per step, dtypes sent, gradient error, equal to torch's hook."""

    KIND: ClassVar[str] = "compression"
    scheme: str  # a key of inside_ddp.COMPRESSION
    label: str
    bytes: int
    calls: int
    dtypes: list
    max_error: float
    same_as_torch_hook: bool


@dataclass
class ProfiledStep(Record):
    """A profiled torch DDP step: the Chrome trace's path and its spans (inside_ddp.profiled_step)."""

    KIND: ClassVar[str] = "profile"
    trace: str
    spans: list


@dataclass
class HandmadeSchedule(Record):
    """The handmade bucketed DDP's step: [{"kind": hook or all_reduce, "index", "ms" from the first event}]."""

    KIND: ClassVar[str] = "handmade_schedule"
    buckets: int
    events: list


def rank_batch(rank: int, size: int, width: int, step: int = 0, device="cpu"):
    """Rank `rank`'s (size, width) inputs and (size,) labels for a step; different on every rank, same in every process."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(size, width, generator=generator).to(device),
            torch.randint(10, (size,), generator=generator).to(device))


def layer_width(profile) -> int:
    """Width of the layered model's Linear layers: 8 features per image row, so gradients grow with the profile."""
    return 8 * profile.image_size


def synchronise(model) -> None:
    """What each version does between backward and optimizer.step() (torch DDP did it during backward)."""
    if isinstance(model, handmade_ddp.AllReduceAfterBackward):
        model.sync_gradients()
    elif isinstance(model, handmade_ddp.BucketedDDP):
        model.finish_gradient_sync()


def equivalence(ctx, records, width: int, batch: int, steps: int = 3) -> None:
    """Handmade (a) and (b), torch DDP and one process on the union of the batches, after `steps` SGD steps."""
    make = lambda: inside_ddp.layered_model(width=width).to(ctx.device)
    models = {"torch_ddp": DDP(make()), "after_backward": handmade_ddp.AllReduceAfterBackward(make()),
              "buckets": handmade_ddp.BucketedDDP(make(), bucket_cap_mb=0.1)}
    single = make()
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in {**models, "single": single}.items()}
    for index in range(steps):
        for name, model in models.items():
            step(model, None, *rank_batch(ctx.rank, batch, width, index, ctx.device))
            synchronise(model)
            optimizers[name].step()
        everyone = [rank_batch(rank, batch, width, index, ctx.device) for rank in range(ctx.world_size)]
        step(single, optimizers["single"], torch.cat([b[0] for b in everyone]), torch.cat([b[1] for b in everyone]))
    reference = dict(single.named_parameters())
    torch_ddp = {k.removeprefix("module."): p for k, p in models["torch_ddp"].named_parameters()}
    for name, model in models.items():
        mine = {k.removeprefix("module."): p for k, p in model.named_parameters()}
        calls = getattr(model, "allreduce_calls", None)
        records.write(Equivalence(
            version=name, label=VERSIONS[name], steps=steps,
            params_vs_single_process=sync.largest_gap(mine, reference),
            params_vs_torch_ddp=sync.largest_gap(mine, torch_ddp),
            grads_vs_single_process=sync.largest_gap(sync.gradients(model), sync.gradients(single)),
            grads_vs_torch_ddp=sync.largest_gap(sync.gradients(model),
                                                     sync.gradients(models["torch_ddp"])),
            allreduce_calls_per_step=None if calls is None else calls // steps,
            parameters=len(mine), buckets=len(getattr(model, "buckets", [])) or None))


def bucket_sweep(ctx, records, width: int, batch: int, caps_mb: list[float], repeats: int,
                 on_cap=lambda: None) -> None:
    """torch DDP's all-reduce calls per step and step time for each bucket_cap_mb, beside the buckets predicted.

    on_cap() is called after each bucket size (the lab's progress).
    """
    parameters = list(inside_ddp.layered_model(width=width).parameters())
    for cap in caps_mb:
        model = DDP(inside_ddp.layered_model(width=width).to(ctx.device), bucket_cap_mb=cap)
        counter = inside_ddp.CommCounter()
        model.register_comm_hook(counter, inside_ddp.counting_hook())
        seconds, calls = [], []
        for index in range(repeats + 1):  # step 0: one bucket, then DDP rebuilds them in gradient-ready order
            images, labels = rank_batch(ctx.rank, batch, width, index, ctx.device)
            counter.reset()
            with timed(ctx.device) as elapsed:
                step(model, None, images, labels)
            seconds.append(elapsed["s"])
            calls.append(counter.calls)
        first_cap, cap_bytes = inside_ddp.torch_ddp_caps(cap)
        predicted = handmade_ddp.assign_buckets(parameters, cap_bytes, first_cap)
        records.write(BucketSweep(cap_mb=cap, allreduce_calls=calls[-1], calls_per_step=calls,
                                  step_s=statistics.median(seconds[1:]), bytes_per_step=counter.bytes,
                                  gradient_bytes=sum(p.numel() * p.element_size() for p in parameters),
                                  predicted_buckets=len(predicted), buckets=counter.buckets(model.module),
                                  predicted=predicted))
        on_cap()


def accumulation(ctx, records, width: int, batch: int, micro_steps: int, bucket_cap_mb: float = 0.1) -> None:
    """k micro-batches with no_sync on the first k-1: all-reduces counted, gradient vs one large batch."""
    model = DDP(inside_ddp.layered_model(width=width).to(ctx.device), bucket_cap_mb=bucket_cap_mb)
    counter = inside_ddp.CommCounter()
    model.register_comm_hook(counter, inside_ddp.counting_hook())
    batches = [rank_batch(ctx.rank, max(1, batch // micro_steps), width, index, ctx.device)
               for index in range(micro_steps)]
    step(model, None, *batches[0])  # let DDP rebuild its buckets first
    calls_wrong = inside_ddp.accumulate(model, batches, counter, forward_inside=False)
    calls = inside_ddp.accumulate(model, batches, counter, forward_inside=True)
    accumulated = sync.gradients(model)
    large = copy.deepcopy(model)
    step(large, None, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    records.write(NoSync(micro_steps=micro_steps, calls_per_micro_step=calls,
                         calls_with_forward_outside_no_sync=calls_wrong, buckets_per_step=counter.calls,
                         vs_large_batch=sync.largest_gap(accumulated, sync.gradients(large))))


def settings(ctx, records, width: int, batch: int) -> None:
    """Unused parameters (and static_graph), gradient_as_bucket_view, compression hooks."""
    images, labels = rank_batch(ctx.rank, batch, 16, 0, ctx.device)
    for outcome in inside_ddp.unused_parameter_outcomes(images, labels):
        records.write(UnusedParameters(**outcome))
    images, labels = rank_batch(ctx.rank, batch, width, 0, ctx.device)
    make = lambda: inside_ddp.layered_model(width=width).to(ctx.device)
    for row in inside_ddp.bucket_view_comparison(make, images, labels, bucket_cap_mb=0.1):
        records.write(BucketView(**row))
    for row in inside_ddp.compression_comparison(make, images, labels):
        records.write(Compression(**row))


def overlap(ctx, records, width: int, batch: int, run_dir: str, bucket_cap_mb: float = 0.25) -> None:
    """A profiled DDP step (small buckets, so several all-reduces run during backward) and the handmade schedule."""
    make = lambda: inside_ddp.layered_model(layers=8, width=2 * width).to(ctx.device)
    model = DDP(make(), bucket_cap_mb=bucket_cap_mb)
    images, labels = rank_batch(ctx.rank, batch, 2 * width, 0, ctx.device)
    step(model, None, images, labels)  # warm-up and bucket rebuild
    trace = os.path.join(run_dir, f"rank{ctx.rank}.pt.trace.json")
    records.write(ProfiledStep(trace=trace, spans=inside_ddp.profiled_step(model, images, labels, trace)))
    handmade = handmade_ddp.BucketedDDP(make(), bucket_cap_mb=bucket_cap_mb)
    for _ in range(2):  # the second step is recorded: nothing left to warm up
        step(handmade, None, images, labels)
        handmade.finish_gradient_sync()
    origin = handmade.events[0].time
    records.write(HandmadeSchedule(buckets=len(handmade.buckets), events=[
        {"kind": event.kind, "index": event.index, "ms": 1000 * (event.time - origin)} for event in handmade.events]))


def ddp_internals_lab(ctx, records, options: Options) -> dict:
    profile = resolve_profile(options)
    width = options.width or layer_width(profile)
    batch = split_global_batch(options.global_batch, profile, ctx.world_size) // ctx.world_size
    done, total = [0], len(options.parts) + ("buckets" in options.parts) * (len(options.caps_mb) - 1)

    def tick():  # one unit per part but the sweep, which counts one per bucket size
        done[0] += 1
        records.progress(done[0], total, unit="experiments")
    parts = {
        "equivalence": lambda: equivalence(ctx, records, width, batch),
        "buckets": lambda: bucket_sweep(ctx, records, width, batch, list(options.caps_mb), profile.repeats, tick),
        "no_sync": lambda: accumulation(ctx, records, width, batch, options.micro_steps),
        "settings": lambda: settings(ctx, records, width, batch),
        "overlap": lambda: overlap(ctx, records, width, batch, str(records.run_dir)),
    }
    records.progress(0, total, unit="experiments")
    for part in options.parts:
        parts[part]()
        if part != "buckets":
            tick()
    return {"profile": profile.name, "width": width, "batch_per_rank": batch, "caps_mb": list(options.caps_mb),
            "micro_steps": options.micro_steps, "parts": list(options.parts)}


def main(argv=None):
    return run_lab("ddp_internals", ddp_internals_lab, Options, argv)


if __name__ == "__main__":
    main()
