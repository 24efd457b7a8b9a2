"""A ring all-reduce and a naive one written from send/recv, the bytes each sends, and an all-reduce timed by size.

Lesson 02 shows and checks them (labsrc/lessons/collectives/); lessons 06, 09 and 11 reuse the timing, the
single-tensor collectives and the ring's byte count.
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from labsrc.training.timing import synchronize


def _single_tensor_collective(new_name: str, old_name: str):
    """Newer torch renames the single-tensor collectives (*_single); 2.11 only has the older names."""
    return getattr(dist, new_name, None) or getattr(dist, old_name)


def all_gather(output: torch.Tensor, piece: torch.Tensor) -> None:
    """Gather every rank's piece into output: (n * k,) <- (k,) from each rank, in rank order."""
    _single_tensor_collective("all_gather_single", "all_gather_into_tensor")(output, piece)


def reduce_scatter(output: torch.Tensor, full: torch.Tensor) -> str:
    """Sum (n * k,) inputs over ranks, keep slice r of length k on rank r; return how it ran.

    The backend's own reduce-scatter where it accepts the call (NCCL, and gloo in torch 2.11-2.14):
    "reduce_scatter". Gloo accepts it but has no real reduce-scatter: in torch 2.14 it clones the whole input,
    all-reduces it and keeps a slice (ProcessGroupGloo.cpp, reduce_scatter_tensor_coalesced; the profiler shows
    gloo:all_reduce), so on the wire it costs an all-reduce, 2(n-1)/n of the data per rank, not a ring
    reduce-scatter's (n-1)/n. A backend that refuses the call gets the same all_reduce then this rank's slice
    here: "all_reduce_then_slice".
    """
    try:
        _single_tensor_collective("reduce_scatter_single", "reduce_scatter_tensor")(output, full)
        return "reduce_scatter"
    except (RuntimeError, NotImplementedError) as error:
        if "support" not in str(error).lower():
            raise
    total = full.clone()
    dist.all_reduce(total)
    output.copy_(total.view(dist.get_world_size(), -1)[dist.get_rank()])
    return "all_reduce_then_slice"


def neighbours(rank: int, world_size: int) -> tuple[int, int]:
    """(left, right) on the ring: receive from the left, send to the right."""
    return (rank - 1) % world_size, (rank + 1) % world_size


def exchange(send: torch.Tensor, send_to: int, receive: torch.Tensor, receive_from: int,
             timeout: datetime.timedelta | None = None) -> None:
    """One step of the ring: send `send` to one neighbour while receiving into `receive` from the other.

    Both operations are posted before either waits, so two ranks never wait on each other's send. A partner
    that never answers raises after `timeout` (default: the process group's): a broken ring fails, not hangs.
    """
    operations = []
    if send.numel() > 0:  # a chunk is empty when there are fewer elements than ranks; its partner's is too
        operations.append(dist.P2POp(dist.isend, send.contiguous(), send_to))
    if receive.numel() > 0:
        operations.append(dist.P2POp(dist.irecv, receive, receive_from))
    if not operations:
        return
    for request in dist.batch_isend_irecv(operations):  # both posted; now wait for each
        if timeout is None:
            request.wait()
        else:
            request.wait(timeout)


def ring_all_reduce(tensor: torch.Tensor, rank: int, world_size: int,
                    timeout: datetime.timedelta | None = None, neighbours_of=None) -> int:
    """Sum `tensor` over all ranks in place with the ring algorithm; return the bytes this rank sent.

    The flat tensor (N,) is cut into world_size chunks (sizes differ by at most one element).
    Reduce-scatter, n-1 steps: at step s rank r sends chunk (r - s) and adds the chunk (r - s - 1) it
    receives from its left neighbour; afterwards rank r owns the complete sum of chunk (r + 1).
    All-gather, n-1 steps: at step s rank r passes on chunk (r + 1 - s) and stores chunk (r - s).
    Each rank sends 2(n-1) chunks, 2(n-1)/n of the data, whatever n is.
    neighbours_of(rank, n) -> (left, right) defaults to `neighbours`; another one shows a broken ring.
    """
    if world_size == 1:
        return 0
    left, right = (neighbours_of or neighbours)(rank, world_size)
    chunks = list(torch.tensor_split(tensor.view(-1), world_size))
    sent = 0
    for step in range(world_size - 1):  # reduce-scatter: add what arrives
        outgoing, incoming = chunks[(rank - step) % world_size], chunks[(rank - step - 1) % world_size]
        buffer = torch.empty_like(incoming)
        exchange(outgoing, right, buffer, left, timeout)
        incoming.add_(buffer)
        sent += outgoing.numel() * outgoing.element_size()
    for step in range(world_size - 1):  # all-gather: store what arrives
        outgoing, incoming = chunks[(rank + 1 - step) % world_size], chunks[(rank - step) % world_size]
        buffer = torch.empty_like(incoming)
        exchange(outgoing, right, buffer, left, timeout)
        incoming.copy_(buffer)
        sent += outgoing.numel() * outgoing.element_size()
    return sent


def chunk_sizes(size: int, world_size: int) -> list[int]:
    """Elements in each of the ring's chunks: the first size % n chunks hold one element more."""
    base, extra = divmod(size, world_size)
    return [base + (1 if index < extra else 0) for index in range(world_size)]


def ring_bytes_sent(size: int, rank: int, world_size: int, element_size: int = 4) -> int:
    """What ring_all_reduce must send from `rank`, by counting chunks rather than by running it.

    Reduce-scatter sends every chunk but (r + 1), all-gather every chunk but (r + 2):
    2N - chunk(r + 1) - chunk(r + 2) elements, i.e. 2(n-1)/n * N when n divides N.
    """
    if world_size == 1:
        return 0
    chunks = chunk_sizes(size, world_size)
    elements = 2 * size - chunks[(rank + 1) % world_size] - chunks[(rank + 2) % world_size]
    return elements * element_size


def naive_all_reduce(tensor: torch.Tensor, rank: int, world_size: int, root: int = 0) -> int:
    """Sum over ranks in place: everyone sends to the root, the root adds and sends the sum back to each.

    The root sends (n-1) whole tensors and receives as many: its link is the bottleneck as n grows.
    Returns the bytes this rank sent.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if world_size == 1:
        return 0
    if rank == root:
        buffer = torch.empty_like(tensor)
        for other in range(world_size):
            if other != root:
                dist.recv(buffer, other)
                tensor.add_(buffer)
        for other in range(world_size):
            if other != root:
                dist.send(tensor, other)
        return (world_size - 1) * nbytes
    dist.send(tensor, root)
    dist.recv(tensor, root)
    return nbytes


def naive_bytes_sent(size: int, rank: int, world_size: int, element_size: int = 4, root: int = 0) -> int:
    """What naive_all_reduce must send from `rank`: (n-1) N from the root, N from every other rank."""
    if world_size == 1:
        return 0
    return (world_size - 1 if rank == root else 1) * size * element_size


def torch_all_reduce(tensor: torch.Tensor, rank: int, world_size: int) -> None:
    """dist.all_reduce, the backend's own algorithm; what it sends is the backend's business (None)."""
    dist.all_reduce(tensor)
    return None


ALGORITHMS = {"dist.all_reduce": torch_all_reduce, "ring": ring_all_reduce, "naive": naive_all_reduce}
"""Every all-reduce the lab checks and times, by the name records and summaries use."""

BYTES_FORMULAS = {"ring": ring_bytes_sent, "naive": naive_bytes_sent}
"""The bytes each hand-written algorithm must send per rank: formula(size, rank, world_size)."""


def tensor_device(ctx) -> torch.device:
    """Where the lab's tensors live: the rank's GPU on NCCL; host memory on gloo, whose send/recv copy host bytes."""
    return ctx.device if ctx.backend == "nccl" else torch.device("cpu")


def rank_values(rank: int, size: int, device) -> torch.Tensor:
    """A rank's input: (size,) float32 values that differ per rank and per element (sums exact in float32)."""
    return (torch.arange(size, dtype=torch.float32, device=device) % 7) + 10 * rank


REPEAT_TARGET_S = 0.02  # a timed repeat lasts about this long, so a stall of a few ms is a part of it, not a multiple


def calls_per_repeat(algorithm, tensor: torch.Tensor, ctx, warmup: int = 3) -> int:
    """Warm up, then how many back-to-back calls make one timed repeat last about REPEAT_TARGET_S.

    The first calls pay for connections and allocations. The fastest warm-up call estimates one
    call; all ranks take the smallest estimate (the least disturbed) and so run the same number of calls.
    """
    fastest = float("inf")
    for _ in range(warmup):
        synchronize(tensor.device)
        start = time.perf_counter()
        algorithm(tensor, ctx.rank, ctx.world_size)
        synchronize(tensor.device)
        fastest = min(fastest, time.perf_counter() - start)
    estimate = torch.tensor([fastest], dtype=torch.float64, device=tensor.device)
    dist.all_reduce(estimate, op=dist.ReduceOp.MIN)
    return max(1, min(1000, round(REPEAT_TARGET_S / estimate.item())))


def _time_loop(algorithm, tensor: torch.Tensor, ctx, calls: int) -> float:
    """Seconds per call over `calls` back-to-back calls, ranks started together, GPU work included."""
    dist.barrier()
    synchronize(tensor.device)
    start = time.perf_counter()
    for _ in range(calls):
        algorithm(tensor, ctx.rank, ctx.world_size)
    synchronize(tensor.device)
    return (time.perf_counter() - start) / calls


def sweep(ctx, sizes, repeats: int, algorithms: dict | None = None, on_repeat=None) -> dict:
    """{(algorithm name, size): {"seconds": [per-call seconds of each repeat], "calls": calls per repeat}}.

    As nccl-tests does, a repeat times a loop of back-to-back calls and divides by their number.
    Repeats go round every (algorithm, size) in turn, so a burst of load from elsewhere on the machine
    slows one repeat of every point rather than every repeat of one point. A collective lasts until its
    last rank is done: each repeat keeps the slowest rank's time. Tensors are (size,) float32 zeros,
    so repeated sums never overflow.
    """
    algorithms = algorithms or ALGORITHMS
    tensors = {size: torch.zeros(size, device=tensor_device(ctx)) for size in sizes}
    calls = {(name, size): calls_per_repeat(algorithms[name], tensors[size], ctx)
             for name in algorithms for size in sizes}
    seconds: dict = {key: [] for key in calls}
    for repeat in range(repeats):
        for (name, size), count in calls.items():
            seconds[(name, size)].append(_time_loop(algorithms[name], tensors[size], ctx, count))
        if on_repeat is not None:
            on_repeat(repeat + 1)
    slowest = torch.tensor(list(seconds.values()), dtype=torch.float64, device=tensor_device(ctx))
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {key: {"seconds": row, "calls": calls[key]} for key, row in zip(seconds, slowest.tolist())}


def time_algorithm(algorithm, size: int, ctx, repeats: int) -> float:
    """Fastest of `repeats` timed loops of one algorithm on (size,) float32: seconds per call, slowest rank.

    The fastest window is the one other work on the machine disturbed least: what the algorithm costs.
    """
    return min(sweep(ctx, [size], repeats, {"algorithm": algorithm})[("algorithm", size)]["seconds"])
