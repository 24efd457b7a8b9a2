"""What torchrun starts on every rank: tie the rank to its agent, give it its output channel, run the target.

    python -m labsrc.launch.rank_entry --script PATH -- ARGS
    python -m labsrc.launch.rank_entry --module pkg.mod -- ARGS

The rank's Python output goes, prefixed and in whole lines, to runs/<lab>/<run_id>/output.log (the launcher
streams it); an uncaught exception goes to rank<r>.error.json (the launcher shows it once) and its traceback
to the rank's original stderr, which torchrun's launcher.log holds. Then the target runs as __main__.
"""
from __future__ import annotations

import os
import runpy
import signal
import sys
import traceback
from pathlib import Path

from labsrc.core import runs
from labsrc.core.processes import die_with_parent
from labsrc.core.rank_output import OUTPUT_FILE, AppendChannel, RankPrefixed, rank_prefix


def parse(argv: list[str]) -> tuple[str, str, list[str]]:
    """('script' | 'module', target, its arguments) from `--script PATH|--module MOD [--] ARGS`."""
    if len(argv) < 2 or argv[0] not in ("--script", "--module"):
        raise SystemExit("usage: python -m labsrc.launch.rank_entry --script PATH|--module MOD [--] ARGS")
    rest = argv[2:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    return argv[0][2:], argv[1], rest


def node_rank_to_show() -> int | None:
    """This rank's node when the run spans several nodes (torchrun's GROUP_RANK), else None."""
    if os.environ.get("WORLD_SIZE", "1") == os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")):
        return None
    return int(os.environ.get("GROUP_RANK", 0))


def own_frames_dropped(exc: BaseException) -> str:
    """The traceback as the learner's code sees it: this module's and runpy's frames left out."""
    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in skip
                              or os.path.abspath(tb.tb_frame.f_code.co_filename) in skip):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def record_failure(run_dir: Path, rank: int, exc: BaseException) -> None:
    """rank<r>.error.json for the launcher, torchrun's error file for its report (unless run_lab did both)."""
    if getattr(exc, runs.ERROR_RECORDED, False):
        return
    runs.report_failure(run_dir, rank, exc, own_frames_dropped(exc))


def run_target(kind: str, target: str, args: list[str]) -> None:
    """Run the script or module as __main__, with sys.argv and sys.path as `python script.py ARGS` has them."""
    if kind == "script":
        path = os.path.abspath(target)
        sys.argv = [path, *args]
        sys.path.insert(0, os.path.dirname(path))
        runpy.run_path(path, run_name="__main__")
    else:
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> int:
    kind, target, args = parse(list(sys.argv[1:] if argv is None else argv))
    die_with_parent(signal.SIGKILL)  # no rank outlives its torchrun agent
    run_dir = Path(os.environ.get(runs.RUN_DIR_ENV) or ".")
    rank = int(os.environ.get("RANK", 0))
    node_rank = node_rank_to_show()
    runs.note_attempt(run_dir, rank=rank, node_rank=int(os.environ.get("GROUP_RANK", 0)),
                      local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                      world_size=int(os.environ.get("WORLD_SIZE", 1)), pid=os.getpid())
    channel = AppendChannel(run_dir / OUTPUT_FILE)
    original_stderr = sys.stderr
    sys.stdout = RankPrefixed(channel, rank, rank_prefix(rank, node_rank))
    sys.stderr = RankPrefixed(channel, rank, rank_prefix(rank, node_rank))
    code = 1
    try:
        run_target(kind, target, args)
        code = 0
    except SystemExit as exc:  # sys.exit(n) in the target: its status is the rank's
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except Exception as exc:
        record_failure(run_dir, rank, exc)
        original_stderr.write(own_frames_dropped(exc))
        original_stderr.flush()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        runs.note_attempt(run_dir, runs.EXITS_FILE, rank=rank, exit_code=code)
    return code


if __name__ == "__main__":
    sys.exit(main())
