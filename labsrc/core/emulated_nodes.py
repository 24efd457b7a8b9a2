"""Emulated nodes: each node of a run gets its own network stack, address and a link shaped to a rate.

    launch.run("setup", nproc=2, nnodes=2, link="100mbit")   # two nodes of two ranks, joined by 100 Mbit/s

Node i lives in its own network namespace with the interface eth0 at 198.18.0.(i+1)/15, wired to a switch (a
bridge in one more namespace); both directions of each node's link are shaped with HTB. Ranks on one node talk
over its loopback (fast); ranks on different nodes cross two shaped hops (node -> switch -> node). One holder
process (labsrc.core.network_holder) owns every namespace: they vanish with it, and it dies with the launcher.
Works as root, or for any user through a user namespace where the kernel allows it; `availability()` says which,
or why not and what would enable it. Latency (netem) is not emulated: where the kernel has netem the holder
says so (`Network.netem`), and the lessons model latency.
"""
from __future__ import annotations

import functools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

from labsrc.core.network_holder import INTERFACE, node_address
from labsrc.core.world import RequestError

SWITCH_ENV = "LABSRC_EMULATED_NODES"  # "off": behave as if emulated nodes were unavailable
NODE_ENV, ADDRESS_ENV, LINK_ENV = "LABSRC_NODE", "LABSRC_NODE_ADDRESS", "LABSRC_LINK_BITS"
RENDEZVOUS_PORT = 29400  # torchrun's usual port: free in namespaces this run created
READY_TIMEOUT_S = 30.0
HOLDER_MODULE = "labsrc.core.network_holder"
HOLDER_ENV = "LABSRC_NETWORK_HOLDER"  # on every node process: the pid of the holder that owns its namespace
_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9}
TOOLS = ("ip", "tc", "nsenter", "unshare")


@dataclass(frozen=True)
class Link:
    """The link from every node to the switch: its rate in each direction."""

    rate_bits_per_s: int
    """Bits per second each way, e.g. 100_000_000 for 100 Mbit/s."""

    def __post_init__(self):
        if isinstance(self.rate_bits_per_s, bool) or not isinstance(self.rate_bits_per_s, int) \
                or not 10**5 <= self.rate_bits_per_s <= 10**11:
            raise RequestError(f"a link's rate must be a whole number of bit/s from 100 kbit/s to 100 Gbit/s "
                               f"(got {self.rate_bits_per_s!r}); e.g. Link(100_000_000) or link=\"100mbit\".")

    @property
    def label(self) -> str:
        for unit, scale in (("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
            if self.rate_bits_per_s >= scale:
                return f"{self.rate_bits_per_s / scale:g} {unit}"
        return f"{self.rate_bits_per_s} bit/s"


def parse_link(link) -> Link:
    """"100mbit", "1gbit", "2.5Gbit", "10gbit" (or a Link) -> Link; anything else RequestError saying how."""
    if isinstance(link, Link):
        return link
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg])bit\s*", str(link).lower()) if isinstance(link, str) else None
    if not match:
        raise RequestError(f"link must be a rate like \"100mbit\", \"1gbit\", \"2.5gbit\" or \"10gbit\", or "
                           f"emulated_nodes.Link(rate_bits_per_s); got {link!r}. Leave link=None for nodes "
                           f"that share this machine's loopback.")
    return Link(round(float(match.group(1)) * _UNITS[match.group(2)]))


@dataclass(frozen=True)
class Availability:
    """Can this machine run emulated nodes, how, and if not, why and what would enable it."""

    ok: bool
    how: str
    """"root", "user namespace", or "" when not ok."""
    reason: str


def _probe(command: list[str]) -> str:
    """'' when building a shaped veth pair and a bridge works under `command`, else what went wrong."""
    script = ("ip link add probe0 type veth peer name probe1 && ip link add probebr type bridge && "
              "tc qdisc add dev probe0 root handle 1: htb default 10")
    try:
        done = subprocess.run([*command, "sh", "-c", script], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return "" if done.returncode == 0 else (done.stderr or done.stdout).strip() or f"exit {done.returncode}"


@functools.lru_cache(maxsize=1)
def _probed() -> Availability:
    if not sys.platform.startswith("linux"):
        return Availability(False, "", f"emulated nodes need Linux network namespaces; this is {sys.platform}. "
                                       f"Run the course in a Linux VM or container (as root) to get them.")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return Availability(False, "", f"the tools {', '.join(missing)} are missing: install iproute2 (ip, tc) "
                                       f"and util-linux (nsenter, unshare).")
    failures = []
    if os.geteuid() == 0:
        failure = _probe(["unshare", "--net", "--"])
        if not failure:
            return Availability(True, "root", "network namespaces, veth pairs and HTB work as root")
        failures.append(f"as root: {failure}")
    failure = _probe(["unshare", "--user", "--map-root-user", "--net", "--"])
    if not failure:
        return Availability(True, "user namespace", "unprivileged user namespaces are allowed: each run "
                                                    "builds its network inside one")
    failures.append(f"in a user namespace: {failure}")
    return Availability(False, "", "network namespaces with shaped links could not be built here ("
                        + "; ".join(failures) + "). Run as root (e.g. in a container with --cap-add NET_ADMIN "
                        "--cap-add SYS_ADMIN), or allow unprivileged user namespaces (sysctl "
                        "kernel.unprivileged_userns_clone=1, user.max_user_namespaces>0, and on Ubuntu "
                        "kernel.apparmor_restrict_unprivileged_userns=0).")


def availability() -> Availability:
    """Whether emulated nodes work on this machine (probed once per process); LABSRC_EMULATED_NODES=off says no."""
    if os.environ.get(SWITCH_ENV, "").strip().lower() == "off":
        return Availability(False, "", f"{SWITCH_ENV}=off is set: unset it to use emulated nodes.")
    return _probed()


def holder_processes() -> list:
    """Every live holder process on this machine, of any run (not its node processes, forked copies of it)."""
    import psutil
    found = {}
    for proc in psutil.process_iter(["cmdline", "ppid"]):
        cmdline = proc.info.get("cmdline") or []
        if "-m" in cmdline and HOLDER_MODULE in cmdline:
            found[proc.pid] = proc
    return [proc for proc in found.values() if proc.info["ppid"] not in found]


def holder_is_live(pid: int) -> bool:
    """Is `pid` a holder whose launcher still runs (the launcher is its parent)?"""
    import psutil
    try:
        proc = psutil.Process(pid)
        cmdline = proc.cmdline()
        parent = int(cmdline[cmdline.index("--parent") + 1])
        return HOLDER_MODULE in cmdline and proc.ppid() == parent and psutil.pid_exists(parent)
    except (psutil.Error, ValueError, IndexError):
        return False


def end_stale_leftovers() -> int:
    """End what crashed runs left: holders whose launcher is gone, and any process of a node whose holder is gone.

    A node's agent and ranks carry their holder's pid (LABSRC_NETWORK_HOLDER); a network namespace lives as
    long as a process in it, so ending these frees every namespace, interface and qdisc. Returns how many.
    """
    import psutil
    stale = [proc for proc in holder_processes() if not holder_is_live(proc.pid)]
    leftovers = processes_in_namespaces(namespaces_of([p for h in stale for p in _family(h)])) if stale else []
    for proc in psutil.process_iter():
        try:
            holder = proc.environ().get(HOLDER_ENV)
        except (psutil.Error, OSError):
            continue
        # checked now, not from a list made earlier: a run starting beside this one is live, not stale
        if holder and (not holder.isdigit() or not holder_is_live(int(holder))):
            leftovers.append(proc)
    for proc in [*leftovers, *stale]:
        _kill(proc)
    return len({p.pid for p in [*leftovers, *stale]})


def _family(proc) -> list:
    import psutil
    try:
        return [proc, *proc.children()]
    except psutil.Error:
        return [proc]


def namespaces_of(procs) -> set[int]:
    """The network namespaces (inode numbers) the processes are in."""
    found = set()
    for proc in procs:
        try:
            found.add(os.stat(f"/proc/{proc.pid}/ns/net").st_ino)
        except OSError:
            pass
    return found


def processes_in_namespaces(inodes: set[int]) -> list:
    """Every live process in one of these network namespaces (never this machine's or the caller's own)."""
    import psutil
    inodes = inodes - namespaces_of([psutil.Process(1), psutil.Process()])
    found = []
    for proc in psutil.process_iter():
        try:
            if os.stat(f"/proc/{proc.pid}/ns/net").st_ino in inodes:
                found.append(proc)
        except OSError:
            continue
    return found


def _kill(proc) -> None:
    import psutil
    try:
        proc.kill()
        proc.wait(2)
    except psutil.Error:
        pass


class Network:
    """A running emulated network of `nodes` nodes joined by `link`, owned by one holder process."""

    def __init__(self, nodes: int, link: Link, how: str):
        from labsrc.core.processes import die_with_parent
        end_stale_leftovers()
        self.nodes, self.link, self.how = nodes, link, how
        wrapper = ["unshare", "--net", "--"] if how == "root" else \
            ["unshare", "--user", "--map-root-user", "--net", "--"]
        command = [*wrapper, sys.executable, "-m", HOLDER_MODULE, "--nodes", str(nodes),
                   "--rate", str(link.rate_bits_per_s), "--parent", str(os.getpid())]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), os.environ.get("PYTHONPATH")])))
        self.holder = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                                       preexec_fn=die_with_parent)
        ready = self._answer(READY_TIMEOUT_S)
        if "error" in ready:
            self.close()
            raise RequestError(f"emulated nodes could not be built: {ready['error']}")
        self.node_pids: list[int] = ready["nodes"]
        self.netem: bool = ready.get("netem", False)

    def _answer(self, timeout: float) -> dict:
        """The holder's next JSON line, or an error if it says nothing in time or dies."""
        readable, _, _ = select.select([self.holder.stdout], [], [], timeout)
        line = self.holder.stdout.readline() if readable else ""
        if not line:
            if self.holder.poll() is None:
                self.holder.kill()
            self.holder.wait()
            return {"error": f"the network holder said nothing in {timeout:g} s (exit {self.holder.returncode}): "
                             f"{self.holder.stderr.read().strip()[-800:]}"}
        return json.loads(line)

    def address(self, node: int) -> str:
        return node_address(node)

    @property
    def interface(self) -> str:
        """The name of every node's network interface (the gloo/NCCL socket interface)."""
        return INTERFACE

    def enter(self, node: int) -> list[str]:
        """The command prefix that runs a program inside node `node`'s network namespace."""
        prefix = ["nsenter", f"--net=/proc/{self.node_pids[node]}/ns/net"]
        if self.how != "root":
            prefix += [f"--user=/proc/{self.holder.pid}/ns/user", "--preserve-credentials"]
        return [*prefix, "--"]

    def environment(self, node: int) -> dict:
        """What every rank of node `node` gets besides torchrun's variables."""
        return {"GLOO_SOCKET_IFNAME": INTERFACE, "NCCL_SOCKET_IFNAME": INTERFACE, NODE_ENV: str(node),
                ADDRESS_ENV: self.address(node), LINK_ENV: str(self.link.rate_bits_per_s),
                HOLDER_ENV: str(self.holder.pid)}

    def _command(self, action: str, node: int) -> None:
        if not 0 <= node < self.nodes:
            raise RequestError(f"node must be 0..{self.nodes - 1} (got {node}).")
        if self.holder.poll() is not None:
            raise RequestError("the run's network is gone (the run ended): there is no link to change.")
        self.holder.stdin.write(f"{action} {node}\n")
        self.holder.stdin.flush()
        answer = self._answer(10.0)
        if "error" in answer:
            raise RequestError(f"could not {action} node {node}'s link: {answer['error']}")

    def cut(self, node: int) -> None:
        """Take node `node`'s link down at the switch: its packets to and from the others are lost."""
        self._command("cut", node)

    def restore(self, node: int) -> None:
        """Bring node `node`'s link back up."""
        self._command("restore", node)

    def close(self) -> None:
        """End the holder; every namespace, interface and qdisc of the network goes with it."""
        if self.holder.poll() is None:
            try:
                self.holder.stdin.write("end\n")
                self.holder.stdin.close()
            except (OSError, ValueError):
                pass
            try:
                self.holder.wait(5)
            except subprocess.TimeoutExpired:
                self.holder.send_signal(signal.SIGKILL)
                self.holder.wait()
        for stream in (self.holder.stdout, self.holder.stderr, self.holder.stdin):
            try:
                stream.close()
            except (OSError, ValueError):
                pass
