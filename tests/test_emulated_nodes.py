"""Emulated nodes: own namespace, address and interface per node, a link that carries its rate, nothing left behind."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from labsrc import launch
from labsrc.core.world import RequestError
from labsrc.nodes import network as emulated_nodes, network_holder
from labsrc.nodes.network import Link, Network, parse_link

AVAILABLE = emulated_nodes.availability()
needs_namespaces = pytest.mark.skipif(not AVAILABLE.ok, reason=f"emulated nodes unavailable: {AVAILABLE.reason}")
REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture
def runs(tmp_path, monkeypatch):
    monkeypatch.setenv("LABSRC_RUNS", str(tmp_path / "runs"))
    return tmp_path / "runs"


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def machine_state() -> dict:
    """What a run could leave on this machine: interfaces, qdiscs, named namespaces, namespace mounts."""
    def text(*command):
        return subprocess.run(command, capture_output=True, text=True).stdout
    return {"links": sorted(line.split(":")[1].strip().split("@")[0] for line in text("ip", "-o", "link").splitlines()),
            "qdiscs": text("tc", "qdisc", "show"), "named namespaces": text("ip", "netns", "list"),
            "nsfs mounts": [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if " nsfs " in line]}


def network_namespaces(network: Network) -> set[int]:
    """The switch's and every node's network namespace (inode numbers) while the run lives."""
    return {os.stat(f"/proc/{pid}/ns/net").st_ino for pid in [network.holder.pid, *network.node_pids]}


def assert_nothing_left(before: dict, namespaces: set[int], run_id: str, deadline_s: float = 20) -> None:
    """No process of the run, none in its namespaces (the holder included: so they are freed), the machine as it was."""
    deadline = time.time() + deadline_s
    while time.time() < deadline and (network_holder.processes_in_namespaces(namespaces)
                                      or launch.processes_of_run(run_id, None)):
        time.sleep(0.2)
    assert network_holder.processes_in_namespaces(namespaces) == []
    assert launch.processes_of_run(run_id, None) == []
    assert machine_state() == before


def test_link_rates_parse_and_bad_requests_say_what_to_write(runs):
    assert parse_link("100mbit") == Link(100_000_000) and parse_link(" 1GBIT ") == Link(10**9)
    assert parse_link("2.5gbit").rate_bits_per_s == 2_500_000_000 and parse_link(Link(10**7)) == Link(10**7)
    for bad in ("100", "fast", "1 gbps", 100, "0mbit"):
        with pytest.raises(RequestError, match="link|rate"):
            parse_link(bad)
    with pytest.raises(RequestError, match="nnodes=2"):
        launch.start("setup", nproc=1, link="1gbit")
    with pytest.raises(RequestError, match="like \"100mbit\""):
        launch.start("setup", nproc=1, nnodes=2, link="1gbps")
    assert not runs.exists(), "a refused request started something"


def test_the_off_switch_makes_emulated_nodes_unavailable_with_its_reason(runs, monkeypatch):
    monkeypatch.setenv(emulated_nodes.SWITCH_ENV, "off")
    found = emulated_nodes.availability()
    assert not found.ok and found.how == "" and emulated_nodes.SWITCH_ENV in found.reason
    with pytest.raises(RequestError, match=f"not available here: {emulated_nodes.SWITCH_ENV}=off"):
        launch.run("setup", nproc=1, nnodes=2, link="100mbit")


@needs_namespaces
def test_each_node_has_its_own_stack_address_and_no_route_out_and_stale_leftovers_go(runs, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a crashed run's leftover: a process in a namespace of its own whose holder is gone
    leftover = subprocess.Popen(["unshare", "--net", "--", "sleep", "120"],
                                env={**os.environ, network_holder.HOLDER_ENV: str(dead.pid)})
    probe = script(tmp_path, "where_am_i", """\
        import errno, os, socket
        from labsrc.core.runs import RUN_DIR_ENV, RecordWriter
        try:
            socket.create_connection(("192.0.2.1", 9), timeout=2)  # TEST-NET-1: no route may lead there
            out = "connected"
        except OSError as exc:
            out = errno.errorcode.get(exc.errno, str(exc))
        RecordWriter(os.environ[RUN_DIR_ENV], int(os.environ["RANK"])).write(
            "node", node=int(os.environ["LABSRC_NODE"]), address=os.environ["LABSRC_NODE_ADDRESS"],
            ifname=os.environ["GLOO_SOCKET_IFNAME"], link=int(os.environ["LABSRC_LINK_BITS"]),
            local_world=int(os.environ["LOCAL_WORLD_SIZE"]), namespace=os.stat("/proc/self/ns/net").st_ino,
            interfaces=sorted(name for _, name in socket.if_nameindex()), out=out)
    """)
    result = launch.run(probe, nproc=2, nnodes=2, link="100mbit", timeout=120, echo=False)
    assert leftover.poll() is not None, "the stale leftover survived the next start"
    nodes = {r["rank"]: r for r in result.of_kind("node")}
    assert sorted(nodes) == [0, 1, 2, 3]
    for rank, seen in nodes.items():
        node = rank // seen["local_world"]
        assert seen["node"] == node and seen["address"] == f"198.18.0.{node + 1}"
        assert seen["ifname"] == "eth0" and seen["interfaces"] == ["eth0", "lo"] and seen["link"] == 10**8
        assert seen["out"] == "ENETUNREACH", seen
    assert nodes[0]["namespace"] == nodes[1]["namespace"] != nodes[2]["namespace"] == nodes[3]["namespace"]
    assert os.stat("/proc/self/ns/net").st_ino not in {n["namespace"] for n in nodes.values()}


@needs_namespaces
def test_the_link_carries_its_rate_within_15_percent(runs, tmp_path):
    stream = script(tmp_path, "stream", """\
        import os, statistics, time
        import torch, torch.distributed as dist
        from labsrc.core.runs import RUN_DIR_ENV, RecordWriter
        dist.init_process_group("gloo")
        rank, payload, ack = dist.get_rank(), torch.zeros(1_250_000), torch.zeros(1)  # 5 MB, 0.4 s at 100 Mbit/s
        seconds = []
        for repeat in range(4):
            start = time.perf_counter()
            if rank == 0:
                dist.send(payload, 1); dist.recv(ack, 1)
            else:
                dist.recv(payload, 0); dist.send(ack, 0)
            seconds.append(time.perf_counter() - start)
        if rank == 0:  # the first round also opens the connection: left out
            RecordWriter(os.environ[RUN_DIR_ENV], rank).write(
                "stream", bits=payload.numel() * 4 * 8, seconds=statistics.median(seconds[1:]))
        dist.destroy_process_group()
    """)
    result = launch.run(stream, nproc=1, nnodes=2, link="100mbit", timeout=120, echo=False)
    measured = result.of_kind("stream")[0]
    ratio = measured["bits"] / measured["seconds"] / 100e6
    assert 0.85 <= ratio <= 1.15, f"{ratio:.2f} of the set rate"


@needs_namespaces
@pytest.mark.parametrize("how", ["root", "user namespace"] if os.geteuid() == 0 else ["user namespace"])
def test_cut_link_is_a_partition_and_restore_link_heals_it(how):
    network = Network(2, Link(10**9), how)
    try:
        def connect(timeout: float) -> subprocess.CompletedProcess:
            code = f"import socket; socket.create_connection(('198.18.0.2', 5000), timeout={timeout})"
            return subprocess.run([*network.enter(0), sys.executable, "-c", code], capture_output=True, text=True)
        listener = subprocess.Popen([*network.enter(1), sys.executable, "-c",
                                     "import socket, time; s = socket.create_server(('198.18.0.2', 5000)); "
                                     "time.sleep(60)"])
        deadline = time.time() + 10
        while connect(1).returncode and time.time() < deadline:
            time.sleep(0.2)
        assert connect(2).returncode == 0, "node 0 cannot reach node 1"
        network.cut(1)
        assert "timed out" in connect(1).stderr, "a cut link must drop packets, not refuse them"
        network.restore(1)
        assert connect(5).returncode == 0, "the link did not come back"
        listener.kill()
        listener.wait()
    finally:
        network.close()
    with pytest.raises(RequestError, match="network is gone"):
        network.cut(1)


@needs_namespaces
def test_latency_is_emulated_where_netem_exists_and_refused_with_advice_where_not():
    link = Link(10**9, latency_s=0.02)
    if not AVAILABLE.netem:
        with pytest.raises(RequestError, match="netem.*model the latency"):
            emulated_nodes.check_request(link, 2)
        return
    network = Network(2, link, AVAILABLE.how)
    try:  # a TCP connect takes one round trip: twice the one-way latency
        code = ("import socket, time; s = socket.create_server(('198.18.0.1', 5000)); t = time.perf_counter(); "
                "socket.create_connection(('198.18.0.1', 5000)); print(time.perf_counter() - t)")
        local = subprocess.run([*network.enter(0), sys.executable, "-c", code], capture_output=True, text=True)
        listener = subprocess.Popen([*network.enter(1), sys.executable, "-c",
                                     "import socket, time; s = socket.create_server(('198.18.0.2', 5000)); "
                                     "time.sleep(30)"])
        time.sleep(1)
        code = ("import socket, time; t = time.perf_counter(); socket.create_connection(('198.18.0.2', 5000)); "
                "print(time.perf_counter() - t)")
        remote = subprocess.run([*network.enter(0), sys.executable, "-c", code], capture_output=True, text=True)
        listener.kill()
        listener.wait()
    finally:
        network.close()
    assert float(local.stdout) < 0.01 and 0.04 <= float(remote.stdout) < 0.2, (local, remote)


@needs_namespaces
def test_nothing_left_after_a_run_ends_or_fails(runs):
    before = machine_state()
    started = launch.start("setup", nproc=1, nnodes=2, link="1gbit", timeout=120, echo=False)
    namespaces = network_namespaces(started.network)
    assert started.wait().ok
    assert_nothing_left(before, namespaces, started.run_id)
    started = launch.start("setup", nproc=1, nnodes=2, link="1gbit", timeout=120, echo=False,
                           hold_s=6, fail_rank=1, fail_after_s=1)
    namespaces = network_namespaces(started.network)
    with pytest.raises(launch.RankFailed):
        started.wait()
    assert_nothing_left(before, namespaces, started.run_id)


@pytest.fixture
def interruptible():
    """SIGINT raising KeyboardInterrupt, as in a kernel: a shell's background job (`cmd &` without job control)
    starts with SIGINT ignored, and then no Stop could reach the launch."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@needs_namespaces
def test_nothing_left_after_an_interrupt(runs, interruptible):
    before = machine_state()
    started = launch.start("setup", nproc=1, nnodes=2, link="1gbit", timeout=120, echo=False, hold_s=60)
    namespaces = network_namespaces(started.network)
    def stop_once_ranks_run():  # the notebook's Stop button, pressed while the ranks run
        deadline = time.time() + 60
        while not (started.run_dir / "attempts.jsonl").exists() and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGINT)
    interrupt = threading.Thread(target=stop_once_ranks_run)
    interrupt.start()
    with pytest.raises(KeyboardInterrupt):
        started.wait()
    interrupt.join()
    assert_nothing_left(before, namespaces, started.run_id)


@needs_namespaces
def test_nothing_left_after_the_calling_process_is_killed_mid_run(runs):
    before = machine_state()
    kernel = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""\
        from labsrc import launch
        launch.start("setup", nproc=1, nnodes=2, link="1gbit", timeout=120, echo=False, hold_s=60).wait()
    """)], env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline, holder = time.time() + 60, None
    while holder is None and time.time() < deadline:
        holder = next((h for h in network_holder.holder_processes() if str(kernel.pid) in h.cmdline()), None)
        time.sleep(0.2)
    assert holder is not None, "the run never built its network"
    run_dirs = []
    while not run_dirs and time.time() < deadline:  # agents started: the namespaces are in use
        run_dirs = [d for d in runs.glob("setup/*") if (d / "attempts.jsonl").exists()]
        time.sleep(0.2)
    namespaces = network_holder.namespaces_of([holder, *holder.children()])
    assert len(namespaces) == 3 and run_dirs
    kernel.kill()  # SIGKILL: the launcher cannot clean up; the holder and the agents die with it
    kernel.wait()
    assert_nothing_left(before, namespaces, run_dirs[0].name, deadline_s=40)


def test_the_doctor_says_whether_emulated_nodes_work_and_why_not(monkeypatch):
    from labsrc import doctor
    monkeypatch.setenv(emulated_nodes.SWITCH_ENV, "off")
    text = doctor.format_report(doctor.report())
    assert f"emulated nodes (own network stack and shaped link per node): no: {emulated_nodes.SWITCH_ENV}=off" in text
    monkeypatch.delenv(emulated_nodes.SWITCH_ENV)
    found = doctor.report()["emulated_nodes"]
    assert (found["ok"], found["how"], found["reason"]) == (AVAILABLE.ok, AVAILABLE.how, AVAILABLE.reason)


@needs_namespaces
def test_a_network_that_cannot_be_built_says_why_and_leaves_nothing():
    if AVAILABLE.netem:
        pytest.skip("this kernel has netem: the failure planted here (a netem qdisc) would succeed")
    before = machine_state()
    with pytest.raises(RequestError, match="could not be built: .*netem"):
        Network(2, Link(10**9, latency_s=0.01), AVAILABLE.how)  # check_request would refuse it; the holder fails
    assert [h for h in network_holder.holder_processes() if str(os.getpid()) in h.cmdline()] == []
    assert machine_state() == before
