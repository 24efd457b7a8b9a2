"""Two levels of network: ranks grouped by node, the hierarchical all-reduce, and the inter-node link timed.

Ranks are contiguous per node, as torchrun numbers them: global rank = node * ranks_per_node + local rank, so
the node of a rank is rank // ranks_per_node. Two kinds of group follow from that:
  inside a node:  the ranks of one node, [node * g, ..., node * g + g - 1]       (loopback: fast)
  across nodes:   the ranks with the same local rank on every node, [l, l + g, ...] (the shaped link: slow)
"""
from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

WAIT = datetime.timedelta(seconds=60)  # one message or collective may wait this long, then it raises


def reduce_scatter_in(group, output: torch.Tensor, full: torch.Tensor) -> None:
    """Sum (g * k,) over the group's g ranks, keep this rank's slice (k,): *_single in newer torch, *_tensor in 2.11."""
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    _wait(collective(output, full, group=group, async_op=True))


def all_gather_in(group, output: torch.Tensor, piece: torch.Tensor) -> None:
    """Every rank's (k,) piece into (g * k,) output, in group-rank order."""
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _wait(collective(output, piece, group=group, async_op=True))


@dataclass(frozen=True)
class Topology:
    """nodes x ranks_per_node ranks, contiguous per node."""

    nodes: int
    ranks_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def inside(self, node: int) -> list[int]:
        """The ranks of one node."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def across(self, local_rank: int) -> list[int]:
        """The ranks with this local rank on every node: one per node."""
        return [node * self.ranks_per_node + local_rank for node in range(self.nodes)]

    @classmethod
    def from_environment(cls, world_size: int) -> "Topology":
        """What torchrun set: LOCAL_WORLD_SIZE ranks per node (the world is one node without it)."""
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if per_node < 1 or world_size % per_node:
            raise ValueError(f"{world_size} ranks do not make whole nodes of {per_node}")
        return cls(world_size // per_node, per_node)


@dataclass
class NodeGroups:
    """This rank's two groups: its node's ranks (inside) and its peers on the other nodes (across)."""

    topology: Topology
    inside: object
    """The process group of this rank's node."""
    across: object
    """The process group of this rank's local-rank peers, one per node."""
    inside_ranks: list
    across_ranks: list


def make_groups(rank: int, topology: Topology, timeout_s: float = 60.0) -> NodeGroups:
    """Every rank creates every group, in the same order (dist.new_group's rule); each keeps its own two."""
    timeout = datetime.timedelta(seconds=timeout_s)
    mine = {}
    for node in range(topology.nodes):
        ranks = topology.inside(node)
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine["inside"] = (group, ranks)
    for local in range(topology.ranks_per_node):
        ranks = topology.across(local)
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine["across"] = (group, ranks)
    return NodeGroups(topology, mine["inside"][0], mine["across"][0], mine["inside"][1], mine["across"][1])


WATCHED = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter", "all_gather_into_tensor",
           "all_gather_single", "all_gather", "broadcast", "reduce", "send", "recv", "isend", "irecv")


@contextlib.contextmanager
def watching(calls: list, inside: list, across: list):
    """Record (operation, level, elements) for every collective called as dist.<name> inside the block.

    level: inside, across or world (else the group's ranks); elements: its largest tensor argument, the buffer it
    covers (an all-gather's output, a reduce-scatter's input). A group may come by keyword or by position.
    """
    originals = {name: getattr(dist, name) for name in WATCHED if hasattr(dist, name)}
    world = list(range(dist.get_world_size()))

    def level_of(group) -> str:
        ranks = world if group is None else dist.get_process_group_ranks(group)
        levels = {tuple(world): "world", tuple(across): "across", tuple(inside): "inside"}  # one rank per node: across
        return levels.get(tuple(ranks), str(ranks))                                         # is the world

    def spy(name, original):
        signature = inspect.signature(original)

        def call(*args, **kwargs):
            try:  # the group may come by position too: all_reduce(shard, ReduceOp.SUM, across_group)
                group = signature.bind(*args, **kwargs).arguments.get("group")
            except TypeError:  # arguments the collective itself will refuse, with its own message
                group = kwargs.get("group")
            elements = max((a.numel() for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), default=0)
            calls.append((name.replace("_tensor", "").replace("_single", "").replace("_into", ""),
                          level_of(group), elements))
            return original(*args, **kwargs)
        return call

    for name, original in originals.items():
        setattr(dist, name, spy(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _wait(work) -> None:
    work.wait(WAIT)


def hierarchical_all_reduce(tensor: torch.Tensor, groups: NodeGroups) -> dict[str, int]:
    """Sum `tensor` over every rank in place, in three steps; return the payload bytes each level carried.

    1. reduce-scatter inside the node: rank l of a node holds the node's sum of shard l (N/g elements);
    2. all-reduce of that shard across nodes, with the ranks that hold the same shard on the other nodes;
    3. all-gather inside the node: every rank gets every summed shard.
    Only step 2 crosses the slow link, and it moves N/g elements per rank instead of N. A tensor that g does
    not divide is padded with zeros to a multiple of g (the padding adds nothing to the sum).
    Returns {"inside": bytes given to the node's collectives, "across": bytes given to the across group's}.
    """
    per_node = len(groups.inside_ranks)
    flat = tensor.view(-1)
    shard_size = -(-flat.numel() // per_node)
    padded = flat  # g divides N: the collectives work on the tensor itself, no copy
    if shard_size * per_node != flat.numel():
        padded = torch.zeros(shard_size * per_node, dtype=tensor.dtype, device=tensor.device)
        padded[:flat.numel()] = flat
    shard = torch.empty(shard_size, dtype=tensor.dtype, device=tensor.device)
    element = tensor.element_size()
    if per_node > 1:
        reduce_scatter_in(groups.inside, shard, padded)
    else:
        shard.copy_(padded)
    if len(groups.across_ranks) > 1:
        _wait(dist.all_reduce(shard, group=groups.across, async_op=True))
    if per_node > 1:
        all_gather_in(groups.inside, padded, shard)
    else:
        padded.copy_(shard)
    if padded is not flat:
        flat.copy_(padded[:flat.numel()])
    inside = 2 * padded.numel() * element if per_node > 1 else 0
    return {"inside": inside, "across": shard.numel() * element if len(groups.across_ranks) > 1 else 0}


def flat_all_reduce(tensor: torch.Tensor, groups: NodeGroups | None = None) -> dict[str, int]:
    """dist.all_reduce over the whole world: gloo's ring, whose every step waits for the slow hop."""
    _wait(dist.all_reduce(tensor, async_op=True))
    return {"inside": 0, "across": tensor.numel() * tensor.element_size()}


ALGORITHMS = {"flat": flat_all_reduce, "hierarchical": hierarchical_all_reduce}


def rank_values(rank: int, size: int) -> torch.Tensor:
    """(size,) float32 inputs that differ per rank and element; their sums are exact in float32."""
    return (torch.arange(size, dtype=torch.float32) % 13) + 100 * rank


def check_hierarchical(rank: int, groups: NodeGroups, sizes) -> list[dict]:
    """The hierarchical all-reduce against dist.all_reduce on the same inputs: largest error per size, and the bytes
    of the buffers it gave each level's collectives, as watched (not as it reports them)."""
    rows = []
    for size in sizes:
        expected = rank_values(rank, size)
        _wait(dist.all_reduce(expected, async_op=True))
        mine = rank_values(rank, size)
        calls: list = []
        with watching(calls, groups.inside_ranks, groups.across_ranks):
            hierarchical_all_reduce(mine, groups)
        given = {level: mine.element_size() * sum(elements for _, at, elements in calls if at == level)
                 for level in ("inside", "across")}
        rows.append({"size": size, "max_error": float((mine - expected).abs().max()),
                     "inside_bytes": given["inside"], "across_bytes": given["across"]})
    return rows


def node_interface() -> str | None:
    """This node's own interface on emulated nodes (the one gloo uses); None on one host, where the loopback
    carries both levels."""
    return os.environ.get("GLOO_SOCKET_IFNAME") if os.environ.get("LABSRC_NODE_ADDRESS") else None


def interface_sent_bytes(interface: str) -> int:
    """Bytes `interface` has sent, headers included: the kernel's counter in /proc/net/dev, which shows the network
    namespace of the process reading it (not /sys/class/net, which shows the namespace that mounted /sys)."""
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, counters = line.partition(":")
        if name.strip() == interface:
            return int(counters.split()[8])
    raise ValueError(f"no interface {interface!r} in this network namespace's /proc/net/dev")


def node_link_bytes(rank: int, groups: NodeGroups, algorithm: str, size: int) -> int | None:
    """Bytes node 0's interface sent during one `algorithm` all-reduce of `size` float32 (framing and acks included).

    Every rank runs the all-reduce between two barriers; rank 0 reads the counter its node's ranks share. None on
    the other ranks and off emulated nodes.
    """
    interface = node_interface() if rank == 0 else None
    tensor = torch.zeros(size)
    _wait(dist.barrier(async_op=True))
    before = interface_sent_bytes(interface) if interface else 0
    ALGORITHMS[algorithm](tensor, groups)
    _wait(dist.barrier(async_op=True))
    return interface_sent_bytes(interface) - before if interface else None


# --- the link between two ranks -----------------------------------------------------------------------------

def _send(tensor, peer):
    _wait(dist.isend(tensor, peer))


def _receive(tensor, peer):
    _wait(dist.irecv(tensor, peer))


def ping_pong_s(rank: int, pair: tuple[int, int], nbytes: int, calls: int) -> float | None:
    """One-way seconds of an nbytes message between the pair: half the round trip, fastest of `calls`.

    Both ranks of the pair send the same size back and forth; the others return None at once.
    """
    if rank not in pair:
        return None
    peer = pair[1] if rank == pair[0] else pair[0]
    tensor = torch.zeros(max(1, nbytes // 4))
    fastest = float("inf")
    for _ in range(calls + 1):  # the first round opens the connection
        start = time.perf_counter()
        if rank == pair[0]:
            _send(tensor, peer)
            _receive(tensor, peer)
        else:
            _receive(tensor, peer)
            _send(tensor, peer)
        fastest = min(fastest, (time.perf_counter() - start) / 2)
    return fastest


def stream_s(rank: int, pair: tuple[int, int], nbytes: int, messages: int) -> float | None:
    """Seconds per message from pair[0] to pair[1]: `messages` messages of nbytes back to back, then one reply.

    The sender's clock runs until the receiver's one-element reply arrives, so every byte was received
    (the reply's latency is shared by all the messages). pair[1] returns the same number, the others None.
    """
    if rank not in pair:
        return None
    tensor, reply = torch.zeros(max(1, nbytes // 4)), torch.zeros(1)
    peer = pair[1] if rank == pair[0] else pair[0]
    start = time.perf_counter()
    for _ in range(messages):
        (_send if rank == pair[0] else _receive)(tensor, peer)
    (_receive if rank == pair[0] else _send)(reply, peer)
    return (time.perf_counter() - start) / messages


def across_pair(topology: Topology) -> tuple[int, int]:
    """The two ranks that time the inter-node link: rank 0 and the first rank of node 1."""
    return 0, topology.ranks_per_node


def inside_phases(tensor: torch.Tensor, groups: NodeGroups) -> dict[str, int]:
    """The hierarchical all-reduce's inside half alone: reduce-scatter then all-gather on the node's group.

    Together they are an all-reduce within the node, run by the same collectives the hierarchy uses (on gloo they
    cost more than its own all_reduce); every node's group runs at once. The tensor's size must divide by g.
    """
    shard = torch.empty(tensor.numel() // len(groups.inside_ranks), dtype=tensor.dtype)
    reduce_scatter_in(groups.inside, shard, tensor.view(-1))
    all_gather_in(groups.inside, tensor.view(-1), shard)
    return {"inside": 2 * tensor.numel() * tensor.element_size(), "across": 0}


def time_all_reduces(groups: NodeGroups, sizes, repeats: int, algorithms=None) -> dict:
    """{(algorithm, elements): [seconds of each repeat, slowest rank]}, algorithms and sizes interleaved.

    One warm-up round first (connections, allocations); each repeat goes round every (algorithm, size),
    so a burst of load elsewhere slows one repeat of every point rather than every repeat of one.
    """
    algorithms = algorithms or ALGORITHMS
    tensors = {size: torch.zeros(size) for size in sizes}
    seconds: dict = {(name, size): [] for name in algorithms for size in sizes}
    for repeat in range(repeats + 1):
        for (name, size), row in seconds.items():
            _wait(dist.barrier(async_op=True))
            start = time.perf_counter()
            algorithms[name](tensors[size], groups)
            if repeat:
                row.append(time.perf_counter() - start)
    slowest = torch.tensor(list(seconds.values()), dtype=torch.float64)
    _wait(dist.all_reduce(slowest, op=dist.ReduceOp.MAX, async_op=True))
    return {key: row for key, row in zip(seconds, slowest.tolist())}
