"""Multi-node launching for real: per-node torchrun commands and a Slurm script, rendered from cluster/ templates.

    job = ClusterJob(nodes=2, gpus_per_node=8, endpoint_host="node01")
    print(render_node_command(job, node_rank=1))     # what to run on the second machine
    print(render_sbatch(job))                         # sbatch this; srun starts one torchrun per node
"""
from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass
from string import Template

from labsrc.core.paths import REPO
from labsrc.core.world import RequestError

TEMPLATES = REPO / "cluster"
IP_INTERFACE_PREFIXES = ("eth", "en", "ib", "lo", "bond")  # `ip addr` names; InfiniBand adapters are mlx5_0, ...
PLACEHOLDER = re.compile(r"\$(?!\$)\{?[a-z_]+\}?")  # a $name the template did not fill (shell $VARS are upper case)


@dataclass(frozen=True)
class ClusterJob:
    """One training job over several machines."""

    nodes: int = 2
    """Machines in the job."""
    min_nodes: int = 0
    """Fewest machines to keep going with (0: as many as nodes, no elasticity)."""
    gpus_per_node: int = 8
    """Ranks per machine, one per GPU."""
    endpoint_host: str = "node01"
    """The machine that serves the c10d rendezvous store (per-node commands; Slurm picks its first host)."""
    port: int = 29500
    """The rendezvous port on that machine: open to the other nodes, closed to everyone else."""
    socket_ifname: str = "eth0"
    """NCCL_SOCKET_IFNAME: the IP interface (prefix) for NCCL's bootstrap and socket traffic: eth0, or ib0 (IP over IB)."""
    ib_hca: str = "mlx5"
    """NCCL_IB_HCA: the InfiniBand adapters NCCL's IB transport may use (prefix match: mlx5 is every mlx5_N)."""
    max_restarts: int = 3
    """torchrun --max-restarts: how many times a failed group is restarted."""
    module: str = "labsrc.lessons.elastic_fault_tolerance.lab"
    """The python module every rank runs."""
    lab_args: tuple[str, ...] = ("--epochs", "3")
    job_name: str = "elastic-lab"
    run_id: str = "elastic-lab-1"
    """--rdzv-id for hand-started nodes (Slurm uses its job id): the same on every node of one job."""
    time_limit: str = "00:30:00"
    cpus_per_task: int = 32
    kill_on_bad_exit: bool | None = None
    """srun --kill-on-bad-exit: one task (one node's agent) failing ends the whole step. None: on for a fixed-size
    job, off for an elastic one (min_nodes < nodes), whose surviving nodes must run on; True on an elastic job
    defeats it (tests/test_slurm_cluster.py shows the survivor killed)."""
    no_kill: bool | None = None
    """sbatch and srun --no-kill: keep the job and its step when a node of the allocation fails (by default Slurm
    ends the whole job, NODE_FAIL). None: on for an elastic job."""
    torchrun_args: tuple[str, ...] = ()
    """Extra torchrun flags (the sbatch script), e.g. ("--monitor-interval=0.1", "--rdzv-conf=last_call_timeout=3")."""

    def check(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or not 0 <= self.min_nodes <= self.nodes:
            raise RequestError(f"need nodes >= 1, gpus_per_node >= 1 and 0 <= min_nodes <= nodes (got {self}).")
        if not 1024 <= self.port <= 65535:
            raise RequestError(f"port must be 1024-65535 (got {self.port}).")
        if self.socket_ifname.lstrip("=^").startswith("mlx"):
            raise RequestError(f"socket_ifname={self.socket_ifname} is an InfiniBand adapter, not an IP interface: "
                               f"NCCL_SOCKET_IFNAME takes what `ip addr` lists (eth0, ens1, or ib0 for IP over "
                               f"InfiniBand); put the adapter in ib_hca (NCCL_IB_HCA).")
        if self.ib_hca and self.ib_hca.lstrip("=^").startswith(IP_INTERFACE_PREFIXES):
            raise RequestError(f"ib_hca={self.ib_hca} is an IP interface, not an InfiniBand adapter: NCCL_IB_HCA "
                               f"takes what `ibv_devinfo` lists (mlx5_0, or the prefix mlx5); put the IP "
                               f"interface in socket_ifname (NCCL_SOCKET_IFNAME).")

    @property
    def elastic(self) -> bool:
        return self.min_nodes not in (0, self.nodes)

    @property
    def nnodes_spec(self) -> str:
        return str(self.nodes) if self.min_nodes in (0, self.nodes) else f"{self.min_nodes}:{self.nodes}"


def _values(job: ClusterJob) -> dict:
    job.check()
    values = {k: str(v) for k, v in asdict(job).items()}
    values.update(nnodes_spec=job.nnodes_spec, lab_args=shlex.join(job.lab_args),
                  omp_threads=str(max(1, job.cpus_per_task // job.gpus_per_node)),
                  endpoint=f"{job.endpoint_host}:{job.port}")
    return values


def render(template: str, values: dict) -> str:
    """The template with every $name filled; RequestError naming any left (a name the template needs)."""
    text = Template((TEMPLATES / template).read_text()).substitute(values)
    left = [m for m in PLACEHOLDER.findall(text)]
    if left:
        raise RequestError(f"{template}: placeholders left unfilled: {left}")
    return text


def render_node_command(job: ClusterJob, node_rank: int, local_addr: str | None = None) -> str:
    """The shell script to run on machine `node_rank` (0 is the endpoint host)."""
    if not 0 <= node_rank < job.nodes:
        raise RequestError(f"node_rank must be 0..{job.nodes - 1} (got {node_rank}).")
    address = shlex.quote(local_addr) if local_addr else '"$(hostname)"'  # the name the other nodes reach it by
    return render("node_commands.sh.template", {**_values(job), "node_rank": str(node_rank),
                                                "local_addr": address})


NCCL_EXPORTS = ("export NCCL_SOCKET_IFNAME={ifname}   # IP interface for NCCL's bootstrap and socket traffic "
                "(ib0 = IP over IB)\nexport NCCL_IB_HCA={hca}                 # InfiniBand adapters NCCL's IB "
                "transport may use\n")
GLOO_EXPORTS = "export GLOO_SOCKET_IFNAME={ifname}   # IP interface gloo's sockets use (an exact name, the same on every node)\n"


def kill_on_bad_exit(job: ClusterJob) -> bool:
    """srun --kill-on-bad-exit for `job`: its own setting, else on for a fixed-size job and off for an elastic one."""
    return not job.elastic if job.kill_on_bad_exit is None else job.kill_on_bad_exit


def no_kill(job: ClusterJob) -> bool:
    """--no-kill for `job` (sbatch and srun): its own setting, else on for an elastic job only. Both are needed:
    sbatch's keeps the allocation, and it does not reach the steps (it sets no SLURM_NO_KILL; `man sbatch`), so a
    step on a failed node is still killed unless srun asks for --no-kill itself."""
    return job.elastic if job.no_kill is None else job.no_kill


def render_sbatch(job: ClusterJob, gpus: bool = True) -> str:
    """The Slurm batch script: one task per node, torchrun in each, rendezvous on the first allocated host.

    gpus=False: the CPU variant for a cluster without GPUs (no --gpus-per-node, which such a cluster refuses;
    gloo's GLOO_SOCKET_IFNAME instead of NCCL's variables); gpus_per_node is then the ranks per node.
    """
    values = _values(job)
    values.update(gpus_directive=f"#SBATCH --gpus-per-node={job.gpus_per_node}\n" if gpus else "",
                  interface_exports=(NCCL_EXPORTS.format(ifname=job.socket_ifname, hca=job.ib_hca) if gpus
                                     else GLOO_EXPORTS.format(ifname=job.socket_ifname)),
                  kill_on_bad_exit=str(int(kill_on_bad_exit(job))),
                  no_kill_directive="#SBATCH --no-kill\n" if no_kill(job) else "",
                  srun_no_kill=" --no-kill" if no_kill(job) else "",
                  torchrun_args="".join(f" {shlex.quote(arg)}" for arg in job.torchrun_args))
    return render("sbatch_torchrun.sh.template", values)


def rendezvous_demo(port: int, run_id: str = "demo") -> dict:
    """torch's real rendezvous API on one node: parameters -> handler -> next_rendezvous(); the handler closed after.

    The c10d store binds 127.0.0.1:port for the second it takes.
    """
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id=run_id, min_nodes=1,
                                  max_nodes=1, local_addr="127.0.0.1", join_timeout=20, last_call_timeout=1)
    handler = rendezvous_handler_registry.create_handler(params)
    try:
        info = handler.next_rendezvous()
        return {"handler": type(handler).__name__, "backend": handler.get_backend(), "rank": info.rank,
                "world_size": info.world_size, "store": type(info.store).__name__,
                "master": f"{info.bootstrap_store_info.master_addr}:{info.bootstrap_store_info.master_port}",
                "has_get_config": hasattr(handler, "get_config")}
    finally:
        handler.set_closed()
        handler.shutdown()
