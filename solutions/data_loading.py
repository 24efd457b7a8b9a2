"""Reference solutions of notebook 03's exercises (a rank's DistributedSampler shard; the padding counts)."""
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


def shard_counts(dataset_size, world_size, drop_last):
    """(per_rank, duplicates, dropped) over all ranks in one epoch of DistributedSampler."""
    if drop_last:
        return dataset_size // world_size, 0, dataset_size % world_size
    per_rank = math.ceil(dataset_size / world_size)
    return per_rank, per_rank * world_size - dataset_size, 0
