"""Notebook 04's exercise checkers accept the reference solutions and reject planted mistakes, naming them."""
import pytest
import torch
import torch.distributed as dist

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.ddp_internals import exercises as checkers


def test_assign_buckets_solution_passes(capsys):
    checkers.check_assign_buckets(load_solution("ddp_internals", "assign_buckets"))
    assert "passed" in capsys.readouterr().out


def _fill(sizes, order, first_cap, cap, strictly_above=False, close_before=False):
    buckets, current, size = [], [], 0
    for index in order:
        limit = cap if buckets else first_cap
        if close_before and current and size + sizes[index] > limit:
            buckets.append(current)
            current, size, limit = [], 0, cap
        current.append(index)
        size += sizes[index]
        if size > limit if strictly_above else size >= limit:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def forward_order(sizes, cap, first_cap):
    return _fill(sizes, range(len(sizes)), first_cap, cap)


def no_first_cap(sizes, cap, first_cap):
    return _fill(sizes, reversed(range(len(sizes))), cap, cap)


def closes_above_the_cap(sizes, cap, first_cap):
    return _fill(sizes, reversed(range(len(sizes))), first_cap, cap, strictly_above=True)


def closes_before_overflowing(sizes, cap, first_cap):
    return _fill(sizes, reversed(range(len(sizes))), first_cap, cap, close_before=True)


def splits_large_parameters(sizes, cap, first_cap):
    buckets = _fill(sizes, reversed(range(len(sizes))), first_cap, cap)
    large = [index for index, size in enumerate(sizes) if size > cap]
    if large and len(buckets) > 1:  # a large parameter's second half spills into the next bucket
        buckets[1].insert(0, large[-1])
    return buckets


@pytest.mark.parametrize("wrong, named", [
    (forward_order, "REVERSE order"),
    (no_first_cap, "no first-bucket cap"),
    (closes_above_the_cap, "REACHES the cap"),
    (closes_before_overflowing, "adds the parameter first"),
    (splits_large_parameters, "never splits a parameter"),
    (lambda sizes, cap, first_cap: load_solution("ddp_internals", "assign_buckets")(sizes, cap, first_cap)[::-1],
     "wrong order: bucket 0"),
    (lambda sizes, cap, first_cap: [sorted(bucket) for bucket in
                                    load_solution("ddp_internals", "assign_buckets")(sizes, cap, first_cap)],
     "in the order they enter it"),
    (lambda sizes, cap, first_cap: [list(range(len(sizes)))[::-1]], "not the buckets torch DDP built"),
    (lambda sizes, cap, first_cap: len(sizes), "return a list of buckets"),
])
def test_assign_buckets_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_assign_buckets(wrong)


def test_allreduce_average_hook_solution_passes(capsys):
    checkers.check_allreduce_average_hook(load_solution("ddp_internals", "allreduce_average_hook"))
    assert "passed" in capsys.readouterr().out


def not_dividing(process_group, bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda done: done.value()[0])


def dividing_twice(process_group, bucket):
    buffer = bucket.buffer().div_(dist.get_world_size())
    future = dist.all_reduce(buffer, async_op=True).get_future()
    return future.then(lambda done: done.value()[0].div_(dist.get_world_size()))


def returning_the_local_buffer(process_group, bucket):
    copy = bucket.buffer().div(dist.get_world_size())
    dist.all_reduce(copy, async_op=True).wait()
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def returning_the_list(process_group, bucket):
    return dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()


@pytest.mark.parametrize("wrong, named", [
    (not_dividing, "not dividing"),
    (dividing_twice, "dividing twice"),
    (returning_the_local_buffer, "own gradient"),
    (returning_the_list, "LIST of tensors"),
])
def test_allreduce_average_hook_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_allreduce_average_hook(wrong)
