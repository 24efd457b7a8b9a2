"""Snapshot and resume with nothing lost: every piece of training state, the sampler's place and every RNG.

    run = Training.build(ctx, Setup())          # model (gradients averaged over ranks), AdamW, StepLR, GradScaler, sampler
    run.step()                                  # one optimizer step on this rank's share of the global batch
    save_snapshot(run, path)                    # rank 0 writes it atomically (all ranks' RNG states gathered)
    load_snapshot(run, path)                    # every rank puts it all back; the next step() is the one due

The model is replicated (data parallel), so one full snapshot written by rank 0 holds everything; a sharded model (FSDP)
would save with torch.distributed.checkpoint instead, each rank its shard.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch
import torch.distributed as dist
from torch import nn

from labsrc.lessons.elastic_fault_tolerance.snapshot import load_checked, save_atomic
from labsrc.training.loop import step as training_step

PARTS = ("model", "optimizer", "scheduler", "scaler", "sampler", "rng", "step")


@dataclass(frozen=True)
class Setup:
    """The training run every experiment of lesson 10 repeats (sizes chosen to take a second on a CPU)."""

    samples: int = 48
    """Dataset size: (samples, features) inputs, one class label each."""
    features: int = 8
    global_batch: int = 8
    """Samples per optimizer step over all ranks; each rank takes global_batch / world_size of them."""
    epochs: int = 3
    lr: float = 0.01
    seed: int = 0

    @property
    def steps_per_epoch(self) -> int:
        return self.samples // self.global_batch  # drop_last: a partial global batch is skipped

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch


class ResumableSampler:
    """The global order of samples: a seeded permutation per epoch, read global_batch at a time from `position`.

    Its state is (epoch, position): a resumed run carries on from the very next sample. Each step's global
    batch is cut into world_size equal shares, so a run that changes world size still sees each sample once.
    """

    def __init__(self, samples: int, global_batch: int, seed: int):
        self.samples, self.global_batch, self.seed = samples, global_batch, seed
        self.epoch, self.position = 0, 0

    def order(self, epoch: int) -> torch.Tensor:
        """(samples,) sample ids in the order epoch `epoch` visits them."""
        return torch.randperm(self.samples, generator=torch.Generator().manual_seed(self.seed + epoch))

    def next_global_batch(self) -> tuple[int, list[int]]:
        """(epoch, the global_batch sample ids of the next step); moves on, to the next epoch when one is used up."""
        if self.position + self.global_batch > self.samples:
            self.epoch, self.position = self.epoch + 1, 0
        ids = self.order(self.epoch)[self.position:self.position + self.global_batch].tolist()
        self.position += self.global_batch
        return self.epoch, ids

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def rank_share(ids: list[int], rank: int, world_size: int) -> list[int]:
    """This rank's contiguous share of a global batch (global_batch must split evenly)."""
    size = len(ids) // world_size
    return ids[rank * size:(rank + 1) * size]


def capture_rng() -> dict:
    """This process's RNG states as tensors, lists and ints only (what weights_only=True loads)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = numpy.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": [version, list(internal)],
             "numpy": {"keys": torch.from_numpy(keys.astype(numpy.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached": float(cached)}}
    if gauss is not None:
        state["python_gauss"] = float(gauss)
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal = state["python"]
    random.setstate((version, tuple(internal), state.get("python_gauss")))
    saved = state["numpy"]
    numpy.random.set_state(("MT19937", saved["keys"].numpy().astype(numpy.uint32), saved["pos"],
                            saved["has_gauss"], saved["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    """torch, python and numpy RNGs from one seed (what a fresh process does before any resume)."""
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


def make_data(setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    """(samples, features) inputs and (samples,) labels in 4 classes, from a fixed generator."""
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(setup.samples, setup.features, generator=generator)
    labels = (inputs[:, :2].sum(dim=1) > 0).long() + 2 * (inputs[:, 2] > 0).long()
    return inputs, labels


def average_gradients_in_backward(model: nn.Module, world_size: int) -> None:
    """Each gradient, once accumulated, is all-reduced and divided by world_size: DDP's result (lesson 04), with
    none of DDP's start-up cost, which every restarted attempt would pay again."""
    def average(parameter: torch.Tensor) -> None:
        dist.all_reduce(parameter.grad)
        parameter.grad.div_(world_size)

    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(average)


@dataclass
class Training:
    """One rank's whole training state; `step()` advances it by one optimizer step."""

    ctx: object
    setup: Setup
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    sampler: ResumableSampler
    inputs: torch.Tensor
    labels: torch.Tensor
    steps_done: int = 0

    @classmethod
    def build(cls, ctx, setup: Setup) -> "Training":
        """Seed every RNG (seed + rank, as each attempt's fresh process does), then build model and state."""
        seed_everything(setup.seed + ctx.rank)
        torch.manual_seed(setup.seed)  # the same initial weights on every rank
        model = nn.Sequential(nn.Linear(setup.features, 16), nn.ReLU(), nn.Dropout(0.25),
                              nn.Linear(16, 4)).to(ctx.device)
        torch.manual_seed(setup.seed + ctx.rank)
        if ctx.distributed:
            average_gradients_in_backward(model, ctx.world_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
        scaler = torch.amp.GradScaler(ctx.device.type, growth_interval=3)
        sampler = ResumableSampler(setup.samples, setup.global_batch, setup.seed)
        inputs, labels = make_data(setup)
        return cls(ctx, setup, model, optimizer, scheduler, scaler, sampler, inputs, labels)

    @property
    def plain_model(self) -> nn.Module:
        return self.model

    def step(self) -> tuple[int, list[int], float]:
        """One step: (epoch, this rank's sample ids, its loss). Dropout (torch RNG) and a python-RNG input jitter
        make the result depend on every RNG state."""
        epoch, ids = self.sampler.next_global_batch()
        mine = rank_share(ids, self.ctx.rank, self.ctx.world_size)
        jitter = 1.0 + 0.05 * random.uniform(-1.0, 1.0)
        images = (self.inputs[mine] * jitter).to(self.ctx.device)
        loss = training_step(self.model, self.optimizer, images, self.labels[mine].to(self.ctx.device),
                             "fp32", self.scaler, max_norm=1.0)
        self.scheduler.step()
        self.steps_done += 1
        return epoch, mine, float(loss)

    def parameters(self) -> dict[str, torch.Tensor]:
        """{name: a CPU copy} of the model's parameters."""
        return {k: v.detach().cpu().clone() for k, v in self.plain_model.state_dict().items()}


def gather_rng(ctx) -> list[dict]:
    """Every rank's capture_rng(), in rank order (one all_gather_object, bounded by the group's timeout)."""
    mine = capture_rng()
    if not ctx.distributed:
        return [mine]
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def snapshot_state(run: Training, rng: list[dict], leave_out: tuple[str, ...] = ()) -> dict:
    """The snapshot's contents: tensors, dicts, lists, ints, floats and strings only."""
    state = {"step": run.steps_done, "world_size": run.ctx.world_size,
             "model": run.plain_model.state_dict(), "optimizer": run.optimizer.state_dict(),
             "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(),
             "sampler": run.sampler.state_dict(), "rng": rng}
    return {k: v for k, v in state.items() if k not in leave_out}


def save_snapshot(run: Training, path: Path | str, leave_out: tuple[str, ...] = (), write=save_atomic) -> None:
    """All ranks gather their RNG states to everyone; rank 0 writes the snapshot with `write` (atomic)."""
    rng = gather_rng(run.ctx)
    if run.ctx.rank == 0:
        write(snapshot_state(run, rng, leave_out), path)


def restore(run: Training, state: dict) -> str:
    """Put a snapshot's state back into `run`; says how this rank's RNG was restored."""
    run.plain_model.load_state_dict(state["model"])
    for part in ("optimizer", "scheduler", "scaler", "sampler"):
        if part in state:
            getattr(run, part).load_state_dict(state[part])
    run.steps_done = int(state.get("step", 0))
    rng = state.get("rng")
    if rng is None:
        return "left out of the snapshot: this process's fresh seeds"
    if len(rng) == run.ctx.world_size:
        restore_rng(rng[run.ctx.rank])
        return "restored: this rank's own saved RNG state"
    seed_everything(run.setup.seed + 1000 * run.steps_done + run.ctx.rank)
    return (f"saved by {len(rng)} ranks, now {run.ctx.world_size}: re-seeded from (seed, step, rank), "
            f"since no saved stream belongs to this rank")


def load_snapshot(run: Training, path: Path | str) -> str:
    """Load the snapshot at path (digest checked, weights_only=True) into `run`; see `restore`."""
    return restore(run, load_checked(path))


def fingerprint(value) -> str:
    """A short SHA-256 of a state's tensors (dtype, shape, bytes), numbers and strings: equal states, equal prints."""
    digest = hashlib.sha256()
    _feed(digest, value)
    return digest.hexdigest()[:16]


def _feed(digest, value) -> None:
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{flat.dtype}{tuple(value.shape)}".encode() + flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            digest.update(repr(key).encode())
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"[{len(value)}]".encode())
        for item in value:
            _feed(digest, item)
    else:
        digest.update(repr(value).encode())


def part_fingerprints(run: Training) -> dict[str, str]:
    """{part: fingerprint} of everything the next step reads (PARTS); capturing the RNG states draws nothing."""
    return {"model": fingerprint(run.plain_model.state_dict()), "optimizer": fingerprint(run.optimizer.state_dict()),
            "scheduler": fingerprint(run.scheduler.state_dict()), "scaler": fingerprint(run.scaler.state_dict()),
            "sampler": fingerprint(run.sampler.state_dict()), "rng": fingerprint(capture_rng()),
            "step": str(run.steps_done)}


def parameters_equal(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> bool:
    """Bit-for-bit equality of two {name: tensor} parameter sets (torch.equal on each)."""
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
