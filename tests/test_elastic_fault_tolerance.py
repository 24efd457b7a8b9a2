"""Lesson 10: snapshots are whole or refused, a resumed run equals an uninterrupted one, restarts and nodes re-form."""
import signal

import pytest
import torch

from labsrc.core.forked import run_ranks
from labsrc.core.world import RequestError
from labsrc.lessons.elastic_fault_tolerance import analysis, resume as eft
from labsrc.lessons.elastic_fault_tolerance.lab import Options, Resume
from labsrc.lessons.elastic_fault_tolerance.snapshot import (SnapshotCorrupt, crash_mid_write, load_checked,
                                                             save_atomic, temp_path)


def test_a_crash_mid_write_leaves_the_previous_snapshot_in_place(tmp_path):
    path = tmp_path / "snapshot.pt"
    save_atomic({"step": 4, "weights": torch.arange(6.0)}, path)
    status = crash_mid_write(save_atomic, {"step": 6, "weights": torch.arange(6.0) * 2}, path)
    assert status == -signal.SIGKILL
    torn = temp_path(path)
    assert torn.exists() and 0 < torn.stat().st_size < path.stat().st_size
    state = load_checked(path)
    assert state["step"] == 4 and torch.equal(state["weights"], torch.arange(6.0))
    with pytest.raises(SnapshotCorrupt, match="cut short"):
        load_checked(torn)


def test_a_torn_or_changed_file_at_the_final_path_is_refused(tmp_path):
    path = tmp_path / "snapshot.pt"
    save_atomic({"step": 3, "weights": torch.ones(100)}, path)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SnapshotCorrupt, match="cut short"):
        load_checked(path)
    changed = bytearray(whole)
    changed[len(changed) // 3] ^= 0xFF
    path.write_bytes(bytes(changed))
    with pytest.raises(SnapshotCorrupt, match="SHA-256"):
        load_checked(path)


def test_rng_state_round_trips_through_a_weights_only_snapshot(tmp_path):
    eft.seed_everything(5)
    save_atomic({"rng": [eft.capture_rng()]}, tmp_path / "rng.pt")
    expected = (torch.rand(3), eft.random.random(), eft.numpy.random.rand())
    eft.seed_everything(99)
    eft.restore_rng(load_checked(tmp_path / "rng.pt")["rng"][0])
    again = (torch.rand(3), eft.random.random(), eft.numpy.random.rand())
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]


def resume_against_reference(ctx, folder, leave_out):
    """On each rank: the uninterrupted run, then one stopped after 7 steps and resumed from step 6's snapshot."""
    setup = eft.Setup()
    reference = eft.Training.build(ctx, setup)
    while reference.steps_done < setup.total_steps:
        reference.step()
    path = folder / "snapshot.pt"
    crashed = eft.Training.build(ctx, setup)
    kept = []
    for _ in range(7):
        epoch, ids, _ = crashed.step()
        kept += [(epoch, i) for i in ids] if crashed.steps_done <= 6 else []
        if crashed.steps_done == 6:
            eft.save_snapshot(crashed, path, leave_out=leave_out)
    torch.distributed.barrier()
    resumed = eft.Training.build(ctx, setup)  # re-seeded, as a fresh process is
    eft.load_snapshot(resumed, path)
    while resumed.steps_done < setup.total_steps:
        epoch, ids, _ = resumed.step()
        kept += [(epoch, i) for i in ids]
    return eft.parameters_equal(reference.parameters(), resumed.parameters()), kept


def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path):
    verdicts = run_ranks(resume_against_reference, 2, (tmp_path, ()))
    assert [equal for equal, _ in verdicts] == [True, True]
    used = sorted(pair for _, kept in verdicts for pair in kept)
    setup = eft.Setup()
    assert used == sorted((epoch, i) for epoch in range(setup.epochs) for i in range(setup.samples)), \
        "a sample was lost or repeated across the crash"


@pytest.mark.parametrize("part", ["rng", "sampler", "scheduler"])
def test_leaving_a_part_out_of_the_snapshot_changes_the_result(tmp_path, part):
    verdicts = run_ranks(resume_against_reference, 2, (tmp_path, (part,)))
    assert [equal for equal, _ in verdicts] == [False, False], f"without {part} the run still matched"


def test_fingerprints_name_the_part_a_snapshot_left_out(tmp_path):
    from labsrc.core.world import RankContext
    ctx = RankContext(0, 0, 1, torch.device("cpu"), "gloo")
    run = eft.Training.build(ctx, eft.Setup())
    for _ in range(6):
        run.step()
    expected, rng = eft.part_fingerprints(run), eft.capture_rng()
    assert eft.part_fingerprints(run) == expected, "capturing the fingerprints changed the state"
    differing = {}
    for part in ("", "scheduler", "sampler", "rng", "optimizer"):
        eft.restore_rng(rng)  # the RNG is the process's: the previous resume re-seeded it
        eft.save_snapshot(run, tmp_path / "s.pt", leave_out=(part,) if part else ())
        resumed = eft.Training.build(ctx, eft.Setup())
        eft.load_snapshot(resumed, tmp_path / "s.pt")
        found = eft.part_fingerprints(resumed)
        differing[part] = [name for name in expected if found[name] != expected[name]]
    assert differing == {"": [], "scheduler": ["scheduler"], "sampler": ["sampler"], "rng": ["rng"],
                         "optimizer": ["optimizer"]}, differing


def test_a_torn_snapshot_stops_the_resume_instead_of_loading(tmp_path):
    from labsrc.core.world import RankContext
    ctx = RankContext(0, 0, 1, torch.device("cpu"), "gloo")
    run = eft.Training.build(ctx, eft.Setup())
    run.step()
    path = tmp_path / "snapshot.pt"
    eft.save_snapshot(run, path, write=lambda state, target: target.write_bytes(b"half a snapshot"))
    with pytest.raises(SnapshotCorrupt, match="cut short"):
        eft.load_snapshot(eft.Training.build(ctx, eft.Setup()), path)


@pytest.mark.parametrize("values, message", [
    ({"failures": ("explode",)}, "unknown"),
    ({"snapshot_every": 0}, "snapshot_every"),
    ({"failures": ("hang",) * 20}, "raise epochs"),
])
def test_impossible_options_are_refused_with_advice(values, message):
    with pytest.raises(RequestError, match=message):
        Options.make(**values)


# -- multi-node commands and Slurm -------------------------------------------------------------------------

@pytest.mark.parametrize("render", ["sbatch", "node0", "node1"])
def test_rendered_cluster_scripts_are_valid_bash_with_every_value_filled(tmp_path, render):
    import subprocess
    from labsrc.lessons.elastic_fault_tolerance.cluster import ClusterJob, render_node_command, render_sbatch
    job = ClusterJob(nodes=2, min_nodes=1, gpus_per_node=4, endpoint_host="gpu-a01", port=29611,
                     socket_ifname="eno1", ib_hca="mlx5_0,mlx5_1", lab_args=("--epochs", "5"))
    text = render_sbatch(job) if render == "sbatch" else render_node_command(job, int(render[-1]))
    script = tmp_path / "job.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, text
    for expected in ("--nnodes=1:2", "--nproc-per-node=4", "NCCL_SOCKET_IFNAME=eno1", "NCCL_IB_HCA=mlx5_0,mlx5_1",
                     "--rdzv-backend=c10d", "--epochs 5", "--max-restarts=3"):
        assert expected in text, expected
    assert "29611" in text and "$job_name" not in text and "$port" not in text
    if render == "sbatch":
        assert "scontrol show hostnames" in text and "--ntasks-per-node=1" in text and "#SBATCH --nodes=2" in text
    else:
        assert "--rdzv-endpoint=gpu-a01:29611" in text


def test_the_cpu_variant_asks_for_no_gpus_and_names_gloos_interface(tmp_path):
    """render_sbatch(job, gpus=False): a cluster without GPUs refuses --gpus-per-node; gloo reads GLOO_SOCKET_IFNAME.
    The GPU variant keeps both NCCL variables and the GPU request (tests/test_slurm_cluster.py runs the CPU one)."""
    import subprocess
    from labsrc.lessons.elastic_fault_tolerance.cluster import ClusterJob, render_sbatch
    job = ClusterJob(nodes=2, min_nodes=1, gpus_per_node=1, cpus_per_task=1, kill_on_bad_exit=False,
                     torchrun_args=("--monitor-interval=0.1",))
    cpu, gpu = render_sbatch(job, gpus=False), render_sbatch(job)
    script = tmp_path / "job.sh"
    script.write_text(cpu)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, cpu
    assert "#SBATCH --gpus-per-node" not in cpu and "export NCCL_" not in cpu and "export GLOO_SOCKET_IFNAME=eth0" in cpu
    assert "#SBATCH --gpus-per-node=1\n" in gpu and "NCCL_SOCKET_IFNAME=eth0" in gpu and "GLOO_" not in gpu
    assert "--kill-on-bad-exit=0" in cpu and "--kill-on-bad-exit=1" in render_sbatch(ClusterJob())
    assert "--max-restarts=3 --monitor-interval=0.1 \\\n" in cpu


def test_an_elastic_slurm_job_keeps_its_surviving_nodes():
    """Elastic (min_nodes < nodes): no srun --kill-on-bad-exit=1 (it would end the survivors), --no-kill on sbatch
    (Slurm would end the job on a lost node) and on srun (the step would die with its lost node); a fixed-size job
    keeps Slurm's fail-fast defaults."""
    from labsrc.lessons.elastic_fault_tolerance.cluster import ClusterJob, render_sbatch
    elastic, fixed = render_sbatch(ClusterJob(nodes=4, min_nodes=2)), render_sbatch(ClusterJob(nodes=4))
    assert "--kill-on-bad-exit=0 --no-kill \\\n" in elastic and "#SBATCH --no-kill\n" in elastic and "--nnodes=2:4" in elastic
    assert "srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\\n" in fixed and "#SBATCH --no-kill" not in fixed


def test_the_store_setting_the_demos_need_is_in_every_template_and_pinned_to_the_torch_it_was_checked_on():
    """The launcher runs restarts and nodes with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (without it torch 2.14.1's
    rejoining node timed out waiting for role_info): the cluster scripts must set it too, torch must still read
    it, and a torch outside the checked versions fails here until the 10b run is tried again without it."""
    import os
    from unittest import mock
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    from labsrc.launch.command import OWN_STORE_ENV, OWN_STORE_TORCH, child_environment
    from labsrc.lessons.elastic_fault_tolerance.cluster import ClusterJob, render_node_command, render_sbatch
    job = ClusterJob(nodes=2, min_nodes=1)
    for text in (render_sbatch(job), render_sbatch(job, gpus=False), render_node_command(job, 1)):
        assert f"export {OWN_STORE_ENV}=1" in text
    env = child_environment(2, __import__("pathlib").Path("/tmp"), "x", None, None, True, None)
    assert env[OWN_STORE_ENV] == "1"
    with mock.patch.dict(os.environ, {OWN_STORE_ENV: "1"}):
        assert DynamicRendezvousHandler.use_agent_store.fget(None) is False, "torch no longer reads the opt-out"
    with mock.patch.dict(os.environ, {OWN_STORE_ENV: "0"}):
        assert DynamicRendezvousHandler.use_agent_store.fget(None) is True
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    assert OWN_STORE_TORCH[0] <= version <= OWN_STORE_TORCH[1], \
        f"torch {torch.__version__} is outside {OWN_STORE_TORCH}: run 10b's membership demo without {OWN_STORE_ENV} " \
        f"(launch.start(..., env={{'{OWN_STORE_ENV}': '0'}})) and update OWN_STORE_TORCH and the lessons"


@pytest.mark.parametrize("values, message", [
    ({"socket_ifname": "mlx5_0"}, "not an IP interface"),
    ({"ib_hca": "ib0"}, "not an InfiniBand adapter"),
    ({"ib_hca": "eth0"}, "not an InfiniBand adapter"),
])
def test_an_adapter_and_an_interface_swapped_are_refused_with_the_fix(values, message):
    from labsrc.lessons.elastic_fault_tolerance.cluster import ClusterJob, render_sbatch
    with pytest.raises(RequestError, match=message):
        render_sbatch(ClusterJob(**values))


def test_ip_over_infiniband_is_a_valid_socket_interface():
    from labsrc.lessons.elastic_fault_tolerance.cluster import ClusterJob, render_sbatch
    assert "NCCL_SOCKET_IFNAME=ib0" in render_sbatch(ClusterJob(socket_ifname="ib0", ib_hca="mlx5"))


def test_the_real_rendezvous_api_forms_a_group_of_one():
    from labsrc.launch import free_port
    from labsrc.lessons.elastic_fault_tolerance.cluster import rendezvous_demo
    info = rendezvous_demo(free_port())
    assert (info["handler"], info["backend"], info["rank"], info["world_size"]) == \
        ("DynamicRendezvousHandler", "c10d", 0, 1)
    assert info["has_get_config"] is False


# -- through the launcher: restarts and elastic nodes ------------------------------------------------------

@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LABSRC_RUNS", str(tmp_path / "runs"))
    return tmp_path / "runs"


@pytest.mark.slow
def test_three_failures_three_restarts_and_the_end_equals_the_uninterrupted_run(runs_dir):
    from labsrc import launch
    result = launch.run("elastic_fault_tolerance", nproc=2, timeout=240, max_restarts=3, pg_timeout_s=5,
                        failures=("exception", "kill", "hang"), echo=False)
    assert launch.processes_of_run(result.run_dir.name, None) == []
    assert result.attempts == 4
    reference = load_checked(result.run_dir / "reference.pt")
    assert eft.parameters_equal(reference, load_checked(result.run_dir / "final.pt"))
    report = analysis.lost_and_repeated(analysis.sample_counts(analysis.kept_steps(result)), 48, 3)
    assert all(not e["lost"] and not e["repeated"] for e in report.values()), report
    costs = analysis.restart_costs(result)
    assert [c.failure for c in costs] == ["exception", "kill", "hang"]
    assert all(c.steps_replayed >= 0 and c.time_lost_s > 0 for c in costs)
    assert [r.snapshot for r in result.of(Resume)] == ["loaded", "loaded"]
    checks = analysis.resume_checks(result)
    assert len(checks) == 6 and all(not c.differing for c in checks), checks


@pytest.mark.slow
def test_an_elastic_run_shrinks_when_a_node_is_lost_and_grows_when_it_returns(runs_dir):
    from labsrc import launch
    from labsrc.lessons.elastic_fault_tolerance.membership import shrink_then_grow
    started = launch.start("elastic_fault_tolerance", nproc=1, nnodes="1:2", timeout=240, max_restarts=3,
                           reference=False, epochs=8, step_sleep_s=0.3, pg_timeout_s=10, echo=False, check=False)
    try:
        shrink_then_grow(started, timeout_s=120)
    finally:
        result = started.wait()
    assert launch.processes_of_run(result.run_dir.name, None) == []
    assert result.ok, result.log_path
    worlds = [s.world_size for s in analysis.segments(result)]
    assert worlds[:3] == [2, 1, 2], worlds
    report = analysis.lost_and_repeated(analysis.sample_counts(analysis.kept_steps(result)), 48, 8)
    assert all(not e["lost"] and not e["repeated"] for e in report.values()), report
