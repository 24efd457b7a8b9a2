"""Your own DDP training script from a blank page (notebook 01b): write main() and whatever it calls.

    torchrun --nproc-per-node=2 notebooks/your_ddp_script_blank.py --checkpoint /tmp/ddp/model.pt

The same task as your_ddp_script.py without its outline. Every rank trains the given model on its own shard of
the given dataset with DistributedDataParallel. Rank 0 prints the loss over all ranks' samples each epoch and
writes the checkpoint; then every rank reads it back.
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


# ---- the distributed part: yours, all of it -----------------------------------------------------------------

# What the checker watches while your script runs (it reads nothing else):
# - the process group, the device, the DistributedSampler and its order each epoch, the DDP wrapper;
# - once per epoch, one dist.all_reduce of a float64 tensor [summed loss, sample count];
# - the number rank 0 prints each epoch: that sum divided by that count, with 4 decimals or more;
# - rank 0's torch.save of the unwrapped model's state_dict to args.checkpoint, then each rank's torch.load of it;
# - whether the process group is gone when the process exits, also when training raised.
# Keep the given data, model, optimizer and constants: the checker compares your run with one process using them.
# On a machine without GPUs, the GPU each rank picks cannot be seen. Write it as
# choose_device(local_rank, backend) -> (backend, device), as in your_ddp_script.py, to have it tried on pretend GPUs.

def main(argv=None) -> None:
    args = parse_args(argv)
    raise NotImplementedError("write the whole DDP script: device, process group, sampler, DDP, training, "
                              "metric, checkpoint, clean exit")


if __name__ == "__main__":
    main()
