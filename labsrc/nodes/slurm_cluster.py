"""A real Slurm cluster of emulated nodes on this machine: slurmctld, one slurmd per node, munged (Debian's slurm-wlm).

    with SlurmCluster(nodes=2) as cluster:          # as root, with slurm-wlm and munge installed
        print(cluster.client("sinfo"))              # node[0-1] idle
        job = cluster.submit(script_text)           # sbatch; the job runs across node0 and node1
        cluster.wait(job); print(cluster.job(job)["JobState"])

    python -m labsrc.nodes.slurm_cluster             # (make slurm-cluster) start one and say how to use it

Each node is an emulated node (labsrc.nodes.network: its own network namespace, eth0 at 198.18.0.(i+1))
with its own host name (node0, node1; a UTS namespace); `head` (198.18.0.(nodes+1)) runs slurmctld and is where
clients (sinfo, sbatch, scontrol) run. Config, keys, sockets, spool, state and logs live in one temporary
folder; the names resolve through a hosts file bind-mounted over /etc/hosts inside the cluster's own mount
namespace only. One holder (labsrc.nodes.slurm_holder) is PID 1 of the cluster's PID namespace: every process of
the cluster dies with it, and it dies with this process. A crashed run's folder is removed at the next start.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from labsrc.core.paths import python_path
from labsrc.core.world import RequestError
from labsrc.nodes.network_holder import node_address, read_answer
from labsrc.nodes.slurm_holder import HEAD, HOLDER_MODULE, READY_TIMEOUT_S, node_name

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "sinfo", "srun")
FOLDER_PREFIX = "labsrc-slurm-"
OWNER_FILE = "owner.json"
SWITCH_ENV = "LABSRC_SLURM"  # "off": behave as if Slurm were unavailable
CONFIG = """\
# Written by labsrc.nodes.slurm_cluster for an emulated cluster; everything lives under {d}
ClusterName=labsrc
SlurmctldHost={head}({head_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
PlugStackConfig={d}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={d}/jobcomp.txt
JobRequeue=0
ReturnToService=2
SlurmdTimeout={slurmd_timeout}
SlurmctldTimeout=30
MessageTimeout=5
KillWait=5
InactiveLimit=0
MinJobAge=600
NodeName=DEFAULT CPUs={cpus} State=UNKNOWN
{node_lines}
PartitionName=emulated Nodes=ALL Default=YES MaxTime=60 State=UP
"""
CGROUP_CONFIG = "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nCgroupAutomount=no\n"


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str


def availability() -> Availability:
    """Whether a Slurm cluster of emulated nodes can start here, or why not and what would enable it."""
    if os.environ.get(SWITCH_ENV, "").strip().lower() == "off":
        return Availability(False, f"{SWITCH_ENV}=off is set: unset it to use the emulated Slurm cluster.")
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return Availability(False, "the emulated Slurm cluster needs Linux and root (slurmd and munged run as "
                                   "root, in namespaces): run it in a Linux container or VM as root.")
    missing = [tool for tool in DAEMONS if shutil.which(tool) is None]
    if missing:
        return Availability(False, f"{', '.join(missing)} not found: install Debian's packages as root "
                                   f"(apt-get install -y slurm-wlm munge), or run `make test-slurm`.")
    from labsrc.nodes.network import availability as nodes_availability
    found = nodes_availability()
    if not found.ok or found.how != "root":
        return Availability(False, f"emulated nodes (as root) are needed: {found.reason}")
    return Availability(True, "slurm-wlm and munge are installed, and emulated nodes work as root")


def write_config(folder: Path, nodes: int, slurmd_timeout: int) -> None:
    """slurm.conf, cgroup.conf, the hosts file, a fresh munge key, and the folders Slurm writes to."""
    for sub in ("state", "spool", "log", "munge", "munge-key", "jobs"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)  # munged wants its socket's folders searchable by everyone
    (folder / "munge").chmod(0o755)
    (folder / "munge-key").chmod(0o700)
    key = folder / "munge-key" / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    lines = [f"NodeName={node_name(i)} NodeAddr={node_address(i)} NodeHostname={node_name(i)}" for i in range(nodes)]
    (folder / "slurm.conf").write_text(CONFIG.format(
        d=folder, head=HEAD, head_addr=node_address(nodes), slurmd_timeout=slurmd_timeout,
        cpus=os.cpu_count() or 1, node_lines="\n".join(lines)))
    (folder / "cgroup.conf").write_text(CGROUP_CONFIG)
    (folder / "plugstack.conf").write_text("")
    hosts = ["127.0.0.1 localhost", f"{node_address(nodes)} {HEAD}"]
    hosts += [f"{node_address(i)} {node_name(i)}" for i in range(nodes)]
    (folder / "hosts").write_text("\n".join(hosts) + "\n")


def remove_stale_folders() -> int:
    """Remove the folders of clusters whose launcher is gone (its processes died with it); returns how many."""
    import psutil
    removed = 0
    for folder in Path(tempfile.gettempdir()).glob(FOLDER_PREFIX + "*"):
        try:
            owner = json.loads((folder / OWNER_FILE).read_text())
            alive = psutil.Process(owner["pid"]).create_time() == owner["created"]
        except psutil.Error:
            alive = False
        except (OSError, ValueError, KeyError):
            alive = time.time() - folder.stat().st_mtime < 60  # being set up right now, or unreadable and old
        if not alive:
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    return removed


def stop_others(starter: str) -> int:
    """SIGTERM each live `python -m <starter>` that started a cluster (make slurm-cluster runs
    labsrc.lessons.elastic_fault_tolerance.membership_slurm); the cluster ends with it."""
    import psutil
    stopped = 0
    for folder in Path(tempfile.gettempdir()).glob(FOLDER_PREFIX + "*"):
        try:
            owner = json.loads((folder / OWNER_FILE).read_text())
            proc = psutil.Process(owner["pid"])
            if proc.create_time() == owner["created"] and starter in proc.cmdline():
                proc.terminate()
                stopped += 1
        except (OSError, ValueError, KeyError, psutil.Error):
            continue
    return stopped


class SlurmCluster:
    """A running emulated Slurm cluster of `nodes` nodes; `stop()` (or leaving the with-block) ends all of it."""

    def __init__(self, nodes: int = 2, slurmd_timeout: int = 10):
        import psutil
        from labsrc.core.processes import die_with_parent
        found = availability()
        if not found.ok:
            raise RequestError(f"the emulated Slurm cluster is not available here: {found.reason}")
        if not 1 <= nodes <= 8:
            raise RequestError(f"nodes must be 1..8 (got {nodes}).")
        remove_stale_folders()
        self.nodes = nodes
        self.folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
        me = psutil.Process()
        (self.folder / OWNER_FILE).write_text(json.dumps({"pid": me.pid, "created": me.create_time()}))
        write_config(self.folder, nodes, slurmd_timeout)
        env = dict(os.environ, PYTHONPATH=python_path())
        self.holder = subprocess.Popen(
            ["unshare", "--pid", "--kill-child", "--mount-proc", "--", sys.executable, "-m", HOLDER_MODULE,
             "--dir", str(self.folder), "--nodes", str(nodes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True, preexec_fn=die_with_parent)
        ready = self._answer(READY_TIMEOUT_S + 30)
        if "error" in ready:
            logs = self._log_tails()  # read before stop() removes the folder
            self.stop()
            raise RequestError(f"the emulated Slurm cluster did not start: {ready['error']}{logs}")
        self.head_pid = self._host_pid(ready["head"])

    def _log_tails(self, lines: int = 8) -> str:
        """The last lines of each daemon's log, for an error raised after the folder is gone."""
        tails = []
        for log in sorted((self.folder / "log").glob("*.log")):
            text = log.read_text(errors="replace").strip().splitlines()[-lines:]
            tails.append(f"\n--- {log.name}:\n" + "\n".join(text))
        return "".join(tails)

    def _answer(self, timeout: float) -> dict:
        return read_answer(self.holder, timeout, "Slurm holder")

    def _host_pid(self, namespace_pid: int) -> int:
        """This machine's pid of a process the holder knows by its pid inside the cluster's PID namespace."""
        import psutil
        for proc in psutil.Process(self.holder.pid).children(recursive=True):
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
            except OSError:
                continue
            ids = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            if len(ids) >= 2 and int(ids[-1]) == namespace_pid:
                return proc.pid
        raise RequestError(f"no process {namespace_pid} in the cluster's namespace (did the holder die?)")

    def command(self, *args: str) -> list[str]:
        """`args` as a command run on the head node (its network and mount namespace), with this cluster's config."""
        return ["nsenter", "-t", str(self.head_pid), "--net", "--mount", f"--wd={os.getcwd()}", "--",
                "env", f"SLURM_CONF={self.folder / 'slurm.conf'}", *args]

    def client(self, *args: str, timeout: float = 30, check: bool = True) -> str:
        """Run a Slurm client (sinfo, scontrol, ...) on the head node; its output, or RequestError if it fails."""
        done = subprocess.run(self.command(*args), capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RequestError(f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def submit(self, script: str, *sbatch_args: str, env: dict | None = None) -> int:
        """sbatch `script` (its text) from the cluster's jobs/ folder; the job id."""
        path = self.folder / "jobs" / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        exports = ",".join(["ALL", *(f"{k}={v}" for k, v in (env or {}).items())])
        out = self.client("sbatch", "--parsable", f"--chdir={self.folder / 'jobs'}", f"--export={exports}",
                          *sbatch_args, str(path))
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList, Reason, ...)."""
        text = self.client("scontrol", "show", "job", "--oneliner", str(job_id))
        return dict(word.split("=", 1) for word in text.split() if "=" in word)

    def wait(self, job_id: int, timeout: float) -> dict:
        """The job once it has ended (any state but PENDING, RUNNING, CONFIGURING, COMPLETING), or RequestError."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"):
                return info
            if time.monotonic() > deadline:
                self.client("scancel", str(job_id), check=False)
                raise RequestError(f"job {job_id} still {info.get('JobState')} after {timeout:g} s: cancelled.")
            time.sleep(0.5)

    def completion(self, job_id: int) -> dict:
        """The job's line in the job completion log (jobcomp/filetxt: JobState, ExitCode, DerivedExitCode, ...)."""
        path = self.folder / "jobcomp.txt"
        for line in (path.read_text().splitlines() if path.exists() else []):
            fields = dict(word.split("=", 1) for word in line.split() if "=" in word)
            if fields.get("JobId") == str(job_id):
                return fields
        return {}

    def output(self, job_id: int) -> str:
        """What the job's batch script printed (its --output file)."""
        path = self.job(job_id).get("StdOut", "")
        return Path(path).read_text(errors="replace") if path and Path(path).exists() else ""

    def _link(self, action: str, node: int) -> None:
        if not 0 <= node < self.nodes:
            raise RequestError(f"node must be 0..{self.nodes - 1} (got {node}).")
        self.holder.stdin.write(f"{action} {node}\n")
        self.holder.stdin.flush()
        answer = self._answer(10.0)
        if "error" in answer:
            raise RequestError(f"could not {action} node {node}'s link: {answer['error']}")

    def cut(self, node: int) -> None:
        """Take node `node`'s link down: slurmctld, srun and the other ranks lose it, its processes run on."""
        self._link("cut", node)

    def restore(self, node: int) -> None:
        self._link("restore", node)

    def processes(self, job_id: int, node: int) -> list:
        """The job's live processes on node `node` (psutil.Process, found by SLURM_JOB_ID and SLURM_NODEID)."""
        import psutil
        found = []
        for proc in psutil.Process(self.holder.pid).children(recursive=True):
            try:
                env = proc.environ()
            except (psutil.Error, OSError):
                continue
            if env.get("SLURM_JOB_ID") == str(job_id) and env.get("SLURM_NODEID") == str(node):
                found.append(proc)
        return found

    def stop(self) -> None:
        """End the holder (every process of the cluster dies with it) and remove the folder."""
        if self.holder.poll() is None:
            try:
                self.holder.stdin.write("end\n")
                self.holder.stdin.close()
                self.holder.wait(10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.holder.kill()
                self.holder.wait()
        for stream in (self.holder.stdout, self.holder.stdin):
            try:
                stream.close()
            except (OSError, ValueError):
                pass
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "SlurmCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
