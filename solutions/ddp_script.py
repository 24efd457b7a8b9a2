"""A whole DDP training script, the reference for notebook 01b. Every rank trains one small classifier on its
own shard of the data; DDP keeps the ranks' weights equal.

    torchrun --nproc-per-node=2 solutions/ddp_script.py --checkpoint /tmp/ddp/model.pt
"""
import argparse
import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SEED = 0  # the shuffle's seed and the first weights: the same on every rank
DATA_SEED = 1234  # the generated dataset: the same on every rank
DATASET_SIZE = 240  # splits evenly over 1 to 6 and 8 ranks
FEATURES, HIDDEN, CLASSES = 16, 32, 4
BATCH_PER_RANK = 8  # the global batch is BATCH_PER_RANK x world size
LEARNING_RATE = 0.2
EPOCHS = 3
TIMEOUT = datetime.timedelta(seconds=60)  # a collective that waits longer fails instead of hanging


# ---- given: data, model, optimizer, arguments ---------------------------------------------------------------

def make_dataset() -> TensorDataset:
    """DATASET_SIZE samples of FEATURES numbers, each labelled with one of CLASSES by a fixed rule."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    features = torch.randn(DATASET_SIZE, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    return TensorDataset(features, (features @ teacher).argmax(dim=1))


def make_model() -> nn.Module:
    """(batch, FEATURES) -> (batch, CLASSES); the same first weights on every rank."""
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="nccl or gloo; default: nccl when each rank has a GPU")
    parser.add_argument("--checkpoint", default="checkpoint.pt", help="where rank 0 saves the model")
    args = parser.parse_args(argv)
    Path(args.checkpoint).parent.mkdir(parents=True, exist_ok=True)  # torch.save makes no folders
    return args


# ---- the distributed part -----------------------------------------------------------------------------------

def choose_device(local_rank: int, backend: str | None) -> tuple[str, torch.device]:
    """(backend, device): NCCL when each rank has a GPU of its own, gloo otherwise."""
    gpus = torch.cuda.device_count()
    backend = backend or ("nccl" if gpus >= int(os.environ["LOCAL_WORLD_SIZE"]) else "gloo")
    if gpus == 0:
        return backend, torch.device("cpu")
    torch.cuda.set_device(local_rank % gpus)  # before any CUDA work
    return backend, torch.device("cuda", local_rank % gpus)


def make_loader(dataset) -> tuple[DistributedSampler, DataLoader]:
    """This rank's shard of the dataset, in batches of BATCH_PER_RANK."""
    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)  # rank and world size come from the group
    return sampler, DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler)


def train(model, loader, sampler, device, rank: int) -> list[float]:
    """EPOCHS of training; returns each epoch's loss over all ranks' samples, which rank 0 prints."""
    optimizer = make_optimizer(model)
    loss_function = nn.CrossEntropyLoss()
    history = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        loss_sum, count = 0.0, 0
        for features, labels in loader:
            features, labels = features.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = loss_function(model(features), labels)
            loss.backward()  # DDP averages the gradients over the ranks here
            optimizer.step()
            loss_sum += loss.item() * len(labels)
            count += len(labels)
        history.append(global_mean(loss_sum, count, device))
        if rank == 0:
            print(f"epoch {epoch}: loss {history[-1]:.4f}", flush=True)
    return history


def global_mean(loss_sum: float, count: int, device: torch.device) -> float:
    """The mean over every rank's samples: sums and counts added over the ranks, then divided."""
    totals = torch.tensor([loss_sum, count], dtype=torch.float64, device=device)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # every rank must call it
    return (totals[0] / totals[1]).item()


def save_and_reload(model, path: str, device: torch.device, rank: int) -> dict:
    """Rank 0 writes the checkpoint; every rank reads it back once it is complete, onto its own device."""
    if rank == 0:
        torch.save(model.module.state_dict(), path)  # the unwrapped model: no "module." in the keys
    dist.barrier()  # nobody reads before rank 0 has finished writing
    state = torch.load(path, map_location=device, weights_only=True)  # saved from rank 0's device: map it to ours
    model.module.load_state_dict(state)
    return state


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])  # set by torchrun
    backend, device = choose_device(local_rank, args.backend)
    dist.init_process_group(backend, timeout=TIMEOUT, device_id=device if backend == "nccl" else None)
    try:
        sampler, loader = make_loader(make_dataset())
        model = make_model().to(device)
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        train(model, loader, sampler, device, rank)
        save_and_reload(model, args.checkpoint, device, rank)
    finally:
        dist.destroy_process_group()  # also when training failed


if __name__ == "__main__":
    main()
