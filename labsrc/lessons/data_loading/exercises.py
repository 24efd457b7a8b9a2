"""Checkers for notebook 03's exercises: a rank's DistributedSampler shard, and the padding/drop_last counts."""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.data import DistributedSampler

from labsrc.core.exercises import ExerciseFailed, passed
from labsrc.lessons.data_loading.sampling import IndexDataset, coverage

# (dataset_size, world_size): n divides N, pads a little, pads more than once around (N < n)
SIZES = ((12, 4), (10, 4), (11, 2), (10, 3), (3, 8))
SETTINGS = ((0, 0), (1, 0), (2, 7))  # (epoch, seed)


def torch_shard(size: int, rank: int, world_size: int, epoch: int, seed: int, shuffle: bool,
                drop_last: bool) -> list[int]:
    """The indices torch's DistributedSampler gives `rank` in `epoch`: the answer to compare with."""
    sampler = DistributedSampler(IndexDataset(size), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def _order(size: int, seed: int, shuffle: bool) -> list[int]:
    """All N indices before padding: the permutation from a generator seeded `seed` (or 0..N-1)."""
    if not shuffle:
        return list(range(size))
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()


def _padded(order: list[int], world_size: int) -> list[int]:
    total = -(-len(order) // world_size) * world_size
    return (order * (total // len(order) + 1))[:total]


def _call(shard_indices: Callable, *args) -> list[int]:
    """The learner's shard as a list of ints; names a global-RNG side effect or a wrong return type."""
    state = torch.random.get_rng_state()
    got = shard_indices(*args)
    if not torch.equal(state, torch.random.get_rng_state()):
        torch.random.set_rng_state(state)
        raise ExerciseFailed("your function changed torch's global random state (torch.manual_seed, or torch.randperm "
                             "without a generator): a sampler must not reseed the training's randomness. Draw the "
                             "permutation from its own torch.Generator seeded with seed + epoch.")
    try:
        return [int(index) for index in got]
    except TypeError:
        raise ExerciseFailed(f"return the rank's indices as a list of ints, not {type(got).__name__}.") from None


def _mistake(got: list[int], size: int, rank: int, world_size: int, epoch: int, seed: int, shuffle: bool,
             drop_last: bool, all_ranks: list[list[int]]) -> str:
    """What is wrong with `got`, found by building each plausible wrong answer and comparing."""
    expected = torch_shard(size, rank, world_size, epoch, seed, shuffle, drop_last)
    order = _order(size, seed + epoch, shuffle)
    padded = _padded(order, world_size)
    per_rank = len(expected)
    if epoch and got == torch_shard(size, rank, world_size, 0, seed, shuffle, drop_last):
        return "your shard ignores the epoch: seed the generator with seed + epoch, so each epoch reshuffles."
    if seed and got == torch_shard(size, rank, world_size, epoch, 0, shuffle, drop_last):
        return "your shard ignores the seed: the generator is seeded with seed + epoch."
    if shuffle and got == torch_shard(size, rank, world_size, epoch, seed, False, drop_last):
        return "shuffle=True, but your indices are in order: permute them with torch.randperm(N, generator=g)."
    if not shuffle and sorted(got) != got:
        return "shuffle=False must keep the order 0, 1, ..., N-1 (no permutation)."
    if drop_last and len(got) != per_rank:
        return (f"drop_last=True: each rank gets floor(N/n) = {per_rank} indices; cut the order to its first "
                "floor(N/n)*n indices, and pad nothing.")
    if drop_last and got == order[size % world_size:][rank::world_size]:
        return "drop_last cuts the END of the shuffled order (indices[:floor(N/n)*n]), not its start."
    if shuffle and _ranks_disagree(all_ranks, size, drop_last):
        return ("the ranks' shards do not fit together: every rank must draw the SAME permutation (a generator "
                "seeded with seed + epoch, nothing rank-dependent) and take its own stride of it.")
    padding = per_rank * world_size - size
    if not drop_last and padding > size and got == (order + order[:padding])[rank::world_size]:
        return (f"padding too short: N={size} < n, so the {padding} padding indices cycle through the shuffled "
                "order more than once; indices[:padding] gives only N of them. Repeat the order (order * k) "
                "before cutting it to the padding length.")
    if not drop_last and size % world_size and got == order[rank::world_size]:
        return (f"no padding: with drop_last=False every rank gets ceil(N/n) = {per_rank} indices; append the "
                "first ceil(N/n)*n - N indices of the shuffled order (again from its start if that is more than "
                "N) before taking the stride.")
    if got == padded[rank * per_rank:(rank + 1) * per_rank] or got == order[rank * per_rank:(rank + 1) * per_rank]:
        return ("contiguous block: rank r takes every n-th index starting at r (indices[r::n]), not the r-th "
                "block of the order.")
    if not drop_last and len(got) == per_rank and _matches_outside_padding(got, expected, size, rank, world_size):
        return ("padding with the wrong elements: the padding repeats the START of the shuffled order "
                "(indices[:padding]), the same on every rank.")
    hint = (" The order must be torch.randperm(N, generator=g) with g = torch.Generator().manual_seed(seed + epoch): "
            "another shuffle (random, numpy) gives another order.") if shuffle else ""
    return f"expected {expected}, got {got}." + hint


def _matches_outside_padding(got: list[int], expected: list[int], size: int, rank: int, world_size: int) -> bool:
    """Equal at the positions that come from the order itself (position rank + k*n < N), different elsewhere."""
    return all(g == e for k, (g, e) in enumerate(zip(got, expected)) if rank + k * world_size < size)


def _ranks_disagree(all_ranks: list[list[int]], size: int, drop_last: bool) -> bool:
    """Shards that cannot come from one shared permutation: samples read twice where no padding is needed,
    or (without drop_last) samples no rank reads."""
    read = [index for shard in all_ranks for index in shard]
    missing = set(range(size)) - set(read)
    needs_padding = not drop_last and size % len(all_ranks)
    return bool(missing and not drop_last) or (not needs_padding and len(read) != len(set(read)))


def check_shard_indices(shard_indices: Callable) -> None:
    """shard_indices(dataset_size, rank, world_size, epoch, seed, shuffle, drop_last) -> [index, ...] must
    equal what torch's DistributedSampler gives that rank after set_epoch(epoch), for sizes that n divides
    and sizes it does not."""
    for size, world_size in SIZES:
        for epoch, seed in SETTINGS:
            for shuffle in (True, False):
                for drop_last in (False, True):
                    settings = (epoch, seed, shuffle, drop_last)
                    all_ranks = [_call(shard_indices, size, rank, world_size, *settings) for rank in range(world_size)]
                    for rank, got in enumerate(all_ranks):
                        if got != torch_shard(size, rank, world_size, *settings):
                            case = (f"N={size}, n={world_size}, rank {rank}, epoch {epoch}, seed {seed}, "
                                    f"shuffle={shuffle}, drop_last={drop_last}")
                            raise ExerciseFailed(f"{case}: " + _mistake(got, size, rank, world_size, *settings,
                                                                      all_ranks))
    passed(f"your shards equal DistributedSampler's for {len(SIZES)} (N, n) pairs, 3 epochs/seeds, with and "
           "without shuffle and drop_last")


COUNT_SIZES = ((12, 4), (10, 4), (10, 3), (11, 2), (1001, 8), (3, 8))


def _count_mistake(got: tuple, size: int, world_size: int, drop_last: bool, expected: tuple) -> str:
    per_rank, duplicates, dropped = got
    remainder = size % world_size
    if per_rank != expected[0]:
        if drop_last:
            return f"per rank: drop_last rounds DOWN, floor(N/n) = {expected[0]}; you said {per_rank}."
        return f"per rank: padding rounds UP, ceil(N/n) = {expected[0]}; you said {per_rank}."
    if drop_last and duplicates:
        return "drop_last pads nothing: no sample is read twice."
    if not drop_last and dropped:
        return "padding drops nothing: every sample is read at least once."
    if not drop_last and duplicates != expected[1]:
        if size < world_size and duplicates == size:
            return (f"duplicates: you said N = {size}, but with N < n the padding cycles through the order more than "
                    "once, so some samples are read three times or more: count every read beyond a sample's "
                    f"first, ceil(N/n)*n - N = {expected[1]}.")
        if duplicates == remainder and remainder:
            return (f"duplicates: the padding fills the last round, ceil(N/n)*n - N = {expected[1]}, not N mod n "
                    f"= {remainder}.")
        return f"duplicates: the padding is ceil(N/n)*n - N = {expected[1]}; you said {duplicates}."
    if drop_last and dropped != expected[2]:
        note = " (N < n: every rank gets 0 samples, all are dropped)" if size < world_size else ""
        return f"dropped: drop_last cuts N mod n = {expected[2]} samples{note}; you said {dropped}."
    return f"expected {expected}, got {got}."


def check_shard_counts(shard_counts: Callable) -> None:
    """shard_counts(dataset_size, world_size, drop_last) -> (per_rank, duplicates, dropped), compared with
    the counts of what torch's DistributedSampler gives all ranks in one epoch."""
    for size, world_size in COUNT_SIZES:
        for drop_last in (False, True):
            counted = coverage(size, world_size, drop_last)
            expected = (counted["per_rank"], counted["duplicates"], counted["dropped"])
            got = shard_counts(size, world_size, drop_last)
            try:
                got = tuple(int(value) for value in got)
            except (TypeError, ValueError):
                raise ExerciseFailed(f"return (per_rank, duplicates, dropped) as three ints, not {got!r}.") from None
            if len(got) != 3:
                raise ExerciseFailed(f"return three numbers (per_rank, duplicates, dropped), not {len(got)}.")
            if got != expected:
                raise ExerciseFailed(f"N={size}, n={world_size}, drop_last={drop_last}: "
                                     + _count_mistake(got, size, world_size, drop_last, expected))
    passed(f"your counts equal those measured on DistributedSampler for {len(COUNT_SIZES)} (N, n) pairs, "
           "padded and drop_last")
