"""BatchNorm over the global batch, like SyncBatchNorm, on any device: statistics from all-reduced sums."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


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

    (N_rank, C, H, W) -> (N_rank, C, H, W). torch's nn.SyncBatchNorm refuses CPU tensors when it trains
    under a process group; this one also runs on gloo CPU ranks. Its backward all-reduces too (SumOverRanks),
    so after DDP's average the gradient is the full-batch BatchNorm gradient. Outside a process group, or in eval mode, it is
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
