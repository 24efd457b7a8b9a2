"""Reference solutions of notebook 02's exercises (a ring all-reduce from send/recv; its alpha-beta time)."""
import datetime

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=30)


def ring_all_reduce(tensor, rank, world_size):
    """Sum the flat tensor (N,) over all ranks, in place: n-1 reduce-scatter steps, then n-1 all-gather steps."""
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    chunks = tensor.view(-1).tensor_split(world_size)  # views: writing to a chunk writes to the tensor

    def pass_right(outgoing, incoming):
        """Send `outgoing` to the right while receiving a chunk shaped like `incoming` from the left."""
        arrived = torch.empty_like(incoming)
        operations = [dist.P2POp(dist.isend, outgoing.contiguous(), right), dist.P2POp(dist.irecv, arrived, left)]
        for request in dist.batch_isend_irecv(operations):
            request.wait(TIMEOUT)
        return arrived

    for step in range(world_size - 1):  # reduce-scatter: add what arrives
        incoming = chunks[(rank - step - 1) % world_size]
        incoming.add_(pass_right(chunks[(rank - step) % world_size], incoming))
    for step in range(world_size - 1):  # all-gather: store what arrives
        incoming = chunks[(rank - step) % world_size]
        incoming.copy_(pass_right(chunks[(rank + 1 - step) % world_size], incoming))


def predict_time(alpha, beta, nbytes, n):
    """Seconds of a ring all-reduce of nbytes on n ranks over links of alpha s per message, beta s per byte."""
    return 2 * (n - 1) * (alpha + nbytes / n * beta)
