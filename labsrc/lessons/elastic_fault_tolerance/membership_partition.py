"""Lose a node of an elastic run to a partition (its link goes down, its processes live on), time who notices when.

    started = start_partition_run(pg_timeout_s=3)        # emulated nodes where available, else loopback nodes
    partition = partition_node(started)                 # cut the link of the node that does not serve the store
    result = started.wait()
    timeline = partition_timeline(result, partition)    # noticed after pg_timeout, re-formed after the keep-alive

A killed process is noticed at once: its kernel closes its sockets and the peers read a reset. A partitioned node
sends nothing, not even a reset: its peers learn of it only when a timeout fires. Two timeouts govern: the process
group timeout (a collective waiting on the lost peer fails after it) and the rendezvous keep-alive (the store drops
a node whose last heartbeat is older than keep_alive_interval x keep_alive_max_attempt; then the new round waits
last_call_timeout for late joiners). Without emulated nodes the node is frozen instead (SIGSTOP on its agent and
ranks): its sockets stay open and it sends nothing, which its peers see the same way.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass

from labsrc.core import runs
from labsrc.launch import ELASTIC_RDZV_CONF, Launch, end_run, start
from labsrc.lessons.elastic_fault_tolerance.membership import resumable_steps_at, store_host, wait_until
from labsrc.nodes import network


@dataclass(frozen=True)
class RendezvousTimeouts:
    """The c10d rendezvous settings every agent of the course's elastic runs gets (launch.ELASTIC_RDZV_CONF)."""

    keep_alive_interval_s: float
    keep_alive_max_attempt: int
    last_call_s: float

    @property
    def expiry_s(self) -> float:
        """A node whose last heartbeat is older than this is dropped from the rendezvous."""
        return self.keep_alive_interval_s * self.keep_alive_max_attempt


def rendezvous_timeouts(conf: str = ELASTIC_RDZV_CONF) -> RendezvousTimeouts:
    """The keep-alive and last-call settings read from torchrun's --rdzv-conf string."""
    values = dict(item.split("=", 1) for item in conf.split(","))
    return RendezvousTimeouts(float(values["keep_alive_interval"]), int(values["keep_alive_max_attempt"]),
                              float(values["last_call_timeout"]))


@dataclass(frozen=True)
class Partition:
    """How a node was cut off, when, and how long its agent lived on without the others."""

    how: str
    """'cut link' (emulated nodes: the node's link down at the switch) or 'frozen node' (SIGSTOP, one host)."""
    why: str
    """Why this way: the emulated-nodes availability reason."""
    node: int
    cut_wall: float
    """time.time() as the link went down (or the node froze)."""
    survivor_done_s: float
    """Seconds from the cut until the survivor's agent finished the training."""
    partitioned_agent_alive: bool
    """Was the cut-off node's agent still running when the survivor finished? (Then the launcher ended it.)"""


def start_partition_run(pg_timeout_s: float = 3.0, epochs: int = 1, timeout: float = 120.0,
                        link: str = "100mbit", **settings) -> Launch:
    """An elastic 1:2 run of lesson 10's lab, on emulated nodes where this machine has them, else on loopback."""
    emulated = network.availability()
    return start("elastic_fault_tolerance", nproc=1, nnodes="1:2", timeout=timeout, max_restarts=3,
                 reference=False, epochs=epochs, step_sleep_s=0.3, pg_timeout_s=pg_timeout_s,
                 link=link if emulated.ok else None, **settings)


def _freeze(started: Launch, node: int) -> None:
    """Stop (SIGSTOP) node's agent and ranks: alive, sockets open, silent."""
    import psutil
    agent = psutil.Process(started.agents[node].pid)
    for proc in [agent, *agent.children(recursive=True)]:
        try:
            proc.send_signal(signal.SIGSTOP)
        except psutil.Error:
            pass


def partition_node(started: Launch, steps_before: int = 3, timeout_s: float = 90.0) -> Partition:
    """Cut off the node that does not serve the store once 2 ranks did steps_before steps; wait until the survivor
    finishes alone, then end the cut-off node (launcher). On any failure the whole run is ended."""
    try:
        return _partition_node(started, steps_before, timeout_s)
    except BaseException:
        end_run(started.run_id, [agent.pid for agent in started.agents])
        raise


def _partition_node(started: Launch, steps_before: int, timeout_s: float) -> Partition:
    wait_until(lambda: resumable_steps_at(started.run_dir, 2) >= steps_before, timeout_s, "2 ranks training", started)
    emulated = started.network is not None
    # emulated nodes: node 0 hosts the store by construction (the endpoint is its address; psutil cannot see
    # sockets in another network namespace); loopback nodes: whichever agent bound the port first
    survivor = 0 if emulated else store_host(started)
    node = 1 - survivor
    cut_wall = time.time()
    if emulated:
        started.cut_link(node)
    else:
        _freeze(started, node)
    survivor_agent = started.agents[survivor]
    deadline = time.perf_counter() + timeout_s
    while survivor_agent.poll() is None and time.perf_counter() < deadline:
        time.sleep(0.1)
    if survivor_agent.poll() is None:
        raise TimeoutError(f"the survivor did not finish within {timeout_s:g} s of the cut (see {started.log_path}).")
    done_s = time.time() - cut_wall
    alive = started.agents[node].poll() is None
    started.end_node(node)  # SIGKILL: also ends a stopped process, and one waiting on a store it cannot reach
    return Partition("cut link" if emulated else "frozen node", network.availability().reason, node,
                     cut_wall, done_s, alive)


@dataclass(frozen=True)
class PartitionTimeline:
    """Seconds after the cut at which each thing happened, from the run's own records."""

    noticed_s: float
    """The first collective that failed because of the lost peer (its rank's error record)."""
    error: str
    """That error's message (a timeout, not a reset: a partition sends nothing)."""
    reformed_s: float
    """The first rank of the re-formed (smaller) group started."""
    first_step_s: float
    """The re-formed group's first training step."""
    world_sizes: list
    """World size of each start of the group, in order."""


def partition_timeline(result, partition: Partition) -> PartitionTimeline:
    """When the survivor noticed, when the group re-formed and trained again, read from the run's records."""
    errors = [e for e in runs.read_errors(result.run_dir).values() if str(e.get("attempt")) == "0"]
    if not errors:
        raise ValueError(f"no rank of the first attempt recorded an error in {result.run_dir}: nobody noticed.")
    first = min(errors, key=lambda e: float(e["time"]))
    later = [a for a in runs.read_attempts(result.run_dir) if a["attempt"] > 0]
    steps = [r for rows in runs.read_records(result.run_dir).values() for r in rows
             if r["kind"] == "train_step" and r["run"] == "resumable" and r["world_size"] == 1]
    starts = sorted({(a["attempt"], a["world_size"]) for a in runs.read_attempts(result.run_dir)})
    return PartitionTimeline(
        noticed_s=float(first["time"]) - partition.cut_wall, error=first["message"],
        reformed_s=min((a["time"] for a in later), default=float("nan")) - partition.cut_wall,
        first_step_s=min((s["wall"] for s in steps), default=float("nan")) - partition.cut_wall,
        world_sizes=[size for _, size in starts])
