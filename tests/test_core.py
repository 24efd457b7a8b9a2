"""Profiles, backend choice, data, models and the shared training loop."""
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from labsrc.core import profiles, world as labdist
from labsrc.training import data, models, loop
from labsrc.core.forked import RankError, run_ranks


def test_profile_from_environment_wins_and_unknown_is_a_clear_error():
    profile, reason = profiles.pick_profile({"LABSRC_PROFILE": "gpu"}, gpu_count=0, cpu_count=2)
    assert profile.name == "gpu" and "LABSRC_PROFILE" in reason
    with pytest.raises(profiles.ProfileError, match="not a profile.*ci"):
        profiles.pick_profile({"LABSRC_PROFILE": "huge"}, gpu_count=0, cpu_count=2)


@pytest.mark.parametrize("gpus, cores, expected", [(0, 2, "ci"), (0, 8, "cpu"), (4, 8, "gpu")])
def test_profile_from_hardware(gpus, cores, expected):
    assert profiles.pick_profile({}, gpu_count=gpus, cpu_count=cores)[0].name == expected


def test_gpu_profile_uses_every_gpu():
    assert profiles.PROFILES["gpu"].resolved_world_size(8) == 8
    assert profiles.PROFILES["ci"].resolved_world_size(8) == 2


@pytest.mark.parametrize("ranks, gpus, requested, expected", [
    (2, 0, None, ("gloo", "cpu")), (2, 2, None, ("nccl", "cuda")), (4, 1, None, ("gloo", "cuda")),
    (1, 1, "gloo", ("gloo", "cuda")),
])
def test_backend_choice(ranks, gpus, requested, expected):
    assert labdist.choose_backend(ranks, gpus, requested) == expected


def test_nccl_with_more_ranks_than_gpus_says_what_to_do():
    with pytest.raises(labdist.RequestError, match="one GPU per rank.*backend='gloo'"):
        labdist.validate_request(4, "nccl", gpus=2, cpu_count=16)


def test_too_many_cpu_ranks_refused():
    with pytest.raises(labdist.RequestError, match="at most 4"):
        labdist.validate_request(5, None, gpus=0, cpu_count=2)
    assert labdist.validate_request(4, None, gpus=0, cpu_count=2) == ("gloo", "cpu")


def test_doctor_json_names_profile_and_backends():
    out = subprocess.run([sys.executable, "-m", "labsrc.doctor", "--json"], capture_output=True,
                         text=True, check=True).stdout
    report = json.loads(out)
    assert report["profile"] in profiles.PROFILES
    assert report["backends"]["gloo"] is True
    assert set(report["labs"]) >= {"00_setup", "01_dp_vs_ddp"}


def test_synthetic_images_are_deterministic_and_learnable():
    first, second = data.synthetic_images(256, 16, seed=3), data.synthetic_images(256, 16, seed=3)
    assert torch.equal(first.tensors[0], second.tensors[0])
    assert first.tensors[0].shape == (256, 3, 16, 16)
    torch.manual_seed(0)
    model = models.TinyCNN()
    ctx = labdist.RankContext(0, 0, 1, torch.device("cpu"), "gloo")
    batches = iter(data.DeviceBatches(first, 64, ctx, seed=0))
    summary = loop.train(model, batches, ctx, loop.TrainConfig(steps=30, lr=0.05, log_every=10))
    assert summary["losses"][-1] < 0.5 * summary["losses"][0], summary["losses"]


def test_device_batches_partition_matches_distributed_sampler():
    dataset = data.synthetic_images(64, 8)
    ranks = [labdist.RankContext(r, r, 2, torch.device("cpu"), "gloo") for r in range(2)]
    mine = [data.DeviceBatches(dataset, 4, ctx, seed=1).epoch_indices(0) for ctx in ranks]
    assert set(mine[0].tolist()).isdisjoint(mine[1].tolist())
    assert sorted(mine[0].tolist() + mine[1].tolist()) == list(range(64))
    whole = data.DeviceBatches(dataset, 8, ranks[0].__class__(0, 0, 1, torch.device("cpu"), "gloo"), seed=1)
    first_global = next(iter(whole))[1]
    per_rank = [next(iter(data.DeviceBatches(dataset, 4, ctx, seed=1)))[1] for ctx in ranks]
    assert sorted(first_global.tolist()) == sorted(torch.cat(per_rank).tolist())


def test_resnet18_cifar_shapes():
    model = models.build_model("resnet18")
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="unknown model"):
        models.build_model("nope")


def _loss_after_ddp_steps(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(models.TinyCNN())
    batches = iter(data.DeviceBatches(data.synthetic_images(128, 8), 16, ctx))
    summary = loop.train(model, batches, ctx, loop.TrainConfig(steps=3, log_every=2))
    return [p.detach().clone() for p in model.parameters()], len(summary["losses"])


def test_training_loop_under_ddp_keeps_ranks_identical():
    (params0, count0), (params1, count1) = run_ranks(_loss_after_ddp_steps, 2)
    assert count0 == count1 == 3
    for left, right in zip(params0, params1):
        torch.testing.assert_close(left, right)


def test_rerun_controls_call_the_same_function_with_the_chosen_values():
    from labsrc.core.widgets import rerun_controls
    calls = []
    panel = rerun_controls(lambda nproc, profile: calls.append((nproc, profile)) or nproc * 10,
                           nproc=([1, 2, 4], 2), profile=(["ci", "cpu"], "ci"))
    panel.controls["nproc"].value = 4
    assert panel.run() == 40 and calls == [(4, "ci")]


# Fresh ranks: where a GPU is visible, run_ranks starts interpreters instead of forking (a process that ran a
# backward with CUDA devices present cannot fork ranks that run one). Forced here with LABSRC_RANKS_START.
def _cell_function():
    """A function as a notebook cell defines it: its module cannot be imported by another process."""
    namespace = {"__name__": "a_notebook_cell"}
    exec("import torch\nimport torch.distributed as dist\n"
         "def total(ctx, k):\n"
         "    t = torch.tensor([float(ctx.rank + k)])\n"
         "    dist.all_reduce(t)\n"
         "    return t.item()\n", namespace)
    return namespace["total"]


def _sleeps(ctx):
    import time
    time.sleep(600)


def _raises_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("rank one refuses")
    return ctx.rank


def test_fresh_ranks_run_a_notebook_defined_function_after_a_backward(monkeypatch):
    monkeypatch.setenv("LABSRC_RANKS_START", "fresh")
    nn.Linear(2, 1)(torch.ones(1, 2)).sum().backward()  # what poisons fork where CUDA devices exist
    assert run_ranks(_cell_function(), 2, args=(10,), timeout_s=60) == [21.0, 21.0]


def test_fresh_ranks_report_a_failing_rank_and_a_timeout_and_leave_no_process(monkeypatch):
    import psutil
    monkeypatch.setenv("LABSRC_RANKS_START", "fresh")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RankError, match="rank 1 raised:(.|\n)*rank one refuses"):
        run_ranks(_raises_on_rank_one, 2, timeout_s=60)
    with pytest.raises(RankError, match=r"ranks \[0, 1\] gave no result in 1 s"):
        run_ranks(_sleeps, 2, timeout_s=1)
    assert {p.pid for p in psutil.Process().children(recursive=True)} - before == set()


def test_rank_start_method_follows_the_gpu_and_the_setting(monkeypatch):
    from labsrc.core import forked
    monkeypatch.delenv("LABSRC_RANKS_START", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert forked.start_method() == "fresh"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert forked.start_method() == "fork"
    monkeypatch.setenv("LABSRC_RANKS_START", "spawn")
    with pytest.raises(ValueError, match="use fork or fresh"):
        forked.start_method()


def _kills_itself():
    import os
    import signal
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_fresh_process_reports_its_exit_as_multiprocessing_does(monkeypatch):
    from labsrc.core import forked
    monkeypatch.setenv("LABSRC_RANKS_START", "fresh")
    child = forked.process(_kills_itself)
    assert isinstance(child, forked.FreshProcess)
    child.start()
    child.join(timeout=60)
    assert not child.is_alive() and child.exitcode == -9


def test_fresh_ranks_die_with_their_caller(tmp_path):
    # A kernel that Jupyter kills (SIGKILL) must take its fresh ranks with it, as it took forked ones.
    import psutil
    import textwrap
    import time
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""\
        import os, time
        os.environ["LABSRC_RANKS_START"] = "fresh"
        from labsrc.core.forked import run_ranks
        def sleeps(ctx):
            time.sleep(600)
        run_ranks(sleeps, 2, timeout_s=600)
    """)], cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1])})
    deadline = time.time() + 60
    ranks = []
    while time.time() < deadline and len(ranks) < 2:
        ranks = [p for p in psutil.Process(caller.pid).children() if "labsrc.core.forked" in " ".join(p.cmdline())]
        time.sleep(0.2)
    assert len(ranks) == 2, "the fresh ranks did not start"
    caller.kill()
    caller.wait()
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert alive == [], f"ranks outlived their caller: {[p.pid for p in alive]}"
