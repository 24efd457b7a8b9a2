"""Models the labs share: a tiny CNN for CI and a ResNet-18 adapted to 32x32 inputs."""
from __future__ import annotations

import torch
from torch import nn


class TinyCNN(nn.Module):
    """Two conv blocks (BatchNorm optional), global pooling, a linear head. (N, 3, H, W) -> (N, classes).

    batch_norm=False makes every sample's output independent of the rest of its batch, which is what
    makes a sharded batch's averaged gradient equal to the whole batch's gradient exactly.
    """

    def __init__(self, num_classes: int = 10, width: int = 16, batch_norm: bool = True):
        super().__init__()

        def norm(channels: int) -> nn.Module:
            return nn.BatchNorm2d(channels) if batch_norm else nn.Identity()

        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=not batch_norm), norm(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=not batch_norm), norm(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 with a 3x3 stride-1 stem and no max-pool, as usual for 32x32 images."""
    from torchvision.models import resnet18
    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def resnet50(num_classes: int = 1000) -> nn.Module:
    """torchvision's ResNet-50 as published (224x224 inputs), randomly initialised."""
    from torchvision.models import resnet50 as build
    return build(weights=None, num_classes=num_classes)


MODELS = {"tiny_cnn": TinyCNN, "resnet18": resnet18_cifar, "resnet50": resnet50}


def build_model(name: str, num_classes: int = 10) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: use one of {sorted(MODELS)}")
    return MODELS[name](num_classes=num_classes)
