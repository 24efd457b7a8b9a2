"""Your own DDP training script (notebook 01b): fill in every TODO, then launch it from the notebook.

    torchrun --nproc-per-node=2 notebooks/your_ddp_script.py --report-dir /tmp/ddp --checkpoint /tmp/ddp/model.pt

Every rank trains the same small classifier on its shard of a generated dataset; gradients are averaged by
DDP; rank 0 prints the metrics all-reduced over the ranks and writes the checkpoint, which every rank then
reads back. With --report-dir each rank also writes rank<r>.json (numbers for the course's checker).
"""
import argparse
import atexit
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SEED = 0  # the same initial weights on every rank (DDP also broadcasts rank 0's at wrapping)
DATA_SEED = 1234  # the generated dataset: the same on every rank, so ranks differ only in their shard
DATASET_SIZE = 240  # splits evenly over 1, 2, 3, 4, 5, 6 and 8 ranks
FEATURES, HIDDEN, CLASSES = 16, 32, 4
BATCH_PER_RANK = 8  # samples per rank per step: global batch = BATCH_PER_RANK x world size
LEARNING_RATE = 0.2
EPOCHS = 3
TIMEOUT = datetime.timedelta(seconds=60)  # every collective gives up after this instead of hanging
FAILURE_ENV = "LABSRC_DDP_SCRIPT_FAIL"  # the checker sets it to a folder: describe() then raises (a failure run)


# ---- given: data, model, optimizer, and the report the course's checker reads (keep as is) ----------------------------

def make_dataset() -> TensorDataset:
    """DATASET_SIZE samples: features (N, FEATURES) ~ N(0, 1), labels (N,) in [0, CLASSES) from a fixed linear rule."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    features = torch.randn(DATASET_SIZE, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    return TensorDataset(features, (features @ teacher).argmax(dim=1))


def make_model() -> nn.Module:
    """(batch, FEATURES) -> (batch, CLASSES) logits; the same weights wherever it is built after the seed."""
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)


def parameter_checksum(state: dict) -> float:
    """One number for a state_dict: the float64 sum of every tensor (equal states give equal sums)."""
    return float(sum(tensor.detach().double().sum().item() for tensor in state.values()))


def note(report: dict, event: str) -> None:
    """Note that `event` happened on this rank now ('saved' after torch.save, 'loading' before torch.load).

    'saved' first pauses half a second, as a large checkpoint would take to write: a rank that reads without
    waiting for the barrier then reads before 'saved', every time, instead of winning a race by luck.
    """
    if event == "saved":
        time.sleep(0.5)
    report["events"].append([event, time.time()])


def group_timeout_s() -> float | None:
    """The default process group's collective timeout in seconds, read from its backend's options (a private
    attribute: None on a torch that does not have it)."""
    try:
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return dist.group.WORLD._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


class InjectedFailure(RuntimeError):
    """Raised on purpose by describe() in the checker's failure run."""


def describe(report: dict, model: nn.Module) -> None:
    """What this rank's process group, device and model are, seen from inside (call before destroying the group).

    In the checker's failure run (FAILURE_ENV set) it then raises InjectedFailure, and the report is written
    when the process exits: it says whether the group was destroyed by then, i.e. whether that is in a finally.
    """
    report.update(backend=dist.get_backend(), world_size=dist.get_world_size(), group_timeout_s=group_timeout_s(),
                  local_rank=int(os.environ["LOCAL_RANK"]), wrapped_in_ddp=isinstance(model, DistributedDataParallel),
                  device_ids=getattr(model, "device_ids", None),
                  cuda_device=torch.cuda.current_device() if torch.cuda.is_available() else None,
                  parameter_checksum=parameter_checksum(getattr(model, "module", model).state_dict()))
    if os.environ.get(FAILURE_ENV):
        atexit.register(write_report, report, os.environ[FAILURE_ENV])
        raise InjectedFailure(f"raised on purpose ({FAILURE_ENV} is set): is the group destroyed in a finally?")


def note_loaded(report: dict, state: dict) -> None:
    """Note what this rank's torch.load gave back: the state's checksum and the device its tensors are on."""
    report["checkpoint_checksum"] = parameter_checksum(state)
    report["loaded_device"] = str(next(iter(state.values())).device)


def write_report(report: dict, folder) -> None:
    """rank<r>.json in `folder` (when given), noting whether the process group was destroyed by now."""
    if folder:
        report["group_destroyed"] = not dist.is_initialized()
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, f"rank{report['rank']}.json").write_text(json.dumps(report))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="nccl or gloo; default: nccl when every rank has a GPU")
    parser.add_argument("--checkpoint", default="checkpoint.pt", help="where rank 0 saves the model")
    parser.add_argument("--report-dir", default=None, help="where each rank writes rank<r>.json")
    return parser.parse_args(argv)


# ---- the distributed part: yours to write (each TODO raises until you replace it) ---------------------------

def choose_device(local_rank: int, backend: str | None) -> tuple[str, torch.device]:
    """(backend, device): NCCL with one GPU per rank; gloo on CPUs, or when ranks must share GPUs."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    backend = backend or ("nccl" if gpus >= local_world_size else "gloo")
    if gpus == 0:
        return backend, torch.device("cpu")
    # TODO 1: make GPU number local_rank % gpus this process's current device (torch.cuda.set_device), then
    # return (backend, that device).
    raise NotImplementedError("TODO 1: torch.cuda.set_device for this rank's GPU")


def train(model, loader, sampler, device, rank: int, report: dict) -> None:
    """EPOCHS of DDP training; after each epoch the loss summed over every rank's samples, logged by rank 0."""
    optimizer = make_optimizer(model)
    loss_function = nn.CrossEntropyLoss()
    for epoch in range(EPOCHS):
        # TODO 5: tell the sampler which epoch this is, so each epoch is shuffled anew (the same way on every rank).
        raise NotImplementedError("TODO 5: sampler.set_epoch")
        totals = torch.zeros(2, device=device, dtype=torch.float64)  # (summed loss, samples) on this rank
        for features, labels in loader:
            features, labels = features.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = loss_function(model(features), labels)
            loss.backward()
            optimizer.step()
            totals[0] += loss.detach().double() * len(labels)
            totals[1] += len(labels)
        local_loss = (totals[0] / totals[1]).item()
        # TODO 6: sum `totals` over the ranks, then set loss (summed loss / samples) and samples (the count), which
        # the line below records; print one line per epoch on rank 0 only.
        raise NotImplementedError("TODO 6: all-reduce the totals, log on rank 0")
        report["epochs"].append({"epoch": epoch, "local_loss": local_loss, "loss": loss, "samples": samples})


def checkpoint_round_trip(model, path: str, device, rank: int, report: dict) -> dict:
    """Rank 0 writes the checkpoint once; every rank reads it back after the barrier, onto its own device."""
    # TODO 7: rank 0 alone saves the unwrapped model's state_dict to `path`, then note(report, "saved"). No rank
    # reads before the file is complete; each notes (report, "loading"), reads it back onto its own device
    # (weights_only=True), calls note_loaded(report, state), loads it into the model and returns state.
    raise NotImplementedError("TODO 7: save on rank 0, barrier, load with map_location")


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])  # set by torchrun
    report = {"rank": rank, "epochs": [], "events": []}
    backend, device = choose_device(local_rank, args.backend)
    # TODO 2: join the process group with this backend, every collective bounded by TIMEOUT (with NCCL, also
    # bind it to this rank's device).
    raise NotImplementedError("TODO 2: dist.init_process_group")
    try:
        dataset = make_dataset()
        # TODO 3: this rank's shard of the dataset, shuffled with SEED, and a DataLoader of BATCH_PER_RANK over it.
        raise NotImplementedError("TODO 3: DistributedSampler and DataLoader")
        model = make_model().to(device)
        # TODO 4: wrap the model in DistributedDataParallel (on a GPU: its device; on the CPU: no device_ids).
        raise NotImplementedError("TODO 4: DistributedDataParallel")
        train(model, loader, sampler, device, rank, report)
        describe(report, model)  # the trained model, before the checkpoint is loaded into it
        checkpoint_round_trip(model, args.checkpoint, device, rank, report)
    finally:
        pass  # TODO 8: leave the process group, whatever happened above (what belongs in this finally?)
    write_report(report, args.report_dir)


if __name__ == "__main__":
    main()
