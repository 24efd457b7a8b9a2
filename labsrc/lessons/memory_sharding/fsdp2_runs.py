"""The hand-written per-parameter FSDP trains the small transformer on ranks; one process on whole batches is the
reference, step by step: gradients before each step and parameters after it, bytes moved and full weights alive."""
from __future__ import annotations

import copy

import torch
from torch import nn

from labsrc.lessons.memory_sharding.fsdp2_by_hand import cast_floats, shard_model
from labsrc.lessons.memory_sharding.transformer import loss_of, tiny_transformer
from labsrc.lessons.memory_sharding.zero import Traffic

WRAP = (nn.Linear, nn.Embedding)  # sharded module types; RMSNorm weights stay whole on every rank


def make_optimizer(name: str, parameters, lr: float) -> torch.optim.Optimizer:
    """'adamw' or 'sgd' (with momentum): plain torch optimizers over whatever parameters they are given."""
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr, momentum=0.9)
    raise ValueError(f"optimizer {name!r}: choose 'adamw' or 'sgd'")


def _mixed_precision_copy(master: nn.Module, compute_dtype) -> nn.Module:
    """A copy computing as the sharded model does: wrapped modules' weights and float inputs in compute_dtype,
    other modules' float inputs in fp32."""
    compute = copy.deepcopy(master)
    if compute_dtype is None:
        return compute
    for module in compute.modules():
        if isinstance(module, WRAP):
            module.to(compute_dtype)
            module.register_forward_pre_hook(lambda module, args: cast_floats(args, compute_dtype))
        elif any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(lambda module, args: cast_floats(args, torch.float32))
    return compute


def reference_run(batches, compute_dtype, optimizer: str, lr: float) -> dict:
    """One process on whole batches, fp32 master weights: {"gradients": [{name: fp32}], "parameters": [...]}."""
    master = tiny_transformer()
    compute = _mixed_precision_copy(master, compute_dtype)
    step_with = make_optimizer(optimizer, master.parameters(), lr)
    gradients, parameters = [], []
    for tokens, targets in batches:
        with torch.no_grad():
            for low, high in zip(compute.parameters(), master.parameters()):
                low.copy_(high)
        compute.zero_grad()
        loss_of(compute(tokens), targets).backward()
        for low, high in zip(compute.parameters(), master.parameters()):
            high.grad = low.grad.float()
        gradients.append({name: p.grad.clone() for name, p in master.named_parameters()})
        step_with.step()
        step_with.zero_grad()
        parameters.append({name: p.detach().clone() for name, p in master.named_parameters()})
    return {"gradients": gradients, "parameters": parameters}


def _gap(gathered: dict, reference: dict) -> float:
    return max(float((gathered[name] - value).abs().max()) for name, value in reference.items())


def hand_fsdp_run(ctx, batches, compute_dtype, optimizer: str, lr: float, reference: dict) -> dict:
    """Train the sharded transformer on this rank's slice of every batch, against `reference` (reference_run's).

    Per step: the largest gap of the averaged gradients (gathered to full size) and of the parameters; gathered
    bytes alive after forward and after backward; the largest gathered bytes alive at once during forward.
    Bytes sent per collective over all steps, and what the optimizer saw (shapes and dtypes of every .grad).
    "trace": the first step's (event, module, gathered bytes alive) list, in the order the hooks ran.
    """
    model = tiny_transformer()
    traffic = Traffic()
    fsdp = shard_model(model, WRAP, compute_dtype, traffic)
    step_with = make_optimizer(optimizer, model.parameters(), lr)
    steps, first_trace = [], []
    for index, (tokens, targets) in enumerate(batches):
        fsdp.trace.clear()
        tokens = tokens.chunk(ctx.world_size)[ctx.rank]
        targets = targets.chunk(ctx.world_size)[ctx.rank]
        loss = loss_of(model(tokens), targets)
        after_forward = fsdp.unsharded_bytes()
        loss.backward()
        fsdp.finish_gradient_sync()
        after_backward = fsdp.unsharded_bytes()
        first_trace = first_trace or list(fsdp.trace)
        grads_match = all(p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == torch.float32
                          for p in model.parameters())
        gradient_gap = _gap(fsdp.full_state_dict(gradients=True), reference["gradients"][index])
        step_with.step()
        step_with.zero_grad()
        steps.append({"gradient_gap": gradient_gap, "gap": _gap(fsdp.full_state_dict(), reference["parameters"][index]),
                      "after_forward": after_forward, "after_backward": after_backward, "grads_match": grads_match})
    sharded, padded = fsdp.sharded_numel()
    replicated = sum(p.numel() for p in fsdp.replicated)
    return {"steps": steps, "sent": dict(traffic.sent), "sharded": sharded, "padded": padded,
            "replicated": replicated, "peak_gathered": fsdp.peak_unsharded,
            "largest_unit": max(sum(p.padded_shape.numel() for p in unit) for unit in fsdp.units.values()),
            "names": sorted(fsdp.full_state_dict()), "trace": first_trace}

