"""Checkers for notebook 07's exercises: the column shard of a weight, and the row-parallel layer's forward."""
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


def _row_forward_rank(ctx, row_parallel_forward: Callable) -> str | None:
    """On one rank: the learner's forward on this rank's slice against the dense layer's output."""
    generator = torch.Generator().manual_seed(1)
    dense = torch.nn.Linear(8, 6)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(6, 8, generator=generator))
        dense.bias.copy_(torch.randn(6, generator=generator))
    x = torch.randn(3, 5, 8, generator=generator)
    x_slice = x.chunk(ctx.world_size, dim=-1)[ctx.rank]
    weight_shard = dense.weight.detach().chunk(ctx.world_size, dim=1)[ctx.rank].clone()
    with torch.no_grad():
        got = row_parallel_forward(x_slice, weight_shard, dense.bias.detach().clone())
        expected = dense(x)
        partial = x_slice @ weight_shard.T
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return f"expected an output of shape {tuple(expected.shape)}, got {getattr(got, 'shape', type(got))}."
    if torch.allclose(got, expected, atol=1e-5):
        return None
    if torch.allclose(got, partial + dense.bias, atol=1e-5) or torch.allclose(got, partial, atol=1e-5):
        return ("your output is only this rank's partial product x_slice @ weight_shard.T: the ranks' partial "
                "products must be summed with dist.all_reduce (the missing all-reduce of the row-parallel layer).")
    if torch.allclose(got, expected + (ctx.world_size - 1) * dense.bias, atol=1e-5):
        return (f"the bias is counted {ctx.world_size} times: add it once, after the all_reduce, not on every "
                "rank before it.")
    if torch.allclose(got, expected - dense.bias, atol=1e-5):
        return "the bias is missing: add it once, after the all_reduce."
    return f"output differs from the dense layer's by {float((got - expected).abs().max()):.3g}."


def check_row_parallel_forward(row_parallel_forward: Callable, world_size: int = 2) -> None:
    """row_parallel_forward(x_slice (..., in/n), weight_shard (out, in/n), bias (out,)) -> (..., out) on
    every rank, equal to the dense Linear on the whole x; run on forked gloo ranks."""
    on_ranks(_row_forward_rank, world_size, (row_parallel_forward,), timeout_s=60)
    passed(f"on {world_size} ranks the partial products summed by all_reduce, plus the bias once, equal the "
           "dense layer's output")
