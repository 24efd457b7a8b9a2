"""Reference solutions of notebook 04's exercises (DDP's bucket assignment; an averaging comm hook)."""
import torch.distributed as dist


def assign_buckets(parameter_sizes_bytes, cap_bytes, first_cap_bytes):
    """Sizes in registration order -> buckets of parameter indices, bucket 0 first, filled last parameter first."""
    buckets, current, size = [], [], 0
    for index in reversed(range(len(parameter_sizes_bytes))):
        current.append(index)
        size += parameter_sizes_bytes[index]
        if size >= (cap_bytes if buckets else first_cap_bytes):  # closes once it reaches its cap
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def allreduce_average_hook(process_group, bucket):
    """bucket.buffer() (flat gradients) divided by the world size, summed over ranks; a Future of that tensor."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer().div_(group.size())
    future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return future.then(lambda done: done.value()[0])
