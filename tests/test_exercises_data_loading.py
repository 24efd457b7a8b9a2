"""Notebook 03's exercise checkers accept the reference solutions and reject planted mistakes, naming them."""
import math

import pytest
import torch

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.data_loading import exercises as checkers


def _order(size, seed, shuffle):
    if not shuffle:
        return list(range(size))
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()


def _sampler_like(size, rank, n, epoch, seed, shuffle, drop_last, *, pad=None, stride=True, order_seed=None,
                  cut_start=False):
    """A shard built like DistributedSampler's, with one step swapped for a planted mistake."""
    order = _order(size, seed + epoch if order_seed is None else order_seed, shuffle)
    if drop_last:
        per_rank = size // n
        order = order[size - per_rank * n:] if cut_start else order[:per_rank * n]
    else:
        per_rank = math.ceil(size / n)
        missing = per_rank * n - size
        order = order + (pad or (lambda order, missing: (order * (missing // size + 1))[:missing]))(order, missing)
    return order[rank::n] if stride else order[rank * per_rank:(rank + 1) * per_rank]


def no_padding(size, rank, n, epoch, seed, shuffle, drop_last):
    if drop_last:
        return _sampler_like(size, rank, n, epoch, seed, shuffle, drop_last)
    return _order(size, seed + epoch, shuffle)[rank::n]


def padding_from_the_end(size, rank, n, epoch, seed, shuffle, drop_last):
    return _sampler_like(size, rank, n, epoch, seed, shuffle, drop_last,
                         pad=lambda order, missing: [order[-1 - k % size] for k in range(missing)])


def contiguous_blocks(size, rank, n, epoch, seed, shuffle, drop_last):
    return _sampler_like(size, rank, n, epoch, seed, shuffle, drop_last, stride=False)


def ignores_epoch(size, rank, n, epoch, seed, shuffle, drop_last):
    return _sampler_like(size, rank, n, 0, seed, shuffle, drop_last)


def seed_per_rank(size, rank, n, epoch, seed, shuffle, drop_last):
    return _sampler_like(size, rank, n, epoch, seed, shuffle, drop_last, order_seed=seed + epoch + rank)


def ignores_drop_last(size, rank, n, epoch, seed, shuffle, drop_last):
    return _sampler_like(size, rank, n, epoch, seed, shuffle, False)


def drops_the_start(size, rank, n, epoch, seed, shuffle, drop_last):
    return _sampler_like(size, rank, n, epoch, seed, shuffle, drop_last, cut_start=True)


def pads_only_once(size, rank, n, epoch, seed, shuffle, drop_last):
    return _sampler_like(size, rank, n, epoch, seed, shuffle, drop_last,
                         pad=lambda order, missing: order[:missing])


def reseeds_the_global_generator(size, rank, n, epoch, seed, shuffle, drop_last):
    torch.manual_seed(seed + epoch)
    return _sampler_like(size, rank, n, epoch, seed, shuffle, drop_last)


def test_shard_indices_solution_passes(capsys):
    checkers.check_shard_indices(load_solution("data_loading", "shard_indices"))
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, named", [
    (no_padding, "no padding"),
    (pads_only_once, "padding too short"),
    (padding_from_the_end, "padding with the wrong elements"),
    (contiguous_blocks, "contiguous block"),
    (ignores_epoch, "ignores the epoch"),
    (seed_per_rank, "SAME permutation"),
    (ignores_drop_last, "drop_last=True: each rank gets floor"),
    (drops_the_start, "END of the shuffled order"),
    (reseeds_the_global_generator, "global random state"),
])
def test_shard_indices_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_shard_indices(wrong)


def test_drop_padding_solution_passes(capsys):
    checkers.check_drop_padding(load_solution("data_loading", "drop_padding"))
    assert "passed" in capsys.readouterr().out


def test_the_gathered_predictions_are_torchs_shards_in_rank_order():
    gathered, expected = checkers.gathered_predictions(3, 8)
    assert [tensor.tolist() for tensor in gathered] == [[expected[i % 3].item()] for i in range(8)], "padding cycles"
    gathered, expected = checkers.gathered_predictions(11, 2)
    assert gathered[0].tolist() == expected[0::2].tolist() and gathered[1].tolist() == expected[1::2].tolist() + [expected[0].item()]


def kept_the_repeats(gathered, size):
    return torch.stack(gathered, dim=1).flatten()


def dropped_the_wrong_end(gathered, size):
    return torch.stack(gathered, dim=1).flatten()[-size:]


def concatenated(gathered, size):
    return torch.cat(gathered)[:size]


def unique_values(gathered, size):
    return list(dict.fromkeys(torch.stack(gathered, dim=1).flatten().tolist()))


def one_too_many(gathered, size):
    ordered = torch.stack(gathered, dim=1).flatten()[:size]
    return torch.cat([ordered, ordered[:1]])


def not_numbers(gathered, size):
    return {"predictions": gathered}


@pytest.mark.parametrize("wrong, named", [
    (kept_the_repeats, "kept the repeats"),
    (dropped_the_wrong_end, "dropped the wrong end"),
    (concatenated, "Interleave"),
    (unique_values, "drop positions, not values"),
    (one_too_many, "exactly N=12"),
    (not_numbers, "as one tensor"),
])
def test_drop_padding_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_drop_padding(wrong)
