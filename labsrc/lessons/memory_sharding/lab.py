"""Where the bytes go, and sharding them: ZeRO stages 0-3 by hand, FSDP2, ZeroRedundancyOptimizer, checkpointing.

    python -m labsrc.launch --nproc 2 memory_sharding
    torchrun --nproc-per-node 2 -m labsrc.lessons.memory_sharding.lab --width 64
Every experiment runs in this one launch; every sharded run is compared with one process training on whole batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from labsrc.core.lab import run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.runs import Record
from labsrc.core.world import RequestError
from labsrc.lessons.memory_sharding import memory, torch_sharding as production, zero_runs as runs
from labsrc.lessons.memory_sharding.transformer import tiny_transformer
from labsrc.lessons.memory_sharding.zero import Traffic


@dataclass
class Options(LabOptions):
    """Sizes of the sharded model, of the training runs and of the checkpointing sweep."""

    depth: int = 4
    """Hidden Linear(width, width) + ReLU blocks of the sharded model."""
    width: int = 64
    """Width of the sharded model's hidden layers."""
    batch: int = 16
    """Samples per step over all ranks; the world size must divide it."""
    steps: int = 3
    """Optimizer steps of every training run (the memory is read on the last, when Adam's state exists)."""
    lr: float = 0.01
    """AdamW learning rate."""
    checkpoint_depth: int = 16
    """Blocks of the stack cut into segments by checkpoint_sequential."""
    checkpoint_width: int = 256
    """Width of that stack."""
    checkpoint_batch: int = 64
    """Samples in the checkpointing sweep."""
    repeats: int = 3
    """Timed repeats of each checkpointing setting (the fastest counts)."""
    fsdp: bool = True
    """Also run fully_shard in each setting (FsdpRow: the 09 deck's figure; notebook 09b checks these settings on
    forked ranks); notebook 09 runs --no-fsdp."""

    def validate(self) -> None:
        super().validate()
        for name in ("depth", "width", "batch", "steps", "checkpoint_depth", "checkpoint_width",
                     "checkpoint_batch", "repeats"):
            positive(name, getattr(self, name))
        positive("lr", self.lr)


@dataclass
class MemoryRow(Record):
    """Bytes one rank holds between backward and the optimizer step, at one ZeRO stage, beside the formula."""

    KIND: ClassVar[str] = "memory"
    stage: int
    layout: str
    parameters: int
    gradients: int
    optimizer: int
    formula_parameters: float
    formula_gradients: float
    formula_optimizer: float


@dataclass
class StepGap(Record):
    """One step of one run: largest |averaged gradient shard - one process's gradient| before the optimizer step,
    and largest |sharded parameter - one-process parameter| after it."""

    KIND: ClassVar[str] = "step_gap"
    run: str
    step: int
    gap: float
    gradient_gap: float


@dataclass
class Sent(Record):
    """Bytes this rank sent during a run's training steps, counted collective by collective, and the formula."""

    KIND: ClassVar[str] = "sent"
    run: str
    all_reduce: int
    reduce_scatter: int
    all_gather: int
    total: int
    formula: int


@dataclass
class Resharded(Record):
    """Full (gathered) weight buffers of the hand-made stage 3 still alive between forward and backward."""

    KIND: ClassVar[str] = "resharded"
    alive_after_forward: int


@dataclass
class CheckpointRow(Record):
    """One checkpoint_sequential setting (segments 0: none): saved activations, prediction, time, gradient gap."""

    KIND: ClassVar[str] = "checkpoint"
    segments: int
    saved_bytes: int
    predicted_bytes: int
    unit_bytes: int
    seconds: float
    gradient_gap: float


@dataclass
class ActivationRow(Record):
    """Saved activations of the unchecked stack at one depth and batch, beside (depth + 1) x batch x width x 4."""

    KIND: ClassVar[str] = "activation"
    depth: int
    batch: int
    saved_bytes: int
    predicted_bytes: int


@dataclass
class FsdpRow(Record):
    """One FSDP2 fully_shard setting: gap to one process, bytes this rank holds, seconds per step."""

    KIND: ClassVar[str] = "fsdp"
    setting: str
    label: str
    gap: float
    gradient_gap: float
    """Largest |first step's averaged gradient - one process's whole-batch gradient| (fp32, before any update)."""
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    between_bytes: int
    step_s: float


@dataclass
class ZeroOptimizerRow(Record):
    """torch's ZeroRedundancyOptimizer: gap to one process and this rank's optimizer-state bytes."""

    KIND: ClassVar[str] = "zero_optimizer"
    gap: float
    optimizer_bytes: int
    unsharded_optimizer_bytes: int


def hand_zero(ctx, records, options: Options, batches, reference: tuple[list, list], parameters: int) -> None:
    """Stages 0-3 written by hand: bytes held (beside the formula), bytes sent, gradients and parameters against
    one process's (`reference`: its parameters after each step, its gradients before each step)."""
    n = ctx.world_size
    trajectory, gradients = reference
    arguments = (options.depth, options.width, batches, options.lr)
    measured = {0: runs.ddp_by_hand(ctx, *arguments, Traffic())}
    for stage in (1, 2):
        measured[stage] = runs.sharded_optimizer_run(ctx, stage, *arguments, Traffic(), dtype=torch.bfloat16)
    traffic = {name: Traffic() for name in ("stage 0", "stage 1", "stage 2", "stage 3", "stage 3 bf16")}
    runs.ddp_by_hand(ctx, *arguments, traffic["stage 0"])
    results = {f"stage {s}": runs.sharded_optimizer_run(ctx, s, *arguments, traffic[f"stage {s}"],
                                                        trajectory=trajectory, gradients=gradients,
                                                        measure_memory=False) for s in (1, 2)}
    results["stage 3"] = runs.fully_sharded_run(ctx, *arguments, traffic["stage 3"], trajectory=trajectory,
                                                gradients=gradients)
    results["stage 3 bf16"] = runs.fully_sharded_run(ctx, *arguments, traffic["stage 3 bf16"],
                                                     compute_dtype=torch.bfloat16, trajectory=trajectory,
                                                     gradients=gradients)
    measured[3] = results["stage 3"]
    records.write(Resharded(results["stage 3"]["alive_after_forward"]))
    for stage, run in measured.items():
        layout = memory.MIXED if run["layout"] == memory.MIXED.key else memory.FP32
        formula = memory.per_rank_formula(parameters, n, stage, layout)
        held = run["held"]
        records.write(MemoryRow(stage, layout.key, held["parameters"], held["gradients"], held["optimizer"],
                                formula["parameters"], formula["gradients"], formula["optimizer"]))
    for run, result in results.items():
        for step, (gap, gradient_gap) in enumerate(zip(result["gaps"], result["gradient_gaps"])):
            records.write(StepGap(run, step, gap, gradient_gap))
    for run, counted in traffic.items():
        stage = int(run.split()[1])
        formula = options.steps * memory.communication_formula(parameters, n, stage)
        records.write(Sent(run, counted.sent.get("all_reduce", 0), counted.sent.get("reduce_scatter", 0),
                           counted.sent.get("all_gather", 0), counted.total, formula))


def activations(records, options: Options) -> None:
    """Rank 0 alone: saved activations against depth and batch, and checkpoint_sequential against k."""
    depth = options.checkpoint_depth
    for row in memory.activation_grid([depth // 4, depth // 2, depth], [options.checkpoint_batch // 2,
                                                                         options.checkpoint_batch], 64):
        records.write(ActivationRow(**row))
    segments = [k for k in range(1, depth + 1) if depth % k == 0]
    for row in memory.checkpoint_sweep(depth, options.checkpoint_width, options.checkpoint_batch, segments,
                                       options.repeats, options.seed):
        records.write(CheckpointRow(**row))


def torch_apis(ctx, records, options: Options, batches, reference: dict, first_gradients: dict) -> None:
    """FSDP2 fully_shard in each setting and ZeroRedundancyOptimizer, against the one-process run (its parameters
    after the last step, its gradients before the first)."""
    for setting, label in (production.SETTINGS.items() if options.fsdp else ()):
        result = production.train_fsdp(ctx, options.depth, options.width, setting, batches, options.lr)
        records.write(FsdpRow(setting, label, runs.largest_gap(result["parameters"], reference),
                              runs.largest_gap(result["first_gradients"], first_gradients),
                              result["parameter_bytes"], result["gradient_bytes"], result["optimizer_bytes"],
                              result["between_bytes"], result["step_s"]))
    zero = production.train_zero_redundancy(ctx, options.depth, options.width, batches, options.lr)
    unsharded = 8 * memory.count_parameters(memory.deep_mlp(options.depth, options.width))
    records.write(ZeroOptimizerRow(runs.largest_gap(zero["parameters"], reference), zero["optimizer_bytes"],
                                   unsharded))


def memory_sharding_lab(ctx, records, options: Options) -> dict:
    if options.batch % ctx.world_size:
        raise RequestError(f"batch {options.batch} does not split over {ctx.world_size} ranks: choose a multiple "
                           f"of {ctx.world_size}.")
    if ctx.backend != "gloo":
        raise RequestError("this lab keeps its small models on the CPU: launch it with backend='gloo' "
                           "(the notebook does); FSDP2 on GPUs is in the notebook's 'On a GPU, try'.")
    batches = runs.make_batches(options.steps, options.batch, seed=options.seed)
    trajectory = runs.unsharded_trajectory(options.depth, options.width, batches, options.lr)
    gradients = runs.unsharded_gradients(options.depth, options.width, batches, options.lr)
    parameters = memory.count_parameters(memory.deep_mlp(options.depth, options.width))
    steps = ("hand-written ZeRO", "activations", "torch APIs")
    records.progress(0, len(steps), unit="experiments")
    hand_zero(ctx, records, options, batches, (trajectory, gradients), parameters)
    records.progress(1, len(steps), unit="experiments")
    if ctx.is_main:
        activations(records, options)
    records.progress(2, len(steps), unit="experiments")
    torch_apis(ctx, records, options, batches, trajectory[-1], gradients[0])
    records.progress(3, len(steps), unit="experiments")
    first_layer = memory.count_parameters(memory.deep_mlp(options.depth, options.width)[0])
    return {"parameters": parameters, "first_layer_parameters": first_layer, "depth": options.depth,
            "width": options.width, "steps": options.steps, "checkpoint_depth": options.checkpoint_depth,
            "best_segments": memory.best_segments(options.checkpoint_depth),
            "transformer_names": sorted(
                name for name, _ in tiny_transformer().named_parameters()),
            "gradient_scale": max(float(g.abs().max()) for step in gradients for g in step.values())}


def main(argv=None):
    return run_lab("memory_sharding", memory_sharding_lab, Options, argv)


if __name__ == "__main__":
    main()
