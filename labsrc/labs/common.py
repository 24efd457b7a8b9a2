"""What every lab entry point shares: rank context, records, rank-prefixed output, errors reported to the launcher."""
from __future__ import annotations

import argparse
import sys
import traceback
from typing import Callable

from labsrc import dist as labdist
from labsrc import metrics
from labsrc.config import Profile, current_profile, PROFILES


class _RankPrefixed:
    """Wraps a text stream so every line a rank prints starts with [rank<r>]."""

    def __init__(self, stream, rank: int):
        self._stream = stream
        self._prefix = f"[rank{rank}] "
        self._at_line_start = True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self._at_line_start and not piece.startswith(self._prefix.rstrip()):
                out.append(self._prefix)
            out.append(piece)
            self._at_line_start = piece.endswith("\n")
        self._stream.write("".join(out))
        self._stream.flush()
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def base_parser(description: str) -> argparse.ArgumentParser:
    """The options every lab takes; a lab adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--profile", choices=sorted(PROFILES), default=None,
                        help="sizes to use (default: LABSRC_PROFILE, else picked from the hardware)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                        help="process-group backend (default: NCCL when each rank has a GPU, else gloo)")
    parser.add_argument("--seed", type=int, default=0, help="base random seed")
    parser.add_argument("--run-dir", default=None, help="where records go (default: set by the launcher)")
    parser.add_argument("--pg-timeout-s", type=float, default=120.0,
                        help="seconds a collective may wait for the other ranks before it fails")
    return parser


def resolve_profile(args: argparse.Namespace) -> Profile:
    return PROFILES[args.profile] if args.profile else current_profile()


LabBody = Callable[[labdist.RankContext, metrics.RecordWriter, argparse.Namespace], "dict | None"]


def run_lab(name: str, body: LabBody, args: argparse.Namespace) -> dict | None:
    """Set up the rank, run body(ctx, records, args), write rank 0's summary, report a crash, tear down.

    body returns the run summary (rank 0's is written to summary.json). An exception is written to
    rank<r>.error.json with its traceback, then raised again so torchrun sees the failure.
    """
    import os
    run_dir = args.run_dir or os.environ.get(metrics.RUN_DIR_ENV) or metrics.new_run_dir(name)
    rank = int(os.environ.get("RANK", 0))
    if "RANK" in os.environ:
        sys.stdout = _RankPrefixed(sys.stdout, rank)
        sys.stderr = _RankPrefixed(sys.stderr, rank)
    records = metrics.RecordWriter(run_dir, rank)
    ctx = None
    finished = False
    try:
        ctx = labdist.setup(backend=args.backend, timeout_s=args.pg_timeout_s, seed=args.seed)
        records.write("context", lab=name, world_size=ctx.world_size, local_rank=ctx.local_rank,
                      device=str(ctx.device), backend=ctx.backend)
        summary = body(ctx, records, args)
        if ctx.is_main and summary is not None:
            summary = {"lab": name, "world_size": ctx.world_size, "backend": ctx.backend,
                       "device": str(ctx.device), **summary}
            metrics.write_summary(run_dir, summary)
        finished = True
        return summary
    except BaseException as exc:
        metrics.write_error(run_dir, rank, exc, traceback.format_exc())
        if "TORCHELASTIC_ERROR_FILE" in os.environ:  # torchrun's own report then shows the root cause
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
            ErrorHandler().record_exception(exc)
        raise
    finally:
        records.close()
        labdist.teardown(ctx, wait_for_peers=finished)
