"""Notebook 06b's exercise checkers accept the reference solutions and reject planted mistakes, naming them."""
import pytest
import torch
import torch.distributed as dist

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.across_nodes import exercises as checkers


def make_hierarchical(pad=True, gather=True, mean=False, swap=False, whole_across=False):
    """A hierarchical all-reduce with one planted mistake (each parameter at its default is right)."""
    def hierarchical(tensor, inside_group, across_group):
        inside, across = (across_group, inside_group) if swap else (inside_group, across_group)
        if whole_across:
            dist.all_reduce(tensor, group=inside)
            dist.all_reduce(tensor, group=across)
            return
        g = dist.get_world_size(inside)
        flat = tensor.view(-1)
        shard_size = -(-flat.numel() // g) if pad else flat.numel() // g
        padded = torch.zeros(shard_size * g)
        padded[:min(flat.numel(), shard_size * g)] = flat[:shard_size * g]
        shard = torch.empty(shard_size)
        dist.reduce_scatter_tensor(shard, padded, group=inside)
        dist.all_reduce(shard, group=across)
        if mean:
            shard /= dist.get_world_size()
        if gather:
            dist.all_gather_into_tensor(padded, shard, group=inside)
        else:
            padded[dist.get_rank(inside) * shard_size:(dist.get_rank(inside) + 1) * shard_size] = shard
        flat[:shard_size * g] = padded[:flat.numel()][:shard_size * g]
    return hierarchical


def flat(tensor, inside_group, across_group):
    dist.all_reduce(tensor)


def whole_across_by_keyword(tensor, inside_group, across_group):
    """The right sum, the whole tensor sent across, every tensor passed by keyword: still seen."""
    dist.all_reduce(tensor=tensor, group=inside_group)
    dist.all_reduce(tensor=tensor, group=across_group)


def test_the_planted_version_without_mistakes_passes(capsys):
    checkers.check_hierarchical_all_reduce(make_hierarchical(), topologies=((2, 2),))
    assert "passed" in capsys.readouterr().out


def test_solution_passes(capsys):
    checkers.check_hierarchical_all_reduce(load_solution("across_nodes", "hierarchical_all_reduce"))
    assert "passed" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("wrong, named", [
    (flat, "whole world"),
    (make_hierarchical(mean=True), "mean"),
    (make_hierarchical(gather=False), "all-gather inside the node is missing"),
    (make_hierarchical(pad=False), "pad"),
    (make_hierarchical(whole_across=True), "across group carried"),
    (whole_across_by_keyword, "across group carried"),
    (make_hierarchical(swap=True), "groups are swapped"),
])
def test_planted_mistakes_are_named(wrong, named):
    topologies = ((2, 3),) if named == "pad" else ((2, 2),)
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_hierarchical_all_reduce(wrong, topologies=topologies)


def positional_groups(tensor, inside_group, across_group):
    """The reference steps with every group passed by position, as the collectives' signatures allow."""
    g = dist.get_world_size(inside_group)
    flat = tensor.view(-1)
    shard_size = -(-flat.numel() // g)
    padded = torch.zeros(shard_size * g)
    padded[:flat.numel()] = flat
    shard = torch.empty(shard_size)
    dist.reduce_scatter_tensor(shard, padded, dist.ReduceOp.SUM, inside_group)
    dist.all_reduce(shard, dist.ReduceOp.SUM, across_group)
    dist.all_gather_into_tensor(padded, shard, inside_group)
    flat.copy_(padded[:flat.numel()])


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_groups_passed_by_position_are_seen(capsys):
    checkers.check_hierarchical_all_reduce(positional_groups, topologies=((2, 2),))
    assert "passed" in capsys.readouterr().out


REDUCE_SCATTER = dist.reduce_scatter_tensor  # bound before the checker watches: its calls go unseen


def aliased_reduce_scatter(tensor, inside_group, across_group):
    """Right (for sizes the node divides), but its reduce-scatter goes through a name bound at import."""
    g = dist.get_world_size(inside_group)
    flat = tensor.view(-1)
    shard = torch.empty(flat.numel() // g)
    REDUCE_SCATTER(shard, flat, group=inside_group)
    dist.all_reduce(shard, group=across_group)
    dist.all_gather_into_tensor(flat, shard, group=inside_group)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_unseen_collectives_are_explained():
    with pytest.raises(ExerciseFailed, match="a name bound before it runs"):
        checkers.check_hierarchical_all_reduce(aliased_reduce_scatter, topologies=((2, 2),))


def test_a_speedup_dividing_by_zero_on_one_node_is_named():
    with pytest.raises(ExerciseFailed, match="With one node nothing crosses"):
        checkers.check_predict_speedup(lambda nodes, g: (g * nodes - 1) / (g * (nodes - 1)))


def test_speedup_solution_passes(capsys):
    checkers.check_predict_speedup(load_solution("across_nodes", "predict_speedup"))
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(checkers.SPEEDUP_MISTAKES))
def test_speedup_mistakes_are_named(name):
    with pytest.raises(ExerciseFailed, match=checkers.SPEEDUP_HINTS[name][:30].replace("(", r"\(").replace(")", r"\)")):
        checkers.check_predict_speedup(checkers.SPEEDUP_MISTAKES[name])


def test_a_speedup_that_is_not_a_number_is_refused():
    with pytest.raises(ExerciseFailed, match="return a number"):
        checkers.check_predict_speedup(lambda nodes, per_node: "1.5")
