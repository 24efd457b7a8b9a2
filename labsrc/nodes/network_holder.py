"""The one process that owns an emulated-nodes network: a switch namespace, one namespace per node, shaped links.

    unshare --net [--user --map-root-user] -- \
        python -m labsrc.nodes.network_holder --nodes 2 --rate 100000000 --parent PID

Its own network namespace is the switch: a bridge `switch` with one port `node<i>` per node. Each node is a
child process in a fresh network namespace holding the other end of that veth pair, named `eth0`, with the
address 198.18.0.<i+1>/15 and no other route (nothing leaves the machine). Both directions of every node's link
are shaped with HTB to the rate: node -> switch on the node's eth0, switch -> node on the switch's node<i>.

The namespaces have no names (no `ip netns add`): they live exactly as long as the processes inside them. The
holder dies with its parent (PR_SET_PDEATHSIG, and end of its stdin), the node processes die with the holder.
It prints one JSON line when ready ({"nodes": [pid, ...], "netem": bool}) or {"error": "..."}, then answers
commands on stdin, one per line: "cut I", "restore I" (the node's link down/up), "end".
Below the holder program: how a launcher finds holders and what a crashed run left (`end_stale_leftovers`).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
HOLDER_MODULE = "labsrc.nodes.network_holder"
HOLDER_ENV = "LABSRC_NETWORK_HOLDER"  # on every node process: the pid of the holder that owns its namespace
SWITCH = "switch"
INTERFACE = "eth0"
NETWORK = "198.18.0.0/15"  # RFC 2544's benchmarking range: never routed on the internet
MAX_NODES = 250
HTB_QUANTUM = 60000  # bytes a class may send per round; the default (rate / 10) draws kernel warnings above 16 Mbit/s


def node_address(node: int) -> str:
    """Node i's address: 198.18.0.(i+1)."""
    return f"198.18.0.{node + 1}"


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def die_with(sig: int, parent: int) -> None:
    """Get `sig` when the parent dies; exit now if it already has (the parent changed under us)."""
    _libc().prctl(PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent:
        os._exit(1)


def shaping(device: str, rate_bits: int, delay_us: int = 0) -> list[str]:
    """tc -batch lines: every packet leaving `device` goes through one HTB class at `rate_bits` bit/s (then netem)."""
    rate = f"{rate_bits}bit"
    lines = [f"qdisc add dev {device} root handle 1: htb default 10",
             f"class add dev {device} parent 1: classid 1:10 htb rate {rate} ceil {rate} quantum {HTB_QUANTUM}"]
    if delay_us:
        lines.append(f"qdisc add dev {device} parent 1:10 handle 10: netem delay {delay_us}us limit 100000")
    return lines


def run(command: list[str], stdin: str | None = None) -> None:
    """Run a setup command; on failure raise with what it said."""
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        given = f" given {stdin.strip()!r}" if stdin else ""
        raise RuntimeError(f"`{' '.join(command)}`{given} failed: {(done.stderr or done.stdout).strip()}")


def in_namespace(pid: int, command: list[str]) -> list[str]:
    return ["nsenter", f"--net=/proc/{pid}/ns/net", *command]


def start_node(holder: int) -> int:
    """Fork a process that moves into a new network namespace and waits to die with the holder."""
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_read)
            die_with(signal.SIGKILL, holder)
            if _libc().unshare(CLONE_NEWNET) != 0:
                os.write(ready_write, f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())}".encode())
                os._exit(1)
            os.write(ready_write, b"ok")
            os.close(ready_write)
            while True:
                signal.pause()
        finally:
            os._exit(1)
    os.close(ready_write)
    answer = os.read(ready_read, 200).decode()
    os.close(ready_read)
    if answer != "ok":
        raise RuntimeError(answer or "a node process ended before entering its namespace")
    return pid


def build(nodes: int, rate_bits: int, delay_us: int, pids: list[int]) -> None:
    """The switch here, `nodes` node namespaces around it, every link shaped; node processes' pids go to `pids`."""
    run(["ip", "-batch", "-"], f"link set lo up\nlink add {SWITCH} type bridge\nlink set {SWITCH} up\n")
    for node in range(nodes):
        pid = start_node(os.getpid())
        pids.append(pid)
        port = f"node{node}"
        run(["ip", "link", "add", port, "type", "veth", "peer", "name", INTERFACE, "netns", str(pid)])
        run(["ip", "-batch", "-"], f"link set {port} master {SWITCH}\nlink set {port} up\n")
        run(["tc", "-batch", "-"], "\n".join(shaping(port, rate_bits, delay_us)) + "\n")
        run(in_namespace(pid, ["ip", "-batch", "-"]),
            f"link set lo up\nlink set {INTERFACE} addrgenmode none\n"
            f"addr add {node_address(node)}/15 dev {INTERFACE}\nlink set {INTERFACE} up\n")
        run(in_namespace(pid, ["tc", "-batch", "-"]), "\n".join(shaping(INTERFACE, rate_bits, delay_us)) + "\n")


def serve(nodes: int) -> None:
    """Answer cut/restore commands until "end" or the end of stdin."""
    for line in sys.stdin:
        words = line.split()
        if words == ["end"]:
            return
        try:
            action, node = words[0], int(words[1])
            if action not in ("cut", "restore") or not 0 <= node < nodes:
                raise ValueError
        except (ValueError, IndexError):
            print(json.dumps({"error": f"unknown command {line.strip()!r}"}), flush=True)
            continue
        try:
            run(["ip", "link", "set", f"node{node}", "down" if action == "cut" else "up"])
            print(json.dumps({"done": line.strip()}), flush=True)
        except RuntimeError as exc:
            print(json.dumps({"error": str(exc)}), flush=True)


def holder_processes() -> list:
    """Every live holder process on this machine, of any run (not its node processes, forked copies of it)."""
    import psutil
    found = {}
    for proc in psutil.process_iter(["cmdline", "ppid"]):
        cmdline = proc.info.get("cmdline") or []
        if "-m" in cmdline and HOLDER_MODULE in cmdline:
            found[proc.pid] = proc
    return [proc for proc in found.values() if proc.info["ppid"] not in found]


def in_other_pid_namespace(pid: int) -> bool:
    """Is `pid` in a PID namespace other than ours (e.g. an emulated Slurm cluster's, labsrc.nodes.slurm_holder)?

    Its pids (--parent, LABSRC_NETWORK_HOLDER) are numbers of that namespace, which we cannot check from here;
    it needs no check: every process in it dies with the namespace's first process.
    """
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino != os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return False


def read_answer(holder: subprocess.Popen, timeout: float, who: str) -> dict:
    """A holder's next JSON line on its stdout, or {"error": ...} if it says nothing in time or dies (then ended)."""
    import select
    readable, _, _ = select.select([holder.stdout], [], [], timeout)
    line = holder.stdout.readline() if readable else ""
    if not line:
        if holder.poll() is None:
            holder.kill()
        holder.wait()
        return {"error": f"the {who} said nothing in {timeout:g} s (exit {holder.returncode}): "
                         f"{holder.stderr.read().strip()[-800:]}"}
    return json.loads(line)


def holder_is_live(pid: int) -> bool:
    """Is `pid` (a pid of this PID namespace) a holder whose launcher still runs (the launcher is its parent)?"""
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
    # A holder of another PID namespace (the emulated Slurm cluster's) belongs to that namespace's own launcher.
    stale = [proc for proc in holder_processes()
             if not in_other_pid_namespace(proc.pid) and not holder_is_live(proc.pid)]
    leftovers = processes_in_namespaces(namespaces_of([p for h in stale for p in _family(h)])) if stale else []
    for proc in psutil.process_iter():
        try:
            holder = proc.environ().get(HOLDER_ENV)
        except (psutil.Error, OSError):
            continue
        # checked now, not from a list made earlier: a run starting beside this one is live, not stale
        if holder and not in_other_pid_namespace(proc.pid) and (not holder.isdigit()
                                                                or not holder_is_live(int(holder))):
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsrc.nodes.network_holder")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--rate", type=int, required=True, help="each link's rate in bit/s")
    parser.add_argument("--delay-us", type=int, default=0, help="netem delay on each hop (two hops node to node)")
    parser.add_argument("--parent", type=int, required=True, help="the launcher's pid: the holder dies with it")
    options = parser.parse_args(argv)
    die_with(signal.SIGKILL, options.parent)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    children: list[int] = []
    try:
        if not 1 <= options.nodes <= MAX_NODES or options.rate <= 0:
            raise RuntimeError(f"nodes must be 1..{MAX_NODES} and rate positive")
        build(options.nodes, options.rate, options.delay_us, children)  # children fills as nodes start
        print(json.dumps({"nodes": children}), flush=True)
        serve(options.nodes)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
