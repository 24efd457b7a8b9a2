"""Checkers for notebook 03's exercises: a rank's DistributedSampler shard, and evaluation predictions without
the padding."""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.data import DistributedSampler

from labsrc.core.exercises import ExerciseFailed, passed
from labsrc.lessons.data_loading.sampling import IndexDataset

# (dataset_size, world_size): n divides N, pads a little, and (3, 8), where the padding (5) is longer than the
# order (3) and goes round it again
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
        return (f"padding too short: the padding ({padding} indices) is longer than the order (N={size}), so it "
                "goes round the order again; indices[:padding] gives only N of them. Repeat the order (order * k) "
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
    passed(f"the shards equal DistributedSampler's for {len(SIZES)} (N, n) pairs, 3 epochs/seeds, with and "
           "without shuffle and drop_last")


EVAL_SIZES = ((12, 4), (11, 2), (10, 4), (10, 3), (3, 8))  # (N, n): n divides N, pads, pads past the order


def gathered_predictions(size: int, world_size: int, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(what dist.all_gather returns in evaluation, the predictions in dataset order).

    Sample i's prediction is a class 0-9 (different samples can share one). Rank r predicts the shard that
    DistributedSampler(shuffle=False) gives it, padding included: gathered[r] is that shard's predictions.
    """
    predictions = torch.randint(0, 10, (size,), generator=torch.Generator().manual_seed(seed))
    gathered = [predictions[torch_shard(size, rank, world_size, 0, 0, False, False)] for rank in range(world_size)]
    return gathered, predictions


def _eval_mistake(got: torch.Tensor, gathered: list[torch.Tensor], size: int) -> str:
    """What is wrong with `got`, found by building each plausible wrong answer and comparing."""
    world_size, per_rank = len(gathered), len(gathered[0])
    dealt = torch.stack(gathered, dim=1).flatten()  # position p of the padded order: rank p mod n, item p // n
    padding = per_rank * world_size - size
    if len(got) == len(dealt) and padding:
        return (f"kept the repeats: you returned {len(got)} predictions for N={size} samples. The last "
                f"ceil(N/n)*n - N = {padding} positions of the padded order are copies: drop them.")
    if len(got) < size:
        return (f"you returned {len(got)} predictions for N={size} samples: drop positions, not values (two samples "
                "can have the same prediction, and torch.unique would merge them).")
    if len(got) != size:
        return f"return exactly N={size} predictions, one per sample; you returned {len(got)}."
    if padding and torch.equal(got, dealt[padding:]):
        return ("dropped the wrong end: the padding sits at the END of the padded order (it repeats the order's "
                "start), so keep the first N positions.")
    if torch.equal(got, torch.cat(gathered)[:size]):
        return ("you put the ranks' predictions one after the other, but the sampler dealt the order like cards: "
                "rank r's item i sat at position r + i*n. Interleave them.")
    return f"expected {gathered_predictions(size, world_size)[1].tolist()}, got {got.tolist()}."


def check_drop_padding(drop_padding: Callable) -> None:
    """drop_padding(gathered, dataset_size) -> the N predictions in dataset order, for gathered = the ranks'
    predictions over their DistributedSampler(shuffle=False) shards, padding included."""
    for size, world_size in EVAL_SIZES:
        gathered, expected = gathered_predictions(size, world_size)
        got = drop_padding([tensor.clone() for tensor in gathered], size)
        try:
            got = torch.as_tensor(got).flatten()
        except (TypeError, ValueError, RuntimeError):
            raise ExerciseFailed(f"return the predictions as one tensor (or a list of numbers), not {got!r}.") from None
        if not torch.equal(got.to(expected.dtype), expected):
            raise ExerciseFailed(f"N={size} on n={world_size} ranks: "
                                 + _eval_mistake(got.to(expected.dtype), gathered, size))
    passed(f"the predictions come back in dataset order, each sample once, for {len(EVAL_SIZES)} (N, n) pairs")
