"""Profiles (ci, cpu, gpu): how big every experiment is on this machine, and why that profile was picked."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

PROFILE_ENV = "LABSRC_PROFILE"


@dataclass(frozen=True)
class Profile:
    """Sizes every lab reads, so one notebook runs in 90 s on 2 CPU cores and at real scale on GPUs."""

    name: str
    """ci, cpu or gpu."""
    world_size: int
    """Ranks for a multi-rank lab; 0 means one per GPU (the gpu profile)."""
    model: str
    """Model the training labs use: tiny_cnn (CI) or resnet18 (32x32 inputs)."""
    image_size: int
    """Side of the square images (CIFAR-10 is 32)."""
    num_samples: int
    """Size of the synthetic training set."""
    global_batch: int
    """Samples per optimizer step summed over all ranks."""
    steps: int
    """Optimizer steps in a training run."""
    lr: float
    """SGD learning rate at the global batch above."""
    sweep_sizes: tuple[int, ...]
    """Message sizes in float32 elements for communication sweeps."""
    repeats: int
    """Timed repetitions per measured point (after one warm-up)."""
    num_workers: int
    """DataLoader worker processes per rank."""
    notebook_budget_s: int
    """Wall time a notebook should stay within in this profile."""

    def resolved_world_size(self, gpu_count: int) -> int:
        """World size for this machine: the profile's, or one rank per GPU (at least one)."""
        return self.world_size if self.world_size > 0 else max(1, gpu_count)

    def replace(self, **changes) -> "Profile":
        return dataclasses.replace(self, **changes)


PROFILES: dict[str, Profile] = {
    "ci": Profile(
        name="ci", world_size=2, model="tiny_cnn", image_size=16, num_samples=512,
        global_batch=64, steps=12, lr=0.05,
        sweep_sizes=(256, 4096, 65536, 524288, 4194304), repeats=7, num_workers=0,
        notebook_budget_s=90,
    ),
    "cpu": Profile(
        name="cpu", world_size=4, model="tiny_cnn", image_size=32, num_samples=4096,
        global_batch=128, steps=80, lr=0.05,
        sweep_sizes=(256, 4096, 65536, 262144, 1048576, 4194304), repeats=5, num_workers=2,
        notebook_budget_s=600,
    ),
    "gpu": Profile(
        name="gpu", world_size=0, model="resnet18", image_size=32, num_samples=50000,
        global_batch=512, steps=300, lr=0.2,
        sweep_sizes=(1024, 16384, 262144, 1048576, 4194304, 16777216, 67108864), repeats=10,
        num_workers=4, notebook_budget_s=1800,
    ),
}


class ProfileError(ValueError):
    """An unknown profile name was asked for."""


def pick_profile(environ: dict | None = None, gpu_count: int | None = None,
                 cpu_count: int | None = None, hardware=None) -> tuple[Profile, str]:
    """The profile and the reason: LABSRC_PROFILE wins, else the hardware decides.

    hardware (a labsrc.core.hardware.Hardware) or the counts describe the machine; unset: this one.
    """
    environ = os.environ if environ is None else environ
    requested = environ.get(PROFILE_ENV, "").strip()
    if requested:
        if requested not in PROFILES:
            raise ProfileError(
                f"{PROFILE_ENV}={requested!r} is not a profile. Use one of {sorted(PROFILES)} "
                f"or unset {PROFILE_ENV} to pick from the hardware."
            )
        return PROFILES[requested], f"{PROFILE_ENV}={requested} was set"
    if hardware is None and (gpu_count is None or cpu_count is None):
        from labsrc.core.hardware import detect
        hardware = detect()
    gpu_count = hardware.gpus if gpu_count is None else gpu_count
    cpu_count = hardware.cpus if cpu_count is None else cpu_count
    if gpu_count > 0:
        return PROFILES["gpu"], f"{gpu_count} CUDA GPU(s) found"
    if cpu_count <= 2:
        return PROFILES["ci"], f"no GPU and only {cpu_count} CPU core(s): the smallest sizes"
    return PROFILES["cpu"], f"no GPU, {cpu_count} CPU cores: laptop sizes"


def current_profile() -> Profile:
    """The profile in force (see pick_profile)."""
    return pick_profile()[0]
