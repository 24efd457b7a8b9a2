"""Planted collective bugs on forked ranks, each bounded by a short timeout: the symptom, the tool that names it, the fix.

    outcomes = run_case(mismatched_shape, variant="broken", debug="DETAIL")   # [rank 0's Outcome, rank 1's]
"""
from __future__ import annotations

import datetime
import pickle
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labsrc.core.forked import run_ranks
from labsrc.core.processes import environment_set

FLIGHT_RECORDER_ENTRIES = 200  # TORCH_FR_BUFFER_SIZE: collectives each rank remembers
STARTUP_S = 60.0
"""How long ranks may take to start and join their process group (seconds on a loaded machine; fresh ranks import
torch): a start-up allowance, never part of a planted wait. Every planted wait is a group timeout, which gloo counts
from the collective call itself; the watchdogs around the ranks count from the moment every rank has joined."""


@dataclass
class Outcome:
    """What one rank saw in one case: finished, or the exception class, its first line, and how long it took."""

    case: str
    variant: str
    rank: int
    ok: bool
    exception: str
    message: str
    seconds: float
    detail: dict | None = None
    text: str = ""
    """The exception's whole text (torch's own wording: assert only on stable substrings of it)."""
    debug: str = ""
    """The c10d debug level in force on this rank as it ran (OFF, INFO, DETAIL): what its groups were built with."""


def environment(**variables: str | None):
    """Set (or, with None, remove) environment variables for the block; the old values come back after."""
    return environment_set(variables)


def short_group(timeout_s: float):
    """A gloo group over every rank whose collectives give up after timeout_s (the planted bugs' safety net).

    TORCH_DISTRIBUTED_DEBUG is read again first: a group made at DETAIL checks every collective's fingerprint.
    """
    dist.set_debug_level_from_env()
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def meet(timeout_s: float) -> None:
    """Every rank waits here, on the default group, until all have come: a rank that skipped a planted collective
    stays alive until its peer's wait has ended (a timeout counted from the peer's own call), however long a busy
    machine makes that; not a fixed sleep, which a late peer could outlast. STARTUP_S + 2 x timeout_s at most."""
    dist.barrier(async_op=True).wait(datetime.timedelta(seconds=STARTUP_S + 2 * timeout_s))


def attempt(case: str, variant: str, rank: int, action, *args) -> Outcome:
    """Run action(*args) on this rank; an exception becomes the Outcome's class name and first line."""
    started, debug = time.perf_counter(), dist.get_debug_level().name
    try:
        detail = action(*args)
        return Outcome(case, variant, rank, True, "", "", time.perf_counter() - started, detail, debug=debug)
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return Outcome(case, variant, rank, False, type(exc).__name__, first_line,
                       time.perf_counter() - started, text=str(exc)[:4000], debug=debug)


def run_case(rank_function, variant: str, debug: str = "OFF", timeout_s: float = 4.0,
             flight_recorder: bool = False, world_size: int = 2) -> list[Outcome]:
    """rank_function(ctx, variant, timeout_s) -> Outcome on forked gloo ranks, with TORCH_DISTRIBUTED_DEBUG=debug.

    The debug level is read when a process group is created, so it is set before the ranks start and
    restored after. flight_recorder=True turns on TORCH_FR_BUFFER_SIZE the same way. Each planted wait ends by its
    group's timeout_s, counted from the collective; the outer limit is only a safety net against a wedged rank, so
    it includes STARTUP_S for the ranks to start on a busy machine (a quiet one returns as soon as they finish).
    """
    buffer = str(FLIGHT_RECORDER_ENTRIES) if flight_recorder else None
    with environment(TORCH_DISTRIBUTED_DEBUG=debug, TORCH_FR_BUFFER_SIZE=buffer):
        return run_ranks(rank_function, world_size, args=(variant, timeout_s), timeout_s=STARTUP_S + 2 * timeout_s)


# -- case 1: a collective whose shape (or kind) differs on one rank --------------------------------------------

def mismatched_shape(ctx, variant: str, timeout_s: float) -> Outcome:
    """broken: rank 1 all_reduces 5 numbers, rank 0 four (a ragged last batch); fixed: every rank 4."""
    group = short_group(timeout_s)
    length = 5 if variant == "broken" and ctx.rank == 1 else 4

    def reduce_once():
        values = torch.ones(length)
        dist.all_reduce(values, group=group)
        return {"sum": values.tolist()}
    return attempt("mismatched_shape", variant, ctx.rank, reduce_once)


def mismatched_order(ctx, variant: str, timeout_s: float) -> Outcome:
    """broken: rank 0 all_reduces the loss then broadcasts the weights, rank 1 in the other order; fixed: same order."""
    group = short_group(timeout_s)

    def both_collectives():
        loss, weights = torch.tensor([float(ctx.rank)]), torch.full((3,), float(ctx.rank))
        steps = [lambda: dist.all_reduce(loss, group=group), lambda: dist.broadcast(weights, 0, group=group)]
        if variant == "broken" and ctx.rank == 1:
            steps.reverse()
        for step in steps:
            step()
        return {"loss": loss.item(), "weights": weights.tolist()}
    return attempt("mismatched_order", variant, ctx.rank, both_collectives)


# -- case 2: a barrier only rank 0 reaches ----------------------------------------------------------------------

def rank0_only_barrier(ctx, variant: str, timeout_s: float) -> Outcome:
    """broken: only rank 0 reaches the barrier (rank 1 is busy until rank 0's barrier has given up); fixed: both.

    monitored_barrier collects every rank's arrival at rank 0 and, after timeout_s, names those that did not come.
    """
    group = short_group(timeout_s + 2)

    def barrier():
        if variant == "broken" and ctx.rank != 0:
            return {"reached_barrier": False}  # a branch only rank 1 takes; it stays busy in meet() below
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
        return {"reached_barrier": True}
    outcome = attempt("rank0_only_barrier", variant, ctx.rank, barrier)
    meet(timeout_s)
    return outcome


# -- case 3: a hang read back from the flight recorder ---------------------------------------------------------

def skipped_collective(ctx, variant: str, timeout_s: float) -> Outcome:
    """broken: rank 1 skips the third all_reduce (a metric logged only on rank 0), so rank 0 waits in it until
    the timeout; fixed: every rank joins all three. Each rank then dumps its flight recorder."""
    group = short_group(timeout_s)

    def three_reductions():
        for step in range(3):
            if variant == "broken" and step == 2 and ctx.rank == 1:
                break  # rank 1 moves on; it stays alive (in meet, below) so rank 0 sees a timeout, not a lost peer
            dist.all_reduce(torch.full((4,), float(step)), group=group)
        return None

    outcome = attempt("skipped_collective", variant, ctx.rank, three_reductions)
    outcome.detail = {"flight_record": flight_record()}
    meet(timeout_s)
    return outcome


def flight_record() -> list[dict]:
    """This rank's flight recorder entries (gloo and NCCL alike), read directly from the pickled dump.

    `_dump_fr_trace` is a private binding (torch 2.14 has no public Python call): it may change in any release.
    The public path is the dump file the NCCL watchdog writes (TORCH_FR_DUMP_TEMP_FILE) read by `torchfrtrace`.
    """
    from torch._C._distributed_c10d import _dump_fr_trace
    dump = pickle.loads(_dump_fr_trace())
    return [{"seq": entry["collective_seq_id"], "op": entry["profiling_name"], "pg_id": entry["pg_id"],
             "sizes": entry["input_sizes"], "state": entry["state"], "timeout_ms": entry["timeout_ms"]}
            for entry in dump.get("entries", []) if not entry.get("is_p2p")]


def first_divergence(records: list[list[dict]]) -> dict | None:
    """The first collective some ranks entered and others never did: {op, seq, sizes, entered, missing}.

    records: one flight record per rank (rank order). Only the group with the most entries is compared,
    which is the group the training code used.
    """
    groups = [entry["pg_id"] for record in records for entry in record]
    if not groups:
        return None
    busiest = max(set(groups), key=groups.count)
    per_rank = [{entry["seq"]: entry for entry in record if entry["pg_id"] == busiest} for record in records]
    for seq in sorted(set().union(*per_rank)):
        entered = [rank for rank, seen in enumerate(per_rank) if seq in seen]
        if len(entered) < len(per_rank):
            entry = per_rank[entered[0]][seq]
            return {"op": entry["op"], "seq": seq, "sizes": entry["sizes"], "entered": entered,
                    "missing": [rank for rank in range(len(per_rank)) if rank not in entered]}
    return None
