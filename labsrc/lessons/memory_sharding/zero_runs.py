"""Training runs of the hand-written ZeRO stages on this rank: bytes held, bytes sent, parameters against one process."""
from __future__ import annotations

import torch
from torch import nn

from labsrc.lessons.memory_sharding.memory import (FP32, MIXED, deep_mlp, held_bytes, live_storages,
                                                   optimizer_state_bytes, storage_bytes)
from labsrc.lessons.memory_sharding.zero import ShardedOptimizer, Traffic, all_reduce_counted, flatten, unflatten_into
from labsrc.lessons.memory_sharding.zero3 import FullyShardedModel, ShardedLayer


def make_batches(steps: int, batch: int, inputs: int = 16, outputs: int = 4, seed: int = 0) -> list:
    """[(x (batch, inputs), y (batch, outputs))] the same on every rank; each rank trains on its slice."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, inputs, generator=generator), torch.randn(batch, outputs, generator=generator))
            for _ in range(steps)]


def unsharded_trajectory(depth: int, width: int, batches, lr: float) -> list[dict]:
    """Parameters after every AdamW step of one process on whole batches: the reference."""
    model = deep_mlp(depth, width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    trajectory = []
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        trajectory.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return trajectory


def unsharded_gradients(depth: int, width: int, batches, lr: float) -> list[dict]:
    """The whole-batch gradient of every parameter before each AdamW step of one process: the reference that
    every rank's averaged gradient shard must equal (AdamW's update barely changes when a gradient is scaled,
    so a parameter comparison alone would miss a gradient summed but not averaged)."""
    model = deep_mlp(depth, width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    gradients = []
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        gradients.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return gradients


def shard_gap(shard: torch.Tensor, reference: list[torch.Tensor], ctx) -> float:
    """Largest |this rank's (padded/n,) gradient shard - the same slice of the flattened reference gradients|."""
    expected = flatten(reference, ctx.world_size, torch.float32).view(ctx.world_size, -1)[ctx.rank]
    return float((shard.detach().float() - expected).abs().max())


def _local(ctx, x, y):
    return x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]


def ddp_by_hand(ctx, depth: int, width: int, batches, lr: float, traffic: Traffic) -> dict:
    """Stage 0: every rank holds everything, gradients all-reduced as one flat buffer. Returns bytes held."""
    model = deep_mlp(depth, width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    held = {}
    for x, y in batches:
        x, y = _local(ctx, x, y)
        nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        flat = flatten(grads, ctx.world_size)
        all_reduce_counted(flat, traffic)
        unflatten_into(flat / ctx.world_size, grads)
        held = {"parameters": held_bytes(model.parameters()), "gradients": storage_bytes(grads),
                "optimizer": optimizer_state_bytes(optimizer)}
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return {"held": held, "layout": FP32.key}


def sharded_optimizer_run(ctx, stage: int, depth: int, width: int, batches, lr: float, traffic: Traffic,
                          dtype=torch.float32, trajectory=None, gradients=None, measure_memory: bool = True) -> dict:
    """Stage 1 or 2 with ShardedOptimizer; bytes held measured after gradient sync (from the second step, when
    the optimizer state exists), gradients as every tensor allocated by backward and the sync and still alive; the largest gap to the reference after each step (fp32 only), and, given
    the reference `gradients`, the gap of this rank's averaged gradient shard before each step."""
    model = deep_mlp(depth, width).to(dtype)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, traffic=traffic, lr=lr)
    held, gaps, gradient_gaps = {}, [], []
    for index, (x, y) in enumerate(batches):
        x, y = _local(ctx, x.to(dtype), y.to(dtype))
        last = measure_memory and index == len(batches) - 1  # read on the last step only (a census takes ~0.1 s)
        before = live_storages() if last else {}
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.synchronize_gradients()
        if last:  # every tensor backward and the sync allocated and left alive, wherever it is kept
            after = live_storages([p.grad for p in model.parameters() if p.grad is not None])
            held = {"parameters": held_bytes(model.parameters()),
                    "gradients": sum(nbytes for address, nbytes in after.items() if address not in before),
                    "optimizer": optimizer.state_bytes()}
        if gradients is not None:
            reference = [gradients[index][name] for name, _ in model.named_parameters()]
            gradient_gaps.append(shard_gap(optimizer.gradient_shard, reference, ctx))
        optimizer.step()
        optimizer.zero_grad()
        if trajectory is not None:
            gaps.append(largest_gap(dict(model.named_parameters()), trajectory[index]))
    return {"held": held, "gaps": gaps, "gradient_gaps": gradient_gaps,
            "layout": MIXED.key if dtype != torch.float32 else "fp32_master"}


def fully_sharded_run(ctx, depth: int, width: int, batches, lr: float, traffic: Traffic,
                      compute_dtype=None, trajectory=None, gradients=None) -> dict:
    """Stage 3 with FullyShardedModel: bytes held, full weights alive between forward and backward, gaps of the
    parameters after each step and (given the reference `gradients`) of each layer's averaged gradient shard."""
    model = FullyShardedModel(deep_mlp(depth, width), traffic, compute_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    held, gaps, gradient_gaps, alive = {}, [], [], []
    for index, (x, y) in enumerate(batches):
        x, y = _local(ctx, x, y)
        loss = nn.functional.mse_loss(model(x), y)
        alive.append(model.full_weights_alive())
        loss.backward()
        model.finish_gradient_sync()
        if gradients is not None:
            gradient_gaps.append(max(shard_gap(layer.shard.grad, [gradients[index][f"{position}.{name}"]
                                                                   for name in layer.names], ctx)
                                     for position, layer in enumerate(model.layers)
                                     if isinstance(layer, ShardedLayer)))
        held = {"parameters": held_bytes(model.parameters()),
                "gradients": storage_bytes(p.grad for p in model.parameters()),
                "optimizer": optimizer_state_bytes(optimizer)}
        optimizer.step()
        optimizer.zero_grad()
        if trajectory is not None:
            gaps.append(largest_gap(model.full_state_dict(), trajectory[index]))
    return {"held": held, "gaps": gaps, "gradient_gaps": gradient_gaps, "alive_after_forward": max(alive),
            "layout": FP32.key}


def largest_gap(parameters: dict, reference: dict) -> float:
    """Largest |parameter - reference| over every parameter (names as in deep_mlp)."""
    return max(float((parameters[name].detach().float() - value).abs().max()) for name, value in reference.items())
