"""Notebook 09's exercise checkers accept the reference solutions and reject planted mistakes, naming them."""
import math

import pytest
import torch
from torch.distributed import all_reduce as all_reduce_bound_early  # a name the byte counter cannot rewrap

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.memory_sharding import exercises as checkers
from labsrc.lessons.memory_sharding.zero import flatten, unflatten_into
from labsrc.techniques.collectives import all_gather, reduce_scatter


def test_choose_segments_solution_passes(capsys):
    checkers.check_choose_segments(load_solution("memory_sharding", "choose_segments"))
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, named", [
    (lambda depth: depth, "as many as no checkpointing"),
    (lambda depth: 1, "one unchecked segment"),
    (lambda depth: max(1, round(math.sqrt(depth) + 0.5)), "does not divide"),
    (lambda depth: float(depth), "return an int"),
    (math.isqrt, "does not divide"),  # floor(sqrt(n)): right for squares and 12, 48; wrong at 5, 7, 10, 18
])
def test_choose_segments_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_choose_segments(wrong)


def test_zero1_step_solution_passes(capsys):
    checkers.check_zero1_step(load_solution("memory_sharding", "zero1_step"))
    assert "passed" in capsys.readouterr().out


def _step(params, master, optimizer, rank, world_size, reduce=True, divide=True, gather=True, write_back=True,
          all_reduce=False):
    flat = flatten([p.grad for p in params], world_size)
    shard = torch.empty_like(master)
    if all_reduce == "bound early":  # through a name imported before the checker ran: only CommDebugMode sees it
        all_reduce_bound_early(flat)
        shard.copy_(flat.view(world_size, -1)[rank])
    elif all_reduce:  # the same numbers, twice the gradient bytes
        torch.distributed.all_reduce(flat)
        shard.copy_(flat.view(world_size, -1)[rank])
    elif reduce:
        reduce_scatter(shard, flat)
    else:
        shard.copy_(flat.view(world_size, -1)[rank] * world_size)
    master.grad = shard / world_size if divide else shard
    optimizer.step()
    full = flatten(list(params), world_size, torch.float32)
    if gather:
        all_gather(full, master.detach())
    else:
        full.view(world_size, -1)[rank].copy_(master.detach())
    if write_back:
        with torch.no_grad():
            unflatten_into(full, params)


@pytest.mark.parametrize("mistake, named", [
    ({"reduce": False}, "unsynchronised shards"),
    ({"divide": False}, "times too large"),
    ({"gather": False}, "others are stale"),
    ({"write_back": False}, "never changed"),
    ({"all_reduce": True}, "more than DDP's"),
    ({"all_reduce": "bound early"}, "not an all-reduce"),
])
def test_zero1_step_mistakes_are_named(mistake, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_zero1_step(lambda *args: _step(*args, **mistake))
