"""start, run and wait_all: a lab, a module or a script under torchrun, with live output, restarts and nodes.

    result = launch.run("setup", nproc=2, timeout=60)
    result = launch.run("my_ddp.py", nproc=2, args=["--epochs", "1"])
    run = launch.start("setup", nproc=1, nnodes="1:2", max_restarts=1, hold_s=20); run.end_node(1); run.wait()
    result = launch.run("setup", nproc=1, nnodes=2, link="100mbit")   # emulated nodes: own addresses, shaped link
"""
from __future__ import annotations

from pathlib import Path

from labsrc.core import runs
from labsrc.core.world import RequestError, validate_request
from labsrc.launch.command import child_environment, torchrun_command
from labsrc.launch.lease import lease_need, pool_limits
from labsrc.launch.request import (check_args, check_number, check_port, check_profile, free_port, lab_options_argv,
                                   parse_nodes, resolve_target)
from labsrc.launch.result import LaunchError, RunResult
from labsrc.launch.running import Launch
from labsrc.nodes import network as emulated_nodes


def start(target: str, nproc: int = 2, args: list | tuple = (), timeout: float = 300.0,
          backend: str | None = None, profile: str | None = None, port: int | None = None,
          env: dict | None = None, check: bool = True, echo: bool = True, runs_root: Path | None = None,
          max_restarts: int = 0, nnodes: int | str = 1, link=None, ready_timeout: float | None = None,
          **options) -> Launch:
    """Check the request, then start torchrun (one agent per node) on `target`; returns the running Launch.

    target: a script path ("my_ddp.py"), a dotted module ("pkg.train") or a course lab ("setup"); **options
    are a course lab's typed options. link: None (nodes share this machine's loopback) or a rate ("100mbit",
    "1gbit", labsrc.nodes.network.Link(bits)): each node then gets its own network namespace, address and a link
    shaped to that rate (see labsrc.nodes.network). Everything is checked before anything starts
    (RequestError says what to do). On a class server (LABSRC_POOL_DIR names a pool, labsrc.core.leases) the
    run leases its GPUs (one per NCCL rank, or those gloo ranks share) or cores before torchrun starts and
    sees only those; a wait for them counts against `timeout` and, when too long, raises LaunchTimeout.
    ready_timeout: the run also ends this many seconds after every rank was ready (its process group up), however
    long torchrun took to start them (a busy machine); `timeout` still bounds the whole run, start-up included.
    """
    check_number("timeout", timeout, 0, strict=True)
    if ready_timeout is not None:
        check_number("ready_timeout", ready_timeout, 0, strict=True)
    check_number("max_restarts", max_restarts, 0, whole=True)
    nodes = parse_nodes(nnodes)
    check_number("nproc", nproc, 1, whole=True)
    pool, gpus_here, cores_here = pool_limits()
    chosen, device_kind = validate_request(nproc * nodes.maximum, backend, gpus_here, cores_here)
    if nodes.maximum > 1:
        # Simulated nodes share this machine: each node's ranks count their GPUs from cuda:0 (LOCAL_RANK), so two
        # nodes put ranks on the same GPU, which NCCL refuses ("Duplicate GPU detected", seen on an H200), and NCCL
        # between nodes of one host would go through shared memory, around the emulated link. They use gloo.
        if backend == "nccl":
            raise RequestError("simulated nodes share this machine's GPUs and links: NCCL would put two nodes' "
                               "ranks on one GPU and bypass the emulated link. Leave backend unset (gloo), or "
                               "run NCCL across real nodes (cluster/README.md).")
        backend = "gloo"
    check_profile(profile)
    target_args = check_args(args)
    if link is not None:
        link, how = emulated_nodes.check_request(link, nodes.maximum)
    if port is not None:
        check_port(port)
    resolved = resolve_target(target)
    if options and resolved.kind != "lab":
        raise RequestError(f"typed options ({', '.join(sorted(options))}) are for course labs only; give "
                           f"{resolved.name}'s own flags as args=[...].")
    if resolved.kind == "lab":
        target_args = lab_options_argv(resolved.value, options, nproc * nodes.minimum) + target_args
    need = lease_need(pool, nproc * nodes.maximum, device_kind, gpus_here)
    run_dir = runs.new_run_dir(resolved.name, runs_root)
    if nodes.maximum > 1 and port is None:
        port = free_port() if link is None else emulated_nodes.RENDEZVOUS_PORT
    child_env = child_environment(nproc * nodes.maximum, run_dir, run_dir.name, backend, profile,
                                  nodes.maximum > 1 or max_restarts > 0, env)
    if link is None:
        commands = [torchrun_command(resolved, nproc, nodes, target_args, run_dir.name, max_restarts, port)
                    for _ in range(nodes.maximum)]
        return Launch(resolved, nproc, nodes, run_dir, commands, child_env, timeout, echo, check, None, pool, need,
                      ready_timeout)
    network = emulated_nodes.Network(nodes.maximum, link, how)
    commands = [network.enter(i) + torchrun_command(resolved, nproc, nodes, target_args, run_dir.name,
                                                    max_restarts, port, network.address(i), network.address(0),
                                                    is_host=i == 0)
                for i in range(nodes.maximum)]
    try:
        return Launch(resolved, nproc, nodes, run_dir, commands, child_env, timeout, echo, check, network, pool,
                      need, ready_timeout)
    except BaseException:
        network.close()
        raise


def run(target: str, nproc: int = 2, args: list | tuple = (), timeout: float = 300.0, **settings) -> RunResult:
    """Launch `target` on `nproc` ranks (per node) with torchrun and wait: start(...).wait().

    The ranks' lines stream live, each prefixed by its rank. On timeout, interrupt (the notebook's stop
    button, Ctrl-C) or a failed rank, every process of the run is ended, every node's included. With
    check=True a failure raises RankFailed (the first failing rank's traceback, once, and where the full log
    is) / LaunchTimeout / LaunchError. Settings: see `start`.
    """
    return start(target, nproc, args, timeout, **settings).wait()


def wait_all(started: dict[str, Launch]) -> dict[str, tuple[LaunchError | None, RunResult]]:
    """Wait for several started runs in turn: each name's (None, its result) or (the LaunchError it raised, the
    error's result). A Stop (Ctrl-C) or any other exception while waiting ends every run not yet waited for before
    it propagates, so nothing is left running."""
    finished, entered = {}, []
    try:
        for name, launched in started.items():
            entered.append(name)
            try:
                finished[name] = (None, launched.wait())
            except LaunchError as exc:
                finished[name] = (exc, exc.result)
    finally:
        for name, launched in started.items():
            if name in finished:
                continue
            launched._end_everything()  # again for the one whose wait was cut short: ending is idempotent
            if name not in entered:
                launched._finish("stopped")
    return finished
