"""A parameter server on rank 0 and workers on the other ranks: sync, async, bounded async and SSP; local SGD, DiLoCo.

    launch.run("async_parameter_server", nproc=3)
    python -m labsrc.launch --nproc 3 async_parameter_server -- --gradients 120 --bound 1
    torchrun --nproc-per-node 3 -m labsrc.lessons.async_parameter_server.lab
"""
from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import ClassVar

import torch.distributed as dist

from labsrc.core.lab import run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.runs import Record
from labsrc.core.world import RequestError
from labsrc.lessons.async_parameter_server import analysis, local_sgd as local, server as ps
from labsrc.techniques.collectives import ring_bytes_sent


@dataclass
class Options(LabOptions):
    """Parameter-server runs (one worker sync/async, then sync, async, bounded async, SSP), local SGD and DiLoCo."""

    backend: str | None = "gloo"
    """gloo: the server receives from whichever worker sends first (an any-source receive), which NCCL lacks."""
    pg_timeout_s: float = 60.0
    """Seconds a collective may wait for the other ranks before it fails."""
    features: int = 16
    """Weights of the linear regression (the parameters every message carries)."""
    batch: int = 16
    """Samples per gradient on a worker."""
    lr: float = 0.2
    """SGD learning rate of every update (stable in sync; staleness makes the fast directions ring)."""
    gradients: int = 200
    """Gradients the server applies per run (sync: rounded down to a multiple of the workers)."""
    large_lr: float = 0.35
    """A second pair of runs (sync, async) at this learning rate: lr x the largest curvature 4.5 stays under 2, so
    sync converges; stale gradients make async diverge."""
    bound: int = 1
    """Bounded async: the largest staleness the server admits (1: most of the slow worker's gradients, 2 to 3
    updates old on average in ci runs and up to 5 to 7, exceed it even when a busy machine narrows the gap)."""
    clock_bound: int = 2
    """SSP: the most clocks (gradients pushed) a worker may run ahead of the slowest before its reply is held."""
    delays_ms: tuple[float, ...] = (2.0, 10.0)
    """Mean compute delay of worker 1, 2, ... (cycled): a slow worker is what makes staleness appear."""
    jitter: float = 0.5
    """Each delay is drawn in mean * (1 ± jitter), seeded by (worker, step)."""
    local_steps: int = 100
    """Local SGD: SGD steps each worker takes (100: k = 16 ends with a partial round of 4 steps, averaged too)."""
    average_every: tuple[int, ...] = (1, 4, 16)
    """Local SGD: average the workers' parameters every k steps, for each k here."""
    diloco_every: int = 16
    """DiLoCo: inner steps per outer step."""
    outer_lr: float = 1.0
    """DiLoCo: the outer SGD learning rate on the pseudo-gradient (1 with no momentum: plain local SGD)."""
    outer_momentum: float = 0.5
    """DiLoCo: the outer Nesterov momentum (the paper's 0.7 / 0.9 pair is run as well)."""
    slow_inner_lr: float = 0.05
    """DiLoCo: a second inner learning rate, at which 16 inner steps leave the workers far from converged."""
    message_timeout_s: float = 30.0
    """Seconds any one send, receive or averaging all_reduce may wait before it raises."""

    def validate(self) -> None:
        super().validate()
        if self.backend == "nccl":
            raise RequestError("this lab needs backend='gloo': its server receives from any worker, which NCCL "
                               "cannot do (its tensors are tiny and live on the CPU anyway).")
        for name in ("features", "batch", "gradients", "local_steps", "lr", "large_lr", "message_timeout_s",
                     "diloco_every", "outer_lr", "slow_inner_lr"):
            positive(name, getattr(self, name))
        positive("bound", self.bound, allow_zero=True)
        positive("clock_bound", self.clock_bound, allow_zero=True)
        if not 0 <= self.outer_momentum < 1:
            raise RequestError(f"outer_momentum must be in [0, 1) (got {self.outer_momentum}).")
        for delay in self.delays_ms:
            positive("delays_ms", delay, allow_zero=True)
        for every in self.average_every:
            positive("average_every", every)
        if not 0 <= self.jitter < 1:
            raise RequestError(f"jitter must be in [0, 1) so every delay stays positive (got {self.jitter}).")


@dataclass
class Update(Record):
    """One gradient the server handled, in arrival order."""

    KIND: ClassVar[str] = "update"
    experiment: str
    """Key of the run: one_worker_sync, one_worker_async, sync, async, bounded, ssp, sync_large_lr, async_large_lr."""
    order: int
    """Arrival index at the server (0, 1, ...)."""
    worker: int
    worker_step: int
    """The worker's step count: with the worker it names the seeded batch."""
    gradient_version: int
    """Version of the parameters the gradient was computed on."""
    server_version: int
    """The server's version when the gradient arrived."""
    staleness: int
    """server_version - gradient_version: updates applied since the worker pulled."""
    applied: bool
    loss: float
    """Full-data loss of the server's parameters after handling this gradient."""
    seconds: float
    """Since the run's start."""
    held: bool
    """The reply was not sent when the gradient arrived: the worker waited (sync: for the round; ssp: for the
    slowest worker)."""
    held_s: float
    """Seconds from the gradient's arrival to the server's reply."""
    clock_gap: int | None
    """Clocks this worker was ahead of the slowest when told to go on (None: told to stop)."""


@dataclass
class Outcome(Record):
    """One parameter-server run, from the server."""

    KIND: ClassVar[str] = "outcome"
    experiment: str
    mode: str
    workers: int
    bound: int
    """bounded: the largest staleness admitted; ssp: the largest clock gap; otherwise unused."""
    lr: float
    parameters: list
    """Final parameters (features,)."""
    seconds: float
    applied: int
    rejected: int
    versions: int
    gradients_per_s: float
    final_loss: float
    """The loss after the last gradient ("inf" or "nan" where the run diverged: read it with float())."""
    drained: int
    """Gradients in flight when the run stopped, answered with stop and not applied."""
    blocked: int
    """Replies the server held back (the worker idle meanwhile)."""
    idle_s: float
    """Seconds the held replies waited, summed over them."""
    max_clock_gap: int
    """Largest clock gap a worker was told to go on at."""
    messages_in: int
    bytes_in: int
    messages_out: int
    bytes_out: int


@dataclass
class LocalSgd(Record):
    """One worker's local SGD run with averaging every k steps."""

    KIND: ClassVar[str] = "local_sgd"
    every: int
    steps: int
    workers: int
    calls: int
    """all_reduce calls this worker made."""
    payload_bytes: int
    """Bytes handed to those all_reduces."""
    ring_bytes: int
    """What a ring all-reduce sends from this rank for them (notebook 02's count)."""
    final_loss: float
    """Loss of the averaged parameters after the last step ("inf" or "nan" where it diverged: read it with float())."""
    parameters: list
    curve: list
    """[(local steps done, loss of the averaged parameters)] at each averaging."""


@dataclass
class Diloco(Record):
    """One worker's DiLoCo run: inner SGD steps, then an outer Nesterov step on the averaged pseudo-gradient."""

    KIND: ClassVar[str] = "diloco"
    inner_lr: float
    every: int
    outer_lr: float
    outer_momentum: float
    steps: int
    calls: int
    final_loss: float
    """Loss of the global parameters after the last outer step ("inf"/"nan" where it diverged: read with float())."""
    parameters: list
    curve: list
    """[(local steps done, loss of the global parameters)] after each outer step."""


@dataclass
class Bottleneck(Record):
    """Bytes into the server per round of gradients against a ring all-reduce's bytes per rank."""

    KIND: ClassVar[str] = "bottleneck"
    workers: int
    server_in: int
    allreduce_per_rank: int
    allreduce_formula: float
    counted_server_in: float | None
    """Bytes the server received per sync round in this launch (None where no run had this many workers)."""


def experiments(workers: tuple[int, ...], options: Options) -> list[tuple[str, str, tuple[int, ...], float]]:
    """(key, mode, worker ranks, learning rate) of every parameter-server run, in the order they run."""
    lr, large = options.lr, options.large_lr
    return [("one_worker_sync", "sync", workers[:1], lr), ("one_worker_async", "async", workers[:1], lr),
            ("sync", "sync", workers, lr), ("async", "async", workers, lr), ("bounded", "bounded", workers, lr),
            ("ssp", "ssp", workers, lr), ("sync_large_lr", "sync", workers, large),
            ("async_large_lr", "async", workers, large)]


def settings_for(mode: str, ranks: tuple[int, ...], lr: float, options: Options) -> ps.Settings:
    """One worker runs without delays (they change nothing there); several get the slow-worker delays."""
    gradients = options.gradients - options.gradients % len(ranks) if mode == "sync" else options.gradients
    delays = tuple(ms / 1000 for ms in options.delays_ms) if len(ranks) > 1 else ()
    return ps.Settings(mode, ranks, gradients, lr, options.bound, delays, options.jitter, options.message_timeout_s,
                       clock_bound=options.clock_bound)


def write_server_run(records, key: str, settings: ps.Settings, result: dict) -> None:
    for update in result["updates"]:
        records.write(Update(experiment=key, **{k: v for k, v in update.items() if k != "arrived_at_version"}))
    counts = {**analysis.throughput(result["updates"], result["seconds"]), **analysis.waiting(result["updates"])}
    traffic = dataclasses.asdict(result["traffic"])
    bound = settings.clock_bound if settings.mode == "ssp" else settings.bound
    records.write(Outcome(key, settings.mode, len(settings.workers), bound, settings.lr,
                          result["parameters"].tolist(), result["seconds"], final_loss=result["updates"][-1]["loss"],
                          drained=result["drained"], **counts, **traffic))


def local_sgd_runs(ctx, records, data, problem, workers, options: Options) -> None:
    group = dist.new_group(list(workers), timeout=datetime.timedelta(seconds=options.message_timeout_s))
    if ctx.rank not in workers:
        return
    index = workers.index(ctx.rank)
    for every in options.average_every:
        out = local.local_sgd(ctx.rank, data, problem, options.local_steps, every, options.lr, group,
                              options.message_timeout_s)
        ring = out["calls"] * ring_bytes_sent(problem.features, index, len(workers))
        records.write(LocalSgd(every, options.local_steps, len(workers), out["calls"], out["payload_bytes"], ring,
                               out["curve"][-1][1], out["parameters"].tolist(), out["curve"]))
    for inner_lr, outer_lr, momentum in diloco_settings(options):
        out = local.diloco(ctx.rank, data, problem, options.local_steps, options.diloco_every, inner_lr, outer_lr,
                           momentum, group, options.message_timeout_s)
        records.write(Diloco(inner_lr, options.diloco_every, outer_lr, momentum, options.local_steps, out["calls"],
                             out["curve"][-1][1], out["parameters"].tolist(), out["curve"]))


PAPER_OUTER = (0.7, 0.9)
"""DiLoCo's outer learning rate and Nesterov momentum (Douillard et al. 2023)."""


def diloco_settings(options: Options) -> list[tuple[float, float, float]]:
    """(inner lr, outer lr, outer momentum) of every DiLoCo run: plain averaging, the chosen outer step and the
    paper's, at the lab's learning rate and at slow_inner_lr."""
    outers = [(1.0, 0.0), (options.outer_lr, options.outer_momentum), PAPER_OUTER]
    return [(inner, *outer) for inner in (options.lr, options.slow_inner_lr) for outer in outers]


def bottleneck_rows(records, features: int, outcomes: dict) -> None:
    counted = {o["workers"]: o["bytes_in"] / o["versions"] for o in outcomes.values() if o["mode"] == "sync"}
    for row in analysis.bottleneck_table(features, (1, 2, 4, 8, 16)):
        records.write(Bottleneck(**row, counted_server_in=counted.get(row["workers"])))


def parameter_server_lab(ctx, records, options: Options) -> dict:
    if ctx.world_size < 3:
        raise RequestError(f"this lab needs a server and at least 2 workers: nproc=3 or more (got {ctx.world_size}).")
    problem = ps.Problem(features=options.features, batch=options.batch, seed=options.seed)
    data = ps.make_data(problem)
    workers = tuple(range(1, ctx.world_size))
    runs, outcomes = experiments(workers, options), {}
    for done, (key, mode, ranks, lr) in enumerate(runs):
        settings = settings_for(mode, ranks, lr, options)
        result = ps.run(ctx.rank, data, problem, settings)
        if ctx.is_main:
            write_server_run(records, key, settings, result)
            outcomes[key] = {"mode": mode, "workers": len(ranks), "bytes_in": result["traffic"].bytes_in,
                             "versions": analysis.throughput(result["updates"], 1.0)["versions"]}
        records.progress(done + 1, len(runs) + 1, unit="runs")
    local_sgd_runs(ctx, records, data, problem, workers, options)
    records.progress(len(runs) + 1, len(runs) + 1, unit="runs")
    if ctx.is_main:
        bottleneck_rows(records, problem.features, outcomes)
    return {"problem": dataclasses.asdict(problem), "workers": list(workers),
            "noise_floor": problem.noise ** 2, "initial_loss": ps.full_loss(*data, ps.initial_parameters(problem))}


def main(argv=None):
    return run_lab("async_parameter_server", parameter_server_lab, Options, argv)


if __name__ == "__main__":
    main()
