"""Notebook 02's exercise checkers accept the reference solutions and reject planted mistakes, naming them."""
import datetime
import time

import pytest
import torch
import torch.distributed as dist

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.collectives import exercises as checkers


def make_ring(direction=1, reduce=(0, -1), gather=(1, 0), gather_phase=True, mean=False, receive_from=None,
              timeout_s=30.0, gather_adds=False, split="tensor_split"):
    """A hand-written ring with one planted mistake: the parameters that a correct ring leaves at their defaults."""
    def ring(tensor, rank, world_size):
        right = (rank + direction) % world_size
        left = receive_from(rank, world_size) if receive_from else (rank - direction) % world_size
        chunks = getattr(tensor.view(-1), split)(world_size)

        def pass_on(outgoing, incoming):
            arrived = torch.empty_like(incoming)
            operations = [dist.P2POp(dist.isend, outgoing.contiguous(), right), dist.P2POp(dist.irecv, arrived, left)]
            for request in dist.batch_isend_irecv(operations):
                request.wait(datetime.timedelta(seconds=timeout_s))
            return arrived

        for step in range(world_size - 1):
            incoming = chunks[(rank - step + reduce[1]) % world_size]
            incoming.add_(pass_on(chunks[(rank - step + reduce[0]) % world_size], incoming))
        for step in range(world_size - 1 if gather_phase else 0):
            incoming = chunks[(rank - step + gather[1]) % world_size]
            arrived = pass_on(chunks[(rank - step + gather[0]) % world_size], incoming)
            incoming.add_(arrived) if gather_adds else incoming.copy_(arrived)
        if mean:
            tensor.div_(world_size)
    return ring


def test_the_planted_ring_without_mistakes_is_right(capsys):
    checkers.check_ring_all_reduce(make_ring(), world_sizes=(3,))
    assert "passed" in capsys.readouterr().out


def test_ring_solution_passes(capsys):
    checkers.check_ring_all_reduce(load_solution("collectives", "ring_all_reduce"))
    assert "passed" in capsys.readouterr().out


def calls_all_reduce(tensor, rank, world_size):
    dist.all_reduce(tensor)


def returns_a_new_tensor(tensor, rank, world_size):
    return tensor * world_size


@pytest.mark.parametrize("wrong, named", [
    (make_ring(gather_phase=False), "all-gather phase is missing"),
    (make_ring(direction=-1), "wrong neighbour direction"),
    (make_ring(reduce=(0, 0)), "off by one in the reduce-scatter"),
    (make_ring(gather=(0, 0)), "off by one in the all-gather"),
    (make_ring(mean=True), "divide instead of summing"),
    (make_ring(gather_adds=True), "the all-gather adds what arrives"),
    (make_ring(split="chunk"), "(?s)IndexError.*chunk\\(n\\) can give FEWER than n chunks"),
    (calls_all_reduce, "you called dist.all_reduce"),
    (returns_a_new_tensor, "unchanged"),
])
def test_ring_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_ring_all_reduce(wrong)


def test_a_ring_that_listens_to_the_wrong_side_fails_at_its_timeout_and_says_so():
    wrong = make_ring(receive_from=lambda rank, n: (rank + 1) % n, timeout_s=2.0)
    start = time.perf_counter()
    with pytest.raises(ExerciseFailed, match="receive from the neighbour that sends to it"):
        checkers.check_ring_all_reduce(wrong, world_sizes=(3,), timeout_s=30)
    assert time.perf_counter() - start < 25, "the learner's 2 s timeout should end the check, not the 30 s one"


def sends_before_receiving(tensor, rank, world_size):
    """Every rank calls a blocking send before its recv: with gloo nobody's receive is ever posted."""
    outgoing, arrived = tensor.clone(), torch.empty_like(tensor)
    dist.send(outgoing, (rank + 1) % world_size)
    dist.recv(arrived, (rank - 1) % world_size)
    tensor.add_(arrived)


def test_a_ring_that_sends_before_it_receives_deadlocks_and_is_told_why():
    with pytest.raises(ExerciseFailed, match="(?s)gave no result in 5 s.*blocking dist.send before its dist.recv"):
        checkers.check_ring_all_reduce(sends_before_receiving, world_sizes=(2,), timeout_s=5)


def test_simulated_ring_is_dist_all_reduce_and_its_mistakes_differ():
    inputs = [torch.arange(12.0) % 7 + 10 * rank for rank in range(3)]
    total = torch.stack(inputs).sum(0)
    assert all(torch.equal(result, total) for result in checkers.simulate_ring(inputs))
    for wrong in (dict(gather=False), dict(direction=-1), dict(combine="mean")):
        assert not all(torch.equal(result, total) for result in checkers.simulate_ring(inputs, **wrong)), wrong


def test_predict_time_solution_passes(capsys):
    checkers.check_predict_time(load_solution("collectives", "predict_time"))
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, named", [
    (lambda a, b, s, n: 2 * n * (a + s / n * b), "n instead of n-1"),
    (lambda a, b, s, n: (n - 1) * (a + s / n * b), "2 phases"),
    (lambda a, b, s, n: 2 * (n - 1) * (a + s * b), "whole message"),
    (lambda a, b, s, n: a + 2 * (n - 1) / n * s * b, "pays alpha once"),
    (lambda a, b, s, n: 2 * (n - 1) * a + 2 * s * b, "only the limit for large n"),
    (lambda a, b, s, n: 2 * (n - 1) * a + (n - 1) / n * s * b, "both phases send"),
    (lambda a, b, s, n: a + s * b, "2\\(n-1\\) steps"),
    (lambda a, b, s, n: "fast", "return a number"),
])
def test_predict_time_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_predict_time(wrong)
