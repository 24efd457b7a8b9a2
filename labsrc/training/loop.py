"""The one training loop the labs share: optional AMP, per-step records, no host sync between log points."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator

import torch
from torch import nn

from labsrc.core.runs import Record

PRECISIONS = {"fp32": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepLoss(Record):
    """This rank's loss on its own batch at one optimizer step."""

    KIND: ClassVar[str] = "step"
    step: int
    loss: float


@dataclass
class TrainConfig:
    """How one training run goes."""

    steps: int
    """Optimizer steps."""
    lr: float = 0.05
    """SGD learning rate."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 0.0
    """L2 penalty folded into SGD."""
    precision: str = "fp32"
    """fp32, tf32 (matmuls on tensor cores), bf16 or fp16 autocast (fp16 adds a GradScaler)."""
    log_every: int = 1
    """Losses are fetched to the host every this many steps (each fetch is one device sync)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up from lr/warmup_steps to lr, the common form. Goyal et al.'s warm-up for a
    scaled rate starts from the small-batch rate instead (notebook 06; the capstone's schedule does that)."""


def autocast(device: torch.device, precision: str):
    """torch.amp autocast for the precision (a disabled context for fp32 and tf32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is unknown: use one of {sorted(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    return torch.amp.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None)


@contextmanager
def tf32(enabled: bool):
    """TF32 for float32 matmuls and convolutions on (or off) inside the block, the previous settings restored after.

    Only Ampere and newer NVIDIA GPUs have TF32; elsewhere the flags change nothing.
    """
    try:
        previous = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    except RuntimeError:  # the newer fp32_precision API was used in this process: torch then refuses the old flags
        with _tf32_by_precision(enabled):
            yield
        return
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@contextmanager
def _tf32_by_precision(enabled: bool):
    """tf32() through torch's fp32_precision settings, for a process that has used them (torch mixes no APIs)."""
    settings = (torch.backends.cuda.matmul, torch.backends.cudnn.conv)
    previous = [setting.fp32_precision for setting in settings]
    for setting in settings:
        setting.fp32_precision = "tf32" if enabled else "ieee"
    try:
        yield
    finally:
        for setting, value in zip(settings, previous):
            setting.fp32_precision = value


def step(model: nn.Module, optimizer: torch.optim.Optimizer | None, images: torch.Tensor, labels: torch.Tensor,
         precision: str = "fp32", scaler: "torch.amp.GradScaler | None" = None, max_norm: float | None = None,
         loss_fn: Callable = nn.functional.cross_entropy) -> torch.Tensor:
    """One training step, the course's only one: forward under autocast, backward, optional clipping, update.

    images: (N, ...) on the model's device, labels: (N,). With a GradScaler the loss is scaled and the
    gradients unscaled before clipping; with optimizer=None only forward and backward run (gradients
    stay in .grad for inspection). Returns the detached loss, left on the device (no host sync).
    """
    with autocast(images.device, precision):
        loss = loss_fn(model(images), labels)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if optimizer is None:
        return loss.detach()
    if max_norm is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return loss.detach()


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay)


def train(model: nn.Module, batches: Iterator, ctx, cfg: TrainConfig, records=None,
          optimizer: torch.optim.Optimizer | None = None,
          loss_fn: Callable = nn.functional.cross_entropy) -> dict:
    """Train for cfg.steps on (images, labels) batches; returns a summary with per-step losses.

    records gets one "step" record per step (this rank's loss on its own batch) and progress records.
    Losses stay on the device and are fetched every cfg.log_every steps, so logging adds one sync per
    log point and none in between. TF32 is on for precision "tf32" only, and restored after.
    """
    with tf32(cfg.precision == "tf32"):
        return _train_steps(model, batches, ctx, cfg, records, optimizer or make_optimizer(model, cfg), loss_fn)


def _train_steps(model, batches, ctx, cfg: TrainConfig, records, optimizer, loss_fn) -> dict:
    """train()'s loop."""
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.precision == "fp16")
    scheduler = None
    if cfg.warmup_steps > 0:
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / cfg.warmup_steps))
    model.train()
    pending: list[torch.Tensor] = []
    losses: list[float] = []
    samples = 0
    start = time.perf_counter()
    for index in range(cfg.steps):
        images, labels = next(batches)
        images = images.to(ctx.device, non_blocking=True)
        labels = labels.to(ctx.device, non_blocking=True)
        loss = step(model, optimizer, images, labels, cfg.precision, scaler, loss_fn=loss_fn)
        if scheduler is not None:
            scheduler.step()
        samples += labels.shape[0]
        pending.append(loss)
        if (index + 1) % cfg.log_every == 0 or index + 1 == cfg.steps:
            fetched = torch.stack(pending).float().tolist()
            first = index + 1 - len(fetched)
            if records is not None:
                for offset, value in enumerate(fetched):
                    records.write(StepLoss(step=first + offset, loss=value))
                records.progress(index + 1, cfg.steps, unit="steps")
            losses += fetched
            pending.clear()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    seconds = time.perf_counter() - start
    return {"steps": cfg.steps, "losses": losses, "final_loss": losses[-1] if losses else None,
            "seconds": seconds, "samples_per_s_per_rank": samples / seconds if seconds > 0 else None}
