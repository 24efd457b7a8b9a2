"""Checker for notebook 00's exercise: mean_over_ranks(tensor), the first function that runs on several ranks."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from labsrc.core.exercises import ExerciseFailed, on_ranks, passed

WORLD_SIZES = (2, 3)  # 3 as well: a function that divides by a fixed 2 is right on 2 ranks only
SHAPE = (2, 3)


def rank_input(rank: int) -> torch.Tensor:
    """Rank r's tensor (2, 3): different on every rank, so mean, sum and a rank's own values all differ."""
    return torch.arange(6, dtype=torch.float32).reshape(SHAPE) * (rank + 1) + 10 * rank


def classify(got, rank: int, world_size: int) -> str:
    """What one rank's returned value is: mean, sum, sum/k (k a fixed divisor), own, own/n, none, shape or other."""
    inputs = [rank_input(r) for r in range(world_size)]
    total = torch.stack(inputs).sum(0)
    if got is None:
        return "none"
    if not isinstance(got, torch.Tensor):
        return f"type {type(got).__name__}"
    if got.shape != total.shape:
        return f"shape {tuple(got.shape)}"
    got = got.detach().float()
    if torch.allclose(got, total / world_size):
        return "mean"
    if torch.allclose(got, total):
        return "sum"
    for divisor in range(2, 9):
        if torch.allclose(got, total / divisor):
            return f"divided by {divisor}"
    if torch.allclose(got, inputs[rank]):
        return "own"
    if torch.allclose(got, inputs[rank] / world_size):
        return "own divided"
    return "other"


def _mean_rank(ctx, mean_over_ranks: Callable) -> str | None:
    """On one rank: run the learner's function, then rank 0 judges what every rank returned."""
    tensor = rank_input(ctx.rank)
    got = mean_over_ranks(tensor)
    facts = {"kind": classify(got, ctx.rank, ctx.world_size),
             "changed_input": not torch.equal(tensor, rank_input(ctx.rank))}
    every = [None] * ctx.world_size
    dist.all_gather_object(every, facts)
    return verdict(every, ctx.world_size) if ctx.rank == 0 else None


def verdict(every: list[dict], world_size: int) -> str | None:
    """None when every rank returned the mean and kept its input, else what is wrong, by name."""
    kinds = [facts["kind"] for facts in every]
    changed = [rank for rank, facts in enumerate(every) if facts["changed_input"]]
    if changed:
        return (f"your function changed the caller's tensor on rank(s) {changed}: dist.all_reduce works in place, "
                "it writes the result into the tensor you pass. All-reduce a copy (tensor.clone()) and return it.")
    if kinds == ["mean"] * world_size:
        return None
    unfinished = [rank for rank, kind in enumerate(kinds) if kind == "own divided"]
    if unfinished:
        return (f"rank(s) {unfinished} returned their own tensor divided by the world size: the other ranks' values "
                "had not arrived when you read it. Divide after dist.all_reduce has returned, not before it (with "
                "async_op=True, the all_reduce has finished only after .wait() on the handle it returns). Use "
                "dist.all_reduce: dist.reduce delivers to one rank only.")
    if kinds[0] in ("mean", "sum") and any(kind != kinds[0] for kind in kinds[1:]):
        return (f"only rank 0 holds the result (the other ranks returned: {kinds[1:]}): dist.reduce delivers to "
                "one rank (dst) only. Every rank needs the mean: use dist.all_reduce.")
    if set(kinds) == {"none"}:
        return ("you returned None: dist.all_reduce works in place and returns None (a Work handle with "
                "async_op=True), not the result. Return the tensor you reduced, divided by the world size.")
    if set(kinds) == {"sum"}:
        return (f"no division: every rank returned the sum over the {world_size} ranks. The mean is that sum "
                "divided by dist.get_world_size().")
    if len(set(kinds)) == 1 and kinds[0].startswith("divided by"):
        divisor = kinds[0].split()[-1]
        return (f"you divided by {divisor}, but this run has {world_size} ranks: divide by dist.get_world_size(), "
                "not a fixed number, so the function is right at every world size.")
    if all(kind.startswith("type") for kind in kinds):
        return (f"you returned a {kinds[0][5:]}, not a tensor: with async_op=True dist.all_reduce returns a Work "
                "handle; .wait() on it, then return the tensor it reduced (divided by the world size).")
    if set(kinds) == {"own"}:
        return ("every rank returned its own values unchanged: the all_reduce's result never reached what you "
                "returned (did you reduce a copy and return the original?).")
    if all(kind.startswith("shape") for kind in kinds):
        return (f"you returned shape {kinds[0][6:]}, not {SHAPE}: the mean over ranks is element by element, "
                "one value per element of the input (do not average the elements themselves, e.g. with .mean()).")
    return f"expected every rank to return the mean, shape {SHAPE}, float32; the ranks returned: {kinds}."


def check_mean_over_ranks(mean_over_ranks: Callable) -> None:
    """mean_over_ranks(tensor (2, 3)) -> (2, 3), the element-wise mean over ranks on every rank, the input kept;
    run on 2 and then 3 forked gloo ranks."""
    for world_size in WORLD_SIZES:
        try:
            on_ranks(_mean_rank, world_size, (mean_over_ranks,), timeout_s=30)
        except ExerciseFailed as failure:
            raise ExerciseFailed(f"on {world_size} ranks: {str(failure).removeprefix('rank 0: ')}") from None
    passed(f"on {' and '.join(map(str, WORLD_SIZES))} ranks every rank returned the mean of all ranks' tensors, "
           "and every caller's tensor was left as it was")
