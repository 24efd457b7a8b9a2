"""Reference solutions of notebook 11's exercises (bounded-staleness admission; local SGD's averaging step)."""
import datetime

import torch.distributed as dist


def admit(server_version, gradient_version, bound):
    """True when the gradient was computed at most `bound` updates ago."""
    return server_version - gradient_version <= bound


def average_parameters(parameters, group=None, timeout_s=30.0):
    """parameters (features,) replaced in place by their mean over the group's ranks."""
    dist.all_reduce(parameters, op=dist.ReduceOp.SUM, group=group,
                    async_op=True).wait(datetime.timedelta(seconds=timeout_s))
    parameters.div_(dist.get_world_size(group))
