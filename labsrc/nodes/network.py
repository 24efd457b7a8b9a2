"""Emulated nodes: each node of a run gets its own network stack, address and a link shaped to a rate.

    launch.run("setup", nproc=2, nnodes=2, link="100mbit")   # two nodes of two ranks, joined by 100 Mbit/s

Node i lives in its own network namespace with the interface eth0 at 198.18.0.(i+1)/15, wired to a switch (a
bridge in one more namespace); both directions of each node's link are shaped with HTB. Ranks on one node talk
over its loopback (fast); ranks on different nodes cross two shaped hops (node -> switch -> node). One holder
process (labsrc.nodes.network_holder) owns every namespace: they vanish with it, and it dies with the launcher.
Works as root, or for any user through a user namespace where the kernel allows it; `availability()` says which,
or why not and what would enable it. Latency: a Link adds it (`Link(rate, latency_s=...)`) only where the
kernel has the netem qdisc (availability().netem); where it has not, the lessons model latency instead.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

from labsrc.core.paths import python_path
from labsrc.core.world import RequestError
from labsrc.nodes.network_holder import (HOLDER_ENV, HOLDER_MODULE, INTERFACE, end_stale_leftovers, node_address,
                                         read_answer)

SWITCH_ENV = "LABSRC_EMULATED_NODES"  # "off": behave as if emulated nodes were unavailable
NODE_ENV, ADDRESS_ENV, LINK_ENV = "LABSRC_NODE", "LABSRC_NODE_ADDRESS", "LABSRC_LINK_BITS"
RENDEZVOUS_PORT = 29400  # torchrun's usual port: free in namespaces this run created
READY_TIMEOUT_S = 30.0
_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9}
TOOLS = ("ip", "tc", "nsenter", "unshare")


@dataclass(frozen=True)
class Link:
    """The link from every node to the switch: its rate in each direction."""

    rate_bits_per_s: int
    """Bits per second each way, e.g. 100_000_000 for 100 Mbit/s."""
    latency_s: float = 0.0
    """One-way delay added between two nodes (half on each hop), by netem; 0: none (only where netem exists)."""

    def __post_init__(self):
        if isinstance(self.latency_s, bool) or not isinstance(self.latency_s, (int, float)) \
                or not 0 <= self.latency_s <= 1:
            raise RequestError(f"a link's latency_s must be 0 to 1 s (got {self.latency_s!r}).")
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
                           f"labsrc.nodes.network.Link(rate_bits_per_s); got {link!r}. Leave link=None for nodes "
                           f"that share this machine's loopback.")
    return Link(round(float(match.group(1)) * _UNITS[match.group(2)]))


@dataclass(frozen=True)
class Availability:
    """Can this machine run emulated nodes, how, and if not, why and what would enable it."""

    ok: bool
    how: str
    """"root", "user namespace", or "" when not ok."""
    reason: str
    netem: bool = False
    """Whether the kernel has netem, so a Link may add latency (else latency is only modelled)."""


def _probe(command: list[str]) -> tuple[str, bool]:
    """('' or what went wrong building a shaped veth pair and a bridge under `command`, whether netem works)."""
    script = ("ip link add probe0 type veth peer name probe1 && ip link add probebr type bridge && "
              "tc qdisc add dev probe0 root handle 1: htb default 10 && "
              "{ tc qdisc add dev probe1 root netem delay 1ms 2>/dev/null && echo netem; true; }")
    try:
        done = subprocess.run([*command, "sh", "-c", script], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc), False
    if done.returncode != 0:
        return (done.stderr or done.stdout).strip() or f"exit {done.returncode}", False
    return "", done.stdout.strip() == "netem"


_NETEM = {True: "; netem too (links may add latency)",
          False: "; no netem in this kernel: latency is modelled, not emulated"}


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
        failure, netem = _probe(["unshare", "--net", "--"])
        if not failure:
            return Availability(True, "root", "network namespaces, veth pairs and HTB work as root" + _NETEM[netem],
                                netem)
        failures.append(f"as root: {failure}")
    failure, netem = _probe(["unshare", "--user", "--map-root-user", "--net", "--"])
    if not failure:
        return Availability(True, "user namespace", "unprivileged user namespaces are allowed: each run "
                                                    "builds its network inside one" + _NETEM[netem], netem)
    failures.append(f"in a user namespace: {failure}")
    return Availability(False, "", "network namespaces with shaped links could not be built here ("
                        + "; ".join(failures) + "). Run as root (e.g. in a container with --cap-add NET_ADMIN "
                        "--cap-add SYS_ADMIN), or allow unprivileged user namespaces (sysctl "
                        "kernel.unprivileged_userns_clone=1, user.max_user_namespaces>0, and on Ubuntu "
                        "kernel.apparmor_restrict_unprivileged_userns=0).")


def check_request(link, nodes: int) -> tuple[Link, str]:
    """The link asked for and how to build it, or RequestError saying why not (before anything starts)."""
    link = parse_link(link)
    if nodes < 2:
        raise RequestError(f"link={link.label!r} joins nodes: ask for two or more (nnodes=2).")
    found = availability()
    if not found.ok:
        raise RequestError(f"emulated nodes are not available here: {found.reason}")
    if link.latency_s and not found.netem:
        raise RequestError(f"latency_s={link.latency_s:g} needs the netem qdisc, which this kernel lacks: give "
                           f"latency_s=0 and model the latency (the alpha term) instead.")
    return link, found.how


def availability() -> Availability:
    """Whether emulated nodes work on this machine (probed once per process); LABSRC_EMULATED_NODES=off says no."""
    if os.environ.get(SWITCH_ENV, "").strip().lower() == "off":
        return Availability(False, "", f"{SWITCH_ENV}=off is set: unset it to use emulated nodes.")
    return _probed()


class Network:
    """A running emulated network of `nodes` nodes joined by `link`, owned by one holder process."""

    def __init__(self, nodes: int, link: Link, how: str):
        from labsrc.core.processes import die_with_parent
        end_stale_leftovers()
        self.nodes, self.link, self.how = nodes, link, how
        wrapper = ["unshare", "--net", "--"] if how == "root" else \
            ["unshare", "--user", "--map-root-user", "--net", "--"]
        command = [*wrapper, sys.executable, "-m", HOLDER_MODULE, "--nodes", str(nodes),
                   "--rate", str(link.rate_bits_per_s), "--delay-us", str(round(link.latency_s * 1e6 / 2)),
                   "--parent", str(os.getpid())]
        env = dict(os.environ, PYTHONPATH=python_path())
        self.holder = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                                       preexec_fn=die_with_parent)
        ready = self._answer(READY_TIMEOUT_S)
        if "error" in ready:
            self.close()
            raise RequestError(f"emulated nodes could not be built: {ready['error']}")
        self.node_pids: list[int] = ready["nodes"]

    def _answer(self, timeout: float) -> dict:
        return read_answer(self.holder, timeout, "network holder")

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
