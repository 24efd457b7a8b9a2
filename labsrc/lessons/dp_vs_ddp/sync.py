"""The sync experiment: DDP training as a script writes it, and what DDP does to gradients, parameters and buffers."""
from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from labsrc.lessons.dp_vs_ddp.batch_norm import with_global_batch_norm
from labsrc.training.loop import step
from labsrc.training.timing import timed
from labsrc.training.models import TinyCNN


def shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank r's contiguous 1/world_size of a global batch: (G, ...) -> (G / world_size, ...)."""
    if tensor.shape[0] % world_size:
        raise ValueError(f"global batch {tensor.shape[0]} does not split evenly over {world_size} ranks")
    return tensor.chunk(world_size)[rank]


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """{parameter name: a copy of its .grad}, names without DDP's `module.` prefix."""
    return {name.removeprefix("module."): p.grad.detach().clone()
            for name, p in model.named_parameters() if p.grad is not None}


def full_batch_gradients(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> dict:
    """Gradients of the mean loss over the whole global batch, in one process: the reference."""
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    F.cross_entropy(reference(images), labels).backward()
    return gradients(reference)


def average_gradients(model: nn.Module, world_size: int) -> None:
    """DDP's gradient average written out: every gradient summed over ranks, divided by world size.

    Each rank's loss is the mean over its own G/n samples; the mean over all G samples is the mean of
    the n rank means, so the gradient of the global loss is the average of the rank gradients. (DDP
    itself divides first, as it copies each gradient into its bucket, then all-reduces with SUM.)
    """
    for parameter in model.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)
            parameter.grad.div_(world_size)


def largest_gap(left: dict, right: dict) -> float:
    """max |left - right| over every tensor of two {name: tensor} dicts with the same names."""
    if left.keys() != right.keys():
        raise ValueError(f"different tensors: {sorted(left.keys() ^ right.keys())}")
    return max((left[k].float() - right[k].float()).abs().max().item() for k in left)


def spread_across_ranks(tensors: list[torch.Tensor]) -> float:
    """max over elements of |this rank's value - rank 0's value|, the same number on every rank.

    0.0 means the tensors are bit-for-bit identical on all ranks.
    """
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    gap = (flat - reference).abs().max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return gap.item()


def seeded_model(device: torch.device, seed: int, batch_norm: bool, global_statistics: bool = False) -> nn.Module:
    """TinyCNN from `seed`; with global_statistics its BatchNorm layers normalise over the global batch."""
    torch.manual_seed(seed)
    model = TinyCNN(batch_norm=batch_norm).to(device)
    return with_global_batch_norm(model, device) if global_statistics else model


def shard_gradients(ctx, model: nn.Module, images, labels, by_hand: bool = False) -> dict:
    """This rank's gradients on its shard of the global batch: through DDP, or averaged by hand.

    images: (G, ...), labels: (G,), the whole global batch on every rank; the model is copied, not changed.
    """
    copied = copy.deepcopy(model)
    wrapped = copied if by_hand else DDP(copied)
    step(wrapped, None, shard(images, ctx.rank, ctx.world_size),
         shard(labels, ctx.rank, ctx.world_size))
    if by_hand:
        average_gradients(copied, ctx.world_size)
    return gradients(wrapped)


def train_ddp(model: nn.Module, dataset, device: torch.device, batch_size: int, lr: float, epochs: int,
              seed: int = 0):
    """DDP training as a script writes it; yields (this rank's loss, the DDP model) after every step.

    model: the same architecture on every rank; dataset: the whole training set on every rank; batch_size:
    this rank's samples per step, the global batch / world size. Needs the process group set up.
    """
    sampler = DistributedSampler(dataset, seed=seed, drop_last=True)  # this rank's share of each epoch
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    model = DDP(model.to(device))  # copies rank 0's weights to every rank
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)  # the mean over this rank's samples only
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients during backward: every rank gets their average
            optimizer.step()  # the same gradient on every rank, so the same update
            yield loss.item(), model  # for the lab's records


def train_alone(model: nn.Module, dataset, device: torch.device, batch_size: int, lr: float, epochs: int,
                seed: int = 0):
    """One process, no DDP, batch_size = the global batch; yields the loss after every step.

    Its sampler is the ranks' sampler for a world of one: the same shuffle, so each of its batches holds
    exactly the samples that the ranks' batches of that step hold together.
    """
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, seed=seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            yield loss.item()


def buffer_sync_option(enabled: bool) -> dict:
    """DDP's keyword for copying rank 0's buffers to every rank before a training forward: `forward_sync_buffers`
    where this torch has it (torch 2.13 deprecated `broadcast_buffers` for it), else `broadcast_buffers`.
    Unlike `forward_sync_buffers=False`, `broadcast_buffers=False` also skips the buffers' broadcast in DDP(model)."""
    import inspect
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}


def batch_norm_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Every BatchNorm running mean and running variance of a model (its buffers that hold statistics)."""
    return [b for name, b in model.named_buffers() if "running_" in name]


@dataclass(frozen=True)
class Variant:
    """One DDP training run of the sync experiment: `key` goes into records, `label` onto figures."""

    key: str
    label: str
    batch_norm: bool
    """The model has BatchNorm layers."""
    global_statistics: bool
    """Its BatchNorm layers normalise over the global batch (SyncBatchNorm)."""


VARIANTS = (Variant("plain", "no BatchNorm", False, False),
            Variant("batch_norm_local", "BatchNorm, per-rank statistics", True, False),
            Variant("batch_norm_global", "BatchNorm, global statistics", True, True))
"""The training runs the lab compares with one process on the whole global batch."""


def mean_loss_per_step(steps) -> tuple[list[int], list[float]]:
    """(steps, loss) from records with .step and .loss: the loss at a step is the mean over the ranks."""
    by_step: dict[int, list[float]] = {}
    for record in steps:
        by_step.setdefault(record.step, []).append(record.loss)
    ordered = sorted(by_step)
    return ordered, [statistics.fmean(by_step[s]) for s in ordered]


def curve_gaps(ddp_steps, single_steps) -> dict[str, float]:
    """{variant key: largest |DDP loss - single-process loss| over steps}, each beside its own single run.

    ddp_steps: records with .variant, .step, .loss (every rank); single_steps: records with .batch_norm,
    .step, .loss (rank 0's one-process runs).
    """
    gaps = {}
    for variant in VARIANTS:
        _, ddp = mean_loss_per_step(r for r in ddp_steps if r.variant == variant.key)
        _, single = mean_loss_per_step(r for r in single_steps if r.batch_norm == variant.batch_norm)
        if not ddp or len(ddp) != len(single):
            raise ValueError(f"{variant.key}: {len(ddp)} DDP steps but {len(single)} single-process steps")
        gaps[variant.key] = max(abs(a - b) for a, b in zip(ddp, single))
    return gaps


def step_breakdown_ms(timings) -> dict[str, float]:
    """Median milliseconds per phase over timed steps and ranks, from records with .forward_s,
    .backward_s, .local_backward_s, .optimizer_s: backward is the no_sync backward (compute only),
    all_reduce what DDP's backward takes beyond it."""
    timings = list(timings)
    median = lambda key: 1000 * statistics.median(getattr(r, key) for r in timings)
    return {"forward": median("forward_s"), "backward": median("local_backward_s"),  # all_reduce: what it did not hide
            "all_reduce": max(0.0, median("backward_s") - median("local_backward_s")),
            "optimizer": median("optimizer_s")}


def timed_ddp_steps(model: DDP, batches, lr: float, device: torch.device, steps: int):
    """Times `steps` DDP steps after one warm-up: yields (forward_s, backward_s, local_backward_s, optimizer_s).

    local_backward_s: the same backward again under no_sync(), which skips the all-reduce (compute only).
    batches: an iterator of (images, labels) on `device`, this rank's share of each step.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_of = lambda images, labels: F.cross_entropy(model(images), labels)
    for index in range(1 + steps):
        images, labels = next(batches)
        with timed(device) as forward:
            loss = loss_of(images, labels)
        optimizer.zero_grad(set_to_none=True)
        with timed(device) as backward:
            loss.backward()
        with timed(device) as update:
            optimizer.step()
        with model.no_sync():  # no_sync must cover the forward: DDP arms its reducer there
            local_loss = loss_of(images, labels)
            optimizer.zero_grad(set_to_none=True)
            with timed(device) as local:
                local_loss.backward()
        optimizer.zero_grad(set_to_none=True)
        if index > 0:  # the first step pays for warm-up
            yield forward["s"], backward["s"], local["s"], update["s"]
