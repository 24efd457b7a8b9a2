"""Collectives rank by rank, ring and naive all-reduce checked against dist.all_reduce, and a message-size sweep.

    launch.run("collectives", nproc=3)
    python -m labsrc.launch --nproc 2 collectives -- --sizes 256 65536 --repeats 3
    torchrun --nproc-per-node 2 -m labsrc.lessons.collectives.lab --profile ci
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import ClassVar

from labsrc.core.forked import run_ranks
from labsrc.core.lab import resolve_profile, run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.runs import Record
from labsrc.core.world import RequestError
from labsrc.lessons.collectives import checks, rank_by_rank
from labsrc.techniques import alpha_beta, collectives


@dataclass
class Options(LabOptions):
    """Tables of send/recv and four collectives, hand-written all-reduces checked, and an alpha-beta sweep."""

    pg_timeout_s: float = 30.0
    """Seconds a collective may wait for the other ranks: a broken ring raises within it instead of hanging."""
    sizes: tuple[int, ...] = ()
    """Message sizes of the sweep in float32 elements, at least two different ones (empty: the profile's)."""
    repeats: int = 0
    """Timed repeats per (algorithm, size) point (0: the profile's)."""
    ring_timeout_s: float = 20.0
    """Seconds the hand-written ring waits for one message in the check before it raises."""

    def validate(self) -> None:
        super().validate()
        positive("repeats", self.repeats, allow_zero=True)
        positive("ring_timeout_s", self.ring_timeout_s)
        for size in self.sizes:
            positive("sizes", size)
        if self.sizes and len(set(self.sizes)) < 2:
            raise RequestError(f"sizes {list(self.sizes)}: an alpha-beta fit needs at least two different "
                               f"message sizes, e.g. --sizes 256 65536.")


@dataclass
class Holding(Record):
    """What this rank held before and after one collective on a tiny tensor."""

    KIND: ClassVar[str] = "table"
    collective: str
    """Key: send_recv, broadcast, all_reduce, reduce_scatter or all_gather."""
    label: str
    """What the table shows."""
    ran_as: str
    """The operation that ran: the key, or all_reduce_then_slice where a backend has no reduce_scatter."""
    before: list
    after: list


@dataclass
class Check(Record):
    """One all-reduce algorithm on one size against dist.all_reduce: its error and the bytes this rank sent."""

    KIND: ClassVar[str] = "check"
    algorithm: str
    """A collectives.ALGORITHMS key."""
    size: int
    """Elements (float32)."""
    bytes: int
    bytes_sent: int | None
    """Counted while it ran (None for dist.all_reduce: the backend's business)."""
    bytes_formula: int | None
    """What counting chunks predicts (None for dist.all_reduce)."""
    max_error: float


@dataclass
class Timing(Record):
    """One sweep point: seconds per call of every repeat (slowest rank), its fastest, and bandwidths."""

    KIND: ClassVar[str] = "timing"
    algorithm: str
    size: int
    bytes: int
    seconds: float
    """The fastest repeat."""
    median_s: float
    repeats_s: list
    calls_per_repeat: int
    algbw: float
    """Bytes per second, nccl-tests' algorithm bandwidth."""
    busbw: float
    """algbw x 2(n-1)/n, nccl-tests' bus bandwidth of an all-reduce."""


def timing_record(name: str, size: int, timing: dict, world_size: int) -> Timing:
    """The Timing of one point of collectives.sweep."""
    nbytes, seconds = 4 * size, min(timing["seconds"])
    return Timing(name, size, nbytes, seconds, statistics.median(timing["seconds"]), timing["seconds"],
                  timing["calls"], alpha_beta.algbw(nbytes, seconds),
                  alpha_beta.busbw("all_reduce", nbytes, seconds, world_size))


def collectives_lab(ctx, records, options: Options) -> dict:
    profile = resolve_profile(options)
    sizes, repeats = list(options.sizes or profile.sweep_sizes), options.repeats or profile.repeats
    for row in rank_by_rank.collective_tables(ctx):
        records.write(Holding(**row))
    for row in checks.check_algorithms(ctx, checks.check_sizes(ctx.world_size), options.ring_timeout_s):
        records.write(Check(**row))
    records.progress(0, repeats, unit="repeats")
    timings = collectives.sweep(ctx, sizes, repeats,
                                on_repeat=lambda done: records.progress(done, repeats, unit="repeats"))
    for (name, size), timing in timings.items():
        records.write(timing_record(name, size, timing, ctx.world_size))
    fits = {name: dataclasses.asdict(fit) for name, fit in alpha_beta.fit_sweep(timings, min).items()}
    fits_median = {name: dataclasses.asdict(fit)
                   for name, fit in alpha_beta.fit_sweep(timings, statistics.median).items()}
    return {"profile": profile.name, "fits": fits, "fits_median": fits_median, "sizes": sizes,
            "repeats": repeats,
            "statistic": "fits: fastest repeat; fits_median: median repeat; a repeat is a loop's time per call, "
                         "slowest rank"}


def checks_on(result, world_sizes=(2, 3, 4)) -> dict[int, list[Check]]:
    """{ranks: Check rows}: the lab's own rows, and the same check on forked CPU ranks for every other world size."""
    found = {result.nproc: result.of(Check)}
    for ranks in world_sizes:
        if ranks not in found:
            per_rank = run_ranks(checks.check_algorithms, ranks, args=(checks.check_sizes(ranks),))
            found[ranks] = [Check.from_dict(row) for rows in per_rank for row in rows]
    return dict(sorted(found.items()))


def main(argv=None):
    return run_lab("collectives", collectives_lab, Options, argv)


if __name__ == "__main__":
    main()
