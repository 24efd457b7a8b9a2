"""Reference solutions of notebook 06b's exercises (a hierarchical all-reduce; its predicted speed-up)."""
import torch
import torch.distributed as dist


def hierarchical_all_reduce(tensor, inside_group, across_group):
    """Sum the flat tensor (numel,) over every rank in place: reduce-scatter in the node, all-reduce across, all-gather."""
    ranks_per_node = dist.get_world_size(inside_group)
    flat = tensor.view(-1)
    shard_size = -(-flat.numel() // ranks_per_node)  # pad to a multiple of the node's ranks
    padded = torch.zeros(shard_size * ranks_per_node)
    padded[:flat.numel()] = flat
    shard = torch.empty(shard_size)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter(shard, padded, group=inside_group)  # my node's sum of shard l (l = my local rank)
    dist.all_reduce(shard, group=across_group)  # the same shard from every node: only this crosses the link
    all_gather(padded, shard, group=inside_group)  # every summed shard, in local-rank order
    flat.copy_(padded[:flat.numel()])


def predict_speedup(nodes, ranks_per_node):
    """Flat ring / hierarchical on a slow link, large messages: 2(n-1)/n nbytes against 2(N-1)/N nbytes, n = gN."""
    if nodes == 1:
        return 1.0
    ranks = nodes * ranks_per_node
    return (2 * (ranks - 1) / ranks) / (2 * (nodes - 1) / nodes)
