"""Train, crash on purpose, let torchrun restart, resume from the last snapshot: nothing lost, checked to the bit.

    python -m labsrc.launch --nproc 2 --max-restarts 3 elastic_fault_tolerance -- --failures exception kill hang
    torchrun --nproc-per-node 2 --max-restarts 3 -m labsrc.lessons.elastic_fault_tolerance.lab --failures exception
On attempt 0 the ranks first train once without interruption (the reference, saved as reference.pt), then
train again with snapshots; attempt a fails as `failures[a]` says, at a seeded random step; the last attempt
finishes and saves final.pt. With elastic nodes (nnodes "1:2") the same loop re-forms at each world size.
"""
from __future__ import annotations

import os
import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from labsrc.core.lab import run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.runs import Record, current_attempt
from labsrc.core.world import RequestError
from labsrc.lessons.elastic_fault_tolerance.resume import Setup, Training, part_fingerprints, restore, save_snapshot
from labsrc.lessons.elastic_fault_tolerance.snapshot import (SnapshotCorrupt, die_mid_write, load_latest, save_atomic,
                                                             save_keeping, snapshot_path)

FAILURES = ("exception", "kill", "hang")
SNAPSHOT_FOLDER = "snapshots"  # snapshot-<step>.pt, the newest keep_snapshots of them


@dataclass
class Options(LabOptions):
    """Snapshot-and-resume training with planted failures, one per attempt."""

    failures: tuple[str, ...] = ()
    """Attempt a fails as failures[a]: exception (a rank raises), kill (rank 0 SIGKILLed mid-way through writing
    a snapshot) or hang (a rank stops joining collectives; the others' collective times out after pg_timeout_s)."""
    failure_seed: int = 0
    """Seeds the random steps the failures happen at."""
    snapshot_every: int = 2
    """Steps between snapshots (each one costs a gather of RNG states and one file write)."""
    keep_snapshots: int = 2
    """Snapshots kept on disk: a refused newest one (torn or changed) falls back to the one before."""
    epochs: int = 3
    """Epochs of the 48-sample training set (6 steps each at the global batch of 8)."""
    step_sleep_s: float = 0.0
    """Seconds each step waits (to make time to end or add a node during an elastic run)."""
    reference: bool = True
    """Attempt 0 first trains once without failures and saves reference.pt (needs a fixed world size)."""

    def validate(self) -> None:
        super().validate()
        unknown = sorted(set(self.failures) - set(FAILURES))
        if unknown:
            raise RequestError(f"failures {unknown} unknown: use any of {list(FAILURES)}, one per attempt.")
        positive("snapshot_every", self.snapshot_every)
        positive("keep_snapshots", self.keep_snapshots)
        positive("epochs", self.epochs)
        positive("step_sleep_s", self.step_sleep_s, allow_zero=True)
        steps = self.epochs * Setup().steps_per_epoch
        if len(self.failures) > steps - 3:
            raise RequestError(f"{len(self.failures)} failures need more than {steps} steps: raise epochs.")


@dataclass
class Resume(Record):
    """How one rank of one attempt started: its world, the snapshot it found, its RNG."""

    KIND: ClassVar[str] = "resume"
    restart_count: int
    """torchrun's TORCHELASTIC_RESTART_COUNT for this process."""
    world_size: int
    node_rank: int
    pid: int
    started_wall: float
    """time.time() as the training state was built."""
    resumed_from_step: int
    """Steps already done in the snapshot it loaded (0: started from scratch)."""
    snapshot: str
    """'loaded', 'none' (no snapshot yet) or 'refused' (every kept one torn or changed, with refused_why)."""
    refused_why: str = ""
    """Why newer snapshots were refused (also when an older one then loaded: the fallback)."""
    rng: str = ""
    """How this rank's RNG state was restored."""
    host: str = ""
    """The host name of the machine (node) it ran on: node0, node1 on the emulated Slurm cluster."""
    own_store: str = ""
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE as this process saw it ('1': a fresh store per start, not torchrun's)."""


@dataclass
class TrainStep(Record):
    """One optimizer step on one rank: which samples it used."""

    KIND: ClassVar[str] = "train_step"
    run: str
    """'reference' (uninterrupted) or 'resumable' (with snapshots and failures)."""
    step: int
    """Steps done after this one (1 for the first)."""
    epoch: int
    sample_ids: list
    loss: float
    world_size: int
    wall: float


@dataclass
class StateFingerprint(Record):
    """Fingerprints of every part of one rank's training state (resume.part_fingerprints)."""

    KIND: ClassVar[str] = "state_fingerprint"
    run: str
    """'reference': after each uninterrupted step; 'resumed': right after a snapshot was loaded."""
    step: int
    parts: dict
    """{part: fingerprint}: model, optimizer, scheduler, scaler, sampler, rng, step."""


@dataclass
class SnapshotSaved(Record):
    """Rank 0 wrote a whole snapshot (atomically) after `step` steps."""

    KIND: ClassVar[str] = "snapshot_saved"
    step: int
    seconds: float
    wall: float


@dataclass
class Failure(Record):
    """A planted failure, written by the failing rank just before it fails."""

    KIND: ClassVar[str] = "failure"
    failure: str
    step: int
    wall: float


@dataclass
class Finished(Record):
    """Rank 0's parameters at the end of a run, saved (weights_only-loadable) in run_dir/file."""

    KIND: ClassVar[str] = "finished"
    run: str
    step: int
    file: str
    wall: float


class PlantedFailure(RuntimeError):
    """The exception `failures` asks for."""


def failure_steps(options: Options, total_steps: int) -> list[int]:
    """The seeded random steps the failures happen after, increasing (each attempt gets further)."""
    return sorted(random.Random(options.failure_seed).sample(range(2, total_steps - 1), len(options.failures)))


def fail_now(ctx, records, kind: str, step: int) -> None:
    records.write(Failure(failure=kind, step=step, wall=time.time()))
    print(f"planted failure '{kind}' after step {step}", flush=True)
    if kind == "exception":
        raise PlantedFailure(f"rank {ctx.rank} raised on purpose after step {step}")
    if kind == "hang":
        time.sleep(3600)  # never joins the next collective; the others time out, torchrun ends this process


def resume(ctx, records, run: Training, folder: Path) -> None:
    """Load the newest whole snapshot if there is one; a torn or changed one is refused and the one before it tried
    (the run fails only when every kept snapshot is refused)."""
    found, rng = "none", "fresh seeds (no snapshot)"
    state, _, refused = load_latest(folder)
    why = "; ".join(refused)
    if state is not None:
        rng = restore(run, state)
        found = "loaded"
        records.write(StateFingerprint(run="resumed", step=run.steps_done, parts=part_fingerprints(run)))
    elif refused:
        found = "refused"
    records.write(Resume(restart_count=current_attempt(), world_size=ctx.world_size,
                         node_rank=int(os.environ.get("GROUP_RANK", 0)), pid=os.getpid(),
                         started_wall=time.time(), resumed_from_step=run.steps_done, snapshot=found,
                         refused_why=why, rng=rng, host=socket.gethostname(),
                         own_store=os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "")))
    if found == "refused":
        raise SnapshotCorrupt(why)
    print(f"world {ctx.world_size}: resumed from step {run.steps_done} ({found}); RNG {rng}", flush=True)


def save(ctx, records, run: Training, folder: Path, keep: int, planted: str | None) -> None:
    """A snapshot, the newest `keep` kept; with planted 'kill', rank 0 dies half-way through writing it."""
    start = time.perf_counter()
    path = snapshot_path(folder, run.steps_done)
    if planted == "kill":
        def killed_mid_write(state, target):  # the course's own save, SIGKILLed half-way through its write
            records.write(Failure(failure="kill", step=run.steps_done, wall=time.time()))
            die_mid_write()
            save_atomic(state, target)
        save_snapshot(run, path, write=killed_mid_write)
    else:
        save_snapshot(run, path, write=lambda state, _: save_keeping(state, folder, run.steps_done, keep))
    if ctx.rank == 0:
        records.write(SnapshotSaved(step=run.steps_done, seconds=time.perf_counter() - start, wall=time.time()))


def train(ctx, records, options: Options, run: Training, label: str, folder: Path | None) -> None:
    """Steps until the setup's total; snapshots every snapshot_every steps; this attempt's planted failure."""
    attempt = current_attempt()
    planted = options.failures[attempt] if folder is not None and attempt < len(options.failures) else None
    due = failure_steps(options, run.setup.total_steps)[attempt] if planted else None
    while run.steps_done < run.setup.total_steps:
        epoch, ids, loss = run.step()
        records.write(TrainStep(run=label, step=run.steps_done, epoch=epoch, sample_ids=ids, loss=loss,
                                world_size=ctx.world_size, wall=time.time()))
        records.progress(run.steps_done, run.setup.total_steps, unit="steps")
        time.sleep(options.step_sleep_s)
        if folder is None:
            records.write(StateFingerprint(run=label, step=run.steps_done, parts=part_fingerprints(run)))
            continue
        last_rank = ctx.rank == ctx.world_size - 1
        if planted in ("exception", "hang") and run.steps_done == due and last_rank:
            fail_now(ctx, records, planted, run.steps_done)
        if run.steps_done % options.snapshot_every == 0 or run.steps_done == run.setup.total_steps:
            kill = planted == "kill" and run.steps_done >= due and run.steps_done < run.setup.total_steps
            save(ctx, records, run, folder, options.keep_snapshots, "kill" if kill else None)


def finish(ctx, records, run: Training, run_dir: Path, label: str) -> None:
    if ctx.rank == 0:
        save_atomic(run.parameters(), run_dir / f"{label}.pt")
        records.write(Finished(run=label, step=run.steps_done, file=f"{label}.pt", wall=time.time()))


def body(ctx, records, options: Options) -> dict:
    run_dir = records.run_dir
    setup = Setup(epochs=options.epochs, seed=options.seed)
    if options.reference and current_attempt() == 0:
        reference = Training.build(ctx, setup)
        train(ctx, records, options, reference, "reference", None)
        finish(ctx, records, reference, run_dir, "reference")
    run = Training.build(ctx, setup)
    folder = run_dir / SNAPSHOT_FOLDER
    resume(ctx, records, run, folder)
    train(ctx, records, options, run, "resumable", folder)
    finish(ctx, records, run, run_dir, "final")
    return {"steps": run.steps_done, "attempt": current_attempt(), "world_size": ctx.world_size}


def main(argv=None):
    return run_lab("elastic_fault_tolerance", body, Options, argv)


if __name__ == "__main__":
    main()
