"""Notebook 06's exercise checkers accept the reference solutions and reject planted mistakes, naming them."""
import math

import pytest

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.performance_scaling import exercises as checkers


def solution(name):
    return load_solution("performance_scaling", name)


def ring(nbytes, n, link, steps=None, chunk=None):
    steps = 2 * (n - 1) if steps is None else steps
    return steps * (link.alpha_s + (nbytes / n if chunk is None else chunk) * link.beta_s_per_byte) if n > 1 else 0.0


def step_with(communication):
    def predict(compute_s, nbytes, n, link, overlap):
        talk = communication(nbytes, n, link)
        return compute_s + talk - overlap * min(compute_s, talk)
    return predict


def test_predict_step_time_solution_passes(capsys):
    checkers.check_predict_step_time(solution("predict_step_time"))
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, named", [
    (step_with(lambda s, n, link: ring(s, n, link, steps=2 * n)), "2n messages instead of 2\\(n-1\\)"),
    (step_with(lambda s, n, link: ring(s, n, link, steps=n - 1)), "two phases"),
    (step_with(lambda s, n, link: ring(s, n, link, chunk=s)), "whole buffer"),
    (lambda c, s, n, link, overlap: c + ring(s, n, link), "overlap is ignored"),
    (lambda c, s, n, link, overlap: c + ring(s, n, link) * (1 - overlap), "only the shorter"),
    (step_with(lambda s, n, link: 2 * (n - 1) * s / n * link.beta_s_per_byte), "latency term is missing"),
])
def test_predict_step_time_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_predict_step_time(wrong)


def test_ring_vs_tree_solution_passes(capsys):
    checkers.check_ring_vs_tree(solution("ring_vs_tree"))
    assert "passed" in capsys.readouterr().out


def with_tree(tree):
    return lambda nbytes, n, link: {"ring": ring(nbytes, n, link), "tree": tree(nbytes, n, link)}


@pytest.mark.parametrize("wrong, named", [
    (with_tree(lambda s, n, link: 2 * (n - 1) * link.alpha_s + 2 * s * link.beta_s_per_byte), "grows linearly"),
    (with_tree(lambda s, n, link: math.ceil(math.log2(n)) * link.alpha_s + s * link.beta_s_per_byte), "broadcast"),
    (with_tree(lambda s, n, link: 2 * math.log2(n) * link.alpha_s + 2 * s * link.beta_s_per_byte), "ceil"),
    (with_tree(lambda s, n, link: 2 * math.floor(math.log2(n)) * link.alpha_s + 2 * s * link.beta_s_per_byte),
     "floor\\(log2 n\\) rounds are too few"),
    (lambda s, n, link: {"ring": ring(s, n, link, chunk=s), "tree": 0.0}, "whole buffer"),
    (lambda s, n, link: {"ring": ring(s, n, link, steps=n - 1), "tree": 0.0}, "two phases"),
    (lambda s, n, link: (ring(s, n, link), 0.0), "dict"),
])
def test_ring_vs_tree_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_ring_vs_tree(wrong)


def test_largest_world_solution_passes(capsys):
    checkers.check_largest_world(solution("largest_world"))
    assert "passed" in capsys.readouterr().out


def test_largest_world_off_by_one_is_named():
    right = solution("largest_world")
    with pytest.raises(ExerciseFailed, match="off by one"):
        checkers.check_largest_world(lambda *args: right(*args) + 1)


def test_largest_world_ignoring_latency_is_caught():
    def bandwidth_only(compute_s, nbytes, link, efficiency):
        free = type(link)(0.0, link.beta_s_per_byte, link.r2)
        return solution("largest_world")(compute_s, nbytes, free, efficiency)
    with pytest.raises(ExerciseFailed, match="below"):
        checkers.check_largest_world(bandwidth_only)
