"""The hardware a plan is made for: detected here, or given (tests check gpu-profile plans on a machine with no GPU)."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """What decides a lesson's plan: GPUs, their name, CPU cores."""

    gpus: int
    """CUDA devices visible to this process."""
    gpu_name: str | None
    """Name of GPU 0 as CUDA reports it ("NVIDIA H100 80GB HBM3"), None without a GPU."""
    cpus: int
    """CPU cores this process may use."""

    def __post_init__(self):
        if self.gpus < 0 or self.cpus < 1:
            raise ValueError(f"hardware needs gpus >= 0 and cpus >= 1 (got {self.gpus}, {self.cpus})")


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask, which containers and Slurm set), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def detect() -> Hardware:
    """The hardware of this machine, or on a class server the share of it one run leases (labsrc.core.leases)."""
    import torch

    from labsrc.core import leases
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    name, cpus = torch.cuda.get_device_name(0) if gpus else None, cpu_cores()
    try:
        pool = leases.configured()
    except leases.PoolError:
        pool = None  # the launch says what is wrong with it; a plan is still made for the machine
    if pool is not None and pool.gpus:
        gpus = min(gpus, pool.gpus_per_run)
    if pool is not None and pool.cores:
        cpus = min(cpus, pool.cores_per_run)
    return Hardware(gpus=gpus, gpu_name=name if gpus else None, cpus=cpus)


def simulated(gpus: int, gpu_name: str = "NVIDIA H100 80GB HBM3", cpus: int = 16) -> Hardware:
    """Hardware given by hand, to check what a lesson would do on a machine that is not this one."""
    return Hardware(gpus=gpus, gpu_name=gpu_name if gpus else None, cpus=cpus)
