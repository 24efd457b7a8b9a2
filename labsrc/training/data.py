"""Datasets the labs share (all offline), per-rank loaders, and batches kept resident on the device."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from labsrc.core.paths import REPO

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def synthetic_images(num_samples: int, image_size: int = 32, num_classes: int = 10, seed: int = 0,
                     noise: float = 1.0) -> TensorDataset:
    """A learnable image-classification set made offline: each class a tint and a smooth pattern, plus noise.

    images: (num_samples, 3, image_size, image_size) float32; labels: (num_samples,) int64.
    The same seed gives the same set in every process.
    """
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, 3, 4, 4, generator=generator)
    tint = torch.randn(num_classes, 3, 1, 1, generator=generator)  # a colour per class: easy to start on
    prototypes = tint + torch.nn.functional.interpolate(coarse, size=image_size, mode="bilinear",
                                                        align_corners=False)
    labels = torch.randint(num_classes, (num_samples,), generator=generator)
    images = prototypes[labels] + noise * torch.randn(num_samples, 3, image_size, image_size,
                                                      generator=generator)
    return TensorDataset(images, labels)


def random_noise(num_samples: int, image_size: int = 32, num_classes: int = 10, seed: int = 0) -> TensorDataset:
    """Pure noise and random labels, as in the classic DDP sync experiment: throughput, nothing to learn."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(num_samples, 3, image_size, image_size, generator=generator)
    labels = torch.randint(num_classes, (num_samples,), generator=generator)
    return TensorDataset(images, labels)


def data_root() -> Path:
    """Where on-disk datasets are looked for: $LABSRC_DATA, else data/ at the top of the checkout."""
    return Path(os.environ.get("LABSRC_DATA") or REPO / "data")


def cifar10_transform(train: bool):
    from torchvision import transforms
    steps = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if train else []
    return transforms.Compose(steps + [transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])


def cifar10(root: Path | str | None = None, train: bool = True, download: bool = False) -> Dataset | None:
    """CIFAR-10 through torchvision if it is on disk (or download=True and the network allows), else None."""
    from torchvision.datasets import CIFAR10
    root = Path(root or data_root())
    try:
        return CIFAR10(str(root), train=train, download=download, transform=cifar10_transform(train))
    except (RuntimeError, OSError):
        return None


def image_folder(root: Path | str, image_size: int = 32) -> Dataset:
    """Any folder of class sub-folders of images (torchvision ImageFolder), resized to image_size."""
    from torchvision import datasets, transforms
    transform = transforms.Compose([transforms.Resize((image_size, image_size)), transforms.ToTensor()])
    return datasets.ImageFolder(str(root), transform=transform)


def make_loader(dataset: Dataset, batch_size: int, ctx, shuffle: bool = True, drop_last: bool = True,
                num_workers: int = 0, seed: int = 0, pin_memory: bool = False):
    """(loader, sampler): each rank reads its own 1/world_size of the data, batch_size samples a step."""
    sampler = None
    if ctx.world_size > 1:
        sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank,
                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                        shuffle=shuffle and sampler is None, drop_last=drop_last,
                        num_workers=num_workers, pin_memory=pin_memory,
                        persistent_workers=num_workers > 0,
                        generator=torch.Generator().manual_seed(seed))
    return loader, sampler


def forever(loader, sampler=None) -> Iterator:
    """Batches without end, calling sampler.set_epoch at each new epoch so every epoch reshuffles."""
    epoch = 0
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


class DeviceBatches:
    """The whole dataset resident on the device; each rank draws its shard's batches with no copies.

    The fast path when the data fits in memory: no workers, no host-to-device transfer per step.
    The same index partition as DistributedSampler(drop_last=True).
    """

    def __init__(self, dataset: TensorDataset, batch_size: int, ctx, seed: int = 0, shuffle: bool = True):
        self.images, self.labels = (t.to(ctx.device) for t in dataset.tensors)
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.per_rank = len(self.labels) // ctx.world_size

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        if self.shuffle:
            order = torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(len(self.labels))
        mine = order[: self.per_rank * self.world_size][self.rank::self.world_size]
        return mine.to(self.images.device)

    def __iter__(self):
        epoch = 0
        while True:
            indices = self.epoch_indices(epoch)
            for start in range(0, len(indices) - self.batch_size + 1, self.batch_size):
                chosen = indices[start:start + self.batch_size]
                yield self.images[chosen], self.labels[chosen]
            epoch += 1
