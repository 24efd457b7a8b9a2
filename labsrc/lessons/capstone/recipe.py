"""Lesson 13's parts: the scaled warm-up + cosine schedule, the precision choice, data, snapshots, the scaling report."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset

from labsrc.lessons.elastic_fault_tolerance.snapshot import load_checked, save_atomic
from labsrc.training import data
from labsrc.training.loop import step
from labsrc.training.models import build_model
from labsrc.training.timing import timed


@dataclass(frozen=True)
class Schedule:
    """Warm-up to the linearly scaled peak, then a cosine decay to end_lr.

    Goyal et al. 2017 ("Accurate, Large Minibatch SGD"): the rate that works at base_batch, times
    global_batch / base_batch, reached by a linear ramp that starts from the base rate. A global batch below
    base_batch has its peak below the base rate: nothing to warm up to, the ramp stays at the peak.
    """

    base_lr: float
    """The rate known to work at base_batch."""
    base_batch: int
    """The global batch base_lr was tuned at."""
    global_batch: int
    """The global batch of this run (all ranks together)."""
    warmup_steps: int
    """Steps of the linear ramp from min(base_lr, peak) to the peak (0: start at the peak)."""
    total_steps: int
    """Steps of the whole run; the cosine ends here."""
    end_lr: float = 0.0
    """The rate at the last step."""

    @property
    def peak_lr(self) -> float:
        """The linear scaling rule: base_lr x global_batch / base_batch."""
        return self.base_lr * self.global_batch / self.base_batch


def learning_rate(step_index: int, schedule: Schedule) -> float:
    """The rate for optimizer step step_index (0-based): ramp, then cosine from the peak to end_lr."""
    peak = schedule.peak_lr
    if step_index < schedule.warmup_steps:
        first = min(schedule.base_lr, peak)  # never start above the peak (a batch smaller than base_batch)
        return first + (peak - first) * step_index / schedule.warmup_steps
    decay_steps = max(1, schedule.total_steps - 1 - schedule.warmup_steps)
    progress = min(1.0, (step_index - schedule.warmup_steps) / decay_steps)
    return schedule.end_lr + (peak - schedule.end_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def gpu_precision() -> str:
    """bf16 on a GPU with bf16 tensor cores (compute capability 8.0+, no loss scaling needed), else fp16 with a
    GradScaler. including_emulation=False: an older GPU only emulates bf16, slower than fp16."""
    return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"


def time_precisions(model_name: str, batch: int, image_size: int, precisions=("fp32", "bf16"),
                    steps: int = 3) -> dict[str, float]:
    """{precision: seconds per training step} of model_name on the CPU, after one warm-up step each.

    images: (batch, 3, image_size, image_size). The same model and batch for every precision.
    """
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, image_size, image_size, generator=generator)
    labels = torch.randint(10, (batch,), generator=generator)
    seconds = {}
    for precision in precisions:
        model = build_model(model_name)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        step(model, optimizer, images, labels, precision)
        with timed(images.device) as clock:
            for _ in range(steps):
                step(model, optimizer, images, labels, precision)
        seconds[precision] = clock["s"] / steps
    return seconds


def offline_split(num_samples: int, held_out: int, image_size: int, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, held_out): one draw of the learnable synthetic set, the last held_out samples kept apart.

    Both halves share the class patterns (one seed), so held-out accuracy measures generalisation.
    """
    everything = data.synthetic_images(num_samples + held_out, image_size=image_size, seed=seed)
    images, labels = everything.tensors
    return (TensorDataset(images[:num_samples], labels[:num_samples]),
            TensorDataset(images[num_samples:], labels[num_samples:]))


def load_datasets(source: str, num_samples: int, held_out: int, image_size: int, seed: int,
                  root: Path | str | None = None) -> tuple[Dataset, Dataset, str]:
    """(train, held_out, what was used): CIFAR-10 from disk (never downloaded) for "cifar10" or "auto"
    when it is there, else the offline synthetic set ("auto" and "synthetic")."""
    if source not in ("auto", "cifar10", "synthetic"):
        raise ValueError(f"data source {source!r} is unknown: use auto, cifar10 or synthetic")
    if source != "synthetic":
        train = data.cifar10(root, train=True, download=False)
        test = data.cifar10(root, train=False, download=False)
        if train is not None and test is not None:
            return train, test, "cifar10"
        if source == "cifar10":
            raise FileNotFoundError(f"CIFAR-10 is not under {root or data.data_root()} "
                                    "(cifar-10-batches-py/); nothing is downloaded here")
    train, test = offline_split(num_samples, held_out, image_size, seed)
    return train, test, "synthetic"


def with_shuffled_labels(dataset: TensorDataset, seed: int) -> TensorDataset:
    """The same images with their labels permuted: nothing left to learn (the control run)."""
    images, labels = dataset.tensors
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed + 1))
    return TensorDataset(images, labels[order])


# -- snapshots ------------------------------------------------------------------------------------------------

def save_snapshot(path: Path | str, step_index: int, model, optimizer, scaler) -> int:
    """Write everything a resumed run needs as lesson 10's snapshot file (atomic, checksummed); returns bytes.

    Call on rank 0 only; a crash mid-write leaves the previous snapshot intact.
    """
    state = {"step": step_index, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scaler": scaler.state_dict()}
    return save_atomic(state, path).stat().st_size


def load_snapshot(path: Path | str, model, optimizer, scaler, device: torch.device) -> int:
    """Restore model, optimizer (momentum included) and loss scaler from path; returns the step to go on from.

    A torn or changed file raises SnapshotCorrupt instead of loading.
    """
    state = load_checked(path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    return int(state["step"])


def state_digest(model: torch.nn.Module, part: str = "all") -> str:
    """SHA-256 of the bytes of every parameter and buffer ("all"), or of the "parameters" or the "buffers"
    only, in state_dict order: equal digests, equal tensors."""
    chosen = {"all": None, "parameters": dict(model.named_parameters()), "buffers": dict(model.named_buffers())}[part]
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        if chosen is not None and name not in chosen:
            continue
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# -- the scaling report -----------------------------------------------------------------------------------------

def fingerprints_by_step(logs) -> dict[int, float]:
    """{0-based step: the fingerprint of the batch it trained on} from a run's log records (TrainLog, or dicts
    with "step", the step count at the segment's end, and "batches", one fingerprint per step of the segment)."""
    found = {}
    for log in logs:
        values = log if isinstance(log, dict) else vars(log)
        first = values["step"] - len(values["batches"])
        found.update({first + i: fingerprint for i, fingerprint in enumerate(values["batches"])})
    return found


def time_to_target(evaluations: list[dict], target: float) -> float | None:
    """Training seconds at the first evaluation whose accuracy reaches target (None: never reached)."""
    for row in sorted(evaluations, key=lambda r: r["step"]):
        if row["accuracy"] >= target:
            return row["train_seconds"]
    return None


def scaling_report(runs: dict[int, dict], target: float) -> dict[int, dict]:
    """{world size: throughput, time to target, speed-up and efficiency against the smallest world size}.

    runs: {world size: {"images_per_s": ..., "evaluations": [{"step", "accuracy", "train_seconds"}, ...]}}.
    Efficiency = throughput(n) / (n / n0 x throughput(n0)), the same global batch at every n (strong scaling).
    """
    smallest = min(runs)
    base = runs[smallest]["images_per_s"]
    report = {}
    for world_size in sorted(runs):
        throughput = runs[world_size]["images_per_s"]
        speedup = throughput / base
        report[world_size] = {"images_per_s": throughput, "speedup": speedup,
                              "efficiency": speedup * smallest / world_size,
                              "time_to_target_s": time_to_target(runs[world_size]["evaluations"], target)}
    return report
