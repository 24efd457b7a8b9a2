"""Lesson 10b on a real Slurm cluster of emulated nodes: the course's sbatch script, submitted, run and broken.

    with SlurmCluster() as cluster:                                   # labsrc.nodes.slurm_cluster
        ok = run_job(cluster, "none")                                 # the elastic lab across node0 and node1
        lost = run_job(cluster, "kill_agent", kill_on_bad_exit=False) # node1's torchrun agent SIGKILLed mid-run
    python -m labsrc.lessons.elastic_fault_tolerance.membership_slurm   # make slurm-cluster: start one, print its use

The job is render_sbatch(job, gpus=False) of cluster/sbatch_torchrun.sh.template: one srun task per node, each a
torchrun agent with --nnodes=1:2, the c10d rendezvous on the first node (node0, which also hosts the store: the
faults hit node1, since losing the store's node ends the job however elastic it is).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from labsrc.core import runs
from labsrc.core.paths import python_path
from labsrc.core.world import RequestError
from labsrc.launch import ELASTIC_RDZV_CONF
from labsrc.lessons.elastic_fault_tolerance.cluster import ClusterJob, render_sbatch
from labsrc.lessons.elastic_fault_tolerance.lab import Finished, Resume, TrainStep
from labsrc.nodes.slurm_cluster import SlurmCluster

FAULTS = ("none", "kill_agent", "cut_link")
LOST_NODE = 1
STEPS_BEFORE_FAULT = 3  # rank 0's steps at world size 2 before the fault: the job is surely training on both nodes


def emulated_job(kill_on_bad_exit: bool = True, step_sleep_s: float = 0.5, no_kill: bool = False) -> ClusterJob:
    """The elastic lab on the emulated cluster: 2 nodes of one rank each, elastic down to one, fast timeouts.

    kill_on_bad_exit and no_kill are set explicitly (render_sbatch's defaults for an elastic job are off and on):
    the tests record what Slurm does with each choice."""
    return ClusterJob(nodes=2, min_nodes=1, gpus_per_node=1, cpus_per_task=1, port=29400, time_limit="00:05:00",
                      socket_ifname="eth0", kill_on_bad_exit=kill_on_bad_exit, no_kill=no_kill, max_restarts=3,
                      lab_args=("--epochs", "3", "--no-reference", "--step-sleep-s", str(step_sleep_s),
                                "--pg-timeout-s", "10"),
                      torchrun_args=("--monitor-interval=0.1", f"--rdzv-conf={ELASTIC_RDZV_CONF}"))


def job_environment(run_dir: Path) -> dict:
    """What the job needs from the submitter (sbatch --export): this venv's python first on PATH, labsrc, a run dir."""
    return {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            "PYTHONPATH": python_path(),
            runs.RUN_DIR_ENV: str(run_dir)}


@dataclass
class JobOutcome:
    """One submitted job: what Slurm says of it and what the lab's ranks recorded."""

    job_id: int
    fault: str
    kill_on_bad_exit: bool
    state: str
    """scontrol's JobState: COMPLETED, FAILED, NODE_FAIL, ..."""
    exit_code: str
    """ExitCode: the batch script's status:signal (scontrol)."""
    derived_exit_code: str
    """DerivedExitCode: the worst of its steps (the job completion log)."""
    reason: str
    starts: list
    """(world_size, host, restart_count) of every start of rank 0 and rank 1's workers, in order."""
    finished_world: int
    """The world size the lab finished at (0: it did not finish)."""
    seconds: float
    output: str

    @property
    def hosts_at_world_2(self) -> set:
        return {host for world, host, _ in self.starts if world == 2}


def _steps_at_two(run_dir: Path) -> int:
    return sum(1 for r in runs.read_records(run_dir).get(0, []) if r["kind"] == TrainStep.KIND and r["world_size"] == 2)


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RequestError(f"{what}: not seen within {timeout_s:g} s.")
        time.sleep(0.2)


def inject(cluster: SlurmCluster, job_id: int, fault: str) -> None:
    """kill_agent: SIGKILL node1's torchrun agent (its ranks are left to the agent's fate); cut_link: cut node1."""
    if fault == "kill_agent":
        agents = [p for p in cluster.processes(job_id, LOST_NODE) if "torch.distributed.run" in " ".join(p.cmdline())]
        if not agents:
            raise RequestError(f"job {job_id} has no torchrun agent on node{LOST_NODE} to kill.")
        for agent in agents:
            agent.send_signal(signal.SIGKILL)
    elif fault == "cut_link":
        cluster.cut(LOST_NODE)


def run_job(cluster: SlurmCluster, fault: str = "none", kill_on_bad_exit: bool = True,
            timeout_s: float = 180.0, no_kill: bool = False) -> JobOutcome:
    """Submit the elastic lab, inject `fault` on node1 after STEPS_BEFORE_FAULT steps at world 2, wait for the end."""
    if fault not in FAULTS:
        raise RequestError(f"fault must be one of {FAULTS} (got {fault!r}).")
    run_dir = cluster.folder / "jobs" / f"{fault}-kill{int(kill_on_bad_exit)}-{time.monotonic_ns()}"
    started = time.monotonic()
    script = render_sbatch(emulated_job(kill_on_bad_exit, no_kill=no_kill), gpus=False)
    job_id = cluster.submit(script, env=job_environment(run_dir))
    try:
        if fault != "none":
            _wait(lambda: _steps_at_two(run_dir) >= STEPS_BEFORE_FAULT or cluster.job(job_id)["JobState"] not in
                  ("PENDING", "CONFIGURING", "RUNNING"), timeout_s, f"job {job_id} training at world size 2")
            inject(cluster, job_id, fault)
        info = cluster.wait(job_id, timeout_s)
    finally:
        if fault == "cut_link":
            cluster.restore(LOST_NODE)
            _wait(lambda: "idle" in cluster.client("sinfo", "--noheader", "--Node", f"--nodes=node{LOST_NODE}",
                                                   "--format=%T"), 60, f"node{LOST_NODE} back in service")
    records = runs.read_records(run_dir)
    starts = [(r["world_size"], r.get("host", ""), r["restart_count"]) for rank in sorted(records)
              for r in records[rank] if r["kind"] == Resume.KIND]
    finished = [r for r in records.get(0, []) if r["kind"] == Finished.KIND and r["run"] == "final"]
    worlds = [r["world_size"] for r in records.get(0, []) if r["kind"] == Resume.KIND]
    return JobOutcome(job_id=job_id, fault=fault, kill_on_bad_exit=kill_on_bad_exit, state=info.get("JobState", ""),
                      exit_code=info.get("ExitCode", ""), derived_exit_code=cluster.completion(job_id).get("DerivedExitCode", ""),
                      reason=info.get("Reason", ""), starts=starts,
                      finished_world=worlds[-1] if finished and worlds else 0,
                      seconds=time.monotonic() - started, output=cluster.output(job_id))


def write_tools(cluster: SlurmCluster) -> Path:
    """bin/sinfo, bin/sbatch, ...: each runs that client on the head node with this cluster's config and venv."""
    import shlex
    folder = cluster.folder / "bin"
    folder.mkdir(exist_ok=True)
    env = job_environment(cluster.folder / "jobs" / "run")
    for tool in ("sinfo", "squeue", "sbatch", "srun", "scontrol", "scancel"):
        command = ["nsenter", "-t", str(cluster.head_pid), "--net", "--mount"]
        rest = ["--", "env", f"SLURM_CONF={cluster.folder / 'slurm.conf'}", f"PATH={env['PATH']}",
                f"PYTHONPATH={env['PYTHONPATH']}", tool]
        (folder / tool).write_text(f'#!/bin/sh\nexec {shlex.join(command)} --wd="$PWD" {shlex.join(rest)} "$@"\n')
        (folder / tool).chmod(0o755)
    return folder


def main() -> int:
    """make slurm-cluster: start the cluster, write the course's job script, say how to use it, stop on Ctrl-C."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m labsrc.lessons.elastic_fault_tolerance.membership_slurm")
    parser.add_argument("--stop", action="store_true", help="stop the cluster another `make slurm-cluster` started")
    if parser.parse_args().stop:
        from labsrc.nodes.slurm_cluster import stop_others
        print(f"stopped {stop_others(__spec__.name)} emulated Slurm cluster(s)")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with SlurmCluster() as cluster:
        tools = write_tools(cluster)
        script = cluster.folder / "jobs" / "elastic-lab.sh"
        script.write_text(render_sbatch(emulated_job(), gpus=False))
        print(f"A Slurm cluster of emulated nodes is up: node0 (198.18.0.1) and node1 (198.18.0.2), slurmctld on "
              f"head; everything it writes is in {cluster.folder}.\nIn another shell:\n"
              f"  export PATH={tools}:$PATH\n  sinfo\n  srun --nodes=2 hostname\n"
              f"  cd {script.parent} && sbatch {script.name}   # the course's rendered script (CPU variant)\n"
              f"  squeue; scontrol show job JOBID; cat elastic-lab-JOBID.out   # JOBID: what sbatch printed\n"
              f"Stop it: Ctrl-C here, or `make slurm-cluster-stop`.", flush=True)
        try:
            while cluster.holder.poll() is None:
                time.sleep(1)
            print("the cluster's holder ended on its own; see its logs (now removed with the folder).")
        except KeyboardInterrupt:
            print("stopping the cluster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
