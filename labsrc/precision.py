"""Number formats and mixed precision measured: ranges, underflow, loss scaling, unscale_ before clipping, bytes saved."""
from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn import functional as F

from labsrc.train import autocast, set_tf32

FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def format_table() -> dict[str, dict]:
    """Range and precision of each format, and three numbers that show the difference."""
    table = {}
    for name, dtype in FORMATS.items():
        info = torch.finfo(dtype)
        table[name] = {
            "bits": info.bits, "max": info.max, "smallest_normal": info.tiny, "eps": info.eps,
            "1 + 2^-9": torch.tensor(1 + 2**-9, dtype=dtype).item(),  # needs 9 mantissa bits
            "70000": torch.tensor(70000.0, dtype=dtype).item(),  # fp16 tops out at 65504
            "1e-8": torch.tensor(1e-8, dtype=dtype).item(),  # below fp16's smallest subnormal (6e-8)
        }
    return table


def small_model(seed: int = 0, width: int = 64) -> nn.Module:
    """(N, 32) -> (N, 10): a model small enough to train in seconds on a CPU."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def toy_batch(size: int = 64, seed: int = 0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(size, 32, generator=generator).to(device),
            torch.randint(10, (size,), generator=generator).to(device))


def _gradients(model) -> list[torch.Tensor]:
    return [p.grad.detach().float().clone() for p in model.parameters()]


def underflow(loss_factor: float = 1e-6, scale: float = 2.0**16, device="cpu") -> dict:
    """Fraction of gradient elements that fp16 flushes to zero, without and with loss scaling.

    A small loss (loss_factor) makes small gradients, as late in training. Under fp16 autocast the
    backward of the fp16 matmuls computes in fp16, where anything below 6e-8 becomes 0. Multiplying the
    loss by `scale` (what GradScaler does) lifts the gradients into fp16's range; dividing by the scale
    afterwards, in fp32, gives them back.
    """
    images, labels = toy_batch(device=device)
    results = {}
    reference_model = small_model().to(device)
    (F.cross_entropy(reference_model(images), labels) * loss_factor).backward()
    reference = _gradients(reference_model)
    alive = sum(int((g != 0).sum()) for g in reference)
    for name, multiplier in [("fp16, no scaling", 1.0), ("fp16, loss scaled", scale)]:
        model = small_model().to(device)
        with torch.amp.autocast(device_type=torch.device(device).type, dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels) * loss_factor
        (loss * multiplier).backward()
        grads = [g / multiplier for g in _gradients(model)]
        lost = sum(int(((g == 0) & (r != 0)).sum()) for g, r in zip(grads, reference))
        error = max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, reference))
        results[name] = {"lost_fraction": lost / alive, "relative_error": error}
    return results


def scaler_trace(steps: int = 24, overflow_steps: tuple = (7, 15), growth_interval: int = 3,
                 init_scale: float = 2.0**10, device="cpu") -> list[dict]:
    """Train with fp16 autocast + GradScaler; at overflow_steps an input of 1e5 overflows fp16.

    Per step: the scale used, whether optimizer.step() was skipped (the scale fell), and the loss.
    The scale doubles after `growth_interval` clean steps and halves at every inf/NaN gradient.
    """
    model = small_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=init_scale, growth_interval=growth_interval)
    trace = []
    for step in range(steps):
        images, labels = toy_batch(seed=step, device=device)
        if step in overflow_steps:
            images = images * 1e5  # activations beyond fp16's 65504: inf in forward, inf gradients
        optimizer.zero_grad(set_to_none=True)
        with torch.amp.autocast(device_type=torch.device(device).type, dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
        used = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        trace.append({"step": step, "scale": used, "skipped": scaler.get_scale() < used,
                      "loss": loss.item(), "injected_overflow": step in overflow_steps})
    return trace


def clipping_with_and_without_unscale(max_norm: float = 1.0, scale: float = 2.0**12, device="cpu") -> dict:
    """Gradient norm that clip_grad_norm_ sees on scaled gradients vs after scaler.unscale_(optimizer)."""
    norms = {}
    for unscale_first in (False, True):
        model = small_model().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=scale)
        images, labels = toy_batch(device=device)
        with torch.amp.autocast(device_type=torch.device(device).type, dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
        scaler.scale(loss).backward()
        if unscale_first:
            scaler.unscale_(optimizer)
        seen = nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
        clipped = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()])).item()
        scaler.step(optimizer)
        scaler.update()
        norms["with unscale_" if unscale_first else "without unscale_"] = {
            "norm_seen_by_clip": seen, "norm_applied": clipped / (1.0 if unscale_first else scale)}
    norms["scale"] = scale
    return norms


def saved_activation_bytes(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, precision: str) -> int:
    """Bytes autograd keeps for backward during one forward in this precision (what activations cost)."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast(images.device, precision):
        loss = F.cross_entropy(model(images), labels)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return total


def mode_costs(make_model, images, labels, modes, steps: int = 5) -> dict[str, dict]:
    """Per precision mode: median step time, activation bytes saved for backward, peak GPU memory."""
    device = images.device
    results = {}
    for mode in modes:
        model = make_model().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16")
        set_tf32(mode == "tf32")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with autocast(device, mode):
                loss = F.cross_entropy(model(images), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        results[mode] = {"step_s": sorted(seconds[1:])[len(seconds[1:]) // 2],
                         "activation_bytes": saved_activation_bytes(model, images, labels, mode),
                         "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    set_tf32(False)
    return results
