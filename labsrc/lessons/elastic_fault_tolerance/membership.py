"""Lose a simulated node of an elastic run, wait for the job to re-form smaller, bring the node back, watch it grow.

    started = launch.start("elastic_fault_tolerance", nproc=1, nnodes="1:2", max_restarts=3, reference=False, ...)
    shrink_then_grow(started)      # end_node(1) after some steps at world 2, rejoin it after some at world 1
    result = started.wait()
"""
from __future__ import annotations

import time

from labsrc.core import runs
from labsrc.launch import Launch, end_run
from labsrc.lessons.elastic_fault_tolerance.lab import Resume, TrainStep


class MembershipTimeout(RuntimeError):
    """The elastic run did not reach the state waited for in time."""


def resumable_steps_at(run_dir, world_size: int) -> int:
    """Steps rank 0 has done at this world size so far (read from its records)."""
    rows = runs.read_records(run_dir).get(0, [])
    return sum(1 for r in rows if r["kind"] == TrainStep.KIND and r["run"] == "resumable"
               and r["world_size"] == world_size)


def starts_at(run_dir, world_size: int) -> int:
    """How many times rank 0 has started at this world size."""
    rows = runs.read_records(run_dir).get(0, [])
    return sum(1 for r in rows if r["kind"] == Resume.KIND and r["world_size"] == world_size)


def wait_until(condition, timeout_s: float, what: str, started: Launch) -> None:
    deadline = time.perf_counter() + timeout_s
    while not condition():
        if time.perf_counter() > deadline or not started.running_nodes:
            raise MembershipTimeout(f"{what}: not seen within {timeout_s:g} s (see {started.log_path}).")
        time.sleep(0.2)


def rendezvous_port(started: Launch) -> int:
    """The c10d rendezvous port, from the agents' --rdzv-endpoint."""
    flag = next(a for a in started.commands[0] if a.startswith("--rdzv-endpoint="))
    return int(flag.rsplit(":", 1)[1])


def store_host(started: Launch) -> int:
    """The node whose agent serves the c10d store (the first to bind the endpoint's port).

    Every agent's rendezvous goes through that store: losing this node ends the job however elastic it is.
    """
    import psutil
    port = rendezvous_port(started)
    for node, agent in enumerate(started.agents):
        try:
            listening = psutil.Process(agent.pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in listening):
            return node
    raise RuntimeError(f"no agent of {started.run_id} listens on the rendezvous port {port}.")


def shrink_then_grow(started: Launch, steps_before: int = 3, steps_between: int = 3, grow: bool = True,
                     timeout_s: float = 90.0) -> int:
    """End the node that does not serve the store once rank 0 has done steps_before steps at world 2; rejoin
    it after steps_between steps at world 1. Returns the node ended; on any failure the whole run is ended."""
    try:
        return _shrink_then_grow(started, steps_before, steps_between, grow, timeout_s)
    except BaseException:
        end_run(started.run_id, [agent.pid for agent in started.agents])  # nothing of the run outlives a failure
        raise


def _shrink_then_grow(started: Launch, steps_before: int, steps_between: int, grow: bool, timeout_s: float) -> int:
    run_dir = started.run_dir
    wait_until(lambda: resumable_steps_at(run_dir, 2) >= steps_before, timeout_s, "2 ranks training", started)
    lost = 1 - store_host(started)
    started.end_node(lost)
    wait_until(lambda: resumable_steps_at(run_dir, 1) >= steps_between, timeout_s,
               "training again on the one node left", started)
    if grow:
        grown = starts_at(run_dir, 2)
        started.rejoin_node(lost)
        wait_until(lambda: starts_at(run_dir, 2) > grown, timeout_s, "the returning node admitted", started)
    return lost
