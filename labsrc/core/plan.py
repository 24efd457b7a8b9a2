"""A lesson's plan on given hardware: ranks, backend, device, and a global batch that splits over the ranks.

    plan = make_plan()                                   # this machine, the profile in force
    plan = make_plan(simulated(gpus=3), PROFILES["gpu"])  # what 3 GPUs would run
"""
from __future__ import annotations

from dataclasses import dataclass

from labsrc.core.hardware import Hardware, detect
from labsrc.core.profiles import Profile, pick_profile
from labsrc.core.world import RequestError, choose_backend, max_cpu_ranks


@dataclass(frozen=True)
class Plan:
    """How a multi-rank lesson runs on one machine."""

    profile: Profile
    """Sizes in force."""
    world_size: int
    """Ranks to launch."""
    backend: str
    """nccl (one GPU per rank) or gloo (CPU ranks, or ranks sharing GPUs)."""
    device: str
    """cuda or cpu."""
    global_batch: int
    """Samples per step over all ranks: the profile's, rounded down to a multiple of world_size."""
    reason: str
    """Why these ranks and this backend, in words."""

    @property
    def per_rank_batch(self) -> int:
        return self.global_batch // self.world_size

    @property
    def ranks_share_gpus(self) -> bool:
        return self.device == "cuda" and self.backend == "gloo"


def check_batch_splits(global_batch: int, world_size: int) -> None:
    """RequestError naming two batches that do split, unless global_batch divides over world_size ranks."""
    if global_batch % world_size:
        lower = max(world_size, global_batch - global_batch % world_size)
        raise RequestError(f"global_batch {global_batch} does not split over {world_size} ranks: "
                           f"choose a multiple of {world_size}, e.g. {lower} or {lower + world_size}.")


def split_global_batch(requested: int, profile: Profile, world_size: int) -> int:
    """The global batch a run uses: `requested`, which must split over the ranks, or (0) the profile's rounded down."""
    if not requested:
        return max(world_size, profile.global_batch - profile.global_batch % world_size)
    check_batch_splits(requested, world_size)
    return requested


def make_plan(hardware: Hardware | None = None, profile: Profile | None = None, min_ranks: int = 2) -> Plan:
    """The plan for a lesson that needs at least min_ranks ranks (2 for every multi-rank lesson).

    One rank per GPU with NCCL when there are at least min_ranks GPUs; with fewer GPUs, min_ranks gloo
    ranks share them (NCCL refuses two ranks on one GPU); without a GPU, the profile's CPU ranks, at most
    two per core.
    """
    hardware = hardware or detect()
    if profile is None:
        profile = pick_profile(gpu_count=hardware.gpus, cpu_count=hardware.cpus)[0]
    if hardware.gpus:
        world_size = max(min_ranks, profile.world_size or hardware.gpus)
        reason = (f"one rank per GPU on {hardware.gpus} GPU(s)" if world_size <= hardware.gpus else
                  f"{world_size} ranks share {hardware.gpus} GPU(s) through gloo (NCCL needs a GPU per rank)")
    else:
        world_size = min(max(min_ranks, profile.world_size or 2), max_cpu_ranks(hardware.cpus))
        reason = f"{world_size} gloo ranks on {hardware.cpus} CPU core(s)"
    backend, device = choose_backend(world_size, hardware.gpus)
    global_batch = split_global_batch(0, profile, world_size)
    if global_batch != profile.global_batch:
        reason += f"; global batch {profile.global_batch} rounded to {global_batch} to split evenly"
    return Plan(profile, world_size, backend, device, global_batch, reason)
