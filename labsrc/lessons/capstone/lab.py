"""Lesson 13: train an image classifier end to end with DDP, AMP, channels_last, compile, snapshots and evaluation.

    python -m labsrc.launch --nproc 2 capstone -- --steps 64
    torchrun --nproc-per-node 2 -m labsrc.lessons.capstone.lab --crash-at-step 32   # add --max-restarts 1 to resume
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from labsrc.core.lab import resolve_profile, run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.plan import split_global_batch
from labsrc.core.runs import Record, current_attempt
from labsrc.core.world import RequestError
from labsrc.lessons.capstone.recipe import Schedule, gpu_precision, load_datasets, with_shuffled_labels
from labsrc.lessons.capstone.training_run import RunSettings, train_run

STEPS = {"ci": 32, "cpu": 160, "gpu": 3900}  # ci: 4 epochs of 512 (measured: 1.00 held out); gpu: 40 CIFAR epochs
BASE_LR = {"ci": 0.4, "cpu": 0.4, "gpu": 0.1}  # per base_batch 256; gpu: Goyal et al.'s 0.1, the tiny CNN takes 0.4
HELD_OUT = {"ci": 256, "cpu": 1024, "gpu": 10000}  # synthetic held-out samples (CIFAR-10 brings its 10,000)


@dataclass
class Options(LabOptions):
    """The capstone: ResNet-18 (tiny_cnn in ci) on CIFAR-10 when it is on disk, else the offline set."""

    model: str | None = None
    """tiny_cnn or resnet18 (default: the profile's)."""
    data: str = "auto"
    """auto (CIFAR-10 when it is on disk, else synthetic), cifar10 (fail without it) or synthetic."""
    num_samples: int = 0
    """Synthetic training samples (0: the profile's); CIFAR-10 always has 50,000."""
    held_out: int = 0
    """Synthetic held-out samples (0: by profile); CIFAR-10's test split has 10,000."""
    global_batch: int = 0
    """Samples per step over all ranks, a multiple of the ranks (0: the profile's, rounded to split)."""
    steps: int = 0
    """Optimizer steps (0: by profile, enough to reach the notebook's stated accuracy)."""
    base_lr: float = 0.0
    """The learning rate at base_batch (0: by profile; Goyal et al. 2017 use 0.1 per 256 images for ResNets)."""
    base_batch: int = 256
    """The global batch base_lr belongs to; the peak rate is base_lr x global_batch / base_batch."""
    warmup_steps: int = -1
    """Steps of the ramp from base_lr to the peak (-1: one epoch, capped at a quarter of the run)."""
    end_lr: float = 0.0
    """The rate the cosine decays to at the last step."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 5e-4
    """L2 penalty folded into SGD (the usual value for ResNets on CIFAR-10)."""
    max_norm: float = 0.0
    """Clip the gradient norm to this (0: no clipping)."""
    precision: str | None = None
    """fp32, bf16 or fp16 (default: bf16 on GPUs that have it, else fp16 + GradScaler; fp32 on the CPU)."""
    channels_last: bool | None = None
    """NHWC memory format for model and images (default: on GPUs, where it speeds convolutions)."""
    compile: bool | None = None
    """torch.compile the DDP model, eager on failure (default: on GPUs only, compiling costs seconds)."""
    compile_backend: str = "inductor"
    """torch.compile backend (aot_eager captures graphs without generating code: fast to compile)."""
    eval_every: int = 0
    """Evaluate on the held-out split every this many steps (0: once an epoch)."""
    snapshot_every: int = 0
    """Write a snapshot every this many steps, a multiple of eval_every (0: at every evaluation)."""
    crash_at_step: int = -1
    """Raise on purpose after this step (its snapshot, if any, written) on the first attempt only (-1: never)."""
    shuffle_labels: bool = False
    """Train on permuted labels (the control: held-out accuracy must stay at chance)."""
    num_workers: int = -1
    """DataLoader workers per rank (-1: none for the in-memory synthetic set, the profile's for CIFAR-10)."""

    def validate(self) -> None:
        super().validate()
        for name in ("num_samples", "held_out", "global_batch", "steps", "eval_every", "snapshot_every"):
            positive(name, getattr(self, name), allow_zero=True)
        positive("base_lr", self.base_lr, allow_zero=True)
        positive("base_batch", self.base_batch)
        positive("end_lr", self.end_lr, allow_zero=True)
        positive("max_norm", self.max_norm, allow_zero=True)
        if self.data not in ("auto", "cifar10", "synthetic"):
            raise RequestError(f"data {self.data!r} is unknown: use auto, cifar10 or synthetic.")
        if self.model not in (None, "tiny_cnn", "resnet18"):
            raise RequestError(f"model {self.model!r} is unknown: use tiny_cnn or resnet18.")
        if self.precision not in (None, "fp32", "bf16", "fp16"):
            raise RequestError(f"precision {self.precision!r} is unknown: use fp32, bf16 or fp16.")
        if self.eval_every and self.snapshot_every and self.snapshot_every % self.eval_every:
            raise RequestError(f"snapshot_every ({self.snapshot_every}) must be a multiple of eval_every "
                               f"({self.eval_every}): snapshots are written after an evaluation.")


@dataclass
class Start(Record):
    """What the run uses, once resolved (rank 0)."""

    KIND: ClassVar[str] = "capstone_start"
    source: str
    model: str
    precision: str
    channels_last: bool
    compile_reason: str
    global_batch: int
    per_rank_batch: int
    steps: int
    steps_per_epoch: int
    base_lr: float
    base_batch: int
    peak_lr: float
    warmup_steps: int
    resumed_from: int
    held_out: int
    """Samples in the held-out split (every evaluation must count them all)."""
    parameter_tensors: int
    parameter_bytes: int
    """Bytes of all parameters: what one full gradient all-reduce sends per step (fp32 gradients)."""
    momentum_buffers: int
    """Parameter tensors with an SGD momentum buffer once built: all of them after a resume, none at step 0."""


@dataclass
class SampleOrder(Record):
    """The dataset indices this rank's sampler handed out in one epoch, in order (every rank, first epochs)."""

    KIND: ClassVar[str] = "capstone_sample_order"
    epoch: int
    indices: list[int]


@dataclass
class TrainLog(Record):
    """The training loss averaged over the last segment's steps and all ranks, the rates the optimizer used (rank 0)."""

    KIND: ClassVar[str] = "capstone_log"
    step: int
    epoch: int
    lr: float
    max_lr: float
    rates: list[float]
    """The rate the optimizer used at each step of the segment, read back from it."""
    batches: list[float]
    """Each step's batch_fingerprint on rank 0: which samples the step trained on, comparable between runs."""
    allreduce_bytes_per_step: float | None
    """Gradient bytes DDP's all-reduce sent per step, counted by a comm hook (None: no DDP, or compiled)."""
    loss: float
    images_per_s: float


@dataclass
class Evaluation(Record):
    """Held-out accuracy and loss after `step` steps, and the training seconds spent so far (rank 0)."""

    KIND: ClassVar[str] = "capstone_evaluation"
    step: int
    accuracy: float
    loss: float
    count: int
    train_seconds: float


@dataclass
class Snapshot(Record):
    """A snapshot written atomically by rank 0 after `step` steps."""

    KIND: ClassVar[str] = "capstone_snapshot"
    step: int
    bytes: int


@dataclass
class Final(Record):
    """This rank's model at the end: SHA-256 digests of all its state, of its parameters, of its buffers (every rank)."""

    KIND: ClassVar[str] = "capstone_final"
    step: int
    digest: str
    parameters_digest: str
    buffers_digest: str
    train_seconds: float


class PlantedCrash(RuntimeError):
    """The failure crash_at_step asks for, to watch a restarted run resume from its snapshot."""


def resolve(options: Options, ctx, profile, train_size: int) -> RunSettings:
    """Options with every default filled in for this profile, device and data."""
    cuda = ctx.device.type == "cuda"
    global_batch = split_global_batch(options.global_batch, profile, ctx.world_size)
    steps = options.steps or STEPS[profile.name]
    steps_per_epoch = max(1, train_size // global_batch)
    warmup = options.warmup_steps if options.warmup_steps >= 0 else min(steps_per_epoch, steps // 4)
    eval_every = options.eval_every or steps_per_epoch
    precision = options.precision or (gpu_precision() if cuda else "fp32")  # CPUs: notebook 13 times both
    return RunSettings(
        model=options.model or profile.model, precision=precision,
        channels_last=cuda if options.channels_last is None else options.channels_last,
        compile=cuda if options.compile is None else options.compile, compile_backend=options.compile_backend,
        schedule=Schedule(options.base_lr or BASE_LR[profile.name], options.base_batch, global_batch, warmup, steps, options.end_lr),
        momentum=options.momentum, weight_decay=options.weight_decay, max_norm=options.max_norm or None,
        eval_every=eval_every, snapshot_every=options.snapshot_every or eval_every,
        num_workers=options.num_workers if options.num_workers >= 0 else 0, seed=options.seed)


def body(ctx, records, options: Options) -> dict:
    profile = resolve_profile(options)
    train_set, held_out, source = load_datasets(options.data, options.num_samples or profile.num_samples,
                                                options.held_out or HELD_OUT[profile.name], profile.image_size,
                                                options.seed)
    if options.shuffle_labels:
        if source != "synthetic":
            raise RequestError("shuffle_labels is for the in-memory synthetic set: use data='synthetic'.")
        train_set = with_shuffled_labels(train_set, options.seed)
    settings = resolve(options, ctx, profile, len(train_set))
    if source == "cifar10" and options.num_workers < 0:
        settings = RunSettings(**{**settings.__dict__, "num_workers": profile.num_workers})
    snapshot = records.run_dir / "snapshot.pt"

    def report(kind: str, values: dict) -> None:
        if kind == "final":
            records.write(Final(**values))
        elif kind == "order":
            records.write(SampleOrder(**values))
        elif ctx.is_main and kind == "start":
            records.write(Start(source=source, model=settings.model, precision=settings.precision,
                                channels_last=settings.channels_last, global_batch=settings.schedule.global_batch,
                                steps=settings.schedule.total_steps, base_lr=settings.schedule.base_lr,
                                base_batch=settings.schedule.base_batch, peak_lr=settings.schedule.peak_lr,
                                warmup_steps=settings.schedule.warmup_steps, **values))
            print(f"{source}, {settings.model}, {settings.precision}, global batch {settings.schedule.global_batch}, "
                  f"peak lr {settings.schedule.peak_lr:.4g}, from step {values['resumed_from']}")
        elif ctx.is_main and kind in ("log", "evaluation", "snapshot"):
            record = {"log": TrainLog, "evaluation": Evaluation, "snapshot": Snapshot}[kind](**values)
            records.write(record)
            if kind == "evaluation":
                print(f"step {values['step']}: held-out accuracy {values['accuracy']:.3f}")
                records.progress(values["step"], settings.schedule.total_steps, unit="steps")

    crash = options.crash_at_step >= 0 and current_attempt() == 0
    final = train_run(ctx, settings, train_set, held_out, snapshot, report,
                      stop_after=lambda step: crash and step >= options.crash_at_step)
    if final["step"] < settings.schedule.total_steps:
        raise PlantedCrash(f"rank {ctx.rank} stopped on purpose after step {final['step']} (crash_at_step)")
    return {"source": source, "model": settings.model, "precision": settings.precision,
            "global_batch": settings.schedule.global_batch, "steps": final["step"], "digest": final["digest"],
            "train_seconds": final["train_seconds"]}


def main(argv=None):
    return run_lab("capstone", body, Options, argv)


if __name__ == "__main__":
    main()
