"""Checkers for notebook 06b's exercises: a hierarchical all-reduce from collectives, and its speed-up predicted.

The all-reduce checker runs the learner's function on forked gloo ranks laid out as nodes (ranks contiguous per
node), watches every collective it calls (which group, how many elements), and compares the result exactly with
dist.all_reduce: a wrong sum and a right sum sent the wrong way are both named.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from labsrc.core.exercises import ExerciseFailed, on_ranks, passed
from labsrc.lessons.across_nodes.cost_model import predicted_speedup
from labsrc.lessons.across_nodes.hierarchy import Topology, make_groups, rank_values, watching
from labsrc.techniques.alpha_beta import AlphaBeta

TOPOLOGIES = ((2, 2), (3, 2), (2, 3))
"""(nodes, ranks per node): 3 ranks per node make sizes the node does not divide; 3 nodes, an across ring of 3."""
UNSEEN = (" The checker sees the collectives called as dist.<name>(...) while your function runs: a name bound "
          "before it runs (rs = dist.reduce_scatter_tensor at the top of the cell) is not seen; call dist.<name>.")
def sizes(ranks_per_node: int) -> list[int]:
    """(numel,) sizes: one the node's ranks divide (diagnosed first), then one they do not, and a larger one."""
    return [4 * ranks_per_node, 4 * ranks_per_node + 1, 1000 * ranks_per_node + 3]


def diagnose(calls: list, size: int, topology: Topology, got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """What is wrong: the result first, then which group carried what."""
    g, shard = topology.ranks_per_node, -(-size // topology.ranks_per_node)
    carried = "; ".join(f"{operation} on {level} ({elements} elements)" for operation, level, elements in calls)
    if any(level == "world" for _, level, _ in calls) and topology.nodes > 1 and g > 1:
        return (f"you called a collective on the whole world ({carried}): that is the flat ring, whose every step "
                "waits for the slow link. Use only the two groups you were given.")
    if not torch.equal(got, expected):
        if torch.equal(got, expected / topology.world_size) or torch.allclose(got * topology.world_size, expected):
            return "you got the mean: sum (ReduceOp.SUM, the default); DDP divides later, not here."
        if not any(operation == "all_gather" for operation, _, _ in calls):
            return (f"the all-gather inside the node is missing ({carried}): after the across all-reduce each rank "
                    "holds only its own summed shard; gather the shards from the node's ranks into the tensor." + UNSEEN)
        if size % g:
            return (f"wrong for size {size}, which {g} ranks per node do not divide (it was right for {4 * g}): pad "
                    f"the flat tensor with zeros to a multiple of {g}, run the three steps, copy back the first "
                    f"{size} elements.")
        wrong = int((got != expected).sum())
        return f"{wrong} of {size} elements differ from dist.all_reduce ({carried})."
    across = [(operation, elements) for operation, level, elements in calls if level == "across"]
    if any(operation in ("reduce_scatter", "all_gather") for operation, _ in across):
        return (f"the sum is right, but the groups are swapped ({carried}): reduce-scatter and all-gather belong to "
                "the node's group (inside_group, fast), the all-reduce of your shard to across_group (the link).")
    if any(elements > shard for _, elements in across):
        return (f"the sum is right, but the across group carried {across} while a shard is {shard} elements: "
                "reduce-scatter inside the node first, so that only one shard per rank crosses the link.")
    if not any(operation == "reduce_scatter" and level == "inside" for operation, level, _ in calls):
        summed_inside = any(operation in ("all_reduce", "reduce") and level == "inside" for operation, level, _ in calls)
        return f"the node's ranks must reduce-scatter the tensor first ({carried})." + ("" if summed_inside else UNSEEN)
    return None


def _rank(ctx, hierarchical_all_reduce: Callable, nodes: int, per_node: int) -> str | None:
    """On one rank: the learner's function on each size, watched; every rank stops at the first failure."""
    topology = Topology(nodes, per_node)
    groups = make_groups(ctx.rank, topology, timeout_s=30.0)
    for size in sizes(per_node):
        got = rank_values(ctx.rank, size)
        expected = got.clone()
        dist.all_reduce(expected)
        calls: list = []
        with watching(calls, groups.inside_ranks, groups.across_ranks):
            hierarchical_all_reduce(got, groups.inside, groups.across)
        verdict = diagnose(calls, size, topology, got, expected)
        if verdict:
            verdict = f"{nodes} nodes x {per_node} ranks, size {size}: {verdict}"
        failed = torch.tensor([verdict is not None], dtype=torch.int32)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # all ranks stop together, none waits on a peer
        if failed.item():
            return verdict
    return None


def check_hierarchical_all_reduce(hierarchical_all_reduce: Callable, topologies=TOPOLOGIES,
                                  timeout_s: float = 60.0) -> None:
    """hierarchical_all_reduce(tensor (numel,) float32, inside_group, across_group) sums over every rank in place.

    Exactly equal to dist.all_reduce (the inputs' sums are exact in float32), on sizes the node's ranks divide
    and sizes they do not; the whole-world group is never used, and the across group carries one shard.
    """
    for nodes, per_node in topologies:
        try:
            on_ranks(_rank, nodes * per_node, (hierarchical_all_reduce, nodes, per_node), timeout_s=timeout_s)
        except ExerciseFailed as failure:
            text = str(failure)
            if not text.startswith("rank "):
                text += ("\nA rank raised or waited for a collective the others never called: every rank of a "
                         "group must call the same collectives in the same order.")
            raise ExerciseFailed(text) from None
    passed("equal to dist.all_reduce on " + ", ".join(f"{n} nodes x {g} ranks" for n, g in topologies)
           + "; the node's group reduce-scattered and all-gathered, the across group carried one shard per rank")


SPEEDUP_CASES = ((2, 2), (2, 8), (4, 8), (16, 8), (8, 1), (1, 4))
"""(nodes, ranks per node) for the speed-up predicted on a slow link, large messages."""
SPEEDUP_MISTAKES = {
    "ranks per node ignore each other": lambda n, g: (g * n - 1) / (n - 1) if n > 1 else 1.0,
    "ratio inverted": lambda n, g: g * (n - 1) / (g * n - 1) if n > 1 else 1.0,
    "flat ring sends 2 nbytes": lambda n, g: n / (n - 1) if n > 1 else 1.0,
}
SPEEDUP_HINTS = {
    "ranks per node ignore each other": "the g rings across nodes run at once through the same node link: their "
                                        "shards add up to nbytes/N per step, not nbytes/(gN).",
    "ratio inverted": "flat time over hierarchical time: a speed-up above 1 when hierarchical is faster.",
    "flat ring sends 2 nbytes": "2 nbytes is the flat ring's limit for many ranks: it sends 2(n-1)/n nbytes "
                                "through each node's link, n = gN ranks.",
}


def check_predict_speedup(predict_speedup: Callable) -> None:
    """predict_speedup(nodes, ranks_per_node) -> flat ring time / hierarchical time on a slow link, large messages.

    Compared with cost_model.predicted_speedup with no latency, an inside link 1000 x faster, 1 GB.
    """
    across, inside = AlphaBeta(0.0, 1e-8, 1.0), AlphaBeta(0.0, 1e-11, 1.0)
    for nodes, per_node in SPEEDUP_CASES:
        expected = predicted_speedup(1e9, Topology(nodes, per_node), inside, across) if nodes > 1 else 1.0
        try:
            got = predict_speedup(nodes, per_node)
        except ZeroDivisionError:
            raise ExerciseFailed(f"{nodes} nodes x {per_node} ranks: division by zero. With one node nothing crosses "
                                 "a link: the flat ring and the hierarchy are the same all-reduce, speed-up 1.") from None
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            raise ExerciseFailed(f"return a number (the ratio), not {type(got).__name__}.")
        if math.isclose(got, expected, rel_tol=0.01):
            continue
        case = f"{nodes} nodes x {per_node} ranks: got {got:.4g}, expected {expected:.4g} (1% tolerance)"
        for name, mistake in SPEEDUP_MISTAKES.items():
            if math.isclose(got, mistake(nodes, per_node), rel_tol=1e-6):
                raise ExerciseFailed(f"{case}. {SPEEDUP_HINTS[name]}")
        raise ExerciseFailed(f"{case}: flat 2(gN-1)/(gN) nbytes over each node link, hierarchical 2(N-1)/N nbytes.")
    passed("the speed-up matches the model on every layout, one node and one rank per node included")
