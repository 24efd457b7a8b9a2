"""Notebook 12's wrong-interface case: what each rank used and saw, and the finding read from it.

A rank's gloo interface and its store address must reach every other node. `lo` and `localhost` reach only the
rank's own node: on one machine every rank is on that node, so the bug hides; across nodes it shows.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import ClassVar

from labsrc.core.runs import Record

PHASES = ("interface", "address", "fixed")


@dataclass
class PhaseOutcome(Record):
    """One rank's try at building a process group with one phase's settings."""

    KIND: ClassVar[str] = "phase_outcome"
    phase: str
    node: int
    gloo_interface: str
    """GLOO_SOCKET_IFNAME as the group was built."""
    own_interface: str
    """The interface the launcher gave this node (its route to the others)."""
    store_host: str
    store_host_resolves_to: str
    ok: bool
    all_reduced: int | None
    """The all-reduce of ones: the world size when every rank took part."""
    error: str
    message: str
    seconds: float
    timeout_s: float
    interfaces: dict = field(default_factory=dict)
    """{interface: IPv4 address} inside the rank's node (`ip -o -4 addr`)."""
    network: int = 0
    """The rank's network namespace (inode of /proc/self/ns/net): ranks with different ones share no loopback."""


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def findings(outcomes: list[PhaseOutcome]) -> list[str]:
    """What the records show, in words: a loopback interface or address used by ranks that share no loopback."""
    apart = len({o.network for o in outcomes}) > 1  # one machine's nodes share one loopback: the bug hides
    found = []
    for o in outcomes:
        gloo_address = o.interfaces.get(o.gloo_interface, "")
        if apart and is_loopback(gloo_address):
            found.append(f"{o.phase}: node {o.node} gave gloo {o.gloo_interface} ({gloo_address}), a loopback address "
                         f"no other node can reach; its route out is {o.own_interface} "
                         f"({o.interfaces.get(o.own_interface, '?')})")
        if apart and is_loopback(o.store_host_resolves_to):
            found.append(f"{o.phase}: node {o.node} looked for the store at {o.store_host} = "
                         f"{o.store_host_resolves_to}, its own loopback: only node 0's ranks find the store there")
    return sorted(set(found))
