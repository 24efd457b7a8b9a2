"""Reference solutions of notebook 09's exercises (the segments for checkpointing; ZeRO-1's step)."""
import torch

from labsrc.lessons.memory_sharding.zero import flatten, unflatten_into
from labsrc.techniques.collectives import all_gather, reduce_scatter


def choose_segments(depth):
    """The divisor k of depth with the smallest k + depth / k (the saved block outputs)."""
    return min((k for k in range(1, depth + 1) if depth % k == 0), key=lambda k: k + depth // k)


def zero1_step(params, master_shard, optimizer, rank, world_size):
    """Reduce-scatter the gradients, average, step this rank's fp32 shard, all-gather the shards back."""
    flat_grads = flatten([p.grad for p in params], world_size)
    shard = torch.empty_like(master_shard)
    reduce_scatter(shard, flat_grads)
    master_shard.grad = shard / world_size
    optimizer.step()
    full = torch.empty(master_shard.numel() * world_size, dtype=master_shard.dtype)
    all_gather(full, master_shard.detach())
    with torch.no_grad():
        unflatten_into(full, params)
