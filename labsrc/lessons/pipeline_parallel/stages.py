"""The model a pipeline splits: a stack of equal blocks, cut into consecutive stages, and its unsplit gradients."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


def make_model(width: int, blocks: int, seed: int = 0) -> nn.Sequential:
    """blocks x (Linear(width, width), Tanh): every block costs the same, so equal cuts give equal stages."""
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)])
    finally:
        torch.random.set_rng_state(generator_state)


def make_batch(batch: int, width: int, seed: int = 0, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), both [batch, width], the same on every rank for a given seed."""
    generator = torch.Generator().manual_seed(1000 + seed)
    inputs = torch.randn(batch, width, generator=generator)
    targets = torch.randn(batch, width, generator=generator)
    return inputs.to(device), targets.to(device)


def block_ranges(blocks: int, parts: int) -> list[range]:
    """Which blocks each of `parts` consecutive parts holds (parts must divide blocks)."""
    if blocks % parts:
        raise ValueError(f"{blocks} blocks do not cut into {parts} equal parts")
    size = blocks // parts
    return [range(part * size, (part + 1) * size) for part in range(parts)]


def split_model(model: nn.Sequential, parts: int, device="cpu") -> list[tuple[range, nn.Sequential]]:
    """[(block indices, a copy of those blocks on device)] for each part, first to last."""
    return [(blocks, nn.Sequential(*[copy.deepcopy(model[i]) for i in blocks]).to(device))
            for blocks in block_ranges(len(model), parts)]


def full_batch_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error over every element: outputs and targets [batch, width]."""
    return F.mse_loss(outputs, targets)


def unsplit_gradients(model: nn.Sequential, inputs: torch.Tensor, targets: torch.Tensor) -> list[list[torch.Tensor]]:
    """Per block, its parameters' gradients after one backward of the whole batch through a copy of model."""
    reference = copy.deepcopy(model).to(inputs.device)
    full_batch_loss(reference(inputs), targets).backward()
    return [[p.grad.detach().clone() for p in block.parameters()] for block in reference]


def gradient_error(part: tuple[range, nn.Module], reference: list[list[torch.Tensor]]) -> float:
    """Largest |gradient - unsplit gradient| over a part's parameters (inf where a gradient is missing)."""
    blocks, module = part
    worst = 0.0
    for local, index in enumerate(blocks):
        for mine, expected in zip(module[local].parameters(), reference[index]):
            if mine.grad is None:
                return float("inf")
            worst = max(worst, (mine.grad - expected.to(mine.grad.device)).abs().max().item())
    return worst


def gradient_scale(parts: list[tuple[range, nn.Module]], reference: list[list[torch.Tensor]]) -> float:
    """The factor c that best fits gradients = c x unsplit gradients (least squares over the parts' parameters).

    1.0 when the loss is scaled right; m when each micro-batch's loss is not divided by m.
    """
    dot = norm = 0.0
    for blocks, module in parts:
        for local, index in enumerate(blocks):
            for mine, expected in zip(module[local].parameters(), reference[index]):
                if mine.grad is None:
                    return 0.0
                expected = expected.to(mine.grad.device)
                dot += (mine.grad * expected).sum().item()
                norm += (expected * expected).sum().item()
    return dot / norm


def assert_part_matches(part: tuple[range, nn.Module], reference: list[list[torch.Tensor]], **tolerance) -> None:
    """torch.testing.assert_close on every parameter gradient of the part against the unsplit model's."""
    blocks, module = part
    for local, index in enumerate(blocks):
        for mine, expected in zip(module[local].parameters(), reference[index]):
            assert mine.grad is not None, f"block {index} got no gradient"
            torch.testing.assert_close(mine.grad, expected.to(mine.grad.device), **tolerance)
