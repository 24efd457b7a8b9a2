"""What every lab entry point shares: typed options, rank context, records, rank-prefixed output, errors reported.

A lab module declares `Options` (a LabOptions dataclass) and its Record kinds, a body, and

    def main(argv=None):
        return run_lab("dp_vs_ddp", body, Options, argv)
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

from labsrc.core import runs
from labsrc.core import world as labdist
from labsrc.core.options import LabOptions
from labsrc.core.profiles import PROFILES, Profile, current_profile
from labsrc.core.rank_output import RankPrefixed



def resolve_profile(options: LabOptions) -> Profile:
    """The options' profile, else the one in force on this machine."""
    return PROFILES[options.profile] if options.profile else current_profile()


LabBody = Callable[[labdist.RankContext, runs.RecordWriter, LabOptions], "dict | None"]


def run_lab(name: str, body: LabBody, options_class: type[LabOptions] = LabOptions,
            argv: list[str] | None = None) -> dict | None:
    """Parse the options, set up the rank, run body(ctx, records, options), write rank 0's summary, tear down.

    body returns the run summary (rank 0's is written to summary.json). An exception is written to
    rank<r>.error.json with its traceback, then raised again so torchrun sees the failure.
    """
    options = options_class.parse(argv)
    run_dir = os.environ.get(runs.RUN_DIR_ENV) or runs.new_run_dir(name)
    rank = int(os.environ.get("RANK", 0))
    if "RANK" in os.environ and not isinstance(sys.stdout, RankPrefixed):
        sys.stdout = RankPrefixed(sys.stdout, rank)
        sys.stderr = RankPrefixed(sys.stderr, rank)
    records = runs.RecordWriter(run_dir, rank)
    ctx = None
    finished = False
    try:
        ctx = labdist.setup(backend=options.backend, timeout_s=options.pg_timeout_s, seed=options.seed)
        records.write("context", lab=name, world_size=ctx.world_size, local_rank=ctx.local_rank,
                      node_rank=int(os.environ.get("GROUP_RANK", 0)), device=str(ctx.device),
                      backend=ctx.backend)
        summary = body(ctx, records, options)
        if ctx.is_main and summary is not None:
            summary = {"lab": name, "world_size": ctx.world_size, "backend": ctx.backend,
                       "device": str(ctx.device), **summary}
            runs.write_summary(run_dir, summary)
        finished = True
        return summary
    except BaseException as exc:
        runs.report_failure(run_dir, rank, exc, traceback.format_exc())
        setattr(exc, runs.ERROR_RECORDED, True)  # the course's rank entry does not record it twice
        raise
    finally:
        records.close()
        labdist.teardown(ctx, wait_for_peers=finished)
