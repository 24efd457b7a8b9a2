"""How DistributedSampler shards data (epochs, set_epoch, padding vs drop_last), uneven inputs with Join, loader timing."""
from __future__ import annotations

import datetime
import re
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from labsrc.training.timing import timed


class IndexDataset(Dataset):
    """Item i is i: lets a sampler's choices be read straight off the batches."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def rank_epoch_orders(dataset_size: int, rank: int, world_size: int, epochs: int, set_epoch: bool = True,
                      drop_last: bool = False, seed: int = 0, batch_size: int = 2) -> list[list[int]]:
    """[the indices rank `rank` reads in epoch 0, epoch 1, ...], read through a DataLoader as training does.

    The loop is the one every training script needs: `sampler.set_epoch(epoch)` before each epoch. Without
    it the shuffle is seeded the same way every epoch, so every epoch repeats the first one's order.
    """
    sampler = DistributedSampler(IndexDataset(dataset_size), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=seed, drop_last=drop_last)
    loader = DataLoader(IndexDataset(dataset_size), batch_size=batch_size, sampler=sampler)
    orders = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        orders.append([int(index) for batch in loader for index in batch])
    return orders


def epoch_orders(dataset_size: int, world_size: int, epochs: int, set_epoch: bool = True,
                 drop_last: bool = False, seed: int = 0) -> dict[int, list[list[int]]]:
    """{rank: rank_epoch_orders(...)} for every rank, computed in this one process."""
    return {rank: rank_epoch_orders(dataset_size, rank, world_size, epochs, set_epoch, drop_last, seed)
            for rank in range(world_size)}


def count_reads(shards: list[list[int]], dataset_size: int) -> dict:
    """What one epoch's shards (one list of indices per rank) read: samples read, distinct, duplicates, dropped.

    duplicates = reads beyond the first of a sample (padding); dropped = samples no rank read.
    """
    read = [index for shard in shards for index in shard]
    distinct = len(set(read))
    return {"per_rank": [len(shard) for shard in shards], "read": len(read), "distinct": distinct,
            "duplicates": len(read) - distinct, "dropped": dataset_size - distinct}


def coverage(dataset_size: int, world_size: int, drop_last: bool) -> dict:
    """count_reads of one epoch of torch's DistributedSampler on every rank, computed in this one process."""
    shards = [orders[0] for orders in epoch_orders(dataset_size, world_size, 1, drop_last=drop_last).values()]
    counted = count_reads(shards, dataset_size)
    return {**counted, "dataset_size": dataset_size, "world_size": world_size, "drop_last": drop_last,
            "per_rank": counted["per_rank"][0]}


def expected_coverage(dataset_size: int, world_size: int, drop_last: bool) -> tuple[int, int]:
    """(duplicates, dropped) by formula, from torch/utils/data/distributed.py.

    Padding appends ceil(N/n)*n - N indices taken from the start of the shuffled order (cycling through it
    again when that is more than N); drop_last cuts the last N mod n indices of the shuffled order.
    """
    if drop_last:
        return 0, dataset_size % world_size
    return -(-dataset_size // world_size) * world_size - dataset_size, 0


def padding_repeats_the_start(shards: list[list[int]], dataset_size: int) -> bool:
    """Are the padded positions N, N+1, ... of the interleaved order copies of positions 0, 1, ...?

    shards: one epoch, one list per rank, as DistributedSampler(drop_last=False) gave them: position p of the
    padded order is rank p mod n's item p // n.
    """
    world_size = len(shards)
    at = lambda position: shards[position % world_size][position // world_size]
    total = sum(len(shard) for shard in shards)
    return all(at(dataset_size + extra) == at(extra % dataset_size) for extra in range(total - dataset_size))


def uneven_steps(model, optimizer, batches: int, generator: torch.Generator, join: bool,
                 finished: list[float]) -> None:
    """`batches` DDP steps on random (8, 4) inputs, inside Join or not; appends each step's end time to `finished`.

    Ranks call it with different `batches`. Every backward all-reduces the gradients (this model has no buffers;
    with BatchNorm the forward's buffer broadcast would be the first collective), so without Join the rank with
    more batches waits in its extra backward for a partner that has stopped.
    """
    from torch.distributed.algorithms.join import Join
    with Join([model]) if join else nullcontext():
        for _ in range(batches):
            inputs = torch.randn(8, 4, generator=generator)
            loss = model(inputs).pow(2).mean()  # mse against zeros
            optimizer.zero_grad()
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            finished.append(time.perf_counter())


def train_uneven(ctx, batches_per_rank: list[int], join: bool, timeout_s: float, seed: int = 0) -> dict:
    """DDP where rank r has batches_per_rank[r] batches, inside Join or not; returns what happened on this rank.

    Without Join the rank that runs out stops all-reducing and the others' next backward waits for it. Here the
    finished rank then waits in another collective (the barrier below), so the wait is a hang: in a real job it
    lasts until the process-group timeout (10 min for NCCL, 30 for gloo by default). A finished rank that exits
    instead breaks the connection, and one that goes on to its next epoch pairs its all-reduces with the
    others' leftover steps. Here the model lives on a gloo group whose collectives give up after timeout_s (on
    the CPU even under NCCL, where a timeout aborts the process), so the hang becomes a recorded error.
    With Join a finished rank answers the others' all-reduces with zero gradients until all are done (each
    forward adds two one-element all-reduces that tell the ranks who is still training), and Join's post-hook
    broadcasts the model of a rank that joined last (the highest-numbered of them) to every rank. DDP still
    divides each rank's gradient by the initial world size before summing (divide_by_initial_world_size=True):
    `uneven_reference` replays that. Times are recorded from a barrier just before the first step.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    torch.manual_seed(seed)
    module = torch.nn.Linear(4, 1)
    dist.barrier()  # arrive together: DDP's construction already communicates on the short-timeout group
    model = DDP(module, process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(seed + ctx.rank)
    error, error_type, waited_s = None, None, 0.0
    dist.barrier()  # start the clocks together: the timeline compares the ranks' step times
    finished = [time.perf_counter()]
    try:
        uneven_steps(model, optimizer, batches_per_rank[ctx.rank], generator, join, finished)
    except RuntimeError as exc:  # gloo's timeout (DistBackendError is a RuntimeError)
        waited_s = time.perf_counter() - finished[-1]  # since the last step that completed
        error_type, error = type(exc).__name__, short_error(exc)
    left_s = time.perf_counter() - finished[0]
    dist.barrier()  # the rank that finished first waits here until the stuck one gave up
    dist.destroy_process_group(group)
    return {"join": join, "steps": len(finished) - 1, "planned": batches_per_rank[ctx.rank],
            "error_type": error_type, "error": error, "waited_s": waited_s, "timeout_s": timeout_s,
            "step_end_s": [end - finished[0] for end in finished[1:]], "left_s": left_s,
            "weight": model.module.weight.detach().flatten().tolist()}


def short_error(exc: BaseException) -> str:
    """The first line of a collective's error, without the C++ source location gloo puts in front of it."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", first)


def uneven_reference(batches_per_rank: list[int], seed: int = 0, lr: float = 0.1,
                     divide_by_initial_world_size: bool = True) -> torch.Tensor:
    """The weight (1, 4) that DDP with Join reaches, computed in one process without any collective.

    Step s averages the gradients of the ranks that still have a batch, the others counting as zeros:
    sum over active ranks / world size (or / active ranks, with divide_by_initial_world_size=False).
    Same model seed, inputs and SGD as train_uneven.
    """
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    generators = [torch.Generator().manual_seed(seed + rank) for rank in range(len(batches_per_rank))]
    for step_index in range(max(batches_per_rank)):
        total = [torch.zeros_like(parameter) for parameter in model.parameters()]
        active = sum(step_index < batches for batches in batches_per_rank)
        divisor = len(batches_per_rank) if divide_by_initial_world_size else active
        for rank, generator in enumerate(generators):
            if step_index < batches_per_rank[rank]:
                loss = model(torch.randn(8, 4, generator=generator)).pow(2).mean()
                for accumulated, grad in zip(total, torch.autograd.grad(loss, list(model.parameters()))):
                    accumulated += grad
        with torch.no_grad():
            for parameter, accumulated in zip(model.parameters(), total):
                parameter -= lr * accumulated / divisor
    return model.weight.detach().clone()


class SlowTransform(Dataset):
    """Wraps a dataset so each item costs `cost_s` seconds, like decoding and augmenting a real image.

    The cost is a sleep: it keeps a worker busy while leaving the core free, so several workers overlap even
    on a 2-core machine. A real decode computes: workers beyond the free cores would not speed it up, so the
    sleep shows the best case that workers can reach.
    """

    def __init__(self, dataset: Dataset, cost_s: float):
        self.dataset, self.cost_s = dataset, cost_s

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        time.sleep(self.cost_s)
        return self.dataset[index]


def time_batches(batches, steps: int, device, compute=None) -> dict:
    """Mean seconds per step waiting for the batch (and its copy to `device`) and computing on it.

    batches: an iterable of (images (B, C, H, W), labels (B,)) with at least steps + 1 batches.
    compute(images, labels) is the training step (None: data only). The first batch and its step are a
    warm-up, not timed: it pays for starting workers and for the first forward and backward. Both phases
    are timed with the course's one timer, which waits for queued GPU work.
    """
    iterator = iter(batches)
    images, labels = next(iterator)
    if compute is not None:
        compute(images.to(device), labels.to(device))
    data_s, compute_s = [], []
    for _ in range(steps):
        with timed(device) as waited:
            images, labels = next(iterator)
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with timed(device) as computed:
            if compute is not None:
                compute(images, labels)
        data_s.append(waited["s"])
        compute_s.append(computed["s"])
    # Means: they set the pace (steps take steps x (mean wait + mean compute)). With workers the waits come in
    # two groups, long and short, so a median would fall between them, on a value no step had.
    return {"steps": steps, "data_s": statistics.mean(data_s), "compute_s": statistics.mean(compute_s),
            "data_steps_s": data_s, "compute_steps_s": compute_s}


def transform_floor_s(batch: int, cost_s: float, num_workers: int) -> float:
    """The least time per step the loader needs to produce one batch: batch x cost, shared by the workers.

    With no workers the rank decodes every sample itself, inside its wait (divisor 1); n workers decode n
    batches at once, so in a steady state one batch is ready every batch x cost / n seconds.
    """
    return batch * cost_s / max(1, num_workers)


def data_bound(data_s: float, compute_s: float) -> bool:
    """True when a step waits longer for its batch than it computes on it.

    A step is wait + compute, one after the other on the rank. When the wait is the larger part, a model
    that cost nothing would at most halve the step, while a loader that cost nothing would remove more than
    half of it: the loader is where speed is won.
    """
    return data_s > compute_s


def find_arm(rows: list, source: str, num_workers: int = 0, pin_memory: bool = False):
    """The one throughput row with this source ("slow_transform", "plain" or "resident"), workers and pinning."""
    found = [row for row in rows
             if (row.source, row.num_workers, row.pin_memory) == (source, num_workers, pin_memory)]
    if len(found) != 1:
        raise KeyError(f"{len(found)} rows for source={source!r}, num_workers={num_workers}, pin_memory={pin_memory}")
    return found[0]
