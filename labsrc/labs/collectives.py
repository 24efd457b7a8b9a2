"""Collectives rank by rank, ring and naive all-reduce checked against dist.all_reduce, and a message-size sweep.

    torchrun --nproc-per-node 2 -m labsrc.labs.collectives --profile ci
"""
from __future__ import annotations

import statistics

from labsrc import alpha_beta, collectives
from labsrc.core.lab import base_parser, resolve_profile, run_lab


def check_sizes(world_size: int) -> list[int]:
    """Sizes that divide evenly by the world size and sizes that do not (including fewer than n elements)."""
    return sorted({1, world_size - 1 or 1, world_size + 1, 1000 * world_size, 1000 * world_size + 1, 4099})


def fit_sweep(timings: dict, statistic=min) -> dict:
    """{algorithm: {"alpha_s", "beta_s_per_byte", "r2"}}: alpha-beta fitted on statistic(repeats) of each point.

    timings: {(algorithm, size): {"seconds": [...], ...}} as collectives.sweep returns it.
    """
    points: dict[str, list] = {}
    for (name, size), timing in timings.items():
        points.setdefault(name, []).append((4 * size, statistic(timing["seconds"])))
    fits = {}
    for name, pairs in points.items():
        fit = alpha_beta.fit(*zip(*sorted(pairs)))
        fits[name] = {"alpha_s": fit.alpha_s, "beta_s_per_byte": fit.beta_s_per_byte, "r2": fit.r2}
    return fits


def collectives_lab(ctx, records, args) -> dict:
    profile = resolve_profile(args)
    for row in collectives.collective_tables(ctx):
        records.write("table", **row)
    for row in collectives.check_algorithms(ctx, check_sizes(ctx.world_size)):
        records.write("check", **row)
    records.progress(0, profile.repeats)
    timings = collectives.sweep(ctx, profile.sweep_sizes, profile.repeats,
                                on_repeat=lambda done: records.progress(done, profile.repeats))
    for (name, size), timing in timings.items():
        nbytes, seconds = 4 * size, min(timing["seconds"])
        records.write("timing", algorithm=name, size=size, bytes=nbytes, seconds=seconds,
                      median_s=statistics.median(timing["seconds"]), repeats_s=timing["seconds"],
                      calls_per_repeat=timing["calls"], algbw=alpha_beta.algbw(nbytes, seconds),
                      busbw=alpha_beta.busbw("all_reduce", nbytes, seconds, ctx.world_size))
    fits, fits_median = fit_sweep(timings, min), fit_sweep(timings, statistics.median)
    for name, fit in fits.items() if ctx.is_main else ():
        print(f"{name:<16} alpha {fit['alpha_s'] * 1e6:9.1f} us  1/beta {1 / fit['beta_s_per_byte'] / 1e9:7.2f} GB/s"
              f"  R^2 {fit['r2']:.3f} (on the medians: {fits_median[name]['r2']:.3f})")
    return {"profile": profile.name, "fits": fits, "fits_median": fits_median, "sizes": list(profile.sweep_sizes),
            "repeats": profile.repeats,
            "statistic": "fits: fastest repeat; fits_median: median repeat; a repeat is a loop's time per call, "
                         "slowest rank"}


def launch_collectives(nproc: int, profile: str | None = None, timeout: float = 300.0):
    """Run this lab from a notebook (the default cell and the controls both call this).

    A 30 s process-group timeout: a broken ring raises within it instead of waiting forever.
    """
    from labsrc import launch
    args = ["--pg-timeout-s", "30"] + (["--profile", profile] if profile else [])
    return launch.run("collectives", nproc=nproc, args=args, timeout=timeout)


def main(argv=None):
    return run_lab("collectives", collectives_lab, base_parser(__doc__.splitlines()[0]).parse_args(argv))


if __name__ == "__main__":
    main()
