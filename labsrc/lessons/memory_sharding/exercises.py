"""Checkers for notebook 09's exercises: ZeRO-1's optimizer step, and the number of checkpoint segments for a depth."""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from labsrc.core.exercises import ExerciseFailed, on_ranks, passed
from labsrc.lessons.memory_sharding.memory import deep_mlp, predicted_saved_units
from labsrc.lessons.memory_sharding.zero import counted_collectives, flatten, padded_size

LR = 0.1


def check_choose_segments(choose_segments: Callable) -> None:
    """choose_segments(depth) -> k dividing depth with the fewest saved activations, k + depth/k blocks."""
    # 5, 7, 10 and 18: floor(sqrt(n)) does not divide them (math.isqrt is a plausible wrong answer).
    for depth in (1, 4, 5, 7, 9, 10, 12, 16, 18, 36, 48, 64):
        k = choose_segments(depth)
        if not isinstance(k, int) or isinstance(k, bool):
            raise ExerciseFailed(f"depth {depth}: return an int, not {type(k).__name__}.")
        if k < 1 or k > depth or depth % k:
            raise ExerciseFailed(f"depth {depth}: k = {k} does not divide the depth; checkpoint_sequential would "
                                 f"give the last segment the remainder. Choose among the divisors of {depth}.")
        best = min(predicted_saved_units(depth, d) for d in range(1, depth + 1) if depth % d == 0)
        if predicted_saved_units(depth, k) > best:
            hint = (" k = depth checkpoints every block: it keeps L inputs, as many as no checkpointing."
                    if k == depth else " k = 1 is one unchecked segment: every activation is kept."
                    if k == 1 else "")
            raise ExerciseFailed(f"depth {depth}: k = {k} keeps {predicted_saved_units(depth, k)} block outputs; "
                                 f"the best divisor keeps {best} (k + L/k is smallest near sqrt(L) = "
                                 f"{math.sqrt(depth):.1f}).{hint}")
    passed("k divides the depth L and keeps k + L/k block outputs, the fewest: near sqrt(L)")


def _setup(ctx, seed: int = 0):
    model = deep_mlp(1, 8, inputs=6, outputs=3, seed=seed)
    params = list(model.parameters())
    shard_size = padded_size(sum(p.numel() for p in params), ctx.world_size) // ctx.world_size
    master = flatten(params, ctx.world_size, torch.float32)[ctx.rank * shard_size:(ctx.rank + 1) * shard_size].clone()
    master.requires_grad_(True)
    return model, params, master, torch.optim.SGD([master], lr=LR)


def _reference(batches, rank: int, world_size: int, mode: str):
    """One process with SGD: mode 'average' (right), 'sum' (not divided), 'local' (this rank's slice only)."""
    model = deep_mlp(1, 8, inputs=6, outputs=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches:
        if mode == "local":
            x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        loss = nn.functional.mse_loss(model(x), y) * (world_size if mode == "sum" else 1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _zero1_rank(ctx, zero1_step: Callable) -> str | None:
    """Diagnose after the first step (every mistake shows there alone), then check a second step too; count the
    bytes sent, which must be DDP's: one reduce-scatter and one all-gather of the flat parameters."""
    generator = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)) for _ in range(2)]
    model, params, master, optimizer = _setup(ctx)
    start = torch.cat([p.detach().reshape(-1) for p in params])
    flat_bytes = padded_size(sum(p.numel() for p in params), ctx.world_size) * 4
    for step, (x, y) in enumerate(batches):
        x, y = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
        nn.functional.mse_loss(model(x), y).backward()
        with CommDebugMode() as calls, counted_collectives() as sent:  # calls: also a name imported before the check
            zero1_step(params, master, optimizer, ctx.rank, ctx.world_size)
        budget = 2 * flat_bytes * (ctx.world_size - 1) // ctx.world_size  # DDP's all-reduce, ring
        all_reduced = any("allreduce" in str(op) or "all_reduce" in str(op) for op in calls.get_comm_counts())
        over = sum(sent.values()) > 1.05 * budget
        if over or all_reduced:
            what = (f"sent {sum(sent.values())} bytes ({sent}), more than DDP's {budget}" if over else
                    "called an all-reduce")
            return (f"the step {what}: ZeRO-1 costs what DDP costs only with a reduce-scatter of the gradients (not "
                    "an all-reduce of all of them, which sends twice the gradient bytes) and one all-gather of the "
                    "updated shards.")
        for param in params:
            param.grad = None
        got = torch.cat([p.detach().reshape(-1) for p in params])
        verdict = _first_step_verdict(got, start, batches[:1], ctx) if step == 0 else None
        if verdict:
            return verdict
    if not torch.allclose(got, _reference(batches, ctx.rank, ctx.world_size, "average"), atol=1e-6):
        return "the first step was right, the second differs from one process's: does your step keep stale state?"
    return None


def _first_step_verdict(got: torch.Tensor, start: torch.Tensor, batches, ctx) -> str | None:
    if torch.equal(got, start):
        return ("the model's parameters never changed: after optimizer.step() on the master shard, all_gather every "
                "rank's shard and copy the result back into the parameters (unflatten_into).")
    rank, world_size = ctx.rank, ctx.world_size
    if torch.allclose(got, _reference(batches, rank, world_size, "average"), atol=1e-6):
        return None
    if torch.allclose(got, _reference(batches, rank, world_size, "sum"), atol=1e-6):
        return f"the step is {world_size} times too large: the reduce-scatter sums, divide by the world size."
    shard = -(-got.numel() // world_size)
    pieces = [slice(r * shard, (r + 1) * shard) for r in range(world_size)]
    if all(torch.allclose(got[piece], _reference(batches, r, world_size, "local")[piece], atol=1e-6)
           for r, piece in enumerate(pieces)):
        return ("each shard was stepped with its own rank's gradient only: reduce-scatter the flat gradients so "
                "that the shard you step on holds every rank's contribution (unsynchronised shards).")
    average = _reference(batches, rank, world_size, "average")
    if torch.allclose(got[pieces[rank]], average[pieces[rank]], atol=1e-6):
        return "this rank's own shard is right but the others are stale: all_gather every rank's updated shard."
    return "the parameters differ from one process training on the whole batch."


def check_zero1_step(zero1_step: Callable, world_size: int = 2) -> None:
    """zero1_step(params, master_shard, optimizer, rank, world_size): ZeRO-1's step, on forked gloo ranks."""
    on_ranks(_zero1_rank, world_size, (zero1_step,))
    passed(f"on {world_size} ranks the parameters equal one process's after 2 SGD steps: gradients reduce-scattered "
           f"and averaged, one shard stepped per rank, shards all-gathered back")
