"""The DDP sync experiment on n ranks: broadcast, gradients, noise data, loss denominators, BatchNorm, curves, time.

    launch.run("dp_vs_ddp", nproc=2, global_batch=32)
    python -m labsrc.launch --nproc 2 dp_vs_ddp -- --global-batch 32
    torchrun --nproc-per-node 2 -m labsrc.lessons.dp_vs_ddp.lab --profile ci
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc.core.lab import resolve_profile, run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.plan import split_global_batch
from labsrc.core.runs import Record
from labsrc.lessons.dp_vs_ddp import loss_mean, sync
from labsrc.lessons.dp_vs_ddp.batch_norm import with_global_batch_norm
from labsrc.training import data
from labsrc.training.loop import tf32
from labsrc.training.models import build_model


@dataclass
class Options(LabOptions):
    """DDP beside one process: gradients, parameters, buffers, BatchNorm statistics, loss curves, step time."""

    global_batch: int = 0
    """Samples per step over all ranks, a multiple of the world size (0: the profile's, rounded down to one)."""

    def validate(self) -> None:
        super().validate()
        positive("global_batch", self.global_batch, allow_zero=True)


@dataclass
class Broadcast(Record):
    """Largest gap to rank 0 before and after DDP(model): its construction broadcasts rank 0's state."""

    KIND: ClassVar[str] = "broadcast"
    parameters_before: float
    parameters_after: float
    buffers_before: float
    buffers_after: float


@dataclass
class Gradients(Record):
    """This rank's gradients after backward, each as its largest gap to the one-process full-batch gradient."""

    KIND: ClassVar[str] = "gradients"
    ddp_vs_full_batch: float
    hand_vs_full_batch: float
    """Gradients averaged by sync.average_gradients instead of DDP."""
    local_vs_full_batch: float
    """This rank's own shard's gradient, not averaged."""
    spread_across_ranks: float
    largest_gradient: float
    batch_norm_local_vs_full_batch: float
    batch_norm_global_vs_full_batch: float
    batch_norm_largest_gradient: float
    shard_size: int


@dataclass
class NoiseStep(Record):
    """One DDP step on pure noise, each rank its own: this rank's loss and the parameters' spread after it."""

    KIND: ClassVar[str] = "noise_step"
    step: int
    loss: float
    parameter_spread: float


@dataclass
class Denominators(Record):
    """A masked-mean token loss under DDP, ranks holding different token counts (loss_mean.DenominatorGaps)."""

    KIND: ClassVar[str] = "denominators"
    mean_of_means: float
    count_weighted: float
    equal_counts: float
    largest_gradient: float


@dataclass
class Buffers(Record):
    """BatchNorm running statistics across ranks after three forwards, with DDP's buffer sync on or off."""

    KIND: ClassVar[str] = "buffers"
    buffer_sync: bool
    spread_seen_by_forward: float
    spread_after_forward: float


@dataclass
class Statistics(Record):
    """One BatchNorm layer on this rank's shard against the same layer on the whole global batch."""

    KIND: ClassVar[str] = "statistics"
    layer: str
    """Class name of the global-statistics layer (SyncBatchNorm or GlobalBatchNorm2d)."""
    local_output_vs_full: float
    global_output_vs_full: float
    global_running_mean_vs_full: float
    global_running_var_vs_full: float


@dataclass
class DdpStep(Record):
    """One DDP training step of a variant: this rank's loss and the parameters' spread across ranks."""

    KIND: ClassVar[str] = "ddp_step"
    variant: str
    """A sync.VARIANTS key."""
    step: int
    loss: float
    parameter_spread: float


@dataclass
class SingleStep(Record):
    """One step of rank 0 training alone on the whole global batch."""

    KIND: ClassVar[str] = "single_step"
    batch_norm: bool
    step: int
    loss: float


@dataclass
class StepTiming(Record):
    """Seconds of each phase of one timed DDP step; local_backward_s is the backward again under no_sync."""

    KIND: ClassVar[str] = "timing"
    model: str
    step: int
    forward_s: float
    backward_s: float
    local_backward_s: float
    optimizer_s: float


def construction_broadcast(ctx, records, seed: int) -> None:
    """Seed every rank differently, then wrap in DDP: rank 0's parameters and buffers win."""
    model = sync.seeded_model(ctx.device, seed + 1000 * ctx.rank, batch_norm=True)
    with torch.no_grad():  # give the buffers rank-dependent values too (fresh ones are all 0 and 1)
        model(torch.randn(8, 3, 8, 8, device=ctx.device))
    buffers = sync.batch_norm_buffers(model)
    parameters_before = sync.spread_across_ranks(list(model.parameters()))
    buffers_before = sync.spread_across_ranks(buffers)
    wrapped = DDP(model)
    records.write(Broadcast(parameters_before, sync.spread_across_ranks(list(wrapped.parameters())),
                            buffers_before, sync.spread_across_ranks(buffers)))


def gradient_equivalence(ctx, records, images, labels, seed: int) -> None:
    """DDP's gradient, the hand-averaged one and a shard's own one against the single-process full batch."""
    images, labels = images.to(ctx.device), labels.to(ctx.device)
    mine, my_labels = (sync.shard(t, ctx.rank, ctx.world_size) for t in (images, labels))
    model = sync.seeded_model(ctx.device, seed, batch_norm=False)
    reference = sync.full_batch_gradients(model, images, labels)
    with_ddp = sync.shard_gradients(ctx, model, images, labels)
    local = sync.full_batch_gradients(model, mine, my_labels)
    bn_model = sync.seeded_model(ctx.device, seed, batch_norm=True)
    bn_reference = sync.full_batch_gradients(bn_model, images, labels)
    bn_global = with_global_batch_norm(copy.deepcopy(bn_model), ctx.device)
    largest = lambda gradients: max(g.abs().max().item() for g in gradients.values())
    records.write(Gradients(
        ddp_vs_full_batch=sync.largest_gap(with_ddp, reference),
        hand_vs_full_batch=sync.largest_gap(
            sync.shard_gradients(ctx, model, images, labels, by_hand=True), reference),
        local_vs_full_batch=sync.largest_gap(local, reference),
        spread_across_ranks=sync.spread_across_ranks(list(with_ddp.values())),
        largest_gradient=largest(reference),
        batch_norm_local_vs_full_batch=sync.largest_gap(
            sync.shard_gradients(ctx, bn_model, images, labels), bn_reference),
        batch_norm_global_vs_full_batch=sync.largest_gap(
            sync.shard_gradients(ctx, bn_global, images, labels), bn_reference),
        batch_norm_largest_gradient=largest(bn_reference), shard_size=int(mine.shape[0])))


def noise_experiment(ctx, records, profile, seed: int) -> None:
    """The classic sync check: random images and labels, different on every rank; losses differ, parameters not."""
    per_rank = profile.global_batch // ctx.world_size
    for index, loss, spread in loss_mean.noise_steps(ctx, seed, profile.steps, per_rank, profile.image_size,
                                                          profile.lr):
        records.write(NoiseStep(index, loss, spread))


def buffer_experiments(ctx, records, mine, seed: int) -> None:
    """Rank-local BatchNorm buffers with and without DDP's buffer sync: mine is this rank's (N, 3, H, W)."""
    for buffer_sync in (False, True):
        model = DDP(sync.seeded_model(ctx.device, seed, batch_norm=True), **sync.buffer_sync_option(buffer_sync))
        seen: list = []
        model.module.register_forward_pre_hook(
            lambda module, args: seen.append([b.clone() for b in sync.batch_norm_buffers(module)]))
        for _ in range(3):
            model(mine).sum().backward()
        records.write(Buffers(buffer_sync, sync.spread_across_ranks(seen[-1]),
                              sync.spread_across_ranks(sync.batch_norm_buffers(model.module))))


def statistics_experiment(ctx, records, images, seed: int) -> None:
    """The first BatchNorm of the model on this rank's shard, per-rank and global statistics, vs the full batch."""
    mine = sync.shard(images, ctx.rank, ctx.world_size).to(ctx.device)
    buffer_experiments(ctx, records, mine, seed)
    features = sync.seeded_model(ctx.device, seed, batch_norm=True).features[0]
    with torch.no_grad():
        whole, shard_features = features(images.to(ctx.device)), features(mine)
        channels = whole.shape[1]
        reference = torch.nn.BatchNorm2d(channels, momentum=1.0).to(ctx.device)
        full_output = sync.shard(reference(whole), ctx.rank, ctx.world_size)
        local_output = torch.nn.BatchNorm2d(channels).to(ctx.device)(shard_features)
        layer = with_global_batch_norm(torch.nn.Sequential(torch.nn.BatchNorm2d(channels)), ctx.device)
        layer = layer.to(ctx.device)
        layer[0].momentum = 1.0  # running statistics := this batch's
        global_output = layer(shard_features)
    gap = lambda left, right: (left - right).abs().max().item()
    records.write(Statistics(type(layer[0]).__name__, gap(local_output, full_output),
                             gap(global_output, full_output), gap(layer[0].running_mean, reference.running_mean),
                             gap(layer[0].running_var, reference.running_var)))


def epochs_for(steps: int, profile, dataset_size: int) -> int:
    """Epochs that hold `steps` steps of the profile's global batch (drop_last: full batches only)."""
    per_epoch = dataset_size // profile.global_batch
    return -(-steps // per_epoch)


def record_ddp_run(ctx, records, profile, dataset, variant: sync.Variant, seed: int) -> None:
    """One DDP run (sync.train_ddp): per-step loss and the parameters' spread across ranks after each step."""
    model = sync.seeded_model(ctx.device, seed, variant.batch_norm, variant.global_statistics)
    run = sync.train_ddp(model, dataset, ctx.device, profile.global_batch // ctx.world_size, profile.lr,
                         epochs_for(profile.steps, profile, len(dataset)), seed)
    for index, (loss, ddp_model) in enumerate(itertools.islice(run, profile.steps)):
        records.write(DdpStep(variant.key, index, loss, sync.spread_across_ranks(list(ddp_model.parameters()))))


def record_single_run(ctx, records, profile, dataset, batch_norm: bool, seed: int) -> None:
    """Rank 0 alone: the same start, one process, the whole global batch each step (the union of the shards)."""
    model = sync.seeded_model(ctx.device, seed, batch_norm)
    run = sync.train_alone(model, dataset, ctx.device, profile.global_batch, profile.lr,
                           epochs_for(profile.steps, profile, len(dataset)), seed)
    for index, loss in enumerate(itertools.islice(run, profile.steps)):
        records.write(SingleStep(batch_norm, index, loss))


def time_steps(ctx, records, profile, dataset, seed: int) -> None:
    """DDP steps of the profile's model, each phase timed (sync.timed_ddp_steps): one StepTiming record each."""
    torch.manual_seed(seed)
    model = DDP(build_model(profile.model).to(ctx.device))
    batches = iter(data.DeviceBatches(dataset, profile.global_batch // ctx.world_size, ctx, seed=seed))
    for index, seconds in enumerate(sync.timed_ddp_steps(model, batches, profile.lr, ctx.device, profile.repeats)):
        records.write(StepTiming(profile.model, index + 1, *seconds))


def experiments(ctx, records, options: Options) -> dict:
    profile = resolve_profile(options)
    profile = profile.replace(global_batch=split_global_batch(options.global_batch, profile, ctx.world_size))
    images, labels = data.synthetic_images(profile.global_batch, profile.image_size, seed=options.seed).tensors
    construction_broadcast(ctx, records, options.seed)
    gradient_equivalence(ctx, records, images, labels, options.seed)
    records.write(Denominators(**dataclasses.asdict(loss_mean.denominator_gaps(ctx, options.seed))))
    noise_experiment(ctx, records, profile, options.seed)
    statistics_experiment(ctx, records, images, options.seed)
    dataset = data.synthetic_images(profile.num_samples, profile.image_size, seed=options.seed)
    runs = [lambda v=v: record_ddp_run(ctx, records, profile, dataset, v, options.seed) for v in sync.VARIANTS]
    runs.append(lambda: time_steps(ctx, records, profile, dataset, options.seed))
    if ctx.is_main:  # rank 0 also trains alone, with and without BatchNorm
        runs += [lambda b=b: record_single_run(ctx, records, profile, dataset, b, options.seed) for b in (False, True)]
    for index, run in enumerate(runs):
        run()
        if ctx.is_main:  # one progress bar: rank 0 runs every part
            records.progress(index + 1, len(runs), unit="training runs")
    return {"profile": profile.name, "global_batch": profile.global_batch, "steps": profile.steps,
            "model": profile.model, "timed_steps": profile.repeats,
            "per_rank_batch": profile.global_batch // ctx.world_size,
            "variants": [variant.key for variant in sync.VARIANTS]}


def dp_vs_ddp_lab(ctx, records, options: Options) -> dict:
    """The experiments in plain float32 on GPUs too (about the math, not TF32 rounding); TF32 restored after."""
    with tf32(False):
        return experiments(ctx, records, options)


def main(argv=None):
    return run_lab("dp_vs_ddp", dp_vs_ddp_lab, Options, argv)


if __name__ == "__main__":
    main()
