"""The sync experiment: what DataParallel and DDP do to a batch, its gradients, parameters and buffers."""
from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from labsrc.training.loop import step, tf32
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
    wrapped = copied if by_hand else DistributedDataParallel(copied)
    step(wrapped, None, shard(images, ctx.rank, ctx.world_size),
         shard(labels, ctx.rank, ctx.world_size))
    if by_hand:
        average_gradients(copied, ctx.world_size)
    return gradients(wrapped)


def buffer_sync_option(enabled: bool) -> dict:
    """DDP's keyword for syncing buffers from rank 0 before each forward: `forward_sync_buffers` where
    this torch has it (newer releases deprecate `broadcast_buffers` for it), else `broadcast_buffers`."""
    import inspect
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}


def batch_norm_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Every BatchNorm running mean and running variance of a model (its buffers that hold statistics)."""
    return [b for name, b in model.named_buffers() if "running_" in name]


class SumOverRanks(torch.autograd.Function):
    """all_reduce(SUM) that autograd can see through: the gradient of a sum over ranks is summed too."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, gradient: torch.Tensor) -> torch.Tensor:
        total = gradient.clone()
        dist.all_reduce(total)
        return total


def global_batch_statistics(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel mean and (biased) variance over the whole global batch: SyncBatchNorm's statistics.

    features: (N_rank, C, H, W) on each rank -> mean (C,), variance (C,), count (): the same on every
    rank, here from all-reduces of sums (count, sum, sum of squared deviations). torch's SyncBatchNorm
    reaches the same numbers by all-gathering every rank's (mean, invstd, count) instead.
    """
    dims = [0, 2, 3]
    count = torch.tensor(float(features.numel() // features.shape[1]), device=features.device)
    dist.all_reduce(count)
    mean = SumOverRanks.apply(features.sum(dims)) / count
    centred = features - mean[None, :, None, None]
    variance = SumOverRanks.apply((centred * centred).sum(dims)) / count
    return mean, variance, count


class GlobalBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d normalising with the statistics of the global batch, like SyncBatchNorm, on any device.

    (N_rank, C, H, W) -> (N_rank, C, H, W). torch's nn.SyncBatchNorm takes GPU tensors only; this one
    also runs on gloo CPU ranks. Its backward all-reduces too (SumOverRanks), so after DDP's average
    the gradient is the full-batch BatchNorm gradient. Outside a process group, or in eval mode, it is
    plain BatchNorm2d.
    """

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(features)
        mean, variance, count = global_batch_statistics(features)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else 1.0 / self.num_batches_tracked.item()
                self.running_mean.lerp_(mean, momentum)
                self.running_var.lerp_(variance * count / (count - 1), momentum)  # unbiased, as BatchNorm
        shape = (1, -1, 1, 1)
        normalised = (features - mean.view(shape)) * torch.rsqrt(variance.view(shape) + self.eps)
        if self.affine:
            normalised = normalised * self.weight.view(shape) + self.bias.view(shape)
        return normalised


def with_global_batch_norm(model: nn.Module, device: torch.device) -> nn.Module:
    """The model with every BatchNorm2d normalising over the global batch, its state kept.

    On CUDA: torch's nn.SyncBatchNorm.convert_sync_batchnorm. Elsewhere: GlobalBatchNorm2d.
    """
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d) and not isinstance(child, GlobalBatchNorm2d):
            replacement = GlobalBatchNorm2d(child.num_features, child.eps, child.momentum, child.affine,
                                            child.track_running_stats).to(device)
            replacement.load_state_dict(child.state_dict())
            setattr(model, name, replacement)
        else:
            with_global_batch_norm(child, device)
    return model


def synchronize_all(gpus: int) -> None:
    """Wait for the queued work of every GPU (DataParallel's replicas run on all of them)."""
    for index in range(gpus):
        torch.cuda.synchronize(index)


def dataparallel_step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, repeats: int = 3,
                      lr: float = 0.05) -> dict:
    """Training steps through nn.DataParallel: what each call of the module saw, its gradient, the step time.

    images: (N, 3, H, W), labels: (N,). With 2+ GPUs the batch is scattered in chunks along dim 0 to
    device_ids, the module replicated onto each GPU, and the outputs gathered on the first; the step
    (forward, backward, SGD update) is timed, the fastest of `repeats` steps after a warm-up. With fewer
    GPUs DataParallel calls the module as it is, once, with the whole batch. Calls are listed in device
    order. The warm-up step runs in float32 (TF32 off) and its gradient is compared with one process's
    full-batch gradient: gradient_vs_full_batch.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    model = model.to(device)
    images, labels = images.to(device), labels.to(device)
    with tf32(False):
        reference = full_batch_gradients(model, images, labels)
    calls: list[dict] = []  # one entry per replica call; replicas share the module's hooks
    hook = model.register_forward_pre_hook(
        lambda module, args: calls.append({"shape": list(args[0].shape), "device": str(args[0].device)}))
    parallel = nn.DataParallel(model, device_ids=list(range(gpus)) or None)
    optimizer = torch.optim.SGD(parallel.parameters(), lr=lr)
    seconds, first_step_calls, gap = [], [], None
    for index in range(1 + repeats if gpus >= 2 else 1):
        synchronize_all(gpus)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with tf32(False) if index == 0 else contextlib.nullcontext():
            outputs = parallel(images)
            F.cross_entropy(outputs, labels).backward()
        if index == 0:
            gap = largest_gap(gradients(model), reference)
        optimizer.step()
        synchronize_all(gpus)
        seconds.append(time.perf_counter() - start)
        first_step_calls = first_step_calls or sorted(calls, key=lambda call: torch.device(call["device"]).index or 0)
    hook.remove()
    return {"gpus": gpus, "device_ids": list(parallel.device_ids), "calls": first_step_calls,
            "chunks": [call["shape"][0] for call in first_step_calls], "output_device": str(outputs.device),
            "replicated": len(first_step_calls) > 1, "step_s": min(seconds[1:]) if gpus >= 2 else None,
            "gradient_vs_full_batch": gap,
            "largest_gradient": max(g.abs().max().item() for g in reference.values())}


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
    return {"forward": median("forward_s"), "backward": median("local_backward_s"),
            "all_reduce": max(0.0, median("backward_s") - median("local_backward_s")),
            "optimizer": median("optimizer_s")}
