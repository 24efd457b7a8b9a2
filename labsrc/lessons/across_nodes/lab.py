"""Across nodes: the link timed, the hierarchical all-reduce checked and timed against the flat ring, TP/PP/DP
traffic over each level, and local SGD, in one launch per topology.

    launch.run("across_nodes", nproc=2, nnodes=2, link="100mbit")      # 2 emulated nodes of 2 ranks
    launch.run("across_nodes", nproc=1, nnodes=4, link="100mbit")      # 4 emulated nodes of 1 rank
    launch.run("across_nodes", nproc=2, nnodes=2)                      # the one-host path: loopback only
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import ClassVar

from labsrc.core.lab import run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.runs import Record
from labsrc.core.world import RequestError
from labsrc.lessons.across_nodes import cost_model, hierarchy, traffic
from labsrc.lessons.async_parameter_server.server import Problem

LINK_BITS_ENV = "LABSRC_LINK_BITS"
LOOPBACK_BYTES_PER_S = 1e8
"""Without a shaped link, sizes are chosen as if the link moved 100 MB/s: short on loopback, still bandwidth-bound."""
EXPERIMENTS = ("link", "all_reduce", "parallelism", "local_sgd")


@dataclass
class Options(LabOptions):
    """What to measure across nodes; sizes follow from the link's rate so each transfer stays short."""

    pg_timeout_s: float = 60.0
    """Seconds a collective may wait for the other ranks."""
    experiments: tuple[str, ...] = EXPERIMENTS
    """Which of link, all_reduce, parallelism (2 nodes of 2 ranks only), local_sgd to run."""
    link_seconds: float = 0.08
    """About how long the largest message of a sweep takes on the link: sizes = rate x this."""
    repeats: int = 5
    """Timed repeats per point (after one warm-up round), interleaved; the fastest is kept."""
    sgd_steps: int = 32
    """Local SGD steps per run."""
    sgd_everies: tuple[int, ...] = (1, 4, 16)
    """Average the parameters every k steps, for each k (1 is synchronous SGD)."""
    sgd_features: int = 4096
    """Parameters of the regression local SGD trains (float32: 4 bytes each averaged)."""
    sgd_lr: float = 2e-3
    """Learning rate of local SGD (stable for the 4096-feature problem; smaller for more features)."""

    def validate(self) -> None:
        super().validate()
        unknown = sorted(set(self.experiments) - set(EXPERIMENTS))
        if unknown:
            raise RequestError(f"experiments {unknown} are unknown: choose from {list(EXPERIMENTS)}.")
        for name in ("link_seconds", "repeats", "sgd_steps", "sgd_features", "sgd_lr"):
            positive(name, getattr(self, name))
        for every in self.sgd_everies:
            positive("sgd_everies", every)


@dataclass
class Layout(Record):
    """Where this rank ran: its node (rank // ranks per node), the node's address, the link's rate, the node its
    agent started it on and the ranks of its node group."""

    KIND: ClassVar[str] = "layout"
    node: int
    nodes: int
    ranks_per_node: int
    node_address: str
    """LABSRC_NODE_ADDRESS on emulated nodes, else "" (loopback)."""
    link_bits: int | None
    """The set rate in bit/s (LABSRC_LINK_BITS), None without a shaped link."""
    node_rank: int
    """torchrun's GROUP_RANK: the node whose agent started this rank, known without the rank arithmetic."""
    inside_ranks: list
    """The ranks of the group this rank's hierarchical all-reduce uses inside its node (make_groups)."""


@dataclass
class LinkPoint(Record):
    """Across nodes: seconds per message of one size, streamed back to back from node 0 to node 1."""

    KIND: ClassVar[str] = "link"
    bytes: int
    messages: int
    """Messages in the stream (enough to carry the largest size STREAM_COPIES times)."""
    seconds: float
    """Seconds per message: the stream's time (until a reply confirmed the last) / messages."""


@dataclass
class InsidePoint(Record):
    """Inside the nodes: reduce-scatter + all-gather on each node's group (all nodes at once), fastest, slowest rank."""

    KIND: ClassVar[str] = "inside"
    bytes: int
    seconds: float


@dataclass
class Latency(Record):
    """Half the round trip of a 4-byte message across nodes: the link's alpha (fastest of the repeats)."""

    KIND: ClassVar[str] = "latency"
    one_way_s: float


@dataclass
class Throughput(Record):
    """Bytes per second of the stream of the largest messages across nodes, against the set rate."""

    KIND: ClassVar[str] = "throughput"
    bytes_per_s: float
    set_bytes_per_s: float | None
    """The set rate in bytes per second; None without a shaped link."""


@dataclass
class HierarchicalCheck(Record):
    """The hierarchical all-reduce against dist.all_reduce on one size, and the bytes each level's collectives were
    given, watched on every call (hierarchy.watching), not taken from what the function returns."""

    KIND: ClassVar[str] = "hierarchical_check"
    size: int
    max_error: float
    inside_bytes: int
    across_bytes: int


@dataclass
class AllReduceTiming(Record):
    """Seconds of one all-reduce (flat or hierarchical) of `bytes`, each repeat, slowest rank."""

    KIND: ClassVar[str] = "all_reduce"
    algorithm: str
    bytes: int
    seconds: list
    fastest_s: float


@dataclass
class LinkBytes(Record):
    """Bytes node 0's interface sent during one all-reduce of `bytes` (the kernel's counter; emulated nodes only)."""

    KIND: ClassVar[str] = "link_bytes"
    algorithm: str
    bytes: int
    sent: int


@dataclass
class SchemeTiming(Record):
    """One step's messages of a parallelism scheme on one level: bytes, what this rank sent, seconds."""

    KIND: ClassVar[str] = "scheme"
    scheme: str
    """tensor, pipeline or data."""
    level: str
    operation: str
    """all_reduce or send_recv."""
    messages: int
    bytes: int
    sent: int
    seconds: list
    fastest_s: float


@dataclass
class LocalSgd(Record):
    """One local SGD run: averaging every k steps, its communication time and final loss."""

    KIND: ClassVar[str] = "local_sgd"
    every: int
    calls: int
    payload_bytes: int
    communication_s: float
    total_s: float
    loss: float
    sync_loss: float
    reference_loss: float
    """Local SGD with this k computed in one process (every worker's steps, then their mean): what `loss` must be."""
    initial_loss: float


def link_rate_bytes() -> float | None:
    """The set rate in bytes per second, None without a shaped link."""
    bits = os.environ.get(LINK_BITS_ENV)
    return int(bits) / 8 if bits else None


def sweep_elements(rate_bytes_per_s: float, link_seconds: float) -> list[int]:
    """Three float32 sizes, the largest taking about link_seconds on the link, the smaller ones 1/8 and 1/2 of it."""
    largest = max(4096, int(rate_bytes_per_s * link_seconds / 4) // 1024 * 1024)  # divides by any g up to 1024
    return [largest // 8, largest // 2, largest]


STREAM_COPIES = 2  # each stream carries twice the largest size: long enough to spend a shaper's burst


def measure_link(ctx, records, topology, groups, elements, repeats) -> dict:
    """The levels' links: inside, the hierarchy's inside phases; across, a 4-byte ping-pong and streams of each size."""
    fits, rate = {}, link_rate_bytes()
    if topology.ranks_per_node > 1:
        inside = hierarchy.time_all_reduces(groups, elements, repeats, {"inside": hierarchy.inside_phases})
        fastest = {4 * size: min(seconds) for (_, size), seconds in inside.items()}
        for nbytes, seconds in fastest.items() if ctx.rank == 0 else ():
            records.write(InsidePoint(nbytes, seconds))
        fits["inside"] = dataclasses.asdict(cost_model.fit_inside(fastest, topology.ranks_per_node))
    if topology.nodes > 1:
        pair = hierarchy.across_pair(topology)
        latency = hierarchy.ping_pong_s(ctx.rank, pair, 4, repeats)
        streamed = {}
        for size in elements:
            messages = max(2, STREAM_COPIES * elements[-1] // size)
            seconds = hierarchy.stream_s(ctx.rank, pair, 4 * size, messages)
            if ctx.rank == pair[0]:
                streamed[4 * size] = seconds
                records.write(LinkPoint(4 * size, messages, seconds))
        if ctx.rank == pair[0]:
            records.write(Latency(latency))
            records.write(Throughput(4 * elements[-1] / streamed[4 * elements[-1]], rate))
            fits["across"] = dataclasses.asdict(cost_model.fit_link(streamed, latency))
    return fits


def across_nodes_lab(ctx, records, options: Options) -> dict:
    topology = hierarchy.Topology.from_environment(ctx.world_size)
    rate = link_rate_bytes()
    groups = hierarchy.make_groups(ctx.rank, topology, options.pg_timeout_s)
    records.write(Layout(topology.node_of(ctx.rank), topology.nodes, topology.ranks_per_node,
                         os.environ.get("LABSRC_NODE_ADDRESS", ""), int(rate * 8) if rate else None,
                         int(os.environ.get("GROUP_RANK", 0)), groups.inside_ranks))
    elements = sweep_elements(rate or LOOPBACK_BYTES_PER_S, options.link_seconds)
    summary = {"nodes": topology.nodes, "ranks_per_node": topology.ranks_per_node,
               "link_bits": int(rate * 8) if rate else None, "elements": elements}
    steps = len(options.experiments)
    records.progress(0, steps)
    if "link" in options.experiments:
        summary["fits"] = measure_link(ctx, records, topology, groups, elements, options.repeats)
    records.progress(1, steps)
    if "all_reduce" in options.experiments:
        for row in hierarchy.check_hierarchical(ctx.rank, groups, [1, topology.world_size + 1, 1000, 4099]):
            records.write(HierarchicalCheck(**row))
        algorithms = hierarchy.ALGORITHMS if topology.nodes > 1 and topology.ranks_per_node > 1 else \
            {"flat": hierarchy.flat_all_reduce}  # one rank per node (or one node): hierarchical is the flat ring
        timings = hierarchy.time_all_reduces(groups, elements, options.repeats, algorithms)
        for (name, size), seconds in timings.items():
            records.write(AllReduceTiming(name, 4 * size, seconds, min(seconds)))
        for name in algorithms if topology.nodes > 1 else ():
            sent = hierarchy.node_link_bytes(ctx.rank, groups, name, elements[-1])
            if sent is not None:
                records.write(LinkBytes(name, 4 * elements[-1], sent))
    records.progress(2, steps)
    if "parallelism" in options.experiments and topology.nodes == 2 and topology.ranks_per_node == 2:
        layers = cost_model.layers_for(4 * elements[-1])
        summary["layers"] = dataclasses.asdict(layers)
        for row in traffic.time_schemes(ctx.rank, groups, layers, options.repeats):
            records.write(SchemeTiming(**row, fastest_s=min(row["seconds"])))
    records.progress(3, steps)
    if "local_sgd" in options.experiments:
        problem = Problem(features=options.sgd_features, samples=1024, batch=32)
        summary["sgd_problem"] = dataclasses.asdict(problem)
        for row in traffic.local_sgd_runs(ctx.rank, ctx.world_size, problem, options.sgd_steps,
                                                        options.sgd_everies, options.sgd_lr):
            records.write(LocalSgd(**row))
    records.progress(steps, steps)
    return summary


def main(argv=None):
    return run_lab("across_nodes", across_nodes_lab, Options, argv)


if __name__ == "__main__":
    main()
