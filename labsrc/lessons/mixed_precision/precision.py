"""Number formats and mixed precision measured: ranges, underflow, loss scaling, unscale_ before clipping, bytes and time."""
from __future__ import annotations

import contextlib
import statistics

import torch
from torch import nn
from torch.nn import functional as F

from labsrc.training import loop
from labsrc.training.loop import autocast
from labsrc.training.timing import timed

FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def format_table() -> dict[str, dict]:
    """Range and precision of each format, and three numbers stored in it that show the difference."""
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


def rounding_error(dtype: torch.dtype, size: int = 4096, seed: int = 0) -> float:
    """Mean relative error of storing size standard-normal fp32 values in dtype (precision, measured)."""
    values = torch.randn(size, generator=torch.Generator().manual_seed(seed))
    return ((values.to(dtype).float() - values).abs() / values.abs()).mean().item()


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

    A small loss (loss_factor) makes small gradients, as late in training. Under fp16 autocast the
    backward of each fp16 matmul takes its incoming gradient in fp16, where anything below 6e-8 is 0.
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
        results[name] = {"zero_fraction": zeros / total, "lost_fraction": lost / alive, "relative_error": error,
                         "elements": total}
    return results


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
        loss = loop.step(model, optimizer, images, labels, "fp16", scaler)
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


def tf32_settings() -> dict[str, object]:
    """The process's TF32 switches as torch reports them (defaults since torch 1.12: matmul False, cuDNN True)."""
    settings = {"torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision()}
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # the newer spelling, where this torch has it
        settings["torch.backends.cuda.matmul.fp32_precision"] = torch.backends.cuda.matmul.fp32_precision
    return settings


def tf32_unavailable(device) -> str | None:
    """Why TF32 cannot be measured on device (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "TF32 is a mode of NVIDIA tensor cores; this device is not a CUDA GPU"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "TF32 needs an Ampere or newer GPU (compute capability 8.0); this one is older"
    return None


@contextlib.contextmanager
def float32_matmul_precision(precision: str):
    """torch.set_float32_matmul_precision(precision) inside the block ("highest": no TF32, "high": TF32),
    the previous setting restored after."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def tf32_matmul(device, size: int = 4096, repeats: int = 10, seed: int = 0) -> dict[str, dict]:
    """An fp32 (size, size) @ (size, size) matmul with TF32 off ("highest") and on ("high").

    Per setting: the largest error against the float64 product, relative to its mean magnitude, and the
    median seconds of repeats matmuls (after one warm-up), timed by the course's device-synchronised timer.
    """
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    left, right = (torch.randn(size, size, generator=generator, dtype=torch.float64).to(device) for _ in range(2))
    exact, left32, right32 = left @ right, left.float(), right.float()
    results = {}
    for name, precision in (("fp32", "highest"), ("tf32", "high")):
        with float32_matmul_precision(precision):
            product = left32 @ right32
            seconds = []
            for _ in range(repeats):
                with timed(device) as timer:
                    left32 @ right32
                seconds.append(timer["s"])
        error = ((product.double() - exact).abs().max() / exact.abs().mean()).item()
        results[name] = {"relative_error": error, "step_s": statistics.median(seconds)}
    return results


def saved_activation_bytes(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                           precision: str) -> dict[str, int]:
    """Bytes autograd keeps for backward during one forward in this precision, by dtype, with the
    "total" bytes and the number of "elements" saved.

    images: (N, C, H, W); labels: (N,). Parameters saved for backward are counted too (autocast keeps
    16-bit copies of them), as they occupy memory until backward just as activations do.
    """
    by_dtype: dict[str, int] = {}
    elements = 0

    def pack(tensor):
        nonlocal elements
        key = str(tensor.dtype).replace("torch.", "")
        by_dtype[key] = by_dtype.get(key, 0) + tensor.numel() * tensor.element_size()
        elements += tensor.numel()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast(images.device, precision):
        loss = F.cross_entropy(model(images), labels)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return {**by_dtype, "total": sum(by_dtype.values()), "elements": elements}


def mode_cost(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mode: str, steps: int,
              growth_interval: int = 2000) -> dict:
    """Train model on one batch for 1 + steps steps (the first a warm-up) with the course's step in this mode.

    images: (N, C, H, W) and labels: (N,) on the model's device. fp16 gets ONE GradScaler for all its
    steps, so its loss scale adapts from step to step (growth_interval: GradScaler's, 2000 by default).
    Returns per-step seconds (warm-up dropped), losses, and for fp16 the loss scale each step used and
    the steps whose parameters did not change (skipped), and on a GPU the peak memory allocated.
    TF32 is on for mode "tf32" only (matmuls and cuDNN convolutions), off otherwise, restored after.
    """
    device = images.device
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type, growth_interval=growth_interval) if mode == "fp16" else None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    seconds, losses, scales, skipped = [], [], [], []
    with loop.tf32(mode == "tf32"):
        for index in range(steps + 1):
            before = [p.detach().clone() for p in model.parameters()] if scaler is not None else []
            if scaler is not None:
                scales.append(scaler.get_scale())
            with timed(device) as timer:
                losses.append(loop.step(model, optimizer, images, labels, mode, scaler))
            seconds.append(timer["s"])
            if scaler is not None and all(torch.equal(b, p) for b, p in zip(before, model.parameters())):
                skipped.append(index)
    timed_s = seconds[1:]
    return {"step_s": statistics.median(timed_s), "step_times_s": timed_s,
            "losses": torch.stack(losses).float().tolist(), "loss_scales": scales, "skipped_steps": skipped,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def mode_costs(make_model, images, labels, modes, steps: int = 5, seed: int = 0,
               growth_interval: int = 2000) -> dict[str, dict]:
    """Per precision mode, the same model (same seed) trained on one batch by mode_cost, plus the bytes
    autograd keeps for backward (total, elements, by dtype).

    images: (N, C, H, W) and labels: (N,) on the device to measure.
    """
    results = {}
    for mode in modes:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = make_model().to(images.device)
        cost = mode_cost(model, images, labels, mode, steps, growth_interval)
        saved = saved_activation_bytes(model, images, labels, mode)
        results[mode] = {**cost, "activation_bytes": saved.pop("total"), "activation_elements": saved.pop("elements"),
                         "activation_bytes_by_dtype": saved}
    return results
