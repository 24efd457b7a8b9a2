"""The parameter server behind a slow link: every update crosses the server's link twice, so it caps updates/s.

    python -m labsrc.launch --nproc 1 --nnodes 4 --link 100mbit \
        labsrc.lessons.async_parameter_server.behind_link -- --workers 1 2 3

Rank 0, the server, on node 0; worker w on node w, each node behind its own shaped link. In each phase the first
W workers run the async protocol of lesson 11 with a large parameter vector: pull [status, parameters], push a
gradient; the server applies each gradient as it arrives and answers that worker alone. An update moves the
parameters out of the server and a gradient into it, t_out and t_in seconds on its link. One worker does both in
turn (an update per t_out + t_in); more workers overlap them, until the server's link is busy both ways (an update
per max(t_out, t_in)): updates/s = min(W / (t_out + t_in), 1 / max(t_out, t_in)).

Each rank of a phase records how long its threads were runnable but not running (`busy.core_wait_since`, the
kernel's count): on a busy machine `judge_rates` judges the rates against the link only where the ranks of every
phase, summed, waited for a core under 5% of it, so a busy machine that still left the ranks their cores can be told
from one that slowed them.
"""
from __future__ import annotations

import argparse
import datetime
import os
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from labsrc.core import busy
from labsrc.core.runs import RUN_DIR_ENV, Record, RecordWriter, write_summary

WIRE_EFFICIENCY = 1448 / 1514
"""Payload per byte the shaper counts: a 1500-byte MTU carries 1448 bytes of TCP payload (20 IP + 20 TCP + 12
timestamp option bytes) in a 1514-byte Ethernet frame, and HTB counts every frame byte."""
CONTINUE, STOP = 1.0, 0.0


@dataclass
class LinkPhase(Record):
    """One phase: W workers against the server behind its link; the server's measured update rate."""

    KIND: ClassVar[str] = "ps_link_phase"
    workers: int
    updates: int
    """Updates applied in the timed window (the first `warmup` are left out)."""
    seconds: float
    """From the warm-up's last update to the last one."""
    parameters_bytes: int
    """Bytes of one server -> worker message (status and parameters)."""
    gradient_bytes: int
    link_bits_per_s: int
    """The link's rate (0: no emulated link, the ranks share this machine's loopback)."""

    @property
    def updates_per_s(self) -> float:
        return self.updates / self.seconds


@dataclass
class CoreWait(Record):
    """One rank in one phase (server or worker): its wall time and how much of it it waited for a core."""

    KIND: ClassVar[str] = "ps_link_core_wait"
    phase: int
    """The phase's index in --workers, in the order they ran."""
    workers: int
    wall_s: float
    """From the phase's start (after a barrier) to this rank's end of it."""
    waited_s: float | None
    """Its threads, summed, runnable but not running (busy.core_wait_since); None where the kernel does not count it."""


@dataclass(frozen=True)
class RatesVerdict:
    """Whether the measured rates can be judged against the link, and why."""

    judged: bool
    why: str
    worst_wait: float | None
    """The largest share of a phase its ranks, summed, waited for a core (None: not counted)."""


def phase_waits(waits: list[CoreWait]) -> dict[int, float] | None:
    """Per phase: its ranks' waits for a core, summed, over the phase's wall time (its slowest rank's). None where
    any rank could not count them."""
    if not waits or any(w.waited_s is None for w in waits):
        return None
    phases: dict[int, list[CoreWait]] = {}
    for w in waits:
        phases.setdefault(w.phase, []).append(w)
    return {phase: sum(w.waited_s for w in ranks) / max(w.wall_s for w in ranks) for phase, ranks in phases.items()}


def judge_rates(waits: list[CoreWait], rounds_spread: float, probes_quiet: bool, linked: bool) -> RatesVerdict:
    """Judge the rates against the link when the rounds of each phase agree and the CPU held no phase up.

    On a quiet machine (the CPU probes before and after the run) nothing else competes for the cores. On a busy one,
    behind an emulated link, the ranks' own waits for a core decide: under busy.QUIET_CORE_WAIT of every phase,
    summed over its ranks, so the CPU cost no phase more than that share of its rate. Without a link (four ranks
    share the cores and wait for each other even on an idle machine) or where the kernel does not count the waits,
    a busy machine cannot be judged.
    """
    if rounds_spread >= busy.QUIET_SPREAD:
        return RatesVerdict(False, f"the rounds of one phase spread {rounds_spread:.0%} (over "
                                   f"{busy.QUIET_SPREAD:.0%}): something besides the link set the rates", None)
    shares = phase_waits(waits) if linked else None
    worst = max(shares.values()) if shares else None
    if probes_quiet:
        return RatesVerdict(True, "the CPU probes found the machine quiet", worst)
    if shares is None:
        reason = "no emulated link" if not linked else "this kernel does not count waits for a core"
        return RatesVerdict(False, f"{reason}, and the CPU probes found the machine busy", None)
    free = worst < busy.QUIET_CORE_WAIT
    effect = "did not hold the ranks up" if free else "may have slowed them"
    return RatesVerdict(free, f"the CPU probes found the machine busy; the ranks of a phase, summed, waited for a "
                              f"core at most {worst:.1%} of it ({'under' if free else 'over'} "
                              f"{busy.QUIET_CORE_WAIT:.0%}): the CPU {effect}", worst)


def model_updates_per_s(workers: int, parameters_bytes: int, gradient_bytes: int, link_bits_per_s: int) -> float:
    """min(W / (t_out + t_in), 1 / max(t_out, t_in)), t = message bits / (link rate x WIRE_EFFICIENCY)."""
    goodput = link_bits_per_s * WIRE_EFFICIENCY
    t_out, t_in = 8 * parameters_bytes / goodput, 8 * gradient_bytes / goodput
    return min(workers / (t_out + t_in), 1 / max(t_out, t_in))


def serve(workers: int, parameters: torch.Tensor, updates: int, warmup: int) -> tuple[int, float]:
    """Async server for workers 1..W: apply each gradient as it comes, answer its sender; (updates timed, seconds)."""
    gradient = torch.empty_like(parameters)
    # replies go out with isend (each its own copy): the server takes the next gradient while one leaves
    sending = [dist.isend(torch.cat([torch.tensor([CONTINUE]), parameters]), worker)
               for worker in range(1, workers + 1)]
    applied, stopped, times = 0, 0, []
    while stopped < workers:
        sender = dist.recv(gradient)
        if applied < updates:
            parameters -= 1e-3 * gradient
            applied += 1
            times.append(time.perf_counter())
            reply = torch.cat([torch.tensor([CONTINUE]), parameters])
        else:
            reply = torch.cat([torch.tensor([STOP]), parameters])
            stopped += 1
        sending = [work for work in sending if not work.is_completed()] + [dist.isend(reply, sender)]
    for work in sending:
        work.wait()
    return len(times) - warmup, times[-1] - times[warmup - 1]


def work(parameters: torch.Tensor) -> None:
    """Pull, push a gradient (a cheap stand-in: the lesson is the bytes), until the server says stop."""
    message = torch.empty(parameters.numel() + 1)
    while True:
        dist.recv(message, 0)
        if message[0] == STOP:
            return
        dist.send(message[1:] * 0.5, 0)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3], help="workers in each phase")
    parser.add_argument("--floats", type=int, default=125_000, help="parameters (0.5 MB: 40 ms at 100 Mbit/s)")
    parser.add_argument("--updates", type=int, default=32, help="updates the server applies per phase")
    parser.add_argument("--warmup", type=int, default=4, help="first updates left out of the timing")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="any message waits at most this long")
    args = parser.parse_args(argv)
    if max(args.workers) >= int(os.environ["WORLD_SIZE"]) or min(args.workers) < 1 or args.updates <= args.warmup:
        raise SystemExit(f"workers {args.workers} need {max(args.workers) + 1} ranks (got {os.environ['WORLD_SIZE']}) "
                         f"and updates > warmup: launch with more nodes or fewer workers.")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    records = RecordWriter(os.environ.get(RUN_DIR_ENV, "."), rank)
    parameters = torch.zeros(args.floats)
    try:
        for phase, workers in enumerate(args.workers):
            dist.barrier()
            started, waits = time.perf_counter(), busy.core_waits()
            if rank == 0:
                timed, seconds = serve(workers, parameters, args.updates, args.warmup)
            elif rank <= workers:
                work(parameters)
            if rank <= workers:
                records.write(CoreWait(phase=phase, workers=workers, wall_s=time.perf_counter() - started,
                                       waited_s=busy.core_wait_since(waits)))
            if rank == 0:
                records.write(LinkPhase(workers=workers, updates=timed, seconds=seconds,
                                        parameters_bytes=4 * (args.floats + 1), gradient_bytes=4 * args.floats,
                                        link_bits_per_s=int(os.environ.get("LABSRC_LINK_BITS", 0))))
        dist.barrier()
        if rank == 0:
            write_summary(records.run_dir, {"workers": args.workers, "floats": args.floats})
    finally:
        records.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
