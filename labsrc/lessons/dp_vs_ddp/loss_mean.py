"""Whose mean is the loss? DDP's mean of rank means against a masked-token mean; the noise-data check."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from labsrc.lessons.dp_vs_ddp.sync import gradients, largest_gap, shard, spread_across_ranks
from labsrc.training.models import TinyCNN


def masked_token_batch(world_size: int, seed: int, features: int = 8, classes: int = 5):
    """A padded token batch whose ranks hold DIFFERENT numbers of real tokens.

    Returns tokens (n*T, features), labels (n*T,), mask (n*T,) with T = 4(n+1) tokens per rank, of
    which rank r's first 4(r+1) are real (mask 1) and the rest padding (mask 0).
    """
    per_rank = 4 * (world_size + 1)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(world_size * per_rank, features, generator=generator)
    labels = torch.randint(classes, (world_size * per_rank,), generator=generator)
    mask = torch.zeros(world_size, per_rank)
    for rank in range(world_size):
        mask[rank, : 4 * (rank + 1)] = 1.0
    return tokens, labels, mask.reshape(-1)


def masked_mean_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the real tokens: sum(loss x mask) / sum(mask). logits (T, C), labels, mask (T,)."""
    return (F.cross_entropy(logits, labels, reduction="none") * mask).sum() / mask.sum()


def count_weighted_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, world_size: int):
    """This rank's summed token loss x world_size / the GLOBAL token count (all-reduced).

    DDP divides the summed gradients by world_size; the world_size here undoes that, so what DDP
    averages is sum over all ranks' tokens / global count: the full-batch masked mean.
    """
    total = mask.sum().detach().clone()
    dist.all_reduce(total)  # the global count, on every rank
    return (F.cross_entropy(logits, labels, reduction="none") * mask).sum() * world_size / total


@dataclass
class DenominatorGaps:
    """Largest |DDP gradient - full-batch gradient| of a masked-mean loss, three ways."""

    mean_of_means: float
    """Each rank's loss: the mean over ITS real tokens (counts differ per rank)."""
    count_weighted: float
    """Each rank's loss: its summed token loss x n / the global count (count_weighted_loss)."""
    equal_counts: float
    """Mean of means again, but with every token real (equal counts on every rank): the control."""
    largest_gradient: float


def denominator_gaps(ctx, seed: int) -> DenominatorGaps:
    """Masked-mean losses under DDP against the one-process masked mean over every rank's tokens."""
    tokens, labels, mask = masked_token_batch(ctx.world_size, seed)
    torch.manual_seed(seed)
    model = nn.Linear(tokens.shape[1], 5).to(ctx.device)
    tokens, labels, mask = tokens.to(ctx.device), labels.to(ctx.device), mask.to(ctx.device)
    everything = torch.ones_like(mask)

    def ddp_gradient(loss_of, rank_mask):
        wrapped = DistributedDataParallel(copy.deepcopy(model))
        mine = [shard(t, ctx.rank, ctx.world_size) for t in (tokens, labels, rank_mask)]
        loss_of(wrapped(mine[0]), mine[1], mine[2]).backward()
        return gradients(wrapped)

    def reference(full_mask):
        copied = copy.deepcopy(model)
        masked_mean_loss(copied(tokens), labels, full_mask).backward()
        return gradients(copied)

    weighted = lambda logits, targets, rank_mask: count_weighted_loss(logits, targets, rank_mask, ctx.world_size)
    full = reference(mask)
    return DenominatorGaps(
        mean_of_means=largest_gap(ddp_gradient(masked_mean_loss, mask), full),
        count_weighted=largest_gap(ddp_gradient(weighted, mask), full),
        equal_counts=largest_gap(ddp_gradient(masked_mean_loss, everything), reference(everything)),
        largest_gradient=max(g.abs().max().item() for g in full.values()))


def noise_steps(ctx, seed: int, steps: int, per_rank_batch: int, image_size: int, lr: float):
    """DDP on pure noise, each rank its own: yields (step, this rank's loss, parameter spread across ranks).

    Every step each rank draws its own random images (per_rank_batch, 3, S, S) and random labels from a
    generator seeded by its rank, so the ranks' losses differ; the all-reduced gradient keeps the
    parameters identical.
    """
    torch.manual_seed(seed)
    model = DistributedDataParallel(TinyCNN(batch_norm=False).to(ctx.device))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed + 7919 * (ctx.rank + 1))
    for index in range(steps):
        images = torch.randn(per_rank_batch, 3, image_size, image_size, generator=generator).to(ctx.device)
        labels = torch.randint(10, (per_rank_batch,), generator=generator).to(ctx.device)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        yield index, loss.item(), spread_across_ranks(list(model.parameters()))


def losses_differ_every_step(records) -> list[int]:
    """Steps at which two ranks reported the same loss, from records with .step, .loss and .rank."""
    by_step: dict[int, list[float]] = {}
    for record in records:
        by_step.setdefault(record.step, []).append(record.loss)
    return sorted(step for step, losses in by_step.items() if len(set(losses)) < len(losses))
