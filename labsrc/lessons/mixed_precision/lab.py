"""Mixed precision on n ranks: step time and memory per mode, the bytes DDP all-reduces per mode, AMP under DDP.

    python -m labsrc.launch --nproc 2 mixed_precision -- --micro-steps 4
    torchrun --nproc-per-node 2 -m labsrc.lessons.mixed_precision.lab --profile ci
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc.core.lab import resolve_profile, run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.runs import Record
from labsrc.core.world import RequestError
from labsrc.lessons.dp_vs_ddp import sync
from labsrc.lessons.mixed_precision import costs, under_ddp
from labsrc.training import benchmark, data
from labsrc.training.models import build_model


@dataclass
class Options(LabOptions):
    """Step time and memory per precision mode, DDP's gradient bytes per mode, then AMP under DDP with no_sync."""

    micro_steps: int = 2
    """Micro-batches accumulated per optimizer step in the AMP + DDP run (no_sync on all but the last)."""
    timed_steps: int = 5
    """Timed steps per precision mode, after one warm-up step (the median is reported)."""
    amp_steps: int = 0
    """Optimizer steps of the AMP + DDP run (0: the profile's steps)."""
    growth_interval: int = 2
    """fp16's GradScaler growth_interval in the timed runs (torch's default 2000 would never grow in a few steps)."""
    message_batch: int = 16
    """Samples per rank in the runs that count the bytes DDP all-reduces (the bytes do not depend on it)."""

    def validate(self) -> None:
        super().validate()
        positive("micro_steps", self.micro_steps)
        positive("timed_steps", self.timed_steps)
        positive("amp_steps", self.amp_steps, allow_zero=True)
        positive("growth_interval", self.growth_interval)
        positive("message_batch", self.message_batch)


@dataclass
class ModeCost(Record):
    """One precision mode on this rank: the same model and batch trained 1 + timed_steps steps."""

    KIND: ClassVar[str] = "mode"
    mode: str
    """fp32, tf32, bf16 or fp16."""
    step_s: float
    """Median seconds per step (the warm-up step left out)."""
    step_times_s: list[float]
    """Seconds of each timed step."""
    losses: list[float]
    """Loss at every step, the warm-up included."""
    activation_bytes: int
    """Bytes autograd keeps for backward during one forward (activations and 16-bit weight copies)."""
    activation_elements: int
    """Elements autograd keeps for backward during one forward."""
    activation_bytes_by_dtype: dict[str, int]
    """activation_bytes split by dtype name (float32, bfloat16, float16)."""
    peak_memory_bytes: int | None
    """Peak GPU memory allocated during the steps (None on a CPU)."""
    loss_scales: list[float] = field(default_factory=list)
    """fp16: the loss scale each step used, from one GradScaler kept across the steps (else empty)."""
    skipped_steps: list[int] = field(default_factory=list)
    """fp16: the steps (warm-up = 0) whose parameters did not change: GradScaler skipped optimizer.step()."""


@dataclass
class GradientBytes(Record):
    """The bytes DDP handed to its gradient all-reduce in one backward, in one precision setup, on this rank."""

    KIND: ClassVar[str] = "gradient_bytes"
    mode: str
    """fp32, bf16 autocast, fp16 autocast + GradScaler, fp32 + bf16_compress_hook, or bf16 parameters."""
    bytes_per_step: list[int]
    """Bytes all-reduced in each backward (counted by a comm hook)."""
    bytes_by_dtype: dict[str, int]
    """The last backward's bytes by the dtype sent (float32, bfloat16)."""
    gradient_elements: int
    """Gradient elements of the model (its trainable parameters)."""
    parameter_dtype: str
    """The parameters' dtype (float32 unless the model itself was cast to bf16)."""
    equals_torch_hook: bool
    """The counting hook's all-reduced gradients equal those of torch's own hook (default or bf16_compress_hook)."""


@dataclass
class SkippedMode(Record):
    """A precision mode this device cannot run, and why."""

    KIND: ClassVar[str] = "skipped"
    mode: str
    reason: str


@dataclass
class AmpStep(Record):
    """One optimizer step of AMP + DDP + accumulation, seen from this rank."""

    KIND: ClassVar[str] = "amp_step"
    step: int
    loss: float
    """This rank's loss over its micro-batches."""
    mean_loss: float
    """The loss averaged over all ranks (all_reduce), the same on every rank."""
    mode: str
    """The autocast mode: bf16 on CPUs, fp16 with a GradScaler on GPUs."""
    micro_batch: int
    """Samples per micro-batch on this rank."""
    scaler_enabled: bool
    """Whether a GradScaler runs (fp16 only; bf16 needs none)."""
    scale: float
    """The GradScaler's loss scale after the step (1.0 when no scaler runs)."""
    scale_spread: float
    """Largest gap between this rank's loss scale and rank 0's (0.0: identical; always 0.0 without a scaler)."""
    parameter_spread: float
    """Largest gap between any parameter element here and on rank 0 (0.0: identical)."""
    allreduce_syncs: int
    """Backward passes of this step whose gradients DDP all-reduced (a comm hook counts each one's last bucket)."""
    allreduced_bytes: int
    """Bytes DDP handed to all-reduce during this step (counted by the same hook)."""
    gradient_bytes: int
    """Bytes of the model's gradients: one all-reduce of each per step is what no_sync aims at."""
    gradient_gap: float | None
    """Largest gap between the accumulated gradient and the mean of the micro-batches' gradients computed one by
    one (under_ddp.micro_batch_mean_gradient), over the latter's largest value; None where the
    GradScaler skipped the step."""


@dataclass
class AccumulationVariant(Record):
    """One optimizer step of AMP + DDP + accumulation from the same weights: done right, or with one mistake."""

    KIND: ClassVar[str] = "accumulation_variant"
    variant: str
    """correct, no no_sync, or loss not divided by k."""
    micro_steps: int
    """k, the micro-batches accumulated in the step."""
    allreduce_syncs: int
    """Backward passes of the step whose gradients DDP all-reduced."""
    allreduced_bytes: int
    """Bytes DDP handed to all-reduce during the step."""
    gradient_bytes: int
    """Bytes of the model's gradients."""
    gradient_gap: float | None
    """Largest gap between the step's gradient and the mean of the micro-batches' gradients, over the latter's
    largest value (None where the GradScaler skipped the step)."""


def modes_for(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The modes this device runs, and why the others are skipped."""
    if device.type != "cuda":
        return ["fp32", "bf16", "fp16"], {"tf32": "TF32 is a mode of NVIDIA tensor cores (Ampere and newer GPUs)"}
    modes, skipped = ["fp32"], {}
    if torch.cuda.get_device_capability(device)[0] >= 8:
        modes.append("tf32")
    else:
        skipped["tf32"] = "TF32 needs an Ampere or newer GPU (compute capability 8.0)"
    # Ampere and newer compute in bf16. torch.cuda.is_bf16_supported() also says yes for older GPUs that only
    # emulate it, slowly, so the compute capability decides here (ROCm GPUs: bf16, as torch says).
    if torch.version.hip or torch.cuda.get_device_capability(device)[0] >= 8:
        modes.append("bf16")
    else:
        skipped["bf16"] = "bf16 needs an Ampere or newer GPU (compute capability 8.0); older ones only emulate it"
    return modes + ["fp16"], skipped


def mean_over_ranks(value: torch.Tensor, ctx) -> float:
    """The mean of a 0-dim tensor over all ranks (the value itself without a process group)."""
    total = value.detach().float().clone()
    if ctx.distributed:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.item() / ctx.world_size


def micro_batch_size(profile, world_size: int, micro_steps: int) -> int:
    """Samples per micro-batch on each rank; RequestError when the global batch cannot give each one a sample."""
    size = profile.global_batch // (world_size * micro_steps)
    if size < 1:
        raise RequestError(f"global batch {profile.global_batch} over {world_size} ranks cannot be cut into "
                           f"{micro_steps} micro-batches: use micro_steps <= {profile.global_batch // world_size}.")
    return size


def amp_ddp_accumulation(ctx, records, profile, options: Options) -> str:
    """DDP + autocast (bf16 on CPUs; fp16 + GradScaler on GPUs) + no_sync over micro_steps micro-batches.

    Records per step this rank's loss, the mean over ranks, and how far parameters and the loss scale
    differ across ranks. Returns the autocast mode used.
    """
    torch.manual_seed(options.seed)
    model = DDP(build_model(profile.model).to(ctx.device))
    counter = under_ddp.CountingHook()  # DDP's default all-reduce, counted
    model.register_comm_hook(None, counter.hook)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=profile.lr, momentum=0.9)
    mode = "fp16" if ctx.device.type == "cuda" else "bf16"
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=mode == "fp16")
    dataset = data.synthetic_images(profile.num_samples, profile.image_size, seed=options.seed)
    micro_batch = micro_batch_size(profile, ctx.world_size, options.micro_steps)
    batches = iter(data.DeviceBatches(dataset, micro_batch, ctx, seed=options.seed))
    steps = options.amp_steps or profile.steps
    for step in range(steps):
        micro_batches = [next(batches) for _ in range(options.micro_steps)]
        before = copy.deepcopy(model.module)  # the parameters this step starts from
        counter.syncs, counter.bytes_by_dtype = 0, {}
        loss = under_ddp.accumulation_step(model, optimizer, scaler, micro_batches, ctx.device, mode)
        syncs, sent = counter.syncs, sum(counter.bytes_by_dtype.values())
        reference = under_ddp.micro_batch_mean_gradient(before, micro_batches, ctx.device, mode)
        scale = torch.tensor([scaler.get_scale() if scaler.is_enabled() else 1.0], device=ctx.device)
        records.write(AmpStep(step=step, loss=loss.item(), mean_loss=mean_over_ranks(loss, ctx), mode=mode,
                              micro_batch=micro_batch, scaler_enabled=scaler.is_enabled(), scale=scale.item(),
                              scale_spread=sync.spread_across_ranks([scale]),
                              parameter_spread=sync.spread_across_ranks(list(model.parameters())),
                              allreduce_syncs=syncs, allreduced_bytes=sent, gradient_bytes=gradient_bytes,
                              gradient_gap=under_ddp.gradient_gap(model, reference)))
        records.progress(step + 1, steps, unit="steps")
    return mode


def mixed_precision_lab(ctx, records, options: Options) -> dict:
    profile = resolve_profile(options)
    micro_batch_size(profile, ctx.world_size, options.micro_steps)  # a bad request fails before any work
    modes, skipped = modes_for(ctx.device)
    dataset = data.synthetic_images(profile.global_batch, profile.image_size, seed=options.seed)
    images, labels = (t.to(ctx.device) for t in dataset.tensors)
    per_mode = costs.mode_costs(lambda: build_model(profile.model), images, labels, modes,
                                steps=options.timed_steps, seed=options.seed, growth_interval=options.growth_interval)
    for mode, cost in per_mode.items():
        records.write(ModeCost(mode=mode, **cost))
    for mode, reason in skipped.items():
        records.write(SkippedMode(mode=mode, reason=reason))
    for mode in under_ddp.MESSAGE_MODES:
        counted = under_ddp.message_bytes(lambda: build_model(profile.model), images[:options.message_batch],
                                                    labels[:options.message_batch], mode, seed=options.seed)
        records.write(GradientBytes(mode=mode, **counted))
    amp_mode = amp_ddp_accumulation(ctx, records, profile, options)
    first = data.synthetic_images(profile.num_samples, profile.image_size, seed=options.seed)
    micro_batch = micro_batch_size(profile, ctx.world_size, options.micro_steps)
    batches = iter(data.DeviceBatches(first, micro_batch, ctx, seed=options.seed))
    micro_batches = [next(batches) for _ in range(options.micro_steps)]
    for row in under_ddp.accumulation_variants(lambda: build_model(profile.model), micro_batches, ctx.device,
                                               amp_mode, seed=options.seed):
        records.write(AccumulationVariant(micro_steps=options.micro_steps, **row))
    return {"profile": profile.name, "model": profile.model, "batch": profile.global_batch,
            "image_size": profile.image_size, "modes": per_mode, "skipped_modes": skipped,
            "micro_steps": options.micro_steps, "growth_interval": options.growth_interval, "amp_ddp_mode": amp_mode,
            "provenance": benchmark.provenance(ctx.device)}


def main(argv=None):
    return run_lab("mixed_precision", mixed_precision_lab, Options, argv)


if __name__ == "__main__":
    main()
