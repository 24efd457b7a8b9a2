"""Run a function on several gloo ranks in forked processes: multi-rank tests in a second, not a torchrun launch.

    results = run_ranks(my_check, world_size=2, args=(4,))   # my_check(ctx, 4) on ranks 0 and 1

Where a GPU is visible, the ranks are fresh interpreters instead (about 3 s each, for importing torch): once a
process has run any backward while CUDA devices exist, autograd has started its per-device threads, and a child
forked from it fails its first backward ("Unable to handle autograd's threading in combination with fork-based
multiprocessing", https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork). A notebook that trained in its own
process (DataParallel in 01) is such a process. The function then travels by value (cloudpickle), so one defined
in a notebook cell runs too. LABSRC_RANKS_START=fork or fresh chooses either way.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from labsrc.core.processes import die_with_parent
from labsrc.core.world import RankContext


class RankError(RuntimeError):
    """A rank raised inside run_ranks; the message holds its traceback."""


def _child(fn, rank, world_size, init_file, args, kwargs, results) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size)
        ctx = RankContext(rank, rank, world_size, torch.device("cpu"), "gloo")
        value = fn(ctx, *args, **kwargs)
        # Plain pickle copies tensor data into the bytes; a Queue would share it through memory that
        # vanishes when this process exits.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


START_ENV = "LABSRC_RANKS_START"


def start_method() -> str:
    """fork (a GPU-less machine) or fresh (a GPU is visible; see the module's docstring); LABSRC_RANKS_START wins."""
    chosen = os.environ.get(START_ENV, "").strip()
    if chosen:
        if chosen not in ("fork", "fresh"):
            raise ValueError(f"{START_ENV}={chosen!r}: use fork or fresh, or unset it")
        return chosen
    return "fresh" if torch.cuda.device_count() > 0 else "fork"


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), kwargs: dict | None = None,
              timeout_s: float = 60.0) -> list[Any]:
    """fn(ctx, *args, **kwargs) on world_size gloo ranks on the CPU; returns [rank 0's value, ...].

    Raises RankError with the first failing rank's traceback, or on timeout (every child is killed).
    Forked ranks: fn and its values must be picklable only on the way back (fork copies fn in). Fresh ranks
    (a GPU is visible): fn and args travel by value with cloudpickle, and the timeout counts from their start.
    """
    if start_method() == "fresh":
        return _run_fresh(fn, world_size, args, kwargs or {}, timeout_s)
    import torch._dynamo  # noqa: F401  DDP's first construction imports it (~2 s); once here, not in every rank
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "rendezvous")
        children = [context.Process(target=_child, daemon=True,
                                    args=(fn, rank, world_size, init_file, args, kwargs or {}, results))
                    for rank in range(world_size)]
        for child in children:
            child.start()
        collected: dict[int, Any] = {}
        failure = None
        try:
            for _ in range(world_size):
                rank, ok, value = results.get(timeout=timeout_s)
                if not ok:
                    failure = f"rank {rank} raised:\n{value}"
                    break
                collected[rank] = pickle.loads(value)
        except Exception:
            failure = f"ranks {sorted(set(range(world_size)) - set(collected))} gave no result in {timeout_s} s"
        finally:
            for child in children:
                child.join(timeout=0 if failure else 10)
                if child.is_alive():
                    child.kill()
                    child.join()
    if failure:
        raise RankError(failure)
    return [collected[rank] for rank in range(world_size)]


# Fresh ranks: one interpreter each (python -m labsrc.core.forked FOLDER RANK WORLD_SIZE), the call in
# FOLDER/call.pkl (the caller's sys.path in path.pkl), each rank's (ok, value or traceback) in
# FOLDER/result<rank>.pkl, its output in FOLDER/out<rank>.
# Each rank is its own session (killing it ends its children too) and dies with its caller (a kernel that Jupyter
# kills takes its fresh ranks with it, as it took its forked ones).
IMPORT_S = 60.0  # a fresh interpreter's import of torch, on a busy machine, before the caller's timeout counts


def _run_fresh(fn, world_size: int, args: tuple, kwargs: dict, timeout_s: float) -> list[Any]:
    import cloudpickle
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "path.pkl").write_bytes(pickle.dumps(list(sys.path)))  # first: fn may name the caller's modules
        (root / "call.pkl").write_bytes(cloudpickle.dumps((fn, args, kwargs)))
        children = []
        for rank in range(world_size):
            with open(root / f"out{rank}", "wb") as out:
                children.append(subprocess.Popen(
                    [sys.executable, "-m", "labsrc.core.forked", folder, str(rank), str(world_size)],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent))
        collected: dict[int, Any] = {}
        failure = None
        deadline = time.monotonic() + timeout_s + IMPORT_S
        started = False
        try:
            while failure is None and len(collected) < world_size:
                for rank in sorted(set(range(world_size)) - set(collected)):
                    result = root / f"result{rank}.pkl"
                    if result.exists():
                        ok, value = pickle.loads(result.read_bytes())
                        if not ok:
                            failure = f"rank {rank} raised:\n{value}"
                            break
                        collected[rank] = pickle.loads(value)
                    elif children[rank].poll() is not None and not result.exists():  # exited just after writing?
                        output = (root / f"out{rank}").read_text(errors="replace")[-3000:]
                        failure = f"rank {rank} exited ({children[rank].returncode}) with no result:\n{output}"
                        break
                if not started and all((root / f"ready{rank}").exists() for rank in range(world_size)):
                    started, deadline = True, time.monotonic() + timeout_s  # every rank imported: the timeout counts
                if failure is None and len(collected) < world_size:
                    if time.monotonic() > deadline:
                        failure = (f"ranks {sorted(set(range(world_size)) - set(collected))} gave no result in "
                                   f"{timeout_s} s")
                    time.sleep(0.02)
        finally:
            complete = failure is None and len(collected) == world_size
            for child in children:
                if complete:  # every result is in: let the ranks leave their group
                    try:
                        child.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
                if child.poll() is None:  # the rank's session: its own children (loader workers) go too
                    _kill_session(child)
            for rank in range(world_size):  # what the ranks printed, as forked ranks would have shown it
                text = (root / f"out{rank}").read_text(errors="replace")
                if text.strip():
                    sys.stdout.write(text)
    if failure:
        raise RankError(failure)
    return [collected[rank] for rank in range(world_size)]


def _kill_session(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, 9)
    except ProcessLookupError:
        pass
    child.wait()


def _fresh_rank(folder: str, rank: int, world_size: int) -> None:
    import cloudpickle  # noqa: F401  (the call was pickled by it; plain pickle reads it back)
    root = Path(folder)
    try:
        sys.path[:] = pickle.loads((root / "path.pkl").read_bytes())
        fn, args, kwargs = pickle.loads((root / "call.pkl").read_bytes())
        (root / f"ready{rank}").touch()
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{root / 'rendezvous'}", rank=rank,
                                world_size=world_size)
        value = fn(RankContext(rank, rank, world_size, torch.device("cpu"), "gloo"), *args, **kwargs)
        outcome = (True, pickle.dumps(value))
    except BaseException:
        outcome = (False, traceback.format_exc())
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # the outcome is what matters; a group torn down badly must not lose it
            pass
    partial = root / f"result{rank}.part"
    partial.write_bytes(pickle.dumps(outcome))
    partial.rename(root / f"result{rank}.pkl")


class FreshProcess:
    """target(*args) in a fresh interpreter (the call by value, with cloudpickle), with the part of
    multiprocessing.Process's interface the exercise checkers use: start, join, is_alive, kill, exitcode
    (negative: the signal that ended it, as multiprocessing reports it)."""

    def __init__(self, target: Callable, args: tuple = ()):
        import cloudpickle
        self._folder = tempfile.TemporaryDirectory()
        root = Path(self._folder.name)
        (root / "path.pkl").write_bytes(pickle.dumps(list(sys.path)))
        (root / "call.pkl").write_bytes(cloudpickle.dumps((target, args)))
        self._popen: subprocess.Popen | None = None

    def start(self) -> None:
        self._popen = subprocess.Popen([sys.executable, "-m", "labsrc.core.forked", "--call", self._folder.name],
                                       start_new_session=True, preexec_fn=die_with_parent)

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def kill(self) -> None:
        if self._popen.poll() is None:
            _kill_session(self._popen)

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()


def process(target: Callable, args: tuple = ()):
    """A not yet started process running target(*args): forked, or fresh where start_method() says so."""
    if start_method() == "fresh":
        return FreshProcess(target, args)
    return multiprocessing.get_context("fork").Process(target=target, args=args)


def _fresh_call(folder: str) -> None:
    root = Path(folder)
    sys.path[:] = pickle.loads((root / "path.pkl").read_bytes())
    target, args = pickle.loads((root / "call.pkl").read_bytes())
    target(*args)


if __name__ == "__main__":
    if sys.argv[1] == "--call":
        _fresh_call(sys.argv[2])
    else:
        _fresh_rank(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
