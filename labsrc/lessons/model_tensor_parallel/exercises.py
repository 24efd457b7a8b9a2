"""Checkers for notebook 07's exercises: the column shard of a weight, and the row-parallel layer, forward and backward."""
from __future__ import annotations

from typing import Callable

import torch

from labsrc.core.exercises import ExerciseFailed, on_ranks, passed

SHAPES = ((8, 6), (12, 6), (6, 10))


def check_column_shard(column_shard: Callable) -> None:
    """column_shard(weight (out, in), rank, world_size) -> (out/n, in): rank's block of output features."""
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features, generator=generator)
        for world_size in [n for n in (2, 3) if out_features % n == 0 and in_features % n == 0]:
            shards = [column_shard(weight, rank, world_size) for rank in range(world_size)]
            for rank, shard in enumerate(shards):
                verdict = _column_verdict(weight, shard, rank, world_size)
                if verdict:
                    raise ExerciseFailed(f"weight {tuple(weight.shape)}, rank {rank} of {world_size}: {verdict}")
            shards[0].add_(1.0)
            if torch.equal(weight.chunk(world_size, 0)[0] + 0, shards[0]):
                raise ExerciseFailed("your shard is a view of the dense weight: writing to it changes the dense "
                                     "layer too; return a copy (.clone()).")
    passed("each rank holds its block of rows (output features) of torch's (out, in) weight, as its own copy")


def _column_verdict(weight: torch.Tensor, shard, rank: int, world_size: int) -> str | None:
    expected = weight.chunk(world_size, dim=0)[rank]
    if not isinstance(shard, torch.Tensor):
        return f"return a tensor, not {type(shard).__name__}."
    if shard.shape == weight.chunk(world_size, dim=1)[rank].shape and torch.equal(
            shard, weight.chunk(world_size, dim=1)[rank]) and shard.shape != expected.shape:
        return ("you cut dim 1 (input features): that is the row-parallel shard. A column-parallel layer keeps a "
                "block of output features, which are the rows of torch's (out, in) weight: dim 0.")
    if shard.shape != expected.shape:
        return f"shape {tuple(shard.shape)}, expected {tuple(expected.shape)} (out/n, in)."
    if not torch.equal(shard, expected):
        for other in range(world_size):
            if torch.equal(shard, weight.chunk(world_size, dim=0)[other]):
                return f"this is rank {other}'s block: rank r holds rows [r*out/n, (r+1)*out/n)."
        return "the values are not a contiguous block of rows of the weight."
    return None


UNTRACKED = "an autograd kernel was not registered"
"""torch's warning when backward runs through an in-place c10d collective that autograd cannot see."""


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().requires_grad_()


def _row_forward_rank(ctx, row_parallel_forward: Callable) -> str | None:
    """On one rank: the learner's layer on this rank's slice against the dense layer, forward and backward."""
    import warnings
    n = ctx.world_size
    generator = torch.Generator().manual_seed(1)
    dense = torch.nn.Linear(8, 6)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(6, 8, generator=generator))
        dense.bias.copy_(torch.randn(6, generator=generator))
    x = torch.randn(3, 5, 8, generator=generator, requires_grad=True)
    probe = torch.randn(3, 5, 6, generator=generator)
    x_slice = _leaf(x.chunk(n, dim=-1)[ctx.rank])
    weight_shard, bias = _leaf(dense.weight.chunk(n, dim=1)[ctx.rank]), _leaf(dense.bias)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = row_parallel_forward(x_slice, weight_shard, bias)
        expected = dense(x)
        partial = (x_slice @ weight_shard.T).detach()
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and got.requires_grad:
            (got * probe).sum().backward()
    (expected * probe).sum().backward()
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return f"expected an output of shape {tuple(expected.shape)}, got {getattr(got, 'shape', type(got))}."
    verdict = _forward_verdict(got.detach(), expected.detach(), partial, dense.bias.detach(), n)
    if verdict:
        return verdict
    if any(UNTRACKED in str(w.message) for w in caught):
        return ("the forward is right, but autograd cannot see dist.all_reduce (torch warns: 'an autograd kernel "
                "was not registered ... silently incorrect'): put the sum in a torch.autograd.Function, Megatron's "
                "g, whose backward says what the sum's gradient is.")
    if x_slice.grad is None or weight_shard.grad is None or bias.grad is None:
        return "no gradient reached x_slice, weight_shard or bias: keep the output connected to them (no .detach())."
    return _backward_verdict({"x_slice": (x_slice.grad, x.grad.chunk(n, dim=-1)[ctx.rank]),
                              "weight_shard": (weight_shard.grad, dense.weight.grad.chunk(n, dim=1)[ctx.rank]),
                              "bias": (bias.grad, dense.bias.grad)}, n)


def _forward_verdict(got, expected, partial, bias, n: int) -> str | None:
    if torch.allclose(got, expected, atol=1e-5):
        return None
    if torch.allclose(got, partial + bias, atol=1e-5) or torch.allclose(got, partial, atol=1e-5):
        return ("your output is only this rank's partial product x_slice @ weight_shard.T: the ranks' partial "
                "products must be summed with dist.all_reduce (the missing all-reduce of the row-parallel layer).")
    if torch.allclose(got, expected - bias, atol=1e-5):
        return "the bias is missing: add it once, after the all_reduce."
    times = 1 + float(((got - expected).reshape(-1, bias.numel()).mean(0) * bias).sum() / (bias * bias).sum())
    if torch.allclose(got, expected + (times - 1) * bias, atol=1e-4):
        return (f"on {n} ranks the bias is counted {times:.3g} times: add it once, after the all_reduce, not on every "
                "rank before it (and not scaled by a fixed world size).")
    return f"on {n} ranks the output differs from the dense layer's by {float((got - expected).abs().max()):.3g}."


def _backward_verdict(pairs: dict, n: int) -> str | None:
    for name, (got, expected) in pairs.items():
        if torch.allclose(got, expected, atol=1e-4):
            continue
        ratio = float((got * expected).sum() / (expected * expected).sum())
        if abs(ratio - n) < 1e-3:
            return (f"the gradient of {name} is {n} times the dense layer's: the backward of your sum over ranks "
                    "all-reduces the gradient again (torch.distributed.nn.functional.all_reduce does). Every rank "
                    "already holds the whole output's gradient: g's backward is the identity.")
        if abs(ratio - 1 / n) < 1e-3 and name == "bias":
            return (f"the gradient of {name} is 1/{n} of the dense layer's: is the bias scaled by 1/n before the "
                    "sum? Add the whole bias once, after it.")
        if abs(ratio - 1 / n) < 1e-3:
            return (f"the gradient of {name} is 1/{n} of the dense layer's: does the backward of your sum over "
                    f"ranks divide by {n} (an average)? Every rank already holds the whole output's gradient: g's "
                    "backward is the identity.")
        return f"the gradient of {name} differs from the dense layer's by {float((got - expected).abs().max()):.3g}."
    return None


def check_row_parallel_forward(row_parallel_forward: Callable, world_sizes: tuple[int, ...] = (2, 4)) -> None:
    """row_parallel_forward(x_slice (..., in/n), weight_shard (out, in/n), bias (out,)) -> (..., out) on every
    rank, equal to the dense Linear on the whole x, and its backward: the gradients of x_slice, weight_shard
    and bias equal the dense layer's, cut the same way. Run on forked gloo ranks at each world size."""
    for world_size in world_sizes:
        on_ranks(_row_forward_rank, world_size, (row_parallel_forward,), timeout_s=60)
    passed(f"on {' and '.join(map(str, world_sizes))} ranks the partial products summed by all_reduce, plus the "
           "bias once, equal the dense layer's output, and backward gives the dense layer's gradients")
