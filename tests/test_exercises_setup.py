"""Notebook 00's exercise checker accepts the reference solution and rejects planted mistakes, naming them."""
import datetime

import pytest
import torch.distributed as dist

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.setup import exercises as checkers

WAIT = datetime.timedelta(seconds=30)


def test_mean_over_ranks_solution_passes(capsys):
    checkers.check_mean_over_ranks(load_solution("setup", "mean_over_ranks"))
    assert "passed" in capsys.readouterr().out


def no_division(tensor):
    total = tensor.clone()
    dist.all_reduce(total, async_op=True).wait(WAIT)
    return total


def reduce_to_rank_zero(tensor):
    total = tensor.clone()
    dist.reduce(total, dst=0, async_op=True).wait(WAIT)
    return total / dist.get_world_size()


def returns_what_all_reduce_returns(tensor):
    total = tensor.clone()
    result = dist.all_reduce(total)
    return result


def returns_the_work_handle(tensor):
    work = dist.all_reduce(tensor.clone(), async_op=True)
    work.wait(WAIT)
    return work


def reduces_the_callers_tensor(tensor):
    dist.all_reduce(tensor, async_op=True).wait(WAIT)
    return tensor / dist.get_world_size()


def returns_the_original(tensor):
    total = tensor.clone()
    dist.all_reduce(total, async_op=True).wait(WAIT)
    total /= dist.get_world_size()
    return tensor


def divides_by_two(tensor):
    total = tensor.clone()
    dist.all_reduce(total, async_op=True).wait(WAIT)
    return total / 2


def divides_before_the_sum_arrives(tensor):
    total = tensor.clone()
    mean = total / dist.get_world_size()  # read before the all_reduce has written the sum (as without .wait())
    dist.all_reduce(total, async_op=True).wait(WAIT)
    return mean


def averages_the_elements(tensor):
    total = tensor.clone()
    dist.all_reduce(total, async_op=True).wait(WAIT)
    return (total / dist.get_world_size()).mean()


@pytest.mark.parametrize("wrong, named", [
    (no_division, "on 2 ranks: no division"),
    (reduce_to_rank_zero, "only rank 0 holds the result.*use dist.all_reduce"),
    (returns_what_all_reduce_returns, "you returned None"),
    (returns_the_work_handle, "returned a Work, not a tensor"),
    (reduces_the_callers_tensor, "changed the caller's tensor"),
    (returns_the_original, "returned its own values unchanged"),
    (divides_by_two, "on 3 ranks: you divided by 2, but this run has 3 ranks"),
    (divides_before_the_sum_arrives, r"rank\(s\) \[0, 1\] returned their own tensor divided.*\.wait"),
    (averages_the_elements, r"you returned shape \(\), not \(2, 3\).*element by element"),
])
def test_mean_over_ranks_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_mean_over_ranks(wrong)


def test_a_rank_that_never_joins_is_reported_not_hung():
    def only_rank_zero_reduces(tensor):
        if dist.get_rank() == 0:
            dist.all_reduce(tensor.clone(), async_op=True).wait(datetime.timedelta(seconds=2))
        return tensor
    with pytest.raises(ExerciseFailed, match="raised or hung"):
        checkers.check_mean_over_ranks(only_rank_zero_reduces)
