"""The one process that owns an emulated Slurm cluster: init of its own PID namespace, so nothing outlives it.

    unshare --pid --kill-child --mount-proc -- python -m labsrc.nodes.slurm_holder --dir D --nodes 2

It runs as PID 1 of a fresh PID and mount namespace: when it dies, for any reason, the kernel kills every process
of the namespace (munged, slurmctld, each slurmd, every job step and rank), and `--kill-child` makes it die with
`unshare`, which dies with its launcher (PR_SET_PDEATHSIG). In its own mount namespace it bind-mounts D/hosts on
/etc/hosts, so the node names resolve there and nowhere else. It builds an emulated network of nodes + 1
(labsrc.nodes.network): node i is the compute node `node<i>`, the last one is `head` (slurmctld, and the
namespace clients run in). Everything Slurm writes lives in D (labsrc.nodes.slurm_cluster writes the config).
It prints one JSON line when the nodes are idle ({"head": pid, "nodes": [pid, ...]}, pids in its namespace) or
{"error": "..."}, then answers "cut I" / "restore I" (node I's link) and "end" on stdin.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

HOLDER_MODULE = "labsrc.nodes.slurm_holder"
HEAD = "head"
LINK = "1gbit"
READY_TIMEOUT_S = 60.0


def node_name(node: int) -> str:
    return f"node{node}"


def reap(tracked: dict) -> None:
    """Collect every exited child: orphans of the namespace come to PID 1; tracked ones keep their exit code."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in tracked:
            tracked[pid] = os.waitstatus_to_exitcode(status)


class Daemons:
    """The cluster's processes, started in their namespaces, their output in D/log/<name>.out."""

    def __init__(self, folder: Path, nodes: int):
        from labsrc.nodes.network import Network, parse_link
        self.folder, self.nodes, self.exits = folder, nodes, {}
        self.env = dict(os.environ, SLURM_CONF=str(folder / "slurm.conf"))
        subprocess.run(["mount", "--bind", str(folder / "hosts"), "/etc/hosts"], check=True, capture_output=True)
        self.network = Network(nodes + 1, parse_link(LINK), "root")
        self.head = nodes

    def start(self, name: str, command: list[str], node: int | None = None, hostname: str = "") -> int:
        prefix = self.network.enter(node) if node is not None else []
        if hostname:  # its own UTS namespace: `hostname` there is the node's name, the machine's is untouched
            command = ["unshare", "--uts", "--", "sh", "-c", f'hostname {hostname} && exec "$@"', "sh", *command]
        out = open(self.folder / "log" / f"{name}.out", "wb")
        proc = subprocess.Popen([*prefix, *command], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env, cwd=self.folder)
        out.close()
        self.exits[proc.pid] = None
        return proc.pid

    def check_running(self, pid: int, name: str) -> None:
        reap(self.exits)
        if self.exits.get(pid) is not None:
            tail = (self.folder / "log" / f"{name}.out").read_text(errors="replace")[-1500:]
            raise RuntimeError(f"{name} exited ({self.exits[pid]}): {tail.strip()}")

    def client(self, *args: str) -> str:
        command = [*self.network.enter(self.head), *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=20, env=self.env)
        return done.stdout

    def bring_up(self) -> None:
        folder = self.folder
        munge = self.start("munged", ["munged", "--foreground", "--force", f"--socket={folder}/munge/munge.socket",
                                      f"--key-file={folder}/munge-key/munge.key", f"--pid-file={folder}/munged.pid",
                                      f"--seed-file={folder}/munged.seed", f"--log-file={folder}/log/munged.log"])
        wait_for(lambda: (folder / "munge" / "munge.socket").exists(), 10, lambda: self.check_running(munge, "munged"),
                 "munged made no socket")
        started = [(self.start("slurmctld", ["slurmctld", "-D", "-i"], self.head, HEAD), "slurmctld")]
        for node in range(self.nodes):
            name = node_name(node)
            started.append((self.start(f"slurmd-{name}", ["slurmd", "-D", "-N", name], node, name),
                            f"slurmd-{name}"))

        def idle() -> bool:
            states = self.client("sinfo", "--noheader", "--Node", "--format=%N %T").split()
            return len(states) == 2 * self.nodes and all(s.startswith("idle") for s in states[1::2])

        wait_for(idle, READY_TIMEOUT_S, lambda: [self.check_running(pid, name) for pid, name in started],
                 "the nodes did not become idle in time (the daemons' logs follow)")


def wait_for(done, timeout: float, check, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        check()
        if time.monotonic() > deadline:
            raise RuntimeError(what)
        time.sleep(0.3)


def serve(daemons: Daemons) -> None:
    """Answer cut/restore until "end" or the end of stdin; reap the namespace's orphans meanwhile."""
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], 1.0)
        reap(daemons.exits)
        if not readable:
            continue
        line = sys.stdin.readline()
        words = line.split()
        if not line or words == ["end"]:
            return
        try:
            action, node = words[0], int(words[1])
            getattr(daemons.network, {"cut": "cut", "restore": "restore"}[action])(node)
            print(json.dumps({"done": line.strip()}), flush=True)
        except (KeyError, ValueError, IndexError) as exc:
            print(json.dumps({"error": f"unknown command {line.strip()!r} ({exc})"}), flush=True)
        except Exception as exc:  # the network's own error, passed on to the caller
            print(json.dumps({"error": str(exc)}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {HOLDER_MODULE}")
    parser.add_argument("--dir", required=True, help="the cluster's folder, with slurm.conf and hosts written")
    parser.add_argument("--nodes", type=int, required=True)
    options = parser.parse_args(argv)
    if os.getpid() != 1:
        print(json.dumps({"error": "run me as PID 1 of a new PID namespace (unshare --pid --fork --mount-proc)"}),
              flush=True)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # PID 1 ignores signals it has no handler for
    daemons = None
    try:
        daemons = Daemons(Path(options.dir), options.nodes)
        daemons.bring_up()
        print(json.dumps({"head": daemons.network.node_pids[daemons.head],
                          "nodes": daemons.network.node_pids[:options.nodes]}), flush=True)
        serve(daemons)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    finally:
        if daemons is not None:
            daemons.network.close()
    return 0  # PID 1 exits: the kernel kills every process left in the namespace


if __name__ == "__main__":
    sys.exit(main())
