"""What a training step costs per precision mode: the bytes autograd keeps for backward, step time, the loss scale."""
from __future__ import annotations

import statistics

import torch
from torch import nn
from torch.nn import functional as F

from labsrc.training import loop
from labsrc.training.timing import timed


def saved_activation_bytes(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                           precision: str) -> dict[str, int]:
    """Bytes autograd keeps for backward during one forward in this precision, by dtype, with the
    "total" bytes and the number of "elements" saved.

    images: (N, C, H, W); labels: (N,). Parameters saved for backward are counted too (autocast keeps
    16-bit copies of them), as they occupy memory until backward just as activations do.
    """
    dtype = loop.PRECISIONS[precision]  # None for fp32 and tf32: autocast off
    by_dtype: dict[str, int] = {}
    elements = 0

    def pack(tensor):  # autograd calls it for every tensor it saves for backward: count it, keep it as it is
        nonlocal elements
        key = str(tensor.dtype).replace("torch.", "")
        by_dtype[key] = by_dtype.get(key, 0) + tensor.numel() * tensor.element_size()
        elements += tensor.numel()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):  # unpack: the tensor as it is
        with torch.autocast(device_type=images.device.type, dtype=dtype, enabled=dtype is not None):
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
