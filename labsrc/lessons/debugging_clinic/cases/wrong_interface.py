"""Two planted multi-node bugs and their fix, one process group each: a gloo interface and a store address that
reach only the rank's own node.

    python -m labsrc.launch --nproc 1 --nnodes 2 --link 1gbit labsrc.lessons.debugging_clinic.cases.wrong_interface

Phase 'interface': GLOO_SOCKET_IFNAME=lo, as a script written on one machine might set it: gloo listens on, and
tells its peers, a loopback address. Phase 'address': the store at MASTER_ADDR=localhost, which every node resolves
to its own loopback. Phase 'fixed': the node's own interface (what the launcher set) and torchrun's MASTER_ADDR.
Each phase builds a gloo group of its own with --timeout-s (a refused connect fails at once, a store wait after the
timeout, gloo's side waiting for a peer that never connects after 5x it); every rank records what it used, what
happened, and `ip -o -4 addr` as seen from inside its node.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import time

import torch
import torch.distributed as dist

from labsrc.core import runs
from labsrc.lessons.debugging_clinic.interface_findings import PHASES, PhaseOutcome


def interfaces_here() -> dict[str, str]:
    """{interface: IPv4 address} in this process's network namespace (what `ip -o -4 addr` lists)."""
    try:
        done = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {}  # no iproute2 here (macOS): nothing to list
    return {words[1]: words[3].split("/")[0] for words in (line.split() for line in done.stdout.splitlines())}


def network_namespace() -> int:
    """This process's network namespace (0 where /proc has none to show, e.g. macOS)."""
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def settings(phase: str, store: dist.Store, rank: int, own_interface: str) -> tuple[str, str, int]:
    """(gloo interface, store host, store port) a phase uses; rank 0 picks the 'address' phase's port."""
    if phase == "interface":
        return "lo", os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if phase == "address":
        if rank == 0:
            store.set("address_port", str(free_port()))
        return own_interface, "localhost", int(store.get("address_port"))
    return own_interface, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def try_phase(phase: str, store: dist.Store, rank: int, world: int, own_interface: str, timeout_s: float) -> dict:
    interface, host, port = settings(phase, store, rank, own_interface)
    timeout = datetime.timedelta(seconds=timeout_s)
    os.environ["GLOO_SOCKET_IFNAME"] = interface  # read by gloo as the group is built
    started, error, message, total = time.perf_counter(), "", "", None
    try:
        if phase == "address":
            group_store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout,
                                        wait_for_workers=False)
        else:
            group_store = dist.PrefixStore(phase, store)
        # a group of its own, not the default one: a failed init_process_group leaves global state behind
        # (its group counter) that would make the next phase's ranks disagree on their store keys
        group = dist.ProcessGroupGloo(group_store, rank, world, timeout)
        value = torch.ones(1)
        group.allreduce([value]).wait()
        total = int(value.item())
    except (RuntimeError, dist.DistError) as exc:
        error, message = type(exc).__name__, str(exc).strip().splitlines()[0][:400]
    return dict(phase=phase, gloo_interface=interface, store_host=host, store_host_resolves_to=_resolve(host),
                ok=not error, all_reduced=total, error=error, message=message,
                seconds=time.perf_counter() - started, timeout_s=timeout_s)


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        return f"unresolved ({exc})"


def wait_for_all(store: dist.Store, key: str, world: int, timeout_s: float = 60.0) -> None:
    """Count this rank in at `key`, then wait (bounded) until every rank has."""
    store.add(key, 1)
    deadline = time.perf_counter() + timeout_s
    while int(store.add(key, 0)) < world:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"not every rank reached {key!r} within {timeout_s:g} s")
        time.sleep(0.05)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--timeout-s", type=float, default=1.5,
                        help="a planted phase's process-group timeout (gloo's waiting side gives up after 5x it)")
    parser.add_argument("--fixed-timeout-s", type=float, default=60.0, help="the fixed phase's timeout")
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    args = parser.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    own_interface = os.environ.get("GLOO_SOCKET_IFNAME", "")
    records = runs.RecordWriter(os.environ.get(runs.RUN_DIR_ENV, "."), rank)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    node = int(os.environ.get("LABSRC_NODE", int(os.environ.get("GROUP_RANK", 0))))
    try:
        for phase in args.phases:
            timeout_s = args.fixed_timeout_s if phase == "fixed" else args.timeout_s
            outcome = try_phase(phase, store, rank, world, own_interface, timeout_s)
            records.write(PhaseOutcome(node=node, interfaces=interfaces_here(), own_interface=own_interface,
                                       network=network_namespace(), **outcome))
            print(f"{phase}: {'ok' if outcome['ok'] else outcome['error'] + ': ' + outcome['message']}", flush=True)
            wait_for_all(store, f"done/{phase}", world)  # the next phase starts together
        if rank == 0:
            runs.write_summary(records.run_dir, {"phases": args.phases, "world_size": world})
        # rank 0 serves the store: it leaves only once every other rank has made its last call to it
        if rank == 0:
            wait_for_all(store, "leaving", world)
        else:
            store.add("leaving", 1)
    finally:
        records.close()


if __name__ == "__main__":
    main()
