"""Notebook 07's exercise checkers accept the reference solutions and reject planted mistakes, naming them."""
import datetime

import pytest
import torch.distributed as dist

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.exercises import model_tensor_parallel as checkers


def test_column_shard_solution_passes(capsys):
    checkers.check_column_shard(load_solution("model_tensor_parallel", "column_shard"))
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, named", [
    (lambda weight, rank, n: weight.chunk(n, dim=1)[rank].clone(), "dim 1"),
    (lambda weight, rank, n: weight.chunk(n, dim=0)[(rank + 1) % n].clone(), "rank 1's block"),
    (lambda weight, rank, n: weight.chunk(n, dim=0)[rank], "view"),
    (lambda weight, rank, n: weight.clone(), "shape"),
])
def test_column_shard_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_column_shard(wrong)


def test_row_parallel_forward_solution_passes(capsys):
    checkers.check_row_parallel_forward(load_solution("model_tensor_parallel", "row_parallel_forward"))
    assert "passed" in capsys.readouterr().out


def without_all_reduce(x_slice, weight_shard, bias):
    return x_slice @ weight_shard.T + bias


def bias_on_every_rank(x_slice, weight_shard, bias):
    partial = x_slice @ weight_shard.T + bias
    dist.all_reduce(partial, async_op=True).wait(datetime.timedelta(seconds=30))
    return partial


def bias_missing(x_slice, weight_shard, bias):
    partial = x_slice @ weight_shard.T
    dist.all_reduce(partial, async_op=True).wait(datetime.timedelta(seconds=30))
    return partial


@pytest.mark.parametrize("wrong, named", [
    (without_all_reduce, "missing all-reduce"),
    (bias_on_every_rank, "counted 2 times"),
    (bias_missing, "bias is missing"),
])
def test_row_parallel_forward_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_row_parallel_forward(wrong)
