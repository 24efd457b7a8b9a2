"""Reading a parameter-server run: a single-process replay of its arrival order, staleness counts, throughput, bytes."""
from __future__ import annotations

from collections import Counter

import torch

from labsrc.lessons.async_parameter_server.server import (GRADIENT_HEADER, Problem, batch_rows, gradient,
                                                          initial_parameters)
from labsrc.techniques.collectives import ring_bytes_sent


def replay(data, problem: Problem, mode: str, lr: float, workers: int, updates: list) -> torch.Tensor:
    """The parameters (features,) one process gets by applying the recorded updates in their recorded order.

    Every applied gradient is recomputed from the parameters of the version the worker said it used and the
    worker's seeded batch; a server that sent one version and labelled it another, or applied a gradient
    anywhere but where it says, ends with different parameters. updates: dicts or Update records.
    """
    history = {0: initial_parameters(problem)}
    parameters, version, pending = history[0], 0, []
    for update in sorted(updates, key=_field("order")):
        if not _field("applied")(update):
            continue
        rows = batch_rows(problem, _field("worker")(update), _field("worker_step")(update))
        used = _field("gradient_version")(update)
        if used not in history:
            raise ValueError(f"gradient {_field('order')(update)} names version {used}, which the server had not "
                             f"reached (it was at {version}): the server labelled its parameters wrongly")
        pending.append(gradient(*data, history[used], rows))
        if mode == "sync" and len(pending) < workers:
            continue
        step = torch.stack(pending).mean(0) if mode == "sync" else pending[0]
        parameters, version, pending = parameters - lr * step, version + 1, []
        history[version] = parameters
    return parameters


def _field(name: str):
    return lambda item: item[name] if isinstance(item, dict) else getattr(item, name)


def staleness_counts(updates: list, applied_only: bool = True) -> dict[int, int]:
    """{staleness: how many gradients} over the updates (those applied, unless applied_only is False)."""
    chosen = [u for u in updates if _field("applied")(u) or not applied_only]
    return dict(sorted(Counter(_field("staleness")(u) for u in chosen).items()))


def throughput(updates: list, seconds: float) -> dict:
    """Gradients applied and rejected, server updates (versions), and gradients applied per second."""
    applied = [u for u in updates if _field("applied")(u)]
    versions = len({_field("server_version")(u) for u in applied})
    return {"applied": len(applied), "rejected": len(updates) - len(applied), "versions": versions,
            "gradients_per_s": len(applied) / seconds if seconds > 0 else float("nan")}


def waiting(updates: list) -> dict:
    """Replies held back (blocked pulls), the seconds they waited, and the largest clock gap a worker went on at."""
    held = [u for u in updates if _field("held")(u)]
    gaps = [_field("clock_gap")(u) for u in updates if _field("clock_gap")(u) is not None]
    return {"blocked": len(held), "idle_s": sum(_field("held_s")(u) for u in held),
            "max_clock_gap": max(gaps, default=0)}


def server_bytes_per_round(workers: int, parameters: int, element_size: int = 4) -> int:
    """Bytes into the server while each of `workers` pushes one gradient (with its header)."""
    return workers * (parameters + GRADIENT_HEADER) * element_size


def allreduce_bytes_per_rank(workers: int, parameters: int, element_size: int = 4) -> int:
    """Bytes a ring all-reduce sends from each rank for one gradient: 2(n-1)/n * N when n divides N (notebook 02)."""
    return max(ring_bytes_sent(parameters, rank, workers, element_size) for rank in range(workers))


def bottleneck_table(parameters: int, worker_counts) -> list[dict]:
    """Per worker count: bytes into the server per round against a ring all-reduce's bytes per rank."""
    return [{"workers": n, "server_in": server_bytes_per_round(n, parameters),
             "allreduce_per_rank": allreduce_bytes_per_rank(n, parameters),
             "allreduce_formula": 2 * (n - 1) / n * parameters * 4} for n in worker_counts]
