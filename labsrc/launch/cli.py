"""`python -m labsrc.launch`: run a course lab, a module or a script on n ranks from a shell.

    python -m labsrc.launch --nproc 2 setup -- --hold-s 1
    python -m labsrc.launch --nproc 2 path/to/my_ddp.py -- --epochs 1
    python -m labsrc.launch --nproc 1 --nnodes 1:2 --max-restarts 1 setup
    python -m labsrc.launch --nproc 1 --nnodes 2 --link 100mbit setup
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading

from labsrc.core.world import RequestError
from labsrc.launch.launcher import run
from labsrc.launch.result import LaunchError, LaunchTimeout


def parser() -> argparse.ArgumentParser:
    described = argparse.ArgumentParser(
        prog="python -m labsrc.launch", description=__doc__.splitlines()[0],
        epilog="Everything after -- goes to the target. Exit status: 0 done, 1 a rank failed, "
               "2 a bad request (nothing started), 124 timeout, 130 interrupted.")
    described.add_argument("target", help="a course lab (setup, dp_vs_ddp, ...), a dotted module (pkg.mod) "
                                          "or a script path (my_ddp.py)")
    described.add_argument("--nproc", type=int, default=2, help="ranks per node (default 2)")
    described.add_argument("--nnodes", default="1", help="simulated nodes on this machine: N, or an elastic "
                                                         "range MIN:MAX (default 1)")
    described.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a failure "
                                                                       "(default 0)")
    described.add_argument("--timeout", type=float, default=300.0, help="seconds before the run is ended "
                                                                        "(default 300)")
    described.add_argument("--backend", choices=["nccl", "gloo"], default=None)
    described.add_argument("--profile", choices=["ci", "cpu", "gpu"], default=None)
    described.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    described.add_argument("--link", default=None, help="emulated nodes: each node its own network namespace "
                                                        "and address, joined by links of this rate (100mbit, "
                                                        "1gbit, ...); default: nodes share loopback")
    return described


def main(argv: list[str] | None = None) -> int:
    """The shell launcher; returns its exit status (2 for any bad request, before anything starts)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # SIGINT ends the run (Ctrl-C, kill -INT) even when a parent left it ignored, as a shell does for a command
    # started in the background: Python then keeps SIG_IGN, and the launcher would never hear the interrupt.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    target_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, target_args = argv[:split], argv[split + 1:]
    try:
        options = parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed the usage and the reason
        return int(exc.code or 0)
    try:
        result = run(options.target, options.nproc, target_args, options.timeout, backend=options.backend,
                     profile=options.profile, port=options.port, max_restarts=options.max_restarts,
                     nnodes=options.nnodes, link=options.link)
    except RequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except LaunchTimeout as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 124
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(f"{result.lab}: {result.nproc} rank(s) per node finished in {result.wall_time_s:.1f} s "
          f"({result.attempts} attempt(s)); records in {result.run_dir}")
    return 0
