"""Run a function on several gloo ranks in forked processes: multi-rank tests in a second, not a torchrun launch.

    results = run_ranks(my_check, world_size=2, args=(4,))   # my_check(ctx, 4) on ranks 0 and 1
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

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


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), kwargs: dict | None = None,
              timeout_s: float = 60.0) -> list[Any]:
    """fn(ctx, *args, **kwargs) on world_size forked gloo ranks; returns [rank 0's value, ...].

    Raises RankError with the first failing rank's traceback, or on timeout (every child is killed).
    fn and its values must be picklable only on the way back (fork copies fn in).
    """
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
