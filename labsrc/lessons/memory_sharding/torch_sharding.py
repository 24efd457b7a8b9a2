"""torch's production sharding: ZeroRedundancyOptimizer, FSDP2 fully_shard and its policies, distributed checkpoints."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from labsrc.lessons.memory_sharding.memory import deep_mlp, optimizer_state_bytes

SETTINGS = {  # key: (label, fully_shard keyword arguments builder)
    "reshard": "reshard_after_forward=True",
    "keep": "reshard_after_forward=False",
    "bf16": "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
    "offload": "CPUOffloadPolicy(pin_memory=False)",
}


def shard_options(setting: str, device: torch.device) -> dict:
    """fully_shard's keyword arguments for one of SETTINGS (pinned memory needs a GPU, so only there)."""
    if setting == "keep":
        return {"reshard_after_forward": False}
    if setting == "bf16":
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if setting == "offload":
        return {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")}
    return {"reshard_after_forward": True}


def local_bytes(tensors) -> int:
    """Bytes this rank holds: a DTensor's local shard, a plain tensor whole."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def sharded_model(depth: int, width: int, setting: str, device: torch.device, seed: int = 0) -> nn.Module:
    """deep_mlp with fully_shard on every Linear (first and last included), then on the root, which here
    owns no parameter of its own (every Linear is its own unit; ReLUs have none)."""
    model = deep_mlp(depth, width, seed=seed).to(device)
    options = shard_options(setting, device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **options)
    return fully_shard(model, **options)


def train_fsdp(ctx, depth: int, width: int, setting: str, batches, lr: float) -> dict:
    """Train a fully_shard model on this rank's slice of each (x, y); full parameters and bytes per rank after.

    Returns parameters gathered to full size, the first step's averaged gradients at full size, held bytes (parameters, gradients, optimizer state, each this
    rank's shards), bytes of parameters held between forward and backward, and seconds per step.
    """
    model = sharded_model(depth, width, setting, ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    seconds, between, first_gradients = [], 0, {}
    for x, y in batches:
        x, y = x.chunk(ctx.world_size)[ctx.rank].to(ctx.device), y.chunk(ctx.world_size)[ctx.rank].to(ctx.device)
        start = time.perf_counter()
        loss = nn.functional.mse_loss(model(x).float(), y)
        between = local_bytes(model.parameters())  # what forward left unsharded for backward
        loss.backward()
        if not first_gradients:  # the averaged gradient of the first step, gathered to full size (every rank)
            first_gradients = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float().cpu()
                               for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        seconds.append(time.perf_counter() - start)
    full = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()
            for name, p in model.named_parameters()}
    return {"parameters": full, "first_gradients": first_gradients, "parameter_bytes": local_bytes(model.parameters()),
            "gradient_bytes": local_bytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer_bytes": local_state_bytes(optimizer), "between_bytes": between,
            "step_s": min(seconds[1:] or seconds)}


def local_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return local_bytes(v for state in optimizer.state.values() for v in state.values()
                       if torch.is_tensor(v) and v.dim() > 0)


def train_unsharded(depth: int, width: int, batches, lr: float) -> dict:
    """The same training in one process on whole batches: the reference every sharded run must equal."""
    model = deep_mlp(depth, width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def train_zero_redundancy(ctx, depth: int, width: int, batches, lr: float) -> dict:
    """torch's ZeroRedundancyOptimizer (stage 1, whole parameters per rank) under DDP-style averaged gradients."""
    model = deep_mlp(depth, width)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
    for x, y in batches:
        x, y = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
        nn.functional.mse_loss(model(x), y).backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
            param.grad /= ctx.world_size
        optimizer.step()
        optimizer.zero_grad()
    return {"parameters": {name: p.detach().clone() for name, p in model.named_parameters()},
            "optimizer_bytes": optimizer_state_bytes(optimizer.optim)}


def save_sharded(ctx, folder: str, depth: int, width: int, batches, lr: float) -> dict:
    """Train a fully_shard model on n ranks, save model and optimizer with torch.distributed.checkpoint."""
    model = sharded_model(depth, width, "reshard", torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for x, y in batches:
        x, y = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
    return {"model": full_model_state(model), "optimizer": full_optimizer_state(model, optimizer)}


def load_sharded(ctx, folder: str, depth: int, width: int, lr: float) -> dict:
    """Load the checkpoint into a fully_shard model on m ranks; return the full model and optimizer states."""
    model = sharded_model(depth, width, "reshard", torch.device("cpu"), seed=99)  # other weights: all must change
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    steps = {float(s["step"]) for s in optimizer.state.values()}
    return {"model": full_model_state(model), "optimizer": full_optimizer_state(model, optimizer),
            "optimizer_steps": sorted(steps)}


def full_model_state(model: nn.Module) -> dict:
    """A full state dict on rank 0 (for inference), from the sharded model: every rank takes part in gathering."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state, _ = get_state_dict(model, [], options=options)
    return {name: tensor.clone() for name, tensor in state.items()} if dist.get_rank() == 0 else {}


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"<parameter>.<state>": full tensor} of the optimizer (exp_avg, exp_avg_sq, step) on rank 0, gathered."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    _, state = get_state_dict(model, optimizer, options=options)
    if dist.get_rank() != 0:
        return {}
    return {f"{name}.{key}": value.clone() for name, values in state["state"].items()
            for key, value in values.items() if torch.is_tensor(value)}
