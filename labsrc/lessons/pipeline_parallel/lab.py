"""Pipeline parallelism on p ranks: gradients of every schedule vs the unsplit model, the bubble, activation memory.

    python -m labsrc.launch --nproc 2 pipeline_parallel
    torchrun --nproc-per-node 2 -m labsrc.lessons.pipeline_parallel.lab --repeats 5
One launch runs every experiment: the gradient checks (hand-written naive, GPipe, 1F1B, interleaved 1F1B and zero
bubble; torch's GPipe, 1F1B, interleaved 1F1B and two zero-bubble schedules), the timed GPipe sweep over
micro-batch counts, timed 1F1B, interleaved and zero-bubble steps, saved-tensor peaks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from labsrc.core.lab import run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.runs import Record
from labsrc.core.world import RequestError
from labsrc.lessons.pipeline_parallel import experiments, schedules
from labsrc.lessons.pipeline_parallel.library import LIBRARY_SCHEDULES


@dataclass
class Options(LabOptions):
    """Pipeline schedules on p ranks, one stage per rank (two when interleaved)."""

    micro_batches: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    """Micro-batch counts m of the timed GPipe sweep (the bubble against (p-1)/(m+p-1))."""
    check_micro_batches: int = 4
    """m for the gradient checks, the 1F1B timing and the Gantt charts (torch's interleaved 1F1B: a multiple of p)."""
    check_batch: int = 8
    """Samples in the gradient checks' batch; check_micro_batches must divide it."""
    memory_micro_batches: int = 8
    """m for the saved-tensor peaks of GPipe and 1F1B."""
    repeats: int = 3
    """Timed repetitions of the sweep and of the 1F1B step; the least disturbed one (shortest span) is kept per m."""
    box_ms: float = 40.0
    """Each timed F and B lasts at least this long (compute, then a wait): equal boxes, as the formula assumes."""
    width: int = 256
    """Features of every layer of the timed model."""
    blocks_per_stage: int = 2
    """Linear+Tanh blocks on each stage of the timed model."""
    micro_batch_size: int = 32
    """Samples in one micro-batch of the timed runs (the batch grows with m, so every box costs the same)."""

    def validate(self) -> None:
        super().validate()
        if not self.micro_batches or min(self.micro_batches) < 1:
            raise RequestError(f"micro_batches must be counts of 1 or more (got {self.micro_batches}).")
        for name in ("check_micro_batches", "check_batch", "memory_micro_batches", "repeats", "width",
                     "blocks_per_stage", "micro_batch_size"):
            positive(name, getattr(self, name))
        positive("box_ms", self.box_ms, allow_zero=True)
        if self.check_batch % self.check_micro_batches:
            raise RequestError(f"check_micro_batches {self.check_micro_batches} must divide check_batch "
                               f"{self.check_batch}: every micro-batch holds the same number of samples.")


@dataclass
class GradientCheck(Record):
    """Largest |gradient - unsplit model's gradient| over the parameters this rank's stage(s) hold."""

    KIND: ClassVar[str] = "gradient_check"
    implementation: str
    """hand-written or torch.distributed.pipelining."""
    schedule: str
    """naive, gpipe, 1f1b or interleaved_1f1b."""
    micro_batches: int
    max_error: float
    scale: float
    """c in gradients = c x unsplit gradients, fitted (1.0 right; m if the loss is not divided by m)."""
    backwards: list[int]
    """Backwards that reached each stage this rank holds (one stage; two when interleaved): m each."""


@dataclass
class ActionTiming(Record):
    """When one F or B ran on one stage (perf_counter seconds, one clock for the machine)."""

    KIND: ClassVar[str] = "action_timing"
    schedule: str
    micro_batches: int
    repeat: int
    stage: int
    action: str
    """F or B."""
    micro_batch: int
    start: float
    end: float
    virtual_stage: int = -1
    """The model chunk (virtual stage) the action ran on, for interleaved and zero-bubble steps; -1: the rank's one stage."""


@dataclass
class StepMessages(Record):
    """Point-to-point messages one rank sent in one timed step of a chunked schedule (counted by the executor)."""

    KIND: ClassVar[str] = "step_messages"
    schedule: str
    micro_batches: int
    stage: int
    sends: int


@dataclass
class ScheduleProblem(Record):
    """A schedule's action lists that cannot run (the ranks would wait on each other forever): not run, named."""

    KIND: ClassVar[str] = "schedule_problem"
    schedule: str
    problem: str


@dataclass
class Skipped(Record):
    """A schedule this launch could not run at its sizes, and why (interleaved 1F1B needs m a multiple of p)."""

    KIND: ClassVar[str] = "skipped"
    schedule: str
    reason: str


@dataclass
class ChunkedMemoryPeak(Record):
    """Peak activation bytes one rank kept in a step of a chunked schedule, measured and replayed from its list."""

    KIND: ClassVar[str] = "chunked_memory_peak"
    schedule: str
    micro_batches: int
    stage: int
    peak_bytes: int
    expected_bytes: int
    """The list replayed with each chunk's one-micro-batch bytes kept from F until B (or W when split)."""


@dataclass
class MemoryPeak(Record):
    """Peak bytes of activations saved for backward on one stage during one step."""

    KIND: ClassVar[str] = "memory_peak"
    schedule: str
    micro_batches: int
    stage: int
    stages: int
    peak_bytes: int
    micro_batch_bytes: int
    """What one micro-batch's forward saves on this stage."""
    in_flight: int
    """Most micro-batches forwarded and not yet backwarded, counted on the action list."""
    cuda_peak_bytes: int | None
    """Peak CUDA memory above the start of the step (None on the CPU)."""


PROGRESS_UNIT = "pipeline steps"  # each gradient check, memory measure and timed run is one step of a schedule


def timed_runs(options: Options) -> list[tuple[str, int, int]]:
    """(schedule, m, repeat) of each timed step: GPipe at every m then 1F1B at check_micro_batches, `repeats`
    times over (interleaved, so a burst of load elsewhere does not land on one schedule only)."""
    return [run for repeat in range(options.repeats)
            for run in [("gpipe", m, repeat) for m in options.micro_batches]
            + [(name, options.check_micro_batches, repeat) for name in ("1f1b",) + experiments.CHUNKED_SCHEDULES]]


def step_count(options: Options) -> int:
    """How many pipeline steps the lab runs: the bar's total."""
    return (len(schedules.SCHEDULES) + 2 * len(experiments.CHUNKED_SCHEDULES) + len(LIBRARY_SCHEDULES) + 2 + 1
            + len(timed_runs(options)))


def runnable(schedule: str, ranks: int, micro_batches: int) -> str | None:
    """Why a hand-written chunked schedule cannot run at these sizes (None: it can)."""
    if schedule == "interleaved_1f1b" and micro_batches % ranks:
        return f"interleaved 1F1B runs micro-batches in groups of p = {ranks}; m = {micro_batches} is not a multiple"
    return None


def check_gradients(ctx, records, options: Options, tick) -> None:
    m, batch = options.check_micro_batches, options.check_batch
    for schedule in schedules.SCHEDULES:
        report = experiments.hand_written_check(ctx, schedule, m, batch=batch, timeout_s=options.pg_timeout_s)
        used = schedules.effective_micro_batches(schedule, m)
        records.write(GradientCheck(implementation="hand-written", schedule=schedule, micro_batches=used, **report))
        tick()
    for schedule in experiments.CHUNKED_SCHEDULES:
        if runnable(schedule, ctx.world_size, m):
            records.write(Skipped(schedule, runnable(schedule, ctx.world_size, m)))
            tick()
            continue
        try:
            report = experiments.chunked_check(ctx, schedule, m, batch=batch, timeout_s=options.pg_timeout_s)
        except ValueError as cannot_run:   # every rank builds every list, so all ranks skip it together
            records.write(ScheduleProblem(schedule, str(cannot_run)))
        else:
            records.write(GradientCheck(implementation="hand-written", schedule=schedule, micro_batches=m, **report))
        tick()
    for schedule in LIBRARY_SCHEDULES:
        report = experiments.library_check(ctx, schedule, m, batch=batch)
        records.write(GradientCheck(implementation="torch.distributed.pipelining", schedule=schedule,
                                    micro_batches=m, **report))
        tick()


def time_schedules(ctx, records, options: Options, tick) -> None:
    sizes = dict(width=options.width, blocks_per_stage=options.blocks_per_stage,
                 micro_batch_size=options.micro_batch_size, box_s=options.box_ms / 1000,
                 timeout_s=options.pg_timeout_s)
    experiments.timed_schedule(ctx, "gpipe", 2, **sizes)   # warm-up, not recorded
    tick()
    for schedule, m, repeat in timed_runs(options):
        if schedule in experiments.CHUNKED_SCHEDULES:
            if runnable(schedule, ctx.world_size, m):
                tick()
                continue
            try:
                run = experiments.timed_chunked(ctx, schedule, m, **sizes)
            except ValueError:   # named once, by check_gradients
                tick()
                continue
            events = run["timeline"]
            if repeat == 0:
                records.write(StepMessages(schedule, m, ctx.rank, run["sends"]))
        else:
            events = experiments.timed_schedule(ctx, schedule, m, **sizes)
        for event in events:
            records.write(ActionTiming(schedule=schedule, micro_batches=m, repeat=repeat, stage=ctx.rank, **event))
        tick()


def measure_memory(ctx, records, options: Options, tick) -> None:
    for schedule in ("gpipe", "1f1b"):
        peak = experiments.saved_tensor_peak(ctx, schedule, options.memory_micro_batches,
                                             timeout_s=options.pg_timeout_s)
        records.write(MemoryPeak(schedule=schedule, micro_batches=options.memory_micro_batches, stage=ctx.rank,
                                 stages=ctx.world_size, **peak))
        tick()
    for schedule in experiments.CHUNKED_SCHEDULES:
        try:
            if not runnable(schedule, ctx.world_size, options.memory_micro_batches):
                peak = experiments.chunked_saved_tensor_peak(ctx, schedule, options.memory_micro_batches,
                                                             timeout_s=options.pg_timeout_s)
                records.write(ChunkedMemoryPeak(schedule, options.memory_micro_batches, ctx.rank, peak["peak_bytes"],
                                                peak["expected_bytes"]))
        except ValueError:   # lists that cannot run: named once, by check_gradients
            pass
        tick()


def pipeline_experiments(ctx, records, options: Options) -> dict:
    if ctx.world_size < 2:
        raise RequestError("a pipeline needs at least 2 ranks: launch with nproc=2 or more.")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # one core per stage, as one GPU per stage would be
    done, total = [0], step_count(options)

    def tick():
        done[0] += 1
        records.progress(done[0], total, unit=PROGRESS_UNIT)
    records.progress(0, total, unit=PROGRESS_UNIT)
    try:
        check_gradients(ctx, records, options, tick)
        measure_memory(ctx, records, options, tick)
        time_schedules(ctx, records, options, tick)
    finally:
        torch.set_num_threads(threads)
    return {"stages": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device), "box_ms": options.box_ms,
            "torch": torch.__version__}


def main(argv=None):
    return run_lab("pipeline_parallel", pipeline_experiments, Options, argv)


if __name__ == "__main__":
    main()
