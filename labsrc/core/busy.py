"""How busy the machine is, measured: the spread of identical timings, so a timing claim knows whether it can judge.

A lesson that asserts a timing (a scaling efficiency, a prediction within ±40%) needs a machine quiet enough for
the timing to mean something. Under a classroom's load the same work takes 1x..5x as long from one repeat to the
next; an assert on one timing then fails through no fault of the learner. `probe()` times one fixed piece of CPU
work several times and reports how far the repeats spread; `spread()` does the same for timings a lesson already
took. A lesson compares inside one run, interleaved and with medians; where it still cannot judge, it says so
(`Busy.verdict`), asserts the mechanism (bytes, counts, equality) and reports the timing without asserting it.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

QUIET_SPREAD = 0.5
"""Repeats whose middle 80% spans less than half the median: a quiet enough machine (idle here: 0.03-0.2)."""
QUIET_SLOWDOWN = 1.5
"""The probe got at least two thirds of a core: wall time under 1.5x its CPU time."""


def spread(samples: Sequence[float]) -> float:
    """(p90 - p10) / median of repeated timings of the same work: 0 on a perfectly quiet machine."""
    if len(samples) < 3:
        raise ValueError(f"spread needs at least 3 repeats of the same work, got {len(samples)}")
    ordered = sorted(samples)
    last = len(ordered) - 1
    low, high = ordered[round(0.1 * last)], ordered[round(0.9 * last)]
    middle = statistics.median(ordered)
    return (high - low) / middle if middle > 0 else float("inf")


@dataclass(frozen=True)
class Busy:
    """One probe: how far identical CPU work spread, its wall time over its CPU time, the load per core."""

    spread: float
    slowdown: float
    """Wall time over CPU time of the probe's work (median of repeats): 1 when it had a core to itself, ~4.5 when
    nine busy processes share two cores."""
    load_per_core: float
    """The 1-minute load average over this process's usable cores (host-wide: in a container it counts neighbours)."""

    @property
    def quiet(self) -> bool:
        return self.spread < QUIET_SPREAD and self.slowdown < QUIET_SLOWDOWN

    def verdict(self, what: str) -> str:
        """The line a lesson prints before it asserts (quiet) or reports without asserting (busy) a timing."""
        state = ("quiet enough to judge" if self.quiet else
                 f"too busy to judge {what}: reported, not asserted (rerun on a quieter machine to check it)")
        return (f"machine: identical work spread {self.spread:.0%} (wall {self.slowdown:.1f}x its CPU time), "
                f"load {self.load_per_core:.1f} per core: {state}")


def _work(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def probe(repeats: int = 7, work: int = 500_000) -> Busy:
    """Time a fixed loop (about 25 ms of CPU, longer than a scheduler's slice) `repeats` times, spaced out.

    A shorter piece of work would finish inside the time slice a waking process is given and look quiet on a busy
    machine; 25 ms is preempted by the busy neighbours, so its wall time over its CPU time is the share it got.
    """
    if repeats < 3:
        raise ValueError(f"probe needs at least 3 repeats, got {repeats}")
    samples, ratios = [], []
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.thread_time()
        _work(work)
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
        samples.append(wall)
        ratios.append(wall / cpu if cpu > 0 else 1.0)
        time.sleep(0.01)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0] / cores if hasattr(os, "getloadavg") else 0.0
    return Busy(spread(samples), statistics.median(ratios), load)
