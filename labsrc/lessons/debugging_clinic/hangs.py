"""Notebook 12 without a safety net: ranks whose end is read from outside (an exit status, a stack, an error file).

    ends = run_unguarded(clinic.mismatched_shape, "broken", timeout_s=3.0)   # no debug mode: rank 0 aborts
    seen = inspect_hang()              # py-spy dump --pid and faulthandler of a rank stuck in an all_reduce
    report = torchrun_recorded(1)      # plain torchrun, a script whose main is decorated with @record

The clinic's other cases catch each rank's exception; these show what is left when there is none to catch
(a gloo abort, an NCCL watchdog teardown, a hang) and the tools that still see it.
"""
from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from labsrc.core.world import RankContext
from labsrc.lessons.debugging_clinic.collective_bugs import STARTUP_S, Outcome, environment, short_group


@dataclass
class RankEnd:
    """How one unguarded rank ended: its exit status (negative: the signal), and its Outcome if it lived to report."""

    rank: int
    exitcode: int | None
    """0: returned; negative: killed by that signal (-6 SIGABRT); None: still running at the deadline (then killed)."""
    outcome: Outcome | None
    """None when the process ended before it could report (an abort takes the Python exception with it)."""
    seconds: float
    """From the start of the ranks to this one's exit (or to the deadline)."""

    @property
    def signal_name(self) -> str:
        return signal.Signals(-self.exitcode).name if self.exitcode and self.exitcode < 0 else ""


def _rank_main(fn, rank: int, world_size: int, init_file: str, args: tuple, results) -> None:
    faulthandler.disable()  # a handler inherited from the parent (pytest's) would print the parent's stack on abort
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    Path(init_file).with_name(f"joined{rank}").touch()  # the watchdog's clock starts when every rank has joined
    value = fn(RankContext(rank, rank, world_size, torch.device("cpu"), "gloo"), *args)
    results.put((rank, pickle.dumps(value)))
    dist.destroy_process_group()


def _start(fn, world_size: int, args: tuple, folder: str):
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    children = [context.Process(target=_rank_main, daemon=True,
                                args=(fn, rank, world_size, os.path.join(folder, "rendezvous"), args, results))
                for rank in range(world_size)]
    for child in children:
        child.start()
    return children, results


def _end(children) -> None:
    for child in children:
        if child.is_alive():
            child.kill()
        child.join()


def _joined(folder: str, children) -> list[int]:
    """Ranks that joined the process group (or already ended: nothing left to wait for)."""
    return [rank for rank, child in enumerate(children)
            if (Path(folder) / f"joined{rank}").exists() or child.exitcode is not None]


def run_unguarded(rank_function, variant: str, timeout_s: float, world_size: int = 2,
                  debug: str = "OFF") -> list[RankEnd]:
    """rank_function(ctx, variant, timeout_s) on forked gloo ranks whose death is recorded, not raised.

    Each rank's exit status is kept (a gloo abort is -6, SIGABRT). The watchdog counts from the moment every rank
    has joined the process group (not from the start: a busy machine may take seconds to get there, which must
    not eat into the planted wait): a rank still running 2 x timeout_s + 5 s after that is killed and reported
    with exitcode None. Nothing is left running afterwards.
    """
    with tempfile.TemporaryDirectory() as folder, environment(TORCH_DISTRIBUTED_DEBUG=debug):
        started = time.perf_counter()
        children, results = _start(rank_function, world_size, (variant, timeout_s), folder)
        ended: dict[int, tuple[int | None, float]] = {}
        deadline = started + STARTUP_S  # until every rank joined; then 2 x timeout_s + 5 from that moment
        all_joined = False
        try:
            while len(ended) < world_size and time.perf_counter() < deadline:
                if not all_joined and len(_joined(folder, children)) == world_size:
                    all_joined, deadline = True, time.perf_counter() + 2 * timeout_s + 5
                for rank, child in enumerate(children):
                    if rank not in ended and child.exitcode is not None:
                        ended[rank] = (child.exitcode, time.perf_counter() - started)
                time.sleep(0.02)
        finally:
            stopped_s = time.perf_counter() - started
            _end(children)
        outcomes = {}
        while not results.empty():
            rank, value = results.get(timeout=1)
            outcomes[rank] = pickle.loads(value)
    ends = []
    for rank in range(world_size):
        exitcode, seconds = ended.get(rank, (None, stopped_s))
        ends.append(RankEnd(rank, exitcode, outcomes.get(rank), seconds))
    return ends


# -- a hung rank's stack, from outside (py-spy) and from inside (faulthandler) ---------------------------------------

FAULTHANDLER_AFTER_S = 1.0


def log_metric(value: float, group) -> float:
    """The learner's code: an all_reduce of a metric (rank 1 skips the last one: it logs 'only on rank 0')."""
    total = torch.tensor([value])
    dist.all_reduce(total, group=group)
    return total.item()


def _hung_rank(ctx, folder: str, hang_s: float) -> None:
    """Rank 0 waits in its third log_metric; rank 1 never calls it. Rank 0 arms faulthandler before it waits."""
    group = short_group(hang_s)
    for step in range(3):
        if step == 2 and ctx.rank == 1:
            time.sleep(hang_s + 1.0)
            return
        if step == 2:
            faulthandler.dump_traceback_later(FAULTHANDLER_AFTER_S, file=open(Path(folder) / "faulthandler.txt", "w"))
            with open(Path(folder) / "waiting", "a") as waiting:  # "<rank> <pid>": every rank that armed the tools
                waiting.write(f"{ctx.rank} {os.getpid()}\n")
        log_metric(float(step), group)


def py_spy() -> str | None:
    """The py-spy executable beside this Python (the course's venv), or on PATH; None if not installed."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def inspect_hang(hang_s: float = 60.0) -> dict:
    """Two forked ranks, rank 0 stuck in an all_reduce rank 1 skipped; its stack read two ways while it waits.

    The hang lasts until both reads are done: this process then ends both ranks (at once on a quiet machine).
    hang_s is only the safety net (rank 0's group timeout, from its all_reduce call): long, so a busy machine's
    slow py-spy never finds the rank already given up. Reaching the hang gets STARTUP_S of its own.

    {"pid", "py_spy" (py-spy dump's text, or ""), "py_spy_error" (why there is none), "faulthandler" (the text
    faulthandler.dump_traceback_later wrote after FAULTHANDLER_AFTER_S), "armed" (the ranks that armed faulthandler
    and named their pid: [0], the waiting rank, alone)}. Both ranks are killed after.
    """
    with tempfile.TemporaryDirectory() as folder:
        children, _ = _start(_hung_rank, 2, (folder, hang_s), folder)
        seen = {"pid": None, "py_spy": "", "py_spy_error": "", "faulthandler": "", "armed": []}
        try:
            waiting, dump = Path(folder) / "waiting", Path(folder) / "faulthandler.txt"
            deadline = time.monotonic() + STARTUP_S
            while not waiting.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            if not waiting.exists():
                raise RuntimeError(f"rank 0 never reached the third all_reduce in {STARTUP_S} s")
            deadline = time.monotonic() + hang_s  # from the moment rank 0 waits: the hang's own length
            time.sleep(0.3)  # well inside the all_reduce by now
            seen["pid"] = int(waiting.read_text().split()[1])
            tool = py_spy()
            if tool is None:
                seen["py_spy_error"] = "py-spy is not installed: pip install py-spy (pinned in requirements.txt)"
            else:
                done = subprocess.run([tool, "dump", "--pid", str(seen["pid"])], capture_output=True, text=True,
                                      timeout=30, env=dict(os.environ, NO_COLOR="1", CLICOLOR_FORCE="0"))
                seen["py_spy"] = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout)  # colours, where a terminal is faked
                seen["py_spy_error"] = "" if done.returncode == 0 else done.stderr.strip()[-500:]
            while ("log_metric" not in (dump.read_text() if dump.exists() else "") and time.monotonic() < deadline
                   and children[0].is_alive()):  # a rank that ended will write nothing more
                time.sleep(0.05)
            seen["faulthandler"] = dump.read_text() if dump.exists() else ""
            seen["armed"] = [int(line.split()[0]) for line in waiting.read_text().splitlines()]
        finally:
            _end(children)
    return seen


# -- torchrun's error file: @record in the learner's own script --------------------------------------------------

RECORDED_SCRIPT = "labsrc.lessons.debugging_clinic.cases.recorded_failure"


def torchrun_recorded(fail_rank: int = 1, timeout_s: float = 90.0) -> dict:
    """Plain torchrun (--standalone, 2 ranks) of the @record script: exit code, stderr, and its Root Cause block.

    root_cause: {"rank", "exitcode", "error_file", "traceback"} as torchrun's report prints them.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", RECORDED_SCRIPT, "--fail-rank", str(fail_rank)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    return {"command": "torchrun " + " ".join(command[3:]), "returncode": done.returncode,
            "stderr": done.stderr, "root_cause": root_cause(done.stderr)}


def failures(report: str) -> list[dict]:
    """Every failure block of torchrun's report: {"rank" (int), "time", "exitcode", "error_file", "traceback",
    "root" (True for the one under 'Root Cause')}, in the report's order."""
    found = []
    head, _, root = report.partition("Root Cause (first observed failure):")
    _, _, others = head.partition("Failures:")
    for text, is_root in ((others, False), (root, True)):
        for block in re.split(r"^\[\d+\]:\s*$", text, flags=re.MULTILINE)[1:]:
            block = re.split(r"^[-=]{20,}\s*$", block, flags=re.MULTILINE)[0]
            fields = {"root": is_root}
            for name in ("time", "rank", "exitcode", "error_file"):
                value = re.search(rf"^\s*{name}\s*:\s*(.*)$", block, re.MULTILINE)
                fields[name] = value.group(1).strip() if value else ""
            fields["rank"] = int(fields["rank"].split()[0]) if fields["rank"] else -1
            fields["traceback"] = block[block.find("traceback"):] if "traceback" in block else ""
            found.append(fields)
    return found


def root_cause(report: str) -> dict:
    """The failure torchrun names as 'Root Cause (first observed failure)' ({} if the report has none).

    torchrun picks the failure with the smallest timestamp, counted in whole seconds (the error file's, or when
    the agent saw the exit): a survivor that fails in the same second as the culprit ties with it, and the tie
    goes to the failure the agent recorded first (it polls every --monitor-interval, in local-rank order: two
    ranks ended between the same polls tie to the lower). Read every failure (`failures`), not only this one.
    """
    return next((failure for failure in failures(report) if failure["root"]), {})


# -- NCCL (2 GPUs): a collective that returns at once, a watchdog that ends the process, a dump read by torchfrtrace -

NCCL_SCRIPT = "labsrc.lessons.debugging_clinic.cases.nccl_skipped"


def torchrun_nccl_skipped(folder: Path, timeout_s: float = 10.0, limit_s: float = 240.0) -> dict:
    """Plain torchrun of the NCCL skipped-collective script with the flight recorder dumping on timeout into folder.

    {"returncode", "stderr", "root_cause", "events": {rank: [event, ...]}, "dumps": [file names],
     "frtrace": {"returncode", "output"}} (torchfrtrace run on the dump folder with torch's own module).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="200", TORCH_NCCL_DUMP_ON_TIMEOUT="1",
               TORCH_FR_DUMP_TEMP_FILE=str(folder / "trace_"), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", NCCL_SCRIPT, "--events", str(folder), "--timeout-s", str(timeout_s)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=limit_s, env=env)
    events = {}
    for rank in (0, 1):
        path = folder / f"events{rank}.jsonl"
        events[rank] = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    dumps = sorted(path.name for path in folder.glob("trace_*"))
    frtrace = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder),
                              "--prefix", "trace_"], capture_output=True, text=True, timeout=120) if dumps else None
    return {"returncode": done.returncode, "stderr": done.stderr, "root_cause": root_cause(done.stderr),
            "events": events, "dumps": dumps,
            "frtrace": {"returncode": frtrace.returncode, "output": frtrace.stdout + frtrace.stderr} if frtrace else {}}
