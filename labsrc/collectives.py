"""Collectives shown rank by rank, a ring all-reduce and a naive one written from send/recv, and their timing."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


def _single_tensor_collective(new_name: str, old_name: str):
    """Newer torch renames the single-tensor collectives (*_single); 2.11 only has the older names."""
    return getattr(dist, new_name, None) or getattr(dist, old_name)


def all_gather(output: torch.Tensor, piece: torch.Tensor) -> None:
    """Gather every rank's piece into output: (n * k,) <- (k,) from each rank, in rank order."""
    _single_tensor_collective("all_gather_single", "all_gather_into_tensor")(output, piece)


def neighbours(rank: int, world_size: int) -> tuple[int, int]:
    """(left, right) on the ring: receive from the left, send to the right."""
    return (rank - 1) % world_size, (rank + 1) % world_size


def _exchange(send: torch.Tensor, send_to: int, receive: torch.Tensor, receive_from: int) -> None:
    """Send and receive at once (isend/irecv), so two neighbours never wait on each other."""
    requests = [dist.isend(send.contiguous(), send_to), dist.irecv(receive, receive_from)]
    for request in requests:
        request.wait()


def ring_all_reduce(tensor: torch.Tensor, rank: int, world_size: int) -> int:
    """Sum `tensor` over all ranks in place with the ring algorithm; return the bytes this rank sent.

    The flat tensor is cut into world_size chunks (sizes may differ by one element).
    Reduce-scatter, n-1 steps: at step s rank r sends chunk (r - s) and adds the chunk (r - s - 1) it
    receives from its left neighbour; afterwards rank r owns the complete sum of chunk (r + 1).
    All-gather, n-1 steps: at step s rank r passes on chunk (r + 1 - s) and stores chunk (r - s).
    Each rank sends 2(n-1) chunks, 2(n-1)/n of the data, whatever n is.
    """
    if world_size == 1:
        return 0
    left, right = neighbours(rank, world_size)
    chunks = list(torch.tensor_split(tensor.view(-1), world_size))
    sent = 0
    for step in range(world_size - 1):
        outgoing, incoming = chunks[(rank - step) % world_size], chunks[(rank - step - 1) % world_size]
        buffer = torch.empty_like(incoming)
        _exchange(outgoing, right, buffer, left)
        incoming.add_(buffer)
        sent += outgoing.numel() * outgoing.element_size()
    for step in range(world_size - 1):
        outgoing, incoming = chunks[(rank + 1 - step) % world_size], chunks[(rank - step) % world_size]
        buffer = torch.empty_like(incoming)
        _exchange(outgoing, right, buffer, left)
        incoming.copy_(buffer)
        sent += outgoing.numel() * outgoing.element_size()
    return sent


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


def torch_all_reduce(tensor: torch.Tensor, rank: int, world_size: int) -> int:
    """dist.all_reduce, the backend's own algorithm; bytes sent are the backend's business (None)."""
    dist.all_reduce(tensor)
    return 0


ALGORITHMS = {"dist.all_reduce": torch_all_reduce, "ring (send/recv)": ring_all_reduce,
              "naive (to rank 0 and back)": naive_all_reduce}


def rank_values(rank: int, size: int, device) -> torch.Tensor:
    """A rank's input: (size,) float32 values that differ per rank and per element (exact in float32)."""
    return (torch.arange(size, dtype=torch.float32, device=device) % 7) + 10 * rank


def collective_tables(ctx) -> list[dict]:
    """Each collective on a tiny tensor: what this rank held before and after, as rows for a table."""
    rank, n, device = ctx.rank, ctx.world_size, ctx.device
    rows = []

    def row(name, before, after):
        rows.append({"collective": name, "before": before.tolist(), "after": after.tolist()})

    value = torch.tensor([float(rank)], device=device)
    if n > 1:
        before = value.clone()
        if rank == 0:
            dist.send(torch.tensor([42.0], device=device), 1)
        elif rank == 1:
            dist.recv(value, 0)
        row("send/recv (rank 0 sends 42 to rank 1)", before, value)
    value = torch.tensor([float(rank)], device=device)
    before = value.clone()
    dist.broadcast(value, src=0)
    row("broadcast from rank 0", before, value)
    value = torch.tensor([float(rank + 1)], device=device)
    before = value.clone()
    dist.all_reduce(value)
    row("all_reduce (sum)", before, value)
    full = torch.arange(n, dtype=torch.float32, device=device) + 10 * rank
    part = torch.empty(1, device=device)
    how = reduce_scatter(part, full)
    row(f"reduce_scatter (sum, one element each; {how})", full, part)
    gathered = torch.empty(n, device=device)
    all_gather(gathered, torch.tensor([float(rank)], device=device))
    row("all_gather", torch.tensor([float(rank)]), gathered)
    return rows


def reduce_scatter(output: torch.Tensor, full: torch.Tensor) -> str:
    """dist.reduce_scatter_tensor where the backend has it; else all_reduce then keep this rank's slice.

    Returns which of the two ran, so a notebook can say so.
    """
    try:
        _single_tensor_collective("reduce_scatter_single", "reduce_scatter_tensor")(output, full)
        return "reduce_scatter"
    except (RuntimeError, NotImplementedError):
        total = full.clone()
        dist.all_reduce(total)
        output.copy_(total.view(dist.get_world_size(), -1)[dist.get_rank()])
        return "all_reduce + slice"


def check_algorithms(ctx, sizes) -> list[dict]:
    """Every algorithm against dist.all_reduce on the same inputs: largest error and bytes sent per size."""
    rows = []
    for size in sizes:
        expected = rank_values(ctx.rank, size, ctx.device)
        dist.all_reduce(expected)
        for name, algorithm in ALGORITHMS.items():
            mine = rank_values(ctx.rank, size, ctx.device)
            sent = algorithm(mine, ctx.rank, ctx.world_size)
            rows.append({"algorithm": name, "size": size, "bytes": size * 4, "bytes_sent": sent,
                         "max_error": (mine - expected).abs().max().item()})
    return rows


def time_algorithm(algorithm, size: int, ctx, repeats: int) -> float:
    """Fastest of `repeats` timed calls (after warm-up calls, ranks started together), slowest rank's.

    The minimum filters out the interruptions a shared machine adds; what is left is the algorithm.
    """
    tensor = torch.ones(size, device=ctx.device)
    for _ in range(3):  # warm-up: the first calls pay for connections and allocations
        algorithm(tensor, ctx.rank, ctx.world_size)
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        start = time.perf_counter()
        algorithm(tensor, ctx.rank, ctx.world_size)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        seconds.append(time.perf_counter() - start)
    slowest = torch.tensor([min(seconds)])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective takes as long as its slowest rank
    return slowest.item()
