"""How busy the machine is, measured: the spread of identical timings, so a timing claim knows whether it can judge.

A lesson that asserts a timing (a scaling efficiency, a prediction within ±40%) needs a machine quiet enough for
the timing to mean something. Under a classroom's load the same work takes 1x..5x as long from one repeat to the
next; an assert on one timing then fails through no fault of the learner. `probe()` times one fixed piece of CPU
work several times and reports how far the repeats spread; `spread()` does the same for timings a lesson already
took. A lesson compares inside one run, interleaved and with medians; where it still cannot judge, it says so
(`Busy.verdict`), asserts the mechanism (bytes, counts, equality) and reports the timing without asserting it.
`judged(what, quiet)` is the lesson's branch between the two: where LABSRC_UNJUDGED_LOG names a file (the load
harness, tools/load_harness.py, sets it per run) it notes there each timing claim that went unjudged, so a pass
under load says which of its claims it checked. `core_waits()` and `core_wait_since()` are the other way to know:
how long a process's threads waited for a core (runnable, not running), as the kernel counts it; a lab whose ranks
mostly wait on a link can show that they did not wait for a core, however busy the CPU is.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Sequence

from labsrc.core.paths import python_path

QUIET_SPREAD = 0.5
"""Repeats whose middle 80% spans less than half the median: a quiet enough machine (idle here: 0.03-0.2)."""
UNJUDGED_LOG_ENV = "LABSRC_UNJUDGED_LOG"
"""A file where `judged` appends one JSON line per timing claim reported without an assert (unset: nowhere)."""
QUIET_SLOWDOWN = 1.5
"""The probe got at least two thirds of a core: wall time under 1.5x its CPU time."""
QUIET_CORE_WAIT = 0.05
"""A step of work whose ranks, summed, waited for a core under 5% of its wall time: even if every one of those
waits held up the step, it lost under 5% of its rate to the CPU."""


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
    """Wall time over CPU time of the probe's work (median of repeats; the worst of its processes): 1 when each had
    a core to itself, ~4.5 when nine busy processes share two cores."""
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


def judged(what: str, quiet: bool) -> bool:
    """`quiet`, as the lesson's branch: assert the timing claim `what` (True) or only report it (False). A claim
    reported without an assert is noted in the file LABSRC_UNJUDGED_LOG names, if any, for the load harness."""
    if not quiet and os.environ.get(UNJUDGED_LOG_ENV):
        with open(os.environ[UNJUDGED_LOG_ENV], "a") as log:
            log.write(json.dumps({"claim": what}) + "\n")
    return bool(quiet)


def core_waits() -> dict[int, float] | None:
    """Per thread of this process (by thread id): the seconds it has so far been runnable but waiting for a core,
    the second field of Linux's /proc/<pid>/task/<tid>/schedstat (run_delay, ns: "time spent waiting on a
    runqueue", kernel Documentation/scheduler/sched-stats.rst; kept where the kernel has CONFIG_SCHED_INFO). None
    where the kernel does not keep it (no file, or the "0 0 0" it prints when the accounting is off).

    Every thread counts: a rank's main thread mostly waits on a condition, and gloo's device thread moves the bytes.
    """
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:
        return None
    waits, ran = {}, 0
    for thread in threads:
        try:
            with open(f"/proc/self/task/{thread}/schedstat") as stats:
                fields = stats.read().split()
        except FileNotFoundError:   # the thread ended meanwhile
            continue
        except OSError:
            return None
        try:
            ran += int(fields[0])
            waits[int(thread)] = int(fields[1]) / 1e9
        except (IndexError, ValueError):
            return None
    return waits if waits and ran > 0 else None


def core_wait_since(before: dict[int, float] | None) -> float | None:
    """Seconds this process's threads, summed, waited for a core since `before` (a `core_waits()`); a thread
    started since counts from 0, one that ended is left out. None where the kernel does not count it.

    A thread that sleeps on a socket or a timer waits for a core only when it wakes and every core is taken; one
    that computes waits whenever busy neighbours hold the cores. Measured here at 16 busy processes on 2 cores: a
    loop of 40 ms sleeps waited 9% of its wall time, a loop of arithmetic 90%.
    """
    now = core_waits()
    if before is None or now is None:
        return None
    return sum(waited - before.get(thread, 0.0) for thread, waited in now.items())


def _timings(repeats: int, work: int) -> tuple[list[float], list[float]]:
    """Wall times and wall/CPU ratios of `repeats` runs of a fixed loop, spaced out so a busy spell shows."""
    samples, ratios = [], []
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.thread_time()
        total = 0
        for i in range(work):
            total += i * i
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
        samples.append(wall)
        ratios.append(wall / cpu if cpu > 0 else 1.0)
        time.sleep(0.01)
    return samples, ratios


_PEER = """import json, sys, time
from labsrc.core.busy import _timings
print("ready", flush=True)
print(json.dumps(_timings({repeats}, {work})[1]), flush=True)
"""


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def probe(repeats: int = 7, work: int = 500_000, processes: int | None = None) -> Busy:
    """Time a fixed loop (about 25 ms of CPU, longer than a scheduler's slice) in `processes` processes at once.

    A shorter piece of work would finish inside the time slice a waking process is given and look quiet on a busy
    machine; 25 ms is preempted by the busy neighbours, so its wall time over its CPU time is the share it got.
    Several processes at once (default: a 2-rank lab's two, at most the usable cores) see what a lab's ranks see:
    one busy neighbour on a 2-core machine leaves one probe a free core, but not two.
    """
    if repeats < 3:
        raise ValueError(f"probe needs at least 3 repeats, got {repeats}")
    cores = usable_cores()
    processes = min(2, cores) if processes is None else processes
    if not 1 <= processes <= cores:
        raise ValueError(f"probe runs 1 to {cores} (the usable cores) processes at once, got {processes}")
    code = _PEER.format(repeats=repeats, work=work)
    peers = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": python_path()}) for _ in range(processes - 1)]
    try:
        for peer in peers:
            peer.stdout.readline()  # "ready": the peers' loops start with this process's
        samples, ratios = _timings(repeats, work)
        medians = [statistics.median(ratios)]
        for peer in peers:
            out, _ = peer.communicate(timeout=60)
            medians.append(statistics.median(json.loads(out)))
    finally:
        for peer in peers:
            if peer.poll() is None:
                peer.kill()
                peer.wait()
    load = os.getloadavg()[0] / cores if hasattr(os, "getloadavg") else 0.0
    return Busy(spread(samples), max(medians), load)
