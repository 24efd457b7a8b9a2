"""Loss scaling measured: fp16 underflow cured by GradScaler, the loss-scale trace, unscale_ before clipping."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def small_model(seed: int = 0, width: int = 64) -> nn.Module:
    """(N, 32) -> (N, 10): a model small enough to train in milliseconds on a CPU."""
    with torch.random.fork_rng(devices=[]):  # seeded here, the caller's random state untouched
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, 10))


def toy_batch(size: int = 64, seed: int = 0, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(images (size, 32) float32, labels (size,) int64), the same for a seed in every process."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(size, 32, generator=generator).to(device),
            torch.randint(10, (size,), generator=generator).to(device))


def _gradients(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().float().clone() for p in model.parameters()]


def small_loss_gradients(dtype: torch.dtype | None, loss_factor: float, scaler_scale: float | None = None,
                         device="cpu") -> list[torch.Tensor]:
    """Gradients of loss_factor x cross-entropy under autocast(dtype) (None: plain fp32).

    With scaler_scale a torch.amp.GradScaler scales the loss before backward and unscale_ divides the
    gradients by the same scale afterwards, in fp32, as a training step does before clipping.
    """
    device = torch.device(device)
    images, labels = toy_batch(device=device)
    model = small_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with torch.amp.autocast(device_type=device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = F.cross_entropy(model(images), labels) * loss_factor
    if scaler_scale is None:
        loss.backward()
    else:
        scaler = torch.amp.GradScaler(device.type, init_scale=scaler_scale)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    return _gradients(model)


def underflow(loss_factor: float = 1e-6, scale: float = 2.0**16, device="cpu") -> dict[str, dict]:
    """Per mode: fraction of gradient elements exactly zero, of fp32's non-zero ones lost, and the error.

    relative_error: per parameter tensor, the largest |error| over that tensor's largest fp32 gradient; the
    largest over the tensors. median_error: the median over fp32's non-zero elements of |error| / |value|.

    A small loss (loss_factor) makes small gradients, as late in training. Under fp16 autocast the
    backward of each fp16 matmul takes its incoming gradient in fp16, where anything below about
    3e-8 (half of fp16's smallest subnormal, 2^-24) rounds to 0.
    GradScaler's scale (2^16 by default) lifts the gradients into range; bf16 has fp32's range.
    """
    reference = small_loss_gradients(None, loss_factor, device=device)
    total = sum(g.numel() for g in reference)
    alive = sum(int((g != 0).sum()) for g in reference)
    modes = {"fp32": (None, None), "fp16, no scaling": (torch.float16, None),
             "fp16 + GradScaler": (torch.float16, scale), "bf16, no scaling": (torch.bfloat16, None)}
    results = {}
    for name, (dtype, scaler_scale) in modes.items():
        grads = small_loss_gradients(dtype, loss_factor, scaler_scale, device)
        zeros = sum(int((g == 0).sum()) for g in grads)
        lost = sum(int(((g == 0) & (r != 0)).sum()) for g, r in zip(grads, reference))
        error = max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, reference))
        # per element: |error| / |fp32 value|, over fp32's non-zero elements; the median is the typical element
        each = torch.cat([((g - r).abs() / r.abs())[r != 0] for g, r in zip(grads, reference)])
        results[name] = {"zero_fraction": zeros / total, "lost_fraction": lost / alive, "relative_error": error,
                         "median_error": each.median().item(), "elements": total}
    return results


def logit_gradient(loss_factor: float = 1e-6, device="cpu") -> torch.Tensor:
    """The fp32 gradient that arrives at the logits (the last layer's output) from loss_factor x cross-entropy.

    Under fp16 autocast the logits are fp16, so this is the first gradient backward stores in fp16: if it
    rounds to 0 there, every gradient further back is 0 too.
    """
    device = torch.device(device)
    images, labels = toy_batch(device=device)
    logits = small_model().to(device)(images)
    logits.retain_grad()
    (F.cross_entropy(logits, labels) * loss_factor).backward()
    return logits.grad.detach()


def expected_scales(steps: int, overflow_steps, init_scale: float, growth_interval: int,
                    growth_factor: float = 2.0, backoff_factor: float = 0.5) -> list[float]:
    """The scale GradScaler should use at each step by its documented rule: x growth_factor after
    growth_interval clean steps in a row, x backoff_factor (and the count restarts) at every overflow."""
    scale, clean, scales = init_scale, 0, []
    for step in range(steps):
        scales.append(scale)
        if step in overflow_steps:
            scale, clean = scale * backoff_factor, 0
        else:
            clean += 1
            if clean == growth_interval:
                scale, clean = scale * growth_factor, 0
    return scales


def scaler_trace(steps: int = 24, overflow_steps: tuple = (7, 15), growth_interval: int = 3,
                 init_scale: float = 2.0**10, device="cpu") -> list[dict]:
    """Train with fp16 autocast + GradScaler; at overflow_steps an input x 1e5 overflows fp16.

    Per step: the scale used, whether the parameters changed (a skipped optimizer.step() leaves them
    as they were), whether the scale fell (GradScaler's own sign of a skip), and the loss.
    """
    device = torch.device(device)
    model = small_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=growth_interval)
    trace = []
    for index in range(steps):
        images, labels = toy_batch(seed=index, device=device)
        if index in overflow_steps:
            images = images * 1e5  # activations beyond fp16's 65504: inf in forward, inf gradients
        used = scaler.get_scale()
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad(set_to_none=True)
        with torch.amp.autocast(device_type=device.type, dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # skipped when a gradient holds inf or NaN
        scaler.update()  # x 0.5 after an overflow, x 2 after growth_interval clean steps
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        trace.append({"step": index, "scale": used, "scale_after": scaler.get_scale(), "parameters_changed": changed,
                      "skipped": scaler.get_scale() < used, "loss": loss.item(),
                      "injected_overflow": index in overflow_steps})
    return trace


def scaler_experiment(steps: int = 24, growth_interval: int = 3, overflow_steps: tuple = (7, 15),
                      init_scale: float = 2.0**10, device="cpu") -> dict:
    """scaler_trace beside the rule's prediction, with the counts a learner checks: steps whose
    parameters did not change, steps after which the scale fell, overflows injected, growths, back-offs."""
    trace = scaler_trace(steps, overflow_steps, growth_interval, init_scale, device)
    return {"trace": trace, "growth_interval": growth_interval,
            "expected": expected_scales(steps, overflow_steps, init_scale, growth_interval),
            "unchanged_steps": [r["step"] for r in trace if not r["parameters_changed"]],
            "backoff_steps": [r["step"] for r in trace if r["skipped"]],
            "injected_steps": [r["step"] for r in trace if r["injected_overflow"]],
            "growths": sum(r["scale_after"] > r["scale"] for r in trace),
            "backoffs": sum(r["scale_after"] < r["scale"] for r in trace)}


def clipping_with_and_without_unscale(max_norm: float = 0.1, scale: float = 2.0**12, device="cpu") -> dict:
    """clip_grad_norm_ on scaled gradients vs after scaler.unscale_(optimizer), on the same model and batch.

    Per case: the norm clip_grad_norm_ saw, and the norm of the gradient the optimizer applied, read
    from the parameters' .grad after scaler.step (which has unscaled them by then, in both cases).
    max_norm sits below the true gradient norm (about 0.3 here), so clipping engages.
    """
    device = torch.device(device)
    norms = {}
    for unscale_first in (False, True):
        model = small_model().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(device.type, init_scale=scale)
        images, labels = toy_batch(device=device)
        with torch.amp.autocast(device_type=device.type, dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
        scaler.scale(loss).backward()
        if unscale_first:
            scaler.unscale_(optimizer)
        seen = nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
        scaler.step(optimizer)  # unscales here if unscale_ was not called: the clipped gradient / scale
        scaler.update()
        applied = gradient_norm(model)
        norms["with unscale_" if unscale_first else "without unscale_"] = {
            "norm_seen_by_clip": seen, "norm_applied": applied}
    norms["scale"], norms["max_norm"] = scale, max_norm
    norms["true_norm"] = _unscaled_gradient_norm(device)
    return norms


def gradient_norm(model: nn.Module) -> float:
    """The 2-norm of all of model's .grad together, as clip_grad_norm_ measures it."""
    return torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()])).item()


def _unscaled_gradient_norm(device) -> float:
    """The gradient norm of the same model and batch with no GradScaler at all: what clipping should see."""
    model = small_model().to(device)
    images, labels = toy_batch(device=device)
    with torch.amp.autocast(device_type=device.type, dtype=torch.float16):
        loss = F.cross_entropy(model(images), labels)
    loss.backward()
    return gradient_norm(model)
