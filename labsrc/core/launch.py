"""Run a lab, a module or a script under torchrun from a notebook or a shell: live output, restarts, nodes, nothing left.

    result = launch.run("setup", nproc=2, timeout=60)
    result = launch.run("my_ddp.py", nproc=2, args=["--epochs", "1"])
    run = launch.start("setup", nproc=1, nnodes="1:2", max_restarts=1, hold_s=20); run.end_node(1); run.wait()
    result = launch.run("setup", nproc=1, nnodes=2, link="100mbit")   # emulated nodes: own addresses, shaped link
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from labsrc.core import leases, runs
from labsrc.core.launch_lease import lease_need, pool_limits, take_lease
from labsrc.core.launch_request import (Nodes, Target, check_args, check_number, check_port, check_profile,
                                        free_port, lab_options_argv, parse_nodes, resolve_target)
from labsrc.core.launch_result import (LOG_FILE, LaunchError, LaunchInterrupted, LaunchTimeout, RankFailed, RunResult,
                                       failure, timeout_advice)
from labsrc.core.paths import REPO
from labsrc.core.processes import RUN_ID_ENV, end_run, processes_of_run, terminate_with_parent
from labsrc.core.progress import in_notebook, make_progress
from labsrc.core.rank_output import OUTPUT_FILE, LineTail
from labsrc.core.world import BACKEND_ENV, RequestError, validate_request
from labsrc.nodes import network as emulated_nodes

__all__ = ["start", "run", "Launch", "RunResult", "LaunchError", "LaunchTimeout", "LaunchInterrupted", "RankFailed",
           "RequestError", "processes_of_run", "end_run"]

FAILED_PEER_GRACE_S = 10.0  # after one node's agent fails, the others get this long to end by themselves
ELASTIC_RDZV_CONF = "last_call_timeout=3,join_timeout=60,keep_alive_interval=2,keep_alive_max_attempt=3"
OWN_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torch's opt-out of sharing the rendezvous store with ranks
# torch versions the course runs restarts and nodes on with OWN_STORE_ENV=1 (the failure without it: 2.14.1)
OWN_STORE_TORCH = ((2, 11), (2, 14))


def torchrun_command(target: Target, nproc: int, nodes: Nodes, target_args: list[str], run_id: str,
                     max_restarts: int = 0, port: int | None = None, local_addr: str = "127.0.0.1",
                     rendezvous_host: str = "127.0.0.1", is_host: bool | None = None) -> list[str]:
    """One torchrun agent: standalone on loopback for one node, else a c10d rendezvous at rendezvous_host:port.

    Emulated nodes give each agent its node's own address (local_addr) and say which one hosts the store.
    """
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--max-restarts={max_restarts}", "--monitor-interval=0.1", f"--local-addr={local_addr}"]
    if nodes.maximum == 1 and port is None:
        command.append("--standalone")
    else:
        command += [f"--nnodes={nodes.spec}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous_host}:{port}",
                    f"--rdzv-id={run_id}"]
        if nodes.maximum > 1:
            host = "" if is_host is None else f",is_host={str(is_host).lower()}"
            command.append(f"--rdzv-conf={ELASTIC_RDZV_CONF}{host}")
    return command + ["-m", "labsrc.core.rank_entry", *target.entry_argv, "--", *target_args]


def child_environment(ranks: int, run_dir: Path, run_id: str, backend: str | None, profile: str | None,
                      own_store: bool, extra: dict | None) -> dict:
    env = dict(os.environ)
    cores = os.cpu_count() or 1
    env.update({
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(max(1, cores // ranks)),  # ranks share the cores instead of fighting
        runs.RUN_DIR_ENV: str(run_dir),
        RUN_ID_ENV: run_id,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                    env.get("PYTHONPATH")])),
    })
    if own_store:
        # Each attempt's ranks build a fresh store (OWN_STORE_ENV) instead of the one node rank 0's agent keeps for
        # its life: with that one, on torch 2.14.1, 10b's rejoin timed out in _assign_worker_ranks waiting for
        # role_info (an agent that knows the store's address does not publish it in a later round), and a restarted
        # attempt's gloo ranks were seen dialling the previous attempt's (dead) addresses, still in the kept store
        # ("connectFullMesh failed ... Connection refused"). Lessons 10/10b and cluster/ say so.
        env[OWN_STORE_ENV] = "1"
    if backend:
        env[BACKEND_ENV] = backend
    if profile:
        env["LABSRC_PROFILE"] = profile
    env.update(extra or {})
    return env


class Launch:
    """A started run: one torchrun agent per node. `wait()` returns its RunResult; `end_node(i)` loses one.

    With a link, `network` is the emulated network the nodes live in (`cut_link(i)` / `restore_link(i)`).
    With a pool (a class server), the run first leases `need` from it, waiting in order under its timeout:
    `lease` holds the slots until the run ends (the agents inherit the locks: an ended launcher frees them
    only once its agents are gone too).
    """

    def __init__(self, target: Target, nproc: int, nodes: Nodes, run_dir: Path, commands: list[list[str]],
                 env: dict, timeout: float, echo: bool, check: bool,
                 network: emulated_nodes.Network | None = None, pool: leases.Pool | None = None,
                 need: leases.Need = leases.Need(), ready_timeout: float | None = None):
        self.network = network
        self.ready_timeout, self.ready_s = ready_timeout, None
        self._ready_check = 0.0
        self.target, self.nproc, self.nodes, self.run_dir = target, nproc, nodes, run_dir
        self.run_id, self.commands, self.timeout, self.echo, self.check = run_dir.name, commands, timeout, echo, check
        self.env = env
        self.ended_nodes: set[int] = set()
        self.output: list[str] = []
        self._tail = LineTail(run_dir / OUTPUT_FILE)
        self._attempts_seen = 0
        self._progress = make_progress(target.name, nproc * nodes.maximum, run_dir)
        self._log = open(run_dir / LOG_FILE, "ab")
        self._start = time.perf_counter()
        self.agents: list[subprocess.Popen] = []
        self.lease = None
        if pool is not None and need:
            try:
                self.lease = take_lease(pool, need, self.timeout, self._progress, self._log, self._start,
                                        f"{target.name} {self.run_id}")
            except BaseException:
                self._log.close()
                raise
        if self.lease is not None:
            self.env = env = {**env, **self.lease.environment(nproc * nodes.maximum)}
        try:
            for i, command in enumerate(commands):
                self.agents.append(self._start_agent(i, command, env))
        except BaseException:
            self._end_everything()
            raise

    @property
    def log_path(self) -> Path:
        return self.run_dir / LOG_FILE

    def _preexec(self) -> None:
        """In each agent before it runs: die with the launcher, run on the leased cores (ranks inherit both)."""
        terminate_with_parent()
        if self.lease is not None:
            self.lease.pin()

    def _start_agent(self, node: int, command: list[str], env: dict) -> subprocess.Popen:
        self._log.write(f"[launch] node {node}: {' '.join(command)}\n".encode())
        self._log.flush()
        if self.network is not None:
            env = {**env, **self.network.environment(node)}
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, preexec_fn=self._preexec,
                                pass_fds=self.lease.fds if self.lease is not None else ())

    def _end_everything(self) -> None:
        """End every agent and rank of the run, then the network they lived in."""
        end_run(self.run_id, [agent.pid for agent in self.agents], grace_s=1.0)
        if self.network is not None:
            self.network.close()
        if self.lease is not None:
            self.lease.release()

    def cut_link(self, node: int) -> None:
        """Take emulated node `node`'s link down (a real partition: its processes live on, unreachable)."""
        self._change_link("cut", node)

    def restore_link(self, node: int) -> None:
        """Bring emulated node `node`'s link back up after cut_link."""
        self._change_link("restore", node)

    def _change_link(self, action: str, node: int) -> None:
        if self.network is None:
            raise RequestError(f"{action}_link needs emulated nodes: start the run with a link (link=\"1gbit\").")
        getattr(self.network, action)(node)
        self._log.write(f"[launch] node {node}'s link: {action} ({action}_link)\n".encode())
        self._log.flush()

    def end_node(self, node: int) -> None:
        """Lose simulated node `node` at once: its torchrun agent and its ranks are killed (SIGKILL)."""
        import psutil
        if not 0 <= node < len(self.agents):
            raise RequestError(f"node must be 0..{len(self.agents) - 1} (got {node}).")
        self.ended_nodes.add(node)
        try:
            agent = psutil.Process(self.agents[node].pid)
            family = [agent, *agent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in family:
            try:
                proc.kill()
            except psutil.Error:
                pass
        self._log.write(f"[launch] node {node} ended on purpose (end_node)\n".encode())
        self._log.flush()

    def rejoin_node(self, node: int) -> None:
        """Start simulated node `node` again after end_node: its agent asks the rendezvous to let it join."""
        if node not in self.ended_nodes:
            raise RequestError(f"node {node} is running: end_node({node}) first (ended: {sorted(self.ended_nodes)}).")
        self.agents[node] = self._start_agent(node, self.commands[node], self.env)
        self.ended_nodes.discard(node)

    @property
    def running_nodes(self) -> list[int]:
        """The simulated nodes whose torchrun agent is still running."""
        return self._running()

    def _pump(self) -> None:
        """Stream the ranks' new lines, announce new attempts, move the progress bars."""
        notes = runs.read_attempts(self.run_dir)
        attempts = 1 + max((n["attempt"] for n in notes), default=-1)
        if attempts > max(self._attempts_seen, 1) and self.echo:
            print(f"[launch] attempt {attempts} of {self.target.name} started (torchrun restart "
                  f"{attempts - 1})", flush=True)
        self._attempts_seen = max(self._attempts_seen, attempts)
        for line in self._tail.new_lines():
            self.output.append(line)
            if self.echo:
                print(line, flush=True)
        self._progress.update()

    def _running(self) -> list[int]:
        return [i for i, agent in enumerate(self.agents) if agent.poll() is None]

    def _failed(self) -> list[int]:
        return [i for i, agent in enumerate(self.agents)
                if i not in self.ended_nodes and agent.poll() not in (None, 0)]

    def _check_ready(self) -> None:
        """Note when every rank (of every node) is ready (runs.ranks_ready); looked at every 0.5 s until then."""
        now = time.perf_counter()
        if self.ready_s is None and now - self._ready_check >= 0.5:
            self._ready_check = now
            if runs.ranks_ready(self.run_dir, self.nproc * self.nodes.maximum):
                self.ready_s = now - self._start

    def _past_timeout(self) -> bool:
        """Past `timeout` from the launch, or past `ready_timeout` from the moment every rank was ready."""
        now = time.perf_counter() - self._start
        after_ready = self.ready_timeout is not None and self.ready_s is not None
        return now > self.timeout or (after_ready and now - self.ready_s > self.ready_timeout)

    def _watch(self) -> bool:
        """Poll until every agent has ended, or one failed and the others outlived the grace; True on timeout."""
        failed_since = None
        while self._running():
            self._pump()
            self._check_ready()
            if self._past_timeout():
                return True
            if self._failed():
                failed_since = failed_since or time.perf_counter()
                if time.perf_counter() - failed_since > FAILED_PEER_GRACE_S:
                    return False
            time.sleep(0.1)
        return False

    def wait(self) -> RunResult:
        """Wait for the run to end (or end it on timeout / interrupt); its RunResult, or raise on failure."""
        pids = [agent.pid for agent in self.agents]
        try:
            timed_out = self._watch()
        except KeyboardInterrupt:
            count = end_run(self.run_id, pids)
            self._finish("stopped")
            message = (f"Interrupted: ended {count} process(es) of {self.target.name}. Records so far stay in "
                       f"{self.run_dir}.")
            if not in_notebook():  # a watched notebook shows the message as a box (labsrc.core.feedback)
                print(f"\n{message}", flush=True)
            raise LaunchInterrupted(message) from None
        end_run(self.run_id, pids, grace_s=5.0 if timed_out or self._running() else 1.0)
        result = self._finish("stopped (timeout)" if timed_out else None)
        if timed_out:
            limit = (f"{self.ready_timeout:g} s timeout from the moment its ranks were ready ({self.ready_s:.1f} s "
                     f"after the launch)" if self.ready_timeout is not None and self.ready_s is not None
                     and result.wall_time_s - self.ready_s > self.ready_timeout else f"{self.timeout:g} s timeout")
            error = LaunchTimeout(
                f"{result.lab} ran past its {limit} and all its processes were ended. What "
                f"the ranks recorded so far is in {self.run_dir}. {timeout_advice(self.env)}\n"
                f"full log: {self.log_path}", result)
            if self.check:
                raise error
            result.returncode = result.returncode or -signal.SIGTERM
            return result
        if result.returncode != 0 and self.check:
            raise failure(result)
        return result

    def _finish(self, ending: str | None = None) -> RunResult:
        """Collect the ended run; the progress bars end on `ending`, else "done" or "failed" by the exit status."""
        for agent in self.agents:
            agent.wait()
        if self.network is not None:
            self.network.close()
        if self.lease is not None:
            self.lease.release()  # the agents, which held it too, are gone
        self._pump()
        self._log.close()
        codes = [a.returncode for i, a in enumerate(self.agents) if i not in self.ended_nodes]
        returncode = next((c for c in codes if c != 0), 0) if codes else -signal.SIGKILL
        self._progress.close(ending or ("done" if returncode == 0 else "failed"))
        notes = runs.read_attempts(self.run_dir)
        if returncode == 1:  # torchrun says 1 for any failure: the first failing rank's own status is truer
            last = max((n["attempt"] for n in notes), default=0)
            exits = [e for e in runs.read_attempts(self.run_dir, runs.EXITS_FILE) if e["attempt"] == last]
            returncode = next((e["exit_code"] for e in exits if e["exit_code"] != 0), returncode)
        self._ready_check = 0.0
        self._check_ready()  # ranks that were ready in the last half second
        result = RunResult.collect(self.target.name, self.nproc, self.run_dir, returncode,
                                   time.perf_counter() - self._start, self.commands[0], self.output,
                                   1 + max((n["attempt"] for n in notes), default=-1), self.nodes.spec)
        result.ready_s = self.ready_s
        return result


def start(target: str, nproc: int = 2, args: list | tuple = (), timeout: float = 300.0,
          backend: str | None = None, profile: str | None = None, port: int | None = None,
          env: dict | None = None, check: bool = True, echo: bool = True, runs_root: Path | None = None,
          max_restarts: int = 0, nnodes: int | str = 1, link=None, ready_timeout: float | None = None,
          **options) -> Launch:
    """Check the request, then start torchrun (one agent per node) on `target`; returns the running Launch.

    target: a script path ("my_ddp.py"), a dotted module ("pkg.train") or a course lab ("setup"); **options
    are a course lab's typed options. link: None (nodes share this machine's loopback) or a rate ("100mbit",
    "1gbit", emulated_nodes.Link(bits)): each node then gets its own network namespace, address and a link
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
