"""Notebook 11's exercise checkers accept the reference solutions and reject planted mistakes, naming them."""
import datetime

import pytest
import torch.distributed as dist

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.async_parameter_server import exercises as checkers


def test_admit_solution_passes(capsys):
    checkers.check_admit(load_solution("async_parameter_server", "admit"))
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, named", [
    (lambda server, gradient, bound: server - gradient < bound, "use <="),
    (lambda server, gradient, bound: gradient - server <= bound, "must not exceed the bound"),
    (lambda server, gradient, bound: True, "must not exceed the bound"),
    (lambda server, gradient, bound: server <= bound, "rejected with bound 0: staleness is"),
    (lambda server, gradient, bound: "yes", "True or False"),
])
def test_admit_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_admit(wrong)


def test_average_parameters_solution_passes(capsys):
    checkers.check_average_parameters(load_solution("async_parameter_server", "average_parameters"))
    assert "passed" in capsys.readouterr().out


def _all_reduce(parameters, group, timeout_s):
    dist.all_reduce(parameters, group=group, async_op=True).wait(datetime.timedelta(seconds=timeout_s))


def sum_only(parameters, group=None, timeout_s=30.0):
    _all_reduce(parameters, group, timeout_s)


def divide_by_two(parameters, group=None, timeout_s=30.0):
    _all_reduce(parameters, group, timeout_s)
    parameters.div_(2)


def no_communication(parameters, group=None, timeout_s=30.0):
    parameters.div_(1)


def returns_a_copy(parameters, group=None, timeout_s=30.0):
    copy = parameters.clone()
    _all_reduce(copy, group, timeout_s)
    return copy / dist.get_world_size(group)


def divide_by_world_size(parameters, group=None, timeout_s=30.0):
    _all_reduce(parameters, group, timeout_s)
    parameters.div_(dist.get_world_size())


def group_ignored(parameters, group=None, timeout_s=30.0):
    _all_reduce(parameters, None, timeout_s)
    parameters.div_(dist.get_world_size(group))


@pytest.mark.parametrize("wrong, named", [
    (sum_only, "sum"),
    (divide_by_two, "divided by 2, but 3 workers"),
    (no_communication, "unchanged"),
    (returns_a_copy, "in place"),
    (divide_by_world_size, r"divided by 3, but 2 workers took part \(the group is ranks \[1, 2\]"),
    (group_ignored, "pass group=group"),
])
def test_average_parameters_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_average_parameters(wrong)
