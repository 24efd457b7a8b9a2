"""Notebook 12's wrong-interface case: the findings name a loopback interface or address only across nodes."""
from labsrc.lessons.debugging_clinic.interface_findings import PhaseOutcome, findings, is_loopback


def outcome(phase: str, node: int, network: int, gloo: str = "eth0", store: str = "198.18.0.1") -> PhaseOutcome:
    address = f"198.18.0.{node + 1}"
    return PhaseOutcome(phase=phase, node=node, gloo_interface=gloo, own_interface="eth0", store_host=store,
                        store_host_resolves_to="127.0.0.1" if store == "localhost" else store, ok=False,
                        all_reduced=None, error="", message="", seconds=1.0, timeout_s=1.5,
                        interfaces={"lo": "127.0.0.1", "eth0": address}, network=network)


def test_loopback_addresses_are_told_apart():
    assert is_loopback("127.0.0.1") and is_loopback("127.0.1.1") and is_loopback("::1")
    assert not is_loopback("198.18.0.1") and not is_loopback("not an address")


def test_across_nodes_a_loopback_interface_and_store_address_are_named_with_the_route_out():
    found = findings([outcome("interface", 0, 11, gloo="lo"), outcome("interface", 1, 12, gloo="lo"),
                      outcome("address", 0, 11, store="localhost"), outcome("address", 1, 12, store="localhost"),
                      outcome("fixed", 0, 11), outcome("fixed", 1, 12)])
    assert {line.split(":")[0] for line in found} == {"interface", "address"}
    assert any("node 1 gave gloo lo (127.0.0.1)" in line and "eth0 (198.18.0.2)" in line for line in found)
    assert any("localhost = 127.0.0.1" in line for line in found)
    assert not any(line.startswith("fixed") for line in found)


def test_on_one_machine_loopback_reaches_every_rank_so_nothing_is_found():
    assert findings([outcome("interface", 0, 11, gloo="lo"), outcome("interface", 1, 11, gloo="lo"),
                     outcome("address", 0, 11, store="localhost"), outcome("address", 1, 11, store="localhost")]) == []
