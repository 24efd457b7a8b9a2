"""Notebook 07's exercise checkers accept the reference solutions and reject planted mistakes, naming them."""
import datetime
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as distributed_functional

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.model_tensor_parallel import exercises as checkers


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


class _Sum(torch.autograd.Function):
    """The all-reduce as an autograd function with the identity backward (g), for the planted mistakes."""

    @staticmethod
    def forward(context, partial):
        total = partial.clone()
        dist.all_reduce(total, async_op=True).wait(datetime.timedelta(seconds=30))
        return total

    @staticmethod
    def backward(context, grad):
        return grad


def without_all_reduce(x_slice, weight_shard, bias):
    return x_slice @ weight_shard.T + bias


def bias_on_every_rank(x_slice, weight_shard, bias):
    return _Sum.apply(x_slice @ weight_shard.T + bias)


def bias_missing(x_slice, weight_shard, bias):
    return _Sum.apply(x_slice @ weight_shard.T)


def bias_halved(x_slice, weight_shard, bias):
    return _Sum.apply(x_slice @ weight_shard.T + bias / 2)   # right on 2 ranks only


def bias_split_over_ranks(x_slice, weight_shard, bias):
    return _Sum.apply(x_slice @ weight_shard.T + bias / dist.get_world_size())   # right forward, 1/n bias gradient


class _SumAveragingBackward(_Sum):
    @staticmethod
    def backward(context, grad):
        return grad / dist.get_world_size()


def backward_averages(x_slice, weight_shard, bias):
    return _SumAveragingBackward.apply(x_slice @ weight_shard.T) + bias   # right forward, 1/n input gradient


def untracked_all_reduce(x_slice, weight_shard, bias):
    partial = x_slice @ weight_shard.T
    dist.all_reduce(partial, async_op=True).wait(datetime.timedelta(seconds=30))
    return partial + bias


def backward_all_reduces_too(x_slice, weight_shard, bias):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # deprecated, still shipped in 2.11-2.14
        return distributed_functional.all_reduce(x_slice @ weight_shard.T) + bias


@pytest.mark.parametrize("wrong, named", [
    (without_all_reduce, "missing all-reduce"),
    (bias_on_every_rank, "counted 2 times"),
    (bias_missing, "bias is missing"),
    (bias_halved, "gradient of bias is 1/2"),
    (bias_split_over_ranks, "gradient of bias is 1/2"),
    (backward_averages, "gradient of x_slice is 1/2 .* divide by 2"),
    (untracked_all_reduce, "autograd cannot see dist.all_reduce"),
    (backward_all_reduces_too, "gradient of x_slice is 2 times"),
])
def test_row_parallel_forward_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_row_parallel_forward(wrong)
