"""Checkers for notebook 01's exercises: averaging gradients by hand, and checking that parameters are in sync."""
from __future__ import annotations

import copy
import datetime
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from labsrc.core.exercises import ExerciseFailed, on_ranks, passed

WAIT = datetime.timedelta(seconds=20)
HANG_HINT = ("\nIf it hung: every rank must make the same collectives in the same order; a collective that one "
             "rank skips waits forever (bound it: dist.all_reduce(t, async_op=True).wait(timeout)).")


def small_model(seed: int = 0) -> nn.Module:
    """The same small MLP on every rank: (N, 6) -> (N, 3)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _on_ranks(check_rank, world_size: int, args: tuple, timeout_s: float) -> None:
    try:
        on_ranks(check_rank, world_size, args, timeout_s=timeout_s)
    except ExerciseFailed as failure:
        if "hung on a rank" in str(failure):
            raise ExerciseFailed(f"{failure}{HANG_HINT}") from None
        raise


def _named_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _gap(left: dict, right: dict, names) -> float:
    return max((left[name] - right[name]).abs().max().item() for name in names)


def _average_rank(ctx, average_gradients: Callable) -> str | None:
    """On one rank: backward on this rank's shard, the learner's average, compared with the full batch."""
    n = ctx.world_size
    generator = torch.Generator().manual_seed(1)
    inputs, labels = torch.randn(4 * n, 6, generator=generator), torch.randint(3, (4 * n,), generator=generator)
    model = small_model()
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(inputs), labels).backward()
    full = _named_gradients(reference)
    F.cross_entropy(model(inputs.chunk(n)[ctx.rank]), labels.chunk(n)[ctx.rank]).backward()
    local = _named_gradients(model)
    average_gradients(model)
    got = _named_gradients(model)
    if got.keys() != full.keys():
        return f"after your function the parameters {sorted(full.keys() - got.keys())} have no .grad: keep them."
    tolerance = 1e-6 + 1e-4 * max(g.abs().max().item() for g in full.values())
    close = lambda target, name: (got[name] - target[name]).abs().max().item() <= tolerance
    wrong = [name for name in full if not close(full, name)]
    if not wrong:
        return None
    scaled = lambda factor: {name: g * factor for name, g in full.items()}
    if all(close(scaled(n), name) for name in full):
        return (f"your gradients are {n} times the full-batch gradient: you summed over the ranks but did not "
                f"divide by the world size ({n}). Each rank's loss is a mean over its shard, so average.")
    if all(close(scaled(1 / n), name) for name in full):
        return (f"your gradients are 1/{n} of the full-batch gradient: you divided twice (or divided and then "
                f"used a mean). Sum with all_reduce(SUM), then divide once by the world size.")
    if all(close(local, name) for name in wrong):
        if len(wrong) == len(full):
            return ("every gradient is still this rank's own gradient: nothing was all-reduced into "
                    "parameter.grad (all_reduce works in place on the tensor you pass it).")
        return (f"{wrong} still hold this rank's own gradient: only some parameters were averaged; loop over "
                f"every parameter of the model (model.parameters()).")
    gap = _gap(got, full, wrong)
    return f"{wrong} differ from the full-batch gradient by up to {gap:.3g} (tolerance {tolerance:.1e})."


def check_average_gradients(average_gradients: Callable, world_size: int = 2, timeout_s: float = 30) -> None:
    """average_gradients(model): after backward on each rank's shard, every .grad becomes the full-batch
    gradient (the average over ranks). Runs on `world_size` forked gloo ranks."""
    _on_ranks(_average_rank, world_size, (average_gradients,), timeout_s)
    passed(f"on {world_size} ranks every gradient equals the full-batch gradient (summed over ranks, divided "
           f"by {world_size}), on every rank")


def _drifted(case: str, rank: int, world_size: int) -> nn.Module:
    """The model on this rank for one of SYNC_CASES, with that case's drift planted on one rank."""
    model = small_model()
    parameters = dict(model.named_parameters())
    last_rank = world_size - 1
    with torch.no_grad():
        bias = parameters["2.bias"]
        bias.copy_(torch.tensor([0.25, 0.5, 0.125]))  # exact in float32: sums do not round
        if case == "rank 0, first parameter" and rank == 0:
            parameters["0.weight"][0, 0] += 1e-3
        elif case == "last parameter" and rank == last_rank:
            bias[2] += 1e-3
        elif case == "one ulp" and rank == last_rank:
            weight = parameters["0.weight"]
            weight[1, 1] = torch.nextafter(weight[1, 1], torch.tensor(float("inf")))
        elif case == "swapped" and rank == last_rank:
            bias.copy_(torch.tensor([0.5, 0.25, 0.125]))
    return model


SYNC_CASES = ("identical", "rank 0, first parameter", "last parameter", "swapped", "one ulp")
SYNC_MISSED = {
    "rank 0, first parameter": "a drift of 1e-3 in the first parameter on rank 0 was missed",
    "last parameter": ("a drift of 1e-3 in the LAST parameter (2.bias) on the last rank was missed: compare every "
                       "parameter, not only some"),
    "one ulp": ("a drift of one float32 step (torch.nextafter) in 0.weight was missed: DDP keeps parameters "
                "bit-for-bit identical, so compare exactly (torch.equal or ==), not with allclose or a tolerance"),
    "swapped": ("two values swapped inside 2.bias on the last rank were missed: a summary of a parameter (its sum, "
                "norm or mean: a checksum) cannot see that; compare the values element by element"),
}


def _sync_rank(ctx, parameters_in_sync: Callable) -> str | None:
    """On one rank: every test case, the learner's verdict, and every rank's verdicts gathered."""
    for case in SYNC_CASES:
        model = _drifted(case, ctx.rank, ctx.world_size)
        answer = parameters_in_sync(model)
        if not isinstance(answer, (bool, torch.Tensor)) or (isinstance(answer, torch.Tensor) and answer.numel() != 1):
            return f"return True or False (got {type(answer).__name__})."
        verdicts = torch.zeros(ctx.world_size)
        verdicts[ctx.rank] = float(bool(answer))
        dist.all_reduce(verdicts, async_op=True).wait(WAIT)
        said = {rank: bool(v) for rank, v in enumerate(verdicts.tolist())}
        if len(set(said.values())) > 1:
            return (f"case '{case}': the ranks disagree ({said}). A rank cannot see another's parameters: compare "
                    "with a collective and combine the verdicts (e.g. all_reduce of a mismatch flag with MAX) so "
                    "every rank returns the same answer.")
        in_sync = said[0]
        if case == "identical" and not in_sync:
            return "every rank holds the same model, but your function returned False."
        if case != "identical" and in_sync:
            return SYNC_MISSED[case] + "."
    return None


def check_parameters_in_sync(parameters_in_sync: Callable, world_size: int = 2, timeout_s: float = 30) -> None:
    """parameters_in_sync(model) -> bool, the same on every rank: True iff every parameter is bit-for-bit
    equal on all ranks. Runs on forked gloo ranks with drifts planted on one rank."""
    _on_ranks(_sync_rank, world_size, (parameters_in_sync,), timeout_s)
    passed(f"on {world_size} ranks: True for identical models; False on every rank for a drift on rank 0, in the "
           "last parameter, for two swapped values and of one float32 step")
