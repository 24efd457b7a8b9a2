"""Reference solutions of notebook 03's exercises (a rank's DistributedSampler shard; evaluation without the
padding)."""
import math

import torch


def shard_indices(dataset_size, rank, world_size, epoch, seed, shuffle, drop_last):
    """The indices DistributedSampler gives `rank` in `epoch`: one shared order, cut or padded, then strided."""
    if shuffle:
        generator = torch.Generator().manual_seed(seed + epoch)  # the same on every rank
        order = torch.randperm(dataset_size, generator=generator).tolist()
    else:
        order = list(range(dataset_size))
    if drop_last:
        per_rank = dataset_size // world_size
        order = order[:per_rank * world_size]  # the tail of the order is dropped
    else:
        per_rank = math.ceil(dataset_size / world_size)
        padding = per_rank * world_size - dataset_size
        repeats = math.ceil(padding / dataset_size) if padding else 0
        order = order + (order * repeats)[:padding]  # padding repeats the start of the order
    return order[rank::world_size]


def drop_padding(gathered, dataset_size):
    """The N predictions in dataset order from the ranks' gathered predictions (DistributedSampler, shuffle=False).

    Rank r's item i sat at position r + i*n of the padded order, so stacking the ranks as columns and reading row
    by row restores that order; the padded copies are its last positions.
    """
    return torch.stack(gathered, dim=1).flatten()[:dataset_size]
