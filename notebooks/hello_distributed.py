"""Hello, distributed: every rank puts a number in a tensor, then all the ranks call one all_reduce.

    torchrun --standalone --nproc-per-node=2 hello_distributed.py
"""
import os

import torch
import torch.distributed as dist

rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # torchrun sets these for each process
local_rank = int(os.environ["LOCAL_RANK"])  # the rank's number on its own machine: it picks the GPU
use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
if use_cuda:
    torch.cuda.set_device(device)  # before init_process_group
dist.init_process_group(backend="nccl" if use_cuda else "gloo")  # join the other ranks
try:
    tensor = torch.tensor([rank + 1], device=device)  # a different number on every rank: 1, 2, ...
    before = tensor.tolist()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)  # every rank calls it, with its own tensor
    print(f"rank {rank} of {world_size}: before all_reduce {before}, after {tensor.tolist()}")
finally:
    dist.destroy_process_group()  # leave the group, even after an error
