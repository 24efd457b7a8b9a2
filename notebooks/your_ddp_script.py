"""Your own DDP training script (notebook 01b). Every rank trains one small classifier on its own shard of the
data; DDP keeps the ranks' weights equal. Replace each TODO, then run the notebook's checks.

    torchrun --nproc-per-node=2 notebooks/your_ddp_script.py --checkpoint /tmp/ddp/model.pt
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


# ---- the distributed part: yours (each TODO raises until you replace it) ----------------------------------

def choose_device(local_rank: int, backend: str | None) -> tuple[str, torch.device]:
    """(backend, device): NCCL when each rank has a GPU of its own, gloo otherwise."""
    gpus = torch.cuda.device_count()
    backend = backend or ("nccl" if gpus >= int(os.environ["LOCAL_WORLD_SIZE"]) else "gloo")
    if gpus == 0:
        return backend, torch.device("cpu")
    # TODO 1: set GPU local_rank % gpus as this process's GPU. Return (backend, torch.device("cuda", that GPU)).
    raise NotImplementedError("TODO 1: torch.cuda.set_device")


def make_loader(dataset) -> tuple[DistributedSampler, DataLoader]:
    """This rank's shard of the dataset, in batches of BATCH_PER_RANK."""
    # TODO 3: a DistributedSampler over the dataset, shuffled with SEED, and a DataLoader of
    # BATCH_PER_RANK that uses it; return both.
    raise NotImplementedError("TODO 3: DistributedSampler and DataLoader")


def train(model, loader, sampler, device, rank: int) -> list[float]:
    """EPOCHS of training; returns each epoch's loss over all ranks' samples, which rank 0 prints."""
    optimizer = make_optimizer(model)
    loss_function = nn.CrossEntropyLoss()
    history = []
    for epoch in range(EPOCHS):
        # TODO 5: tell the sampler which epoch this is, so that each epoch is shuffled anew.
        raise NotImplementedError("TODO 5: sampler.set_epoch")
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
    # TODO 6: put loss_sum and count in one float64 tensor on `device`, sum it over the ranks, return sum / count.
    raise NotImplementedError("TODO 6: dist.all_reduce")


def save_and_reload(model, path: str, device: torch.device, rank: int) -> dict:
    """Rank 0 writes the checkpoint; every rank reads it back once it is complete, onto its own device."""
    # TODO 7: rank 0 saves the unwrapped model's state_dict to `path`. No rank reads before the file is complete.
    # Then every rank loads it onto its own device (weights_only=True), loads it into model.module, returns it.
    raise NotImplementedError("TODO 7: save on rank 0, barrier, load with map_location")


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])  # set by torchrun
    backend, device = choose_device(local_rank, args.backend)
    # TODO 2: join the process group with this backend and TIMEOUT. With NCCL, also pass device_id=device.
    raise NotImplementedError("TODO 2: dist.init_process_group")
    try:
        sampler, loader = make_loader(make_dataset())
        model = make_model().to(device)
        # TODO 4: wrap the model in DistributedDataParallel (device_ids: [device.index] on a GPU, None on the CPU).
        raise NotImplementedError("TODO 4: DistributedDataParallel")
        train(model, loader, sampler, device, rank)
        save_and_reload(model, args.checkpoint, device, rank)
    finally:
        pass  # TODO 8: leave the process group here, so that it happens even when training failed.


if __name__ == "__main__":
    main()
