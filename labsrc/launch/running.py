"""A started run watched to its end: one torchrun agent per node, its lines streamed, its timeouts kept, nothing left.

Launch holds the agents (and the lease and emulated network they run in), lets a lesson lose and bring back a node
or cut its link, and on wait() turns however the run ended into a RunResult or a LaunchError.
"""
from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from labsrc.core import leases, runs
from labsrc.core.processes import end_run, terminate_with_parent
from labsrc.core.progress import in_notebook, make_progress
from labsrc.core.rank_output import OUTPUT_FILE, LineTail
from labsrc.core.world import RequestError
from labsrc.launch.lease import take_lease
from labsrc.launch.request import Nodes, Target
from labsrc.launch.result import LOG_FILE, LaunchInterrupted, LaunchTimeout, RunResult, failure, timeout_advice
from labsrc.nodes import network as emulated_nodes

FAILED_PEER_GRACE_S = 10.0  # after one node's agent fails, the others get this long to end by themselves


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
