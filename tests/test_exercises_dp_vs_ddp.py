"""Notebook 01's exercise checkers accept the reference solutions and reject planted mistakes, naming them."""
import datetime
import time

import pytest
import torch
import torch.distributed as dist

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.dp_vs_ddp import exercises as checkers

WAIT = datetime.timedelta(seconds=20)


def _all_reduce(tensor, op=dist.ReduceOp.SUM):
    dist.all_reduce(tensor, op=op, async_op=True).wait(WAIT)


def test_average_gradients_solution_passes(capsys):
    checkers.check_average_gradients(load_solution("dp_vs_ddp", "average_gradients"))
    assert "passed" in capsys.readouterr().out


def test_average_gradients_solution_passes_on_four_ranks(capsys):
    checkers.check_average_gradients(load_solution("dp_vs_ddp", "average_gradients"), world_size=4)
    assert "passed" in capsys.readouterr().out


def sum_without_dividing(model):
    for parameter in model.parameters():
        _all_reduce(parameter.grad)


def divided_twice(model):
    for parameter in model.parameters():
        _all_reduce(parameter.grad)
        parameter.grad.div_(dist.get_world_size() ** 2)


def only_the_weights(model):
    for name, parameter in model.named_parameters():
        if name.endswith("weight"):
            _all_reduce(parameter.grad)
            parameter.grad.div_(dist.get_world_size())


def averaged_a_copy(model):
    for parameter in model.parameters():
        copied = parameter.grad.clone()
        _all_reduce(copied)
        copied.div_(dist.get_world_size())


@pytest.mark.parametrize("wrong, named", [
    (sum_without_dividing, "did not divide by the world size"),
    (divided_twice, "divided twice"),
    (only_the_weights, r"\['0.bias', '2.bias'\] still hold this rank's own gradient"),
    (averaged_a_copy, "nothing was all-reduced into parameter.grad"),
])
def test_average_gradients_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_average_gradients(wrong)


def all_reduce_on_rank_zero_only(model):
    if dist.get_rank() == 0:
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)  # no timeout of its own: rank 1 returns and leaves it alone


def rank_one_busy_elsewhere(model):
    if dist.get_rank() == 0:
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)  # no timeout of its own: waits for a rank that never comes
    else:
        time.sleep(60)


def test_a_collective_one_rank_skips_fails_with_the_rule_it_broke():
    with pytest.raises(ExerciseFailed, match="(?s)rank 0 raised.*same collectives in the same order"):
        checkers.check_average_gradients(all_reduce_on_rank_zero_only, timeout_s=10)


def test_a_collective_left_hanging_is_stopped_by_the_timeout_and_explained():
    with pytest.raises(ExerciseFailed, match="(?s)gave no result in 3 s.*same collectives in the same order"):
        checkers.check_average_gradients(rank_one_busy_elsewhere, timeout_s=3)


def test_parameters_in_sync_solution_passes(capsys):
    checkers.check_parameters_in_sync(load_solution("dp_vs_ddp", "parameters_in_sync"))
    assert "passed" in capsys.readouterr().out


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def compared_locally_with_rank_zero(model):
    flat = _flat(model)
    reference = flat.clone()
    dist.broadcast(reference, src=0, async_op=True).wait(WAIT)
    return torch.equal(flat, reference)


def first_parameter_only(model):
    first = next(model.parameters()).detach().clone()
    reference = first.clone()
    dist.broadcast(reference, src=0, async_op=True).wait(WAIT)
    mismatch = torch.tensor([float(not torch.equal(first, reference))])
    _all_reduce(mismatch, dist.ReduceOp.MAX)
    return mismatch.item() == 0


def norms(model):
    norms_here = torch.stack([p.detach().norm() for p in model.parameters()])
    reference = norms_here.clone()
    dist.broadcast(reference, src=0, async_op=True).wait(WAIT)
    mismatch = torch.tensor([float(not torch.equal(norms_here, reference))])
    _all_reduce(mismatch, dist.ReduceOp.MAX)
    return mismatch.item() == 0


def with_a_tolerance(model):
    flat = _flat(model)
    reference = flat.clone()
    dist.broadcast(reference, src=0, async_op=True).wait(WAIT)
    mismatch = torch.tensor([float(not torch.allclose(flat, reference))])
    _all_reduce(mismatch, dist.ReduceOp.MAX)
    return mismatch.item() == 0


def checksums(model):
    sums = torch.stack([p.detach().sum() for p in model.parameters()])
    reference = sums.clone()
    dist.broadcast(reference, src=0, async_op=True).wait(WAIT)
    mismatch = torch.tensor([float(not torch.equal(sums, reference))])
    _all_reduce(mismatch, dist.ReduceOp.MAX)
    return mismatch.item() == 0


@pytest.mark.parametrize("wrong, named", [
    (lambda model: True, "first parameter on rank 0 was missed"),
    (lambda model: False, "returned False"),
    (lambda model: "yes", "return True or False"),
    (compared_locally_with_rank_zero, "the ranks disagree"),
    (first_parameter_only, "LAST parameter"),
    (checksums, "checksum"),
    (norms, "its sum, norm or mean"),
    (with_a_tolerance, "compare exactly"),
])
def test_parameters_in_sync_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_parameters_in_sync(wrong)
