"""GPU decisions checked without a GPU: plans, profiles and the doctor's report for simulated machines."""
import pytest

from labsrc import doctor
from labsrc.core import profiles
from labsrc.core.hardware import Hardware, simulated
from labsrc.core.plan import make_plan

GPU = profiles.PROFILES["gpu"]


@pytest.mark.parametrize("gpus, ranks, backend", [(1, 2, "gloo"), (2, 2, "nccl"), (3, 3, "nccl"), (4, 4, "nccl"),
                                                  (8, 8, "nccl")])
def test_gpu_profile_plans(gpus, ranks, backend):
    plan = make_plan(simulated(gpus=gpus), GPU)
    assert (plan.world_size, plan.backend, plan.device) == (ranks, backend, "cuda"), plan.reason
    assert plan.global_batch % plan.world_size == 0 and plan.per_rank_batch * plan.world_size == plan.global_batch
    assert GPU.global_batch - plan.world_size < plan.global_batch <= GPU.global_batch


def test_one_gpu_is_shared_by_two_gloo_ranks():
    plan = make_plan(simulated(gpus=1), GPU)
    assert plan.ranks_share_gpus and "share 1 GPU" in plan.reason


def test_three_gpus_round_the_global_batch_and_say_so():
    plan = make_plan(simulated(gpus=3), GPU)
    assert plan.global_batch == 510 and "rounded to 510" in plan.reason


@pytest.mark.parametrize("cpus, profile, ranks", [(2, "ci", 2), (16, "cpu", 4)])
def test_cpu_only_plans(cpus, profile, ranks):
    hardware = simulated(gpus=0, cpus=cpus)
    picked, _ = profiles.pick_profile({}, hardware=hardware)
    plan = make_plan(hardware, picked)
    assert (picked.name, plan.world_size, plan.backend, plan.device) == (profile, ranks, "gloo", "cpu")
    assert not plan.ranks_share_gpus and plan.global_batch % plan.world_size == 0


@pytest.mark.parametrize("gpus, cpus, expected", [(0, 2, "ci"), (0, 16, "cpu"), (1, 2, "gpu"), (8, 64, "gpu")])
def test_profile_follows_the_given_hardware(gpus, cpus, expected):
    assert profiles.pick_profile({}, hardware=simulated(gpus=gpus, cpus=cpus))[0].name == expected


def test_hardware_refuses_impossible_counts():
    with pytest.raises(ValueError, match="gpus >= 0"):
        Hardware(gpus=-1, gpu_name=None, cpus=4)
    with pytest.raises(ValueError, match="cpus >= 1"):
        Hardware(gpus=0, gpu_name=None, cpus=0)


@pytest.mark.parametrize("gpus", [0, 1, 2, 3, 4, 8])
def test_doctor_reports_each_simulated_machine(gpus):
    hardware = simulated(gpus=gpus, cpus=16)
    report = doctor.report(hardware)
    plan = make_plan(hardware, profiles.pick_profile({}, hardware=hardware)[0])
    assert report["simulated"] and report["cpu_cores"] == 16 and len(report["gpus"]) == gpus
    assert report["profile"] == ("gpu" if gpus else "cpu")
    assert (report["plan"]["world_size"], report["plan"]["backend"]) == (plan.world_size, plan.backend)
    assert report["backends"]["nccl"] == (gpus > 0)
    assert report["multi_rank_nccl"]["possible"] == (gpus >= 2)
    text = doctor.format_report(report)
    assert text.startswith("SIMULATED") and f"plan: {plan.world_size} {plan.backend} ranks" in text
    if gpus == 1:
        assert "NCCL refuses two ranks on one GPU" in text and "1 GPU(s) shared" in text


def test_doctor_simulates_from_the_command_line(capsys):
    assert doctor.main(["--json", "--gpus", "4", "--cpus", "32"]) == 0
    report = __import__("json").loads(capsys.readouterr().out)
    assert report["simulated"] and report["plan"]["world_size"] == 4 and report["plan"]["backend"] == "nccl"


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "-1"], "--gpus must be 0 or more"), (["--gpus", "2", "--cpus", "0"], "--cpus must be 1 or more"),
    (["--cpus", "8"], "add --gpus N"), (["--gpus", "0", "--gpu-name", "H100"], "--gpu-name needs --gpus 1"),
    (["--gpus", "two"], "invalid int value"), (["--verbose"], "unrecognized arguments"),
])
def test_doctor_bad_options_exit_2_with_advice(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_code:
        doctor.main(argv)
    assert exit_code.value.code == 2 and message in capsys.readouterr().err


def test_a_batch_that_does_not_split_is_refused_before_torchrun_starts(tmp_path, monkeypatch):
    from labsrc import launch
    from labsrc.core.world import RequestError
    monkeypatch.setenv("LABSRC_RUNS", str(tmp_path))
    with pytest.raises(RequestError, match="global_batch 33 does not split over 2 ranks: choose a multiple of 2, e.g. 32 or 34"):
        launch.run("dp_vs_ddp", nproc=2, global_batch=33)
    assert not any(tmp_path.glob("*/*")), "a run directory was made for a refused launch"


def test_the_doctor_knows_every_notebook():
    from pathlib import Path
    notebooks = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
    assert sorted(doctor.LESSONS) == notebooks


# Each lesson's least ranks: a server needs 2+ workers beside it (11); every other lesson at least 2 ranks
# (10b's two simulated nodes of one rank each make 2 too). 09 and 11 keep gloo ranks on the CPU (doctor.CPU_ONLY).
MIN_RANKS = {lesson: 2 for lesson in doctor.LESSONS} | {"11_async_parameter_server": 3}
MACHINES = [(gpus, 16) for gpus in (1, 2, 3, 5, 6, 7, 8)] + [(0, 2), (0, 16)]


def test_every_lesson_has_a_rank_count():
    assert set(MIN_RANKS) == set(doctor.LESSONS)


@pytest.mark.parametrize("gpus, cpus", MACHINES)
@pytest.mark.parametrize("lesson", doctor.LESSONS)
def test_every_gpu_count_plans_every_lesson(lesson, gpus, cpus):
    """Ranks, backend and batch split of each lesson's plan are valid, and the launcher accepts them."""
    from labsrc.core.world import validate_request
    hardware = simulated(gpus=gpus, cpus=cpus)
    profile = GPU if gpus else profiles.pick_profile({}, hardware=hardware)[0]
    plan = make_plan(hardware, profile, min_ranks=MIN_RANKS[lesson])
    assert plan.world_size >= MIN_RANKS[lesson], f"{lesson} on {gpus} GPU(s): {plan.reason}"
    if plan.backend == "nccl":
        assert plan.device == "cuda" and plan.world_size <= gpus, f"NCCL needs one GPU per rank: {plan.reason}"
    else:
        assert plan.device == ("cuda" if gpus else "cpu"), plan.reason
    if gpus == 1:
        assert (plan.world_size, plan.backend) == (MIN_RANKS[lesson], "gloo") and plan.ranks_share_gpus, plan.reason
    if gpus >= MIN_RANKS[lesson]:
        assert (plan.world_size, plan.backend) == (gpus, "nccl"), f"one rank per GPU expected: {plan.reason}"
    assert plan.global_batch > 0 and plan.global_batch % plan.world_size == 0, plan.reason
    backend = "gloo" if lesson in doctor.CPU_ONLY else plan.backend
    assert validate_request(plan.world_size, backend, gpus=gpus, cpu_count=cpus)[0] == backend


def test_no_notebook_sizes_its_world_from_the_profile_alone():
    """Profile.resolved_world_size gives 1 rank on one GPU: a multi-rank notebook takes its ranks from make_plan."""
    import json
    from pathlib import Path
    for path in sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb")):
        code = "".join("".join(cell["source"]) for cell in json.loads(path.read_text())["cells"]
                       if cell["cell_type"] == "code")
        assert "resolved_world_size(" not in code, f"{path.name} sizes its world without make_plan"
