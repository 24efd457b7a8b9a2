"""The course's rendered sbatch script on a real Slurm cluster of emulated nodes (labsrc.nodes.slurm_cluster).

Needs root and Debian's slurm-wlm and munge (`make test-slurm` installs them); skips with the reason elsewhere.
One cluster for the module: the elastic lab across node0 and node1, then node1 lost two ways (its torchrun agent
SIGKILLed, its link cut), each with srun --kill-on-bad-exit=1 and =0. About 2 minutes.
"""
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from labsrc.nodes import slurm_cluster

FOUND = slurm_cluster.availability()
pytestmark = pytest.mark.skipif(not FOUND.ok, reason=FOUND.reason)


def _of_a_course_cluster(proc) -> bool:
    """A process the course's cluster started: its command line or SLURM_CONF names a cluster folder, or it is the
    holder. A machine's own munged or slurmd (a systemd service, a real Slurm node) is none of the course's."""
    import psutil
    try:
        text = " ".join(proc.cmdline()) + " " + proc.environ().get("SLURM_CONF", "")
    except (psutil.Error, OSError):
        return False
    return slurm_cluster.FOLDER_PREFIX in text or "labsrc.nodes.slurm_holder" in text


def leftovers() -> list[str]:
    """Processes of a course Slurm cluster still alive, and cluster folders still on disk."""
    import psutil
    names = {"slurmctld", "slurmd", "slurmstepd", "munged", "unshare", "python", "python3"}
    alive = [f"{p.pid} {p.info['name']}" for p in psutil.process_iter(["name"])
             if (p.info["name"] in names or (p.info["name"] or "").startswith("python")) and _of_a_course_cluster(p)]
    return alive + [str(f) for f in Path(tempfile.gettempdir()).glob(slurm_cluster.FOLDER_PREFIX + "*")]


@pytest.fixture(scope="module")
def cluster():
    slurm_cluster.remove_stale_folders()  # a crashed run's folder; its processes died with it
    before = leftovers()
    assert not before, f"a Slurm cluster is already running here (or left behind): {before}"
    with slurm_cluster.SlurmCluster(nodes=2) as running:
        yield running
    assert leftovers() == [], "the cluster left processes or its folder behind"


def test_two_nodes_with_their_own_names_addresses_and_interface(cluster):
    assert cluster.client("sinfo", "--noheader", "--Node", "--format=%N %T").split() == \
        ["node0", "idle", "node1", "idle"]
    lines = cluster.client("srun", "--nodes=2", "--ntasks-per-node=1", "--label", "sh", "-c",
                           "echo $(hostname) $SLURM_NODEID $(ip -4 -o addr show eth0 | awk '{print $4}')")
    seen = sorted(line.split(": ", 1)[1] for line in lines.strip().splitlines())
    assert seen == ["node0 0 198.18.0.1/15", "node1 1 198.18.0.2/15"]
    assert open("/etc/hosts").read().count("198.18.0.") == 0, "the machine's own hosts file is untouched"


def test_the_rendered_script_runs_the_elastic_lab_across_both_nodes(cluster):
    from labsrc.lessons.elastic_fault_tolerance.membership_slurm import run_job
    outcome = run_job(cluster, "none")
    assert (outcome.state, outcome.exit_code) == ("COMPLETED", "0:0"), outcome.output[-3000:]
    assert outcome.hosts_at_world_2 == {"node0", "node1"}, outcome.starts
    assert outcome.finished_world == 2


@pytest.mark.parametrize("kill_on_bad_exit", [True, False], ids=["kill-on-bad-exit", "no-kill-on-bad-exit"])
def test_node1s_agent_killed(cluster, kill_on_bad_exit):
    """srun --kill-on-bad-exit=1 ends node0's agent too: nothing finishes. Without it node0's agent restarts its
    rank alone (--nnodes=1:2) and the lab finishes at world size 1, yet Slurm still calls the job FAILED: srun
    exits with the killed task's status (137 = 128 + SIGKILL), and srun is the script's last command."""
    from labsrc.lessons.elastic_fault_tolerance.membership_slurm import run_job
    outcome = run_job(cluster, "kill_agent", kill_on_bad_exit=kill_on_bad_exit)
    assert outcome.state == "FAILED" and outcome.exit_code == "137:0", (outcome, outcome.output[-3000:])
    assert outcome.hosts_at_world_2 == {"node0", "node1"}
    if kill_on_bad_exit:
        assert outcome.finished_world == 0 and all(world == 2 for world, _, _ in outcome.starts), outcome.starts
    else:
        assert (1, "node0", 1) in outcome.starts, outcome.starts
        assert outcome.finished_world == 1
        assert outcome.derived_exit_code == "0:9", "the worst step ended by signal 9, node1's SIGKILL"


@pytest.mark.parametrize("kill_on_bad_exit", [True, False], ids=["kill-on-bad-exit", "no-kill-on-bad-exit"])
def test_node1s_link_cut(cluster, kill_on_bad_exit):
    """A node that stops answering is Slurm's to judge, not srun's: after SlurmdTimeout slurmctld sets node1 DOWN
    and kills the whole job (NODE_FAIL), with --kill-on-bad-exit or without: srun waits on node1's unreachable task.
    Nothing finishes here only because this cluster's SlurmdTimeout (10 s) is shorter than torchrun's re-forming
    (the gloo timeout, the keep-alive's expiry, the last call): with Slurm's default of 300 s, node0 would go on
    at world size 1 for minutes before NODE_FAIL ended it."""
    from labsrc.lessons.elastic_fault_tolerance.membership_slurm import run_job
    outcome = run_job(cluster, "cut_link", kill_on_bad_exit=kill_on_bad_exit)
    assert (outcome.state, outcome.reason) == ("NODE_FAIL", "NodeDown"), (outcome, outcome.output[-3000:])
    assert outcome.finished_world == 0, "with SlurmdTimeout=10 the job ends before torchrun re-forms (see above)"
    assert outcome.hosts_at_world_2 == {"node0", "node1"}
    assert "node1" in cluster.client("sinfo", "--noheader", "--Node", "--states=idle", "--format=%N"), \
        "node1 is back in service once its link is restored (ReturnToService=2)"


def test_node1s_link_cut_with_no_kill_on_the_job_and_its_step(cluster):
    """What render_sbatch writes for an elastic job: sbatch --no-kill keeps the allocation, srun --no-kill keeps the
    step (sbatch's alone does not reach it: `man sbatch`), --kill-on-bad-exit=0: node0 re-forms alone and finishes,
    and Slurm calls the job COMPLETED."""
    from labsrc.lessons.elastic_fault_tolerance.membership_slurm import run_job
    outcome = run_job(cluster, "cut_link", kill_on_bad_exit=False, no_kill=True, timeout_s=240)
    assert (outcome.state, outcome.exit_code) == ("COMPLETED", "0:0"), (outcome, outcome.output[-3000:])
    assert outcome.hosts_at_world_2 == {"node0", "node1"}
    assert (1, "node0", 1) in outcome.starts and outcome.finished_world == 1, outcome.starts


def test_a_killed_launcher_leaves_nothing_behind():
    """SIGKILL the process that started a cluster: every Slurm process and namespace dies with it; the folder goes
    at the next start."""
    import signal
    import sys
    import time
    code = ("from labsrc.nodes.slurm_cluster import SlurmCluster; import sys, time; c = SlurmCluster(nodes=1); "
            "print(c.folder, flush=True); time.sleep(600)")
    before = set(leftovers())  # the module's cluster, if it is still up
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    folder = Path(proc.stdout.readline().strip())
    assert (folder / "slurm.conf").exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while set(leftovers()) - before - {str(folder)} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(leftovers()) - before == {str(folder)}
    assert folder.exists(), "bookkeeping: the folder outlives a killed launcher"
    assert slurm_cluster.remove_stale_folders() >= 1 and not folder.exists()
