"""Collectives shown rank by rank, a ring all-reduce and a naive one written from send/recv, and their timing."""
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

    The backend's own reduce-scatter where it has one (gloo does in torch 2.11-2.14, NCCL always):
    "reduce_scatter". A backend without it gets all_reduce then this rank's slice, the same result
    for n times the traffic: "all_reduce_then_slice".
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


def _exchange(send: torch.Tensor, send_to: int, receive: torch.Tensor, receive_from: int,
              timeout: datetime.timedelta | None) -> None:
    """Send and receive at once, so two neighbours never wait on each other.

    batch_isend_irecv posts both before waiting (on NCCL inside one group, which NCCL needs when
    two ranks send to each other). A partner that never answers raises after `timeout` (default:
    the process group's), so a broken ring fails instead of hanging.
    """
    # A chunk can be empty (fewer elements than ranks); its partner's matching chunk is then empty too,
    # so both sides skip it and no backend is asked to move zero bytes.
    operations = [dist.P2POp(operation, tensor, peer) for operation, tensor, peer in
                  [(dist.isend, send.contiguous(), send_to), (dist.irecv, receive, receive_from)]
                  if tensor.numel() > 0]
    if not operations:
        return
    for request in dist.batch_isend_irecv(operations):
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
        _exchange(outgoing, right, buffer, left, timeout)
        incoming.add_(buffer)
        sent += outgoing.numel() * outgoing.element_size()
    for step in range(world_size - 1):  # all-gather: store what arrives
        outgoing, incoming = chunks[(rank + 1 - step) % world_size], chunks[(rank - step) % world_size]
        buffer = torch.empty_like(incoming)
        _exchange(outgoing, right, buffer, left, timeout)
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


def collective_tables(ctx) -> list[dict]:
    """Each collective on a tiny tensor: what this rank held before and after, as rows for a table.

    A row: collective (the key: send_recv, broadcast, all_reduce, reduce_scatter, all_gather), label
    (what a table shows), ran_as (which operation ran: the key, or all_reduce_then_slice), before, after.
    """
    rank, n, device = ctx.rank, ctx.world_size, tensor_device(ctx)
    scalar = lambda value: torch.tensor([float(value)], device=device)
    rows = []

    def row(key, label, before, after, ran_as=None):
        rows.append({"collective": key, "label": label, "ran_as": ran_as or key,
                     "before": before.tolist(), "after": after.tolist()})

    if n > 1:
        value = scalar(rank)
        if rank == 0:
            dist.send(scalar(42), 1)
        elif rank == 1:
            dist.recv(value, 0)
        row("send_recv", "send/recv (rank 0 sends 42 to rank 1)", scalar(rank), value)
    value = scalar(rank)
    dist.broadcast(value, src=0)
    row("broadcast", "broadcast from rank 0", scalar(rank), value)
    value = scalar(rank + 1)
    dist.all_reduce(value)
    row("all_reduce", "all_reduce (sum)", scalar(rank + 1), value)
    full, part = torch.arange(n, dtype=torch.float32, device=device) + 10 * rank, torch.empty(1, device=device)
    how = reduce_scatter(part, full)
    row("reduce_scatter", f"reduce_scatter (sum, one element each; ran as {how})", full, part, how)
    gathered = torch.empty(n, device=device)
    all_gather(gathered, scalar(rank))
    row("all_gather", "all_gather", scalar(rank), gathered)
    return rows


def check_sizes(world_size: int) -> list[int]:
    """Sizes that divide evenly by the world size and sizes that do not (including fewer than n elements)."""
    return sorted({1, world_size - 1 or 1, world_size + 1, 1000 * world_size, 1000 * world_size + 1, 4099})


def check_algorithms(ctx, sizes, timeout_s: float = 20.0) -> list[dict]:
    """Every algorithm against dist.all_reduce on the same inputs: largest error and bytes sent per size.

    Inputs are (size,) rank_values. The ring waits at most timeout_s for a message, so a ring with a
    wrong neighbour fails the check within that time instead of hanging.
    """
    device, rows = tensor_device(ctx), []
    algorithms = {**ALGORITHMS, "ring": lambda tensor, rank, world_size: ring_all_reduce(
        tensor, rank, world_size, datetime.timedelta(seconds=timeout_s))}
    for size in sizes:
        expected = rank_values(ctx.rank, size, device)
        dist.all_reduce(expected)
        for name, algorithm in algorithms.items():
            mine = rank_values(ctx.rank, size, device)
            sent = algorithm(mine, ctx.rank, ctx.world_size)
            formula = BYTES_FORMULAS.get(name)
            rows.append({"rank": ctx.rank, "algorithm": name, "size": size, "bytes": size * 4, "bytes_sent": sent,
                         "bytes_formula": formula(size, ctx.rank, ctx.world_size) if formula else None,
                         "max_error": (mine - expected).abs().max().item()})
    return rows


def broken_ring_error(ctx, neighbours_of, size: int, timeout_s: float) -> float:
    """The ring with other neighbours on (size,) rank_values: its largest error against dist.all_reduce.

    A ring whose messages never arrive raises after timeout_s instead of returning.
    """
    tensor = rank_values(ctx.rank, size, tensor_device(ctx))
    expected = tensor.clone()
    dist.all_reduce(expected)
    ring_all_reduce(tensor, ctx.rank, ctx.world_size, datetime.timedelta(seconds=timeout_s), neighbours_of)
    return (tensor - expected).abs().max().item()


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
