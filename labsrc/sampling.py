"""How DistributedSampler shards data (epochs, set_epoch, padding vs drop_last), uneven inputs with Join, loader throughput."""
from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class IndexDataset(Dataset):
    """Item i is i: lets a sampler's choices be read straight off the batches."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def epoch_orders(dataset_size: int, world_size: int, epochs: int, set_epoch: bool = True,
                 drop_last: bool = False, seed: int = 0) -> dict[int, list[list[int]]]:
    """{rank: [the indices the rank reads in epoch 0, epoch 1, ...]} with shuffling on.

    Without sampler.set_epoch(epoch) the shuffle is seeded the same way every epoch: every epoch repeats
    the first one's order.
    """
    orders: dict[int, list[list[int]]] = {}
    for rank in range(world_size):
        sampler = DistributedSampler(IndexDataset(dataset_size), num_replicas=world_size, rank=rank,
                                     shuffle=True, seed=seed, drop_last=drop_last)
        orders[rank] = []
        for epoch in range(epochs):
            if set_epoch:
                sampler.set_epoch(epoch)
            orders[rank].append(list(sampler))
    return orders


def coverage(dataset_size: int, world_size: int, drop_last: bool) -> dict:
    """What one epoch reads over all ranks: samples read, distinct ones, duplicates (padding), dropped."""
    read = [i for rank_order in epoch_orders(dataset_size, world_size, 1, drop_last=drop_last).values()
            for i in rank_order[0]]
    distinct = len(set(read))
    return {"dataset_size": dataset_size, "world_size": world_size, "drop_last": drop_last,
            "per_rank": len(read) // world_size, "read": len(read), "distinct": distinct,
            "duplicates": len(read) - distinct, "dropped": dataset_size - distinct}


def train_uneven_with_join(ctx, batches_per_rank: list[int], seed: int = 0) -> dict:
    """DDP where rank r has batches_per_rank[r] batches, wrapped in Join so early finishers shadow the rest.

    Without Join, a rank that runs out of data stops calling all-reduce and every other rank waits for it
    until the process-group timeout. With Join the finished rank answers the others' all-reduces with zeros
    (and DDP divides by the ranks that really contributed).
    """
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(seed)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(seed + ctx.rank)
    steps = 0
    with Join([model]):
        for _ in range(batches_per_rank[ctx.rank]):
            inputs = torch.randn(8, 4, generator=generator)
            optimizer.zero_grad()
            model(inputs).pow(2).mean().backward()
            optimizer.step()
            steps += 1
    return {"rank": ctx.rank, "steps": steps, "weight": model.module.weight.detach().clone()}


class SlowTransform(Dataset):
    """Wraps a dataset so each item costs `cost_s` seconds, like decoding and augmenting a real image.

    The cost is a sleep: it stands for work that keeps a worker busy while leaving the core free, which is
    how several loader workers overlap even on a 2-core machine.
    """

    def __init__(self, dataset: Dataset, cost_s: float):
        self.dataset, self.cost_s = dataset, cost_s

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        time.sleep(self.cost_s)
        return self.dataset[index]


def time_batches(batches, steps: int, device, compute=None) -> dict:
    """Seconds waiting for each batch and computing on it, over `steps` batches after a first one.

    compute(images, labels) is the training step (None: data only). The first batch is excluded: it pays
    for starting workers.
    """
    iterator = iter(batches)
    next(iterator)
    data_s, compute_s = [], []
    for _ in range(steps):
        start = time.perf_counter()
        images, labels = next(iterator)
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        data_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        if compute is not None:
            compute(images, labels)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        compute_s.append(time.perf_counter() - start)
    return {"data_s": sum(data_s) / steps, "compute_s": sum(compute_s) / steps}


def loader(dataset: Dataset, batch_size: int, num_workers: int, pin_memory: bool, seed: int = 0) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=num_workers,
                      pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed))
