"""Collectives rank by rank, ring and naive all-reduce checked against dist.all_reduce, and a message-size sweep.

    torchrun --nproc-per-node 2 -m labsrc.labs.collectives --profile ci
"""
from __future__ import annotations

from labsrc import alpha_beta, collectives
from labsrc.labs.common import base_parser, resolve_profile, run_lab


def check_sizes(world_size: int) -> list[int]:
    """Sizes that divide evenly by the world size and sizes that do not (including fewer than n elements)."""
    return sorted({1, world_size - 1 or 1, world_size + 1, 1000 * world_size, 1000 * world_size + 1, 4099})


def collectives_lab(ctx, records, args) -> dict:
    profile = resolve_profile(args)
    for row in collectives.collective_tables(ctx):
        records.write("table", **row)
    for row in collectives.check_algorithms(ctx, check_sizes(ctx.world_size)):
        records.write("check", **row)
    fits = {}
    total = len(collectives.ALGORITHMS) * len(profile.sweep_sizes)
    done = 0
    for name, algorithm in collectives.ALGORITHMS.items():
        points = []
        for size in profile.sweep_sizes:
            seconds = collectives.time_algorithm(algorithm, size, ctx, profile.repeats)
            nbytes = 4 * size
            points.append((nbytes, seconds))
            records.write("timing", algorithm=name, bytes=nbytes, seconds=seconds,
                          algbw=alpha_beta.algbw(nbytes, seconds),
                          busbw=alpha_beta.busbw("all_reduce", nbytes, seconds, ctx.world_size))
            done += 1
            records.progress(done, total)
        fit = alpha_beta.fit(*zip(*points))
        fits[name] = {"alpha_s": fit.alpha_s, "beta_s_per_byte": fit.beta_s_per_byte, "r2": fit.r2}
    return {"profile": profile.name, "fits": fits, "sizes": list(profile.sweep_sizes), "repeats": profile.repeats}


def launch_collectives(nproc: int, profile: str | None = None, timeout: float = 300.0):
    """Run this lab from a notebook (the default cell and the controls both call this)."""
    from labsrc import launch
    args = ["--pg-timeout-s", "60"] + (["--profile", profile] if profile else [])
    return launch.run("collectives", nproc=nproc, args=args, timeout=timeout)


def main(argv=None):
    return run_lab("collectives", collectives_lab, base_parser(__doc__.splitlines()[0]).parse_args(argv))


if __name__ == "__main__":
    main()
