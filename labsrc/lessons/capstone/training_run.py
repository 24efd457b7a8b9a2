"""Lesson 13's training run: DDP + AMP + channels_last + compile, sharded data, the scaled schedule, snapshots, evaluation."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from labsrc.lessons.capstone.recipe import Schedule, learning_rate, load_snapshot, save_snapshot, state_digest
from labsrc.training.benchmark import compile_or_fallback
from labsrc.training.loop import autocast, step, tf32
from labsrc.training.models import build_model
from labsrc.training.timing import timed

ORDER_EPOCHS = 2  # epochs whose sample order every rank reports: enough to see the reshuffle, small at any scale


@dataclass(frozen=True)
class RunSettings:
    """One capstone run, every value resolved (the lab's Options turn into this)."""

    model: str
    precision: str
    channels_last: bool
    compile: bool
    compile_backend: str
    schedule: Schedule
    momentum: float
    weight_decay: float
    max_norm: float | None
    eval_every: int
    snapshot_every: int
    num_workers: int
    seed: int


def per_rank_loader(dataset: Dataset, batch: int, ctx, seed: int, epoch: int, num_workers: int):
    """(loader, sampler) for one epoch: DistributedSampler gives this rank its 1/world_size, reshuffled by set_epoch.

    Random augmentation draws from a generator seeded by (seed, epoch, rank), so a resumed epoch replays
    the same crops and flips.
    """
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                 seed=seed, drop_last=True)
    sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
    torch.manual_seed(seed * 1_000_003 + epoch * 1_009 + ctx.rank)  # augmentation in this process
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch * 1_009 + ctx.rank)  # in workers
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True, num_workers=num_workers,
                        generator=generator, pin_memory=ctx.device.type == "cuda")
    return loader, sampler


def batches_from(dataset: Dataset, batch: int, ctx, settings: RunSettings, start_step: int,
                 on_epoch: Callable[[int, list[int]], None] = lambda epoch, order: None) -> Iterator:
    """(epoch, images (batch, 3, H, W), labels (batch,)) from optimizer step start_step on, without end.

    Resuming mid-epoch reads and drops the batches already trained on, so the data order and the
    augmentation draws continue exactly where the snapshot left them. on_epoch(epoch, order) sees the
    dataset indices this rank's sampler hands out in each epoch, in order.
    """
    steps_per_epoch = len(dataset) // (batch * ctx.world_size)
    epoch, done = divmod(start_step, steps_per_epoch)
    while True:
        loader, sampler = per_rank_loader(dataset, batch, ctx, settings.seed, epoch, settings.num_workers)
        on_epoch(epoch, list(sampler))
        for images, labels in itertools.islice(loader, done, None):
            yield epoch, images, labels
        epoch, done = epoch + 1, 0


def build(ctx, settings: RunSettings, example: torch.Tensor, snapshot: Path | None):
    """(model, all-reduce counter (None without DDP or when compiled), runner, optimizer, scaler, start step,
    compile reason); the snapshot restored if it exists.

    example: (N, 3, H, W) images for compile_or_fallback's trial call; BatchNorm statistics that the trial
    changes are put back, so a compiled run and a resumed run start from the same state.
    """
    torch.manual_seed(settings.seed)  # every rank builds the same weights; DDP broadcasts rank 0's anyway
    memory_format = torch.channels_last if settings.channels_last else torch.contiguous_format
    model = build_model(settings.model).to(ctx.device, memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.schedule.base_lr, momentum=settings.momentum,
                                weight_decay=settings.weight_decay)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=settings.precision == "fp16")
    start = 0
    if snapshot is not None and snapshot.exists():
        start = load_snapshot(snapshot, model, optimizer, scaler, ctx.device)
    ddp, counter = model, None  # a world of one started without torchrun has no process group to synchronise over
    if dist.is_initialized():
        ddp = DistributedDataParallel(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None)
        if not settings.compile:  # eager only: the count is for the scaling report, compiled DDP keeps its own
            counter = AllReduceCount()
            ddp.register_comm_hook(counter, counted_allreduce)
    kept = {name: buffer.clone() for name, buffer in model.named_buffers()}
    runner, _, reason = compile_or_fallback(ddp, settings.compile, settings.compile_backend,
                                            example.to(ctx.device, memory_format=memory_format),
                                            settings.precision)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(kept[name])
    return model, counter, runner, optimizer, scaler, start, reason


def batch_fingerprint(images: torch.Tensor, labels: torch.Tensor) -> float:
    """One number for a batch as loaded (before it moves to the device): equal batches give equal numbers, so two
    runs can be compared step by step on which samples each step trained on."""
    return float(images.double().sum() + 1000.0 * (labels.double() * torch.arange(1, len(labels) + 1)).sum())


class AllReduceCount:
    """The state of counted_allreduce: the bytes of gradient buckets all-reduced so far."""

    def __init__(self):
        self.bytes = 0


def counted_allreduce(state: AllReduceCount, bucket):
    """DDP's default all-reduce as a comm hook (torch's allreduce_hook: divide by the world size, all-reduce the
    sum) that also adds each gradient bucket's size in bytes to state.bytes."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    state.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(None, bucket)


def all_reduced_mean(values: list[torch.Tensor]) -> float:
    """The mean of this segment's per-step losses over the steps and over every rank (one all_reduce)."""
    total = torch.stack(values).float().sum().reshape(1)
    count = torch.tensor([float(len(values))], device=total.device)
    both = torch.cat([total, count])
    if dist.is_initialized():
        dist.all_reduce(both)
    return float(both[0] / both[1])


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm's running statistics).

    DDP broadcasts them at the start of each forward, and each rank's forward then updates its copy from its
    own batch: after a step the copies differ, until this (or the next forward) makes them equal again.
    """
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def strided_share(held_out: Dataset, ctx) -> Dataset:
    """This rank's share of the held-out split: every world_size-th sample from its rank on. Disjoint, and
    together exactly the split, whatever its size (shares differ by one sample at most)."""
    return torch.utils.data.Subset(held_out, range(ctx.rank, len(held_out), ctx.world_size))


def sampler_share(held_out: Dataset, ctx) -> Dataset:
    """The share DistributedSampler gives (shuffle=False): equal shares, so when world_size does not divide the
    split it pads by repeating the first ceil(N/n)*n - N samples, which are then counted twice."""
    order = DistributedSampler(held_out, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=False)
    return torch.utils.data.Subset(held_out, list(order))


def evaluate(model: torch.nn.Module, held_out: Dataset, ctx, precision: str, batch: int = 256,
             share: Callable[[Dataset, object], Dataset] = strided_share) -> dict:
    """Accuracy and loss on the held-out split with rank 0's buffers: each rank scores its share (by default
    every world_size-th sample), the sums and counts are all-reduced."""
    broadcast_buffers(model)
    subset = share(held_out, ctx)
    totals = torch.zeros(3, device=ctx.device, dtype=torch.float64)  # correct, loss sum, count
    model.eval()
    with torch.no_grad():
        for images, labels in DataLoader(subset, batch_size=batch):
            images, labels = images.to(ctx.device), labels.to(ctx.device)
            with autocast(ctx.device, precision):
                logits = model(images)
            loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
            totals += torch.stack([(logits.argmax(1) == labels).sum().double(), loss.double(),
                                   torch.tensor(float(len(labels)), device=ctx.device, dtype=torch.float64)])
    model.train()
    if dist.is_initialized():
        dist.all_reduce(totals)
    return {"accuracy": float(totals[0] / totals[2]), "loss": float(totals[1] / totals[2]), "count": int(totals[2])}


def train_run(ctx, settings: RunSettings, train_set: Dataset, held_out: Dataset, snapshot: Path | None,
              report: Callable[[str, dict], None], stop_after: Callable[[int], bool] = lambda step_index: False) -> dict:
    """Train to settings.schedule.total_steps (resuming from snapshot when it exists); report(kind, values) logs.

    report gets "start" (with the optimizer state restored: momentum buffers per parameter tensor), "order"
    (this rank's sample indices in each of the first ORDER_EPOCHS epochs), "log" (all-reduced loss, the rate
    the optimizer used at each step, each step's batch_fingerprint on this rank, the gradient bytes DDP all-reduced per step, throughput), "evaluation"
    (held-out accuracy and the training seconds so far), "snapshot" and "final" (this rank's digests of
    parameters and of buffers). stop_after(step) ends the run right after that step's evaluation (and its
    snapshot, when one is due): a crash between snapshots resumes from the last one and redoes the steps since. Returns the final values.
    """
    schedule = settings.schedule
    batch = schedule.global_batch // ctx.world_size
    probe = next(iter(DataLoader(train_set, batch_size=batch)))[0]
    with tf32(True):  # TF32 on Ampere+ GPUs for what autocast leaves in float32; nothing changes elsewhere
        model, counter, runner, optimizer, scaler, start, reason = build(ctx, settings, probe, snapshot)
        report("start", {"resumed_from": start, "compile_reason": reason, "per_rank_batch": batch,
                         "steps_per_epoch": len(train_set) // schedule.global_batch, "held_out": len(held_out),
                         "parameter_tensors": len(list(model.parameters())),
                         "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                         "momentum_buffers": sum("momentum_buffer" in state for state in optimizer.state.values())})
        return _steps(ctx, settings, model, runner, optimizer, scaler, start, batch, train_set, held_out,
                      snapshot, report, stop_after, counter)


def _steps(ctx, settings, model, runner, optimizer, scaler, start, batch, train_set, held_out, snapshot,
           report, stop_after, counter=None) -> dict:
    """train_run's loop: timed segments of eval_every steps, each followed by logging, evaluation, snapshot."""
    memory_format = torch.channels_last if settings.channels_last else torch.contiguous_format
    def record_order(epoch: int, order: list[int]) -> None:
        if epoch < ORDER_EPOCHS:
            report("order", {"epoch": epoch, "indices": order})

    batches = batches_from(train_set, batch, ctx, settings, start, record_order)
    total, step_index, train_seconds, sent_before = settings.schedule.total_steps, start, 0.0, 0
    while step_index < total:
        segment_end = min(total, (step_index // settings.eval_every + 1) * settings.eval_every)
        losses, rates, fingerprints = [], [], []
        with timed(ctx.device) as clock:
            while step_index < segment_end:
                epoch, images, labels = next(batches)
                fingerprints.append(batch_fingerprint(images, labels))
                images = images.to(ctx.device, non_blocking=True, memory_format=memory_format)
                labels = labels.to(ctx.device, non_blocking=True)
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(step_index, settings.schedule)
                losses.append(step(runner, optimizer, images, labels, settings.precision, scaler,
                                   settings.max_norm))
                rates.append(optimizer.param_groups[0]["lr"])  # the rate this step used, read back
                step_index += 1
        train_seconds += clock["s"]
        images_per_s = len(losses) * settings.schedule.global_batch / clock["s"]
        sent = None if counter is None else (counter.bytes - sent_before) / len(losses)
        sent_before = 0 if counter is None else counter.bytes
        report("log", {"step": step_index, "epoch": epoch, "lr": rates[-1], "max_lr": max(rates), "rates": rates,
                       "batches": fingerprints, "allreduce_bytes_per_step": sent, "loss": all_reduced_mean(losses),
                       "images_per_s": images_per_s})
        scores = evaluate(model, held_out, ctx, settings.precision)
        report("evaluation", {"step": step_index, "train_seconds": train_seconds, **scores})
        if snapshot is not None and (step_index % settings.snapshot_every == 0 or step_index == total):
            written = save_snapshot(snapshot, step_index, model, optimizer, scaler) if ctx.is_main else 0
            if dist.is_initialized():
                dist.barrier()  # no rank runs ahead of a snapshot that is still being written
            report("snapshot", {"step": step_index, "bytes": written})
        if stop_after(step_index):
            break
    final = {"step": step_index, "digest": state_digest(model), "parameters_digest": state_digest(model, "parameters"),
             "buffers_digest": state_digest(model, "buffers"), "train_seconds": train_seconds}
    report("final", final)
    return final
