"""Training across nodes: each parallelism's step traffic timed inside a node and across the link; local SGD.

    time_schemes(rank, groups, layers, repeats)   TP / PP / DP messages of one step, on each level
    local_sgd_runs(rank, problem, steps, (1, 8), lr)   averaging every k steps, its communication timed
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from labsrc.lessons.across_nodes.cost_model import Layers, step_messages
from labsrc.lessons.across_nodes.hierarchy import WAIT, NodeGroups
from labsrc.lessons.async_parameter_server.local_sgd import (average_parameters, local_sgd, local_sgd_reference,
                                                             synchronous_sgd)
from labsrc.lessons.async_parameter_server.server import Problem, full_loss, make_data


def _run_scheme(operation: str, tensors: list[torch.Tensor], group, partner: int, first: bool) -> int:
    """One step's messages in the 2-rank group: all-reduces, or activations forward then gradients back.

    Returns the payload bytes this rank put on the wire (all-reduce: each rank sends half each of 2 steps).
    """
    sent = 0
    for index, tensor in enumerate(tensors):
        nbytes = tensor.numel() * 4
        if operation == "all_reduce":
            dist.all_reduce(tensor, group=group, async_op=True).wait(WAIT)
            sent += nbytes
            continue
        forward = index % 2 == 0  # activations go from the first stage to the second, gradients come back
        if forward == first:
            dist.isend(tensor, partner).wait(WAIT)
            sent += nbytes
        else:
            dist.irecv(tensor, partner).wait(WAIT)
    return sent


def time_schemes(rank: int, groups: NodeGroups, layers: Layers, repeats: int) -> list[dict]:
    """Each scheme's step messages run inside the node (2 ranks of it) and across nodes (2 nodes), interleaved.

    Needs 2 ranks per node and 2 nodes: every rank is in one pair per level, and the pairs of a level run
    at once (as they would in a real layout: two TP groups inside the nodes, or two crossing the link).
    Each rank's clock runs from a barrier to a second barrier after the messages: the pairs are independent, and
    on busy cores one may start milliseconds after the other; without the second barrier the late pair's clock
    would miss the time the early one had the link to itself, and the fastest repeat would be the least shared.
    The closing barrier adds a few of the link's latencies (small next to the across messages).
    Rows: scheme, level, operation, messages, bytes (payload of the step's messages), sent (bytes this rank sent),
    seconds (each repeat, slowest rank).
    """
    if len(groups.inside_ranks) != 2 or len(groups.across_ranks) != 2:
        raise ValueError("the parallelism comparison needs 2 nodes of 2 ranks: launch nproc=2, nnodes=2")
    schemes = step_messages(layers)
    levels = {"inside": (groups.inside, groups.inside_ranks), "across": (groups.across, groups.across_ranks)}
    tensors = {name: [torch.ones(nbytes // 4) for nbytes in scheme["messages"]] for name, scheme in schemes.items()}
    seconds = {(name, level): [] for name in schemes for level in levels}
    sent = {}
    for repeat in range(repeats + 1):  # round 0 warms up connections
        for (name, level), row in seconds.items():
            group, ranks = levels[level]
            partner = ranks[1] if rank == ranks[0] else ranks[0]
            dist.barrier(async_op=True).wait(WAIT)
            start = time.perf_counter()
            sent[(name, level)] = _run_scheme(schemes[name]["operation"], tensors[name], group, partner,
                                              rank == ranks[0])
            dist.barrier(async_op=True).wait(WAIT)  # the clock stops when both pairs are done (see docstring)
            if repeat:
                row.append(time.perf_counter() - start)
    slowest = torch.tensor(list(seconds.values()), dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, async_op=True).wait(WAIT)
    return [{"scheme": name, "level": level, "operation": schemes[name]["operation"],
             "messages": len(schemes[name]["messages"]),
             "bytes": sum(schemes[name]["messages"]), "sent": sent[(name, level)], "seconds": row}
            for (name, level), row in zip(seconds, slowest.tolist())]


def local_sgd_runs(rank: int, world_size: int, problem: Problem, steps: int, everies, lr: float) -> list[dict]:
    """Local SGD on every rank for each k in everies (k = 1 is synchronous SGD, what DDP computes), timed.

    Every run sees the same samples (batches seeded by rank and step). Rows: every, calls, communication_s
    (seconds inside the averaging all-reduces, each started after a barrier, slowest rank), total_s, loss (of the
    final averaged parameters on the whole data set), sync_loss (one process averaging every worker's gradient
    each step), reference_loss (one process running every worker's k steps and averaging them: what this k must
    give; a rank that skipped an average, or averaged with the wrong group, misses it), initial_loss.
    """
    data = make_data(problem)
    reference = full_loss(*data, synchronous_sgd(data, problem, tuple(range(world_size)), steps, lr))
    rows = []
    for every in everies:
        spent = [0.0]

        def timed_average(parameters, group, timeout_s):
            dist.barrier(async_op=True).wait(WAIT)  # ranks arrive together: the clock holds the all-reduce, not a
            start = time.perf_counter()             # straggler's local steps (k of them drift apart on busy cores)
            average_parameters(parameters, group, timeout_s)
            spent[0] += time.perf_counter() - start

        dist.barrier(async_op=True).wait(WAIT)
        start = time.perf_counter()
        outcome = local_sgd(rank, data, problem, steps, every, lr, average=timed_average)
        total = time.perf_counter() - start
        times = torch.tensor([spent[0], total], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, async_op=True).wait(WAIT)
        rows.append({"every": every, "calls": outcome["calls"], "payload_bytes": outcome["payload_bytes"],
                     "communication_s": times[0].item(), "total_s": times[1].item(),
                     "loss": outcome["curve"][-1][1], "sync_loss": reference,
                     "reference_loss": full_loss(*data, local_sgd_reference(data, problem, tuple(range(world_size)),
                                                                            steps, every, lr)),
                     "initial_loss": full_loss(*data, torch.zeros(problem.features))})
    return rows
