"""The sync experiment: what DataParallel and DDP do to a batch, its gradients, parameters and buffers."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


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
    """What DDP does after backward, written out: sum every gradient over ranks, divide by world size.

    Each rank's loss is the mean over its own G/n samples; the mean over all G samples is the mean of
    the n rank means, so the gradient of the global loss is the average of the rank gradients.
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


def buffer_sync_option(enabled: bool) -> dict:
    """DDP's keyword for syncing buffers from rank 0 before each forward: `forward_sync_buffers` where
    this torch has it (newer releases deprecate `broadcast_buffers` for it), else `broadcast_buffers`."""
    import inspect
    from torch.nn.parallel import DistributedDataParallel
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}


def batch_norm_buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b for name, b in model.named_buffers() if "running_" in name]


def global_batch_statistics(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and (biased) variance over the whole global batch, as SyncBatchNorm computes them.

    features: (N_rank, C, H, W) on each rank -> (C,), (C,): all-reduce of count, sum and sum of squares.
    """
    dims = [0, 2, 3]
    count = torch.tensor(float(features.numel() // features.shape[1]))
    totals = torch.stack([features.sum(dims), (features * features).sum(dims)])
    dist.all_reduce(count)
    dist.all_reduce(totals)
    mean = totals[0] / count
    return mean, totals[1] / count - mean * mean


def dataparallel_step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> dict:
    """One training step through nn.DataParallel; what it did with the batch, and how long it took.

    With 2+ GPUs the batch (N, ...) is scattered in chunks to the GPUs, the module is replicated onto each,
    and the outputs are gathered on the first GPU. Without them DataParallel calls the module as it is.
    """
    import time
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    parallel = nn.DataParallel(model.to(device))
    chunks = [int(c.shape[0]) for c in images.chunk(max(1, gpus))]
    images, labels = images.to(device), labels.to(device)
    seconds = []
    for _ in range(3 if gpus >= 2 else 1):
        if gpus:
            torch.cuda.synchronize()
        start = time.perf_counter()
        parallel.zero_grad(set_to_none=True)
        outputs = parallel(images)
        F.cross_entropy(outputs, labels).backward()
        if gpus:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return {"gpus": gpus, "device_ids": list(parallel.device_ids), "chunks": chunks,
            "output_device": str(outputs.device), "replicated": gpus >= 2,
            "step_s": min(seconds) if gpus >= 2 else None}
