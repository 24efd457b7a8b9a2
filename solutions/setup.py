"""Reference solution of notebook 00's exercise: the mean of a tensor over all ranks, returned on every rank."""
import torch.distributed as dist


def mean_over_ranks(tensor):
    """tensor (any shape) -> a new tensor of that shape: the element-wise mean over ranks; the input is left as it was."""
    total = tensor.clone()  # all_reduce writes into the tensor it is given: reduce a copy, not the caller's tensor
    dist.all_reduce(total, op=dist.ReduceOp.SUM)  # every rank waits here until every rank has called it
    return total / dist.get_world_size()
