"""Lesson 13: the scaled schedule, CIFAR-10 read from disk, atomic snapshots, resume to the same model, the report."""
import math
import os
import pickle

import numpy as np
import pytest
import torch

from labsrc.core.forked import run_ranks
from labsrc.core.world import RankContext, RequestError
from labsrc.lessons.capstone import lab, recipe
from labsrc.lessons.capstone.training_run import RunSettings, train_run
from labsrc.lessons.elastic_fault_tolerance import snapshot as snapshot_file
from labsrc.lessons.elastic_fault_tolerance.snapshot import load_checked, save_atomic


def schedule(**changes):
    values = dict(base_lr=0.1, base_batch=256, global_batch=1024, warmup_steps=5, total_steps=26, end_lr=0.001)
    return recipe.Schedule(**{**values, **changes})


def test_schedule_ramps_from_base_to_scaled_peak_then_cosine_to_end():
    plan = schedule()
    rates = [recipe.learning_rate(step, plan) for step in range(plan.total_steps)]
    assert plan.peak_lr == pytest.approx(0.4)  # 0.1 x 1024 / 256
    assert rates[0] == pytest.approx(0.1)
    assert rates[5] == pytest.approx(0.4) and max(rates) == pytest.approx(0.4)
    assert rates[-1] == pytest.approx(0.001)
    assert all(a < b for a, b in zip(rates[:5], rates[1:6])), "the warm-up rises"
    assert all(a > b for a, b in zip(rates[5:], rates[6:])), "the cosine falls"
    middle = 5 + (plan.total_steps - 1 - 5) // 2
    assert rates[middle] == pytest.approx(0.001 + (0.4 - 0.001) * 0.5, rel=1e-9), "half-way down the cosine"


def test_schedule_without_warmup_starts_at_the_peak():
    assert recipe.learning_rate(0, schedule(warmup_steps=0)) == pytest.approx(0.4)


def test_a_batch_below_base_batch_never_runs_above_its_peak():
    plan = schedule(global_batch=64)  # peak 0.1 x 64 / 256 = 0.025, below base_lr
    rates = [recipe.learning_rate(step, plan) for step in range(plan.total_steps)]
    assert plan.peak_lr == pytest.approx(0.025) and max(rates) == pytest.approx(0.025)
    assert rates[:6] == pytest.approx([0.025] * 6), "nothing to warm up to: the ramp stays at the peak"


def fake_cifar(root, per_batch=4):
    """Write the torchvision on-disk layout: pickled dicts with uint8 rows of 3072 values, labels, names."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    generator = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {"data": generator.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 "labels": generator.integers(0, 10, per_batch).tolist()}
        with open(folder / name, "wb") as file:
            pickle.dump(entry, file)
    with open(folder / "batches.meta", "wb") as file:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, file)


@pytest.fixture
def files_not_checksummed(monkeypatch):
    """torchvision checks each file's MD5 against the real release, which a fake cannot match: check existence."""
    import torchvision.datasets.cifar as cifar
    monkeypatch.setattr(cifar, "check_integrity", lambda path, md5=None: os.path.isfile(path))


def test_cifar10_is_read_from_disk_when_there(tmp_path, files_not_checksummed):
    fake_cifar(tmp_path)
    train, held_out, source = recipe.load_datasets("auto", 100, 10, 16, 0, root=tmp_path)
    assert source == "cifar10" and len(train) == 20 and len(held_out) == 4
    image, label = train[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and 0 <= label < 10


def test_without_cifar10_auto_falls_back_and_cifar10_refuses(tmp_path, files_not_checksummed):
    train, held_out, source = recipe.load_datasets("auto", 100, 10, 16, 0, root=tmp_path)
    assert source == "synthetic" and len(train) == 100 and len(held_out) == 10
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        recipe.load_datasets("cifar10", 100, 10, 16, 0, root=tmp_path)


def test_held_out_split_is_disjoint_and_shuffled_labels_keep_images():
    train, held_out = recipe.offline_split(64, 16, 8, seed=3)
    assert train.tensors[0].shape == (64, 3, 8, 8) and held_out.tensors[0].shape == (16, 3, 8, 8)
    assert not any(torch.equal(a, b) for a in held_out.tensors[0] for b in train.tensors[0][:16])
    shuffled = recipe.with_shuffled_labels(train, seed=3)
    assert torch.equal(shuffled.tensors[0], train.tensors[0])
    assert not torch.equal(shuffled.tensors[1], train.tensors[1])
    assert sorted(shuffled.tensors[1].tolist()) == sorted(train.tensors[1].tolist())


def parts():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, torch.amp.GradScaler("cpu", enabled=False)


def test_snapshot_round_trip_restores_momentum(tmp_path):
    model, optimizer, scaler = parts()
    path = tmp_path / "snapshot.pt"
    assert recipe.save_snapshot(path, 7, model, optimizer, scaler) == path.stat().st_size
    other, other_optimizer, other_scaler = parts()
    assert recipe.load_snapshot(path, other, other_optimizer, other_scaler, torch.device("cpu")) == 7
    assert recipe.state_digest(other) == recipe.state_digest(model)
    momentum = optimizer.state[model.weight]["momentum_buffer"]
    assert torch.equal(other_optimizer.state[other.weight]["momentum_buffer"], momentum)
    assert not list(tmp_path.glob("*.tmp"))


def test_snapshot_round_trip_restores_the_loss_scale(tmp_path):
    """fp16's GradScaler comes back with its scale (the notebook trains with a disabled one, fp32 or bf16, where
    nothing shows this): without it a resumed run starts again from 65536 and skips steps finding its scale."""
    model, optimizer, _ = parts()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    recipe.save_snapshot(tmp_path / "snapshot.pt", 3, model, optimizer, scaler)
    other, other_optimizer, _ = parts()
    other_scaler = torch.amp.GradScaler("cpu")
    recipe.load_snapshot(tmp_path / "snapshot.pt", other, other_optimizer, other_scaler, torch.device("cpu"))
    assert other_scaler.get_scale() == 1024.0 and other_scaler.get_growth_interval() == 7


def test_digests_of_parameters_and_of_buffers_tell_them_apart():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    before = {part: recipe.state_digest(model, part) for part in ("all", "parameters", "buffers")}
    model(torch.randn(8, 4))  # a training forward moves BatchNorm's running statistics only
    after = {part: recipe.state_digest(model, part) for part in ("all", "parameters", "buffers")}
    assert after["parameters"] == before["parameters"]
    assert after["buffers"] != before["buffers"] and after["all"] != before["all"]


def test_a_write_that_fails_leaves_the_previous_snapshot(tmp_path, monkeypatch):
    model, optimizer, scaler = parts()
    path = tmp_path / "snapshot.pt"
    recipe.save_snapshot(path, 1, model, optimizer, scaler)
    before = path.read_bytes()

    def dies_half_way(target, data):
        target.write_bytes(data[: len(data) // 2])
        raise OSError("disk full")
    monkeypatch.setattr(snapshot_file, "write_bytes_durably", dies_half_way)
    with pytest.raises(OSError):
        recipe.save_snapshot(path, 2, model, optimizer, scaler)
    assert path.read_bytes() == before


def settings(total_steps=8, eval_every=2, snapshot_every=4):
    return RunSettings(model="tiny_cnn", precision="fp32", channels_last=False, compile=False,
                       compile_backend="inductor",
                       schedule=recipe.Schedule(0.4, 256, 32, 2, total_steps), momentum=0.9,
                       weight_decay=5e-4, max_norm=None, eval_every=eval_every, snapshot_every=snapshot_every,
                       num_workers=0, seed=0)


def train_on_rank(ctx, folder, stop_at, forget_momentum, eval_every=2, snapshot_every=4):
    """Train uninterrupted, then stopped at stop_at and resumed from its last snapshot (128 samples at a global
    batch of 32: 4 steps an epoch). Returns both digests, the start steps, the accuracies, and {step: this
    rank's batch fingerprint} of the uninterrupted run and of the resumed one."""
    train_set, held_out = recipe.offline_split(128, 32, 8, seed=0)
    chosen = settings(eval_every=eval_every, snapshot_every=snapshot_every)
    events = []
    report = lambda kind, values: events.append((kind, values))  # noqa: E731
    whole = train_run(ctx, chosen, train_set, held_out, None, report)
    whole_batches = batches_by_step(events)
    snapshot = folder / "snapshot.pt"
    train_run(ctx, chosen, train_set, held_out, snapshot, report, stop_after=lambda step: step >= stop_at)
    if forget_momentum and ctx.is_main:
        state = load_checked(snapshot)
        state["optimizer"]["state"] = {}
        save_atomic(state, snapshot)
    torch.distributed.barrier()
    events.clear()
    resumed = train_run(ctx, chosen, train_set, held_out, snapshot, report)
    starts = [values["resumed_from"] for kind, values in events if kind == "start"]
    accuracy = [values["accuracy"] for kind, values in events if kind == "evaluation"]
    sent = {values["allreduce_bytes_per_step"] for kind, values in events if kind == "log"}
    assert sent == {next(values["parameter_bytes"] for kind, values in events if kind == "start")}, (
        f"DDP should all-reduce one fp32 gradient per parameter each step; counted {sent} bytes")
    return whole["digest"], resumed["digest"], starts, accuracy, whole_batches, batches_by_step(events)


def batches_by_step(events) -> dict[int, float]:
    """{0-based step: its batch fingerprint} from a run's "log" events."""
    return recipe.fingerprints_by_step(values for kind, values in events if kind == "log")


@pytest.mark.parametrize("stop_at, eval_every, snapshot_every, resumed_from", [
    (4, 2, 4, 4),  # stopped right after the step-4 snapshot: the resume starts epoch 1 at its first batch
    (3, 1, 2, 2),  # stopped between snapshots (at 2 and 4): the resume starts mid-epoch, 2 of 4 batches done
], ids=["epoch-boundary", "mid-epoch"])
def test_resumed_run_equals_the_uninterrupted_one_on_every_rank(tmp_path, stop_at, eval_every, snapshot_every,
                                                                 resumed_from):
    results = run_ranks(train_on_rank, 2, (tmp_path, stop_at, False, eval_every, snapshot_every), timeout_s=120)
    (whole, resumed, starts, accuracy, whole_batches, resumed_batches), other = results
    assert starts == [resumed_from], f"the last snapshot at or before step {stop_at} is at step {resumed_from}"
    assert sorted(resumed_batches) == list(range(resumed_from, 8)), "the resumed run trains the remaining steps"
    replayed = [step for step in resumed_batches if resumed_batches[step] != whole_batches[step]]
    assert not replayed, (f"the resumed run trained steps {replayed} on other batches than the uninterrupted run: "
                          "it must skip the batches of its epoch already trained on, not replay them")
    assert whole == resumed, "resuming from the snapshot must reach the same parameters"
    assert other[:2] == (whole, resumed), "DDP keeps both ranks identical"
    assert len(accuracy) == (8 - resumed_from) // eval_every and all(0 <= a <= 1 for a in accuracy)


def test_a_snapshot_without_optimizer_state_resumes_elsewhere(tmp_path):
    whole, resumed = run_ranks(train_on_rank, 2, (tmp_path, 4, True), timeout_s=120)[0][:2]
    assert whole != resumed, "momentum is part of the state: losing it must change the result"


def test_channels_last_and_a_failed_compile_still_train_in_a_world_of_one():
    from dataclasses import replace
    ctx = RankContext(0, 0, 1, torch.device("cpu"), "none")
    train_set, held_out = recipe.offline_split(64, 16, 8, seed=0)
    events = []
    chosen = replace(settings(total_steps=4), channels_last=True, compile=True, compile_backend="no_such_backend")
    final = train_run(ctx, chosen, train_set, held_out, None, lambda kind, values: events.append((kind, values)))
    start = next(values for kind, values in events if kind == "start")
    assert "no_such_backend" in start["compile_reason"], "a failed compile must say why"
    assert final["step"] == 4 and [kind for kind, _ in events].count("evaluation") == 2


def test_scaling_report_against_the_smallest_world():
    evaluations = [{"step": 8, "accuracy": 0.5, "train_seconds": 1.0}, {"step": 16, "accuracy": 0.9, "train_seconds": 2.0}]
    runs = {1: {"images_per_s": 100.0, "evaluations": evaluations},
            2: {"images_per_s": 150.0, "evaluations": evaluations[:1]}}
    report = recipe.scaling_report(runs, target=0.8)
    assert report[1] == {"images_per_s": 100.0, "speedup": 1.0, "efficiency": 1.0, "time_to_target_s": 2.0}
    assert report[2]["speedup"] == pytest.approx(1.5) and report[2]["efficiency"] == pytest.approx(0.75)
    assert report[2]["time_to_target_s"] is None


def test_options_say_what_to_fix():
    with pytest.raises(RequestError, match="multiple of eval_every"):
        lab.Options.make(eval_every=4, snapshot_every=6)
    with pytest.raises(RequestError, match="auto, cifar10 or synthetic"):
        lab.Options.make(data="imagenet")
    assert lab.Options.make(steps=8).to_argv() == ["--steps", "8"]


def test_lab_runs_as_a_world_of_one(tmp_path, monkeypatch):
    monkeypatch.setenv("LABSRC_RUNS", str(tmp_path))
    summary = lab.main(["--profile", "ci", "--steps", "4", "--num-samples", "128", "--held-out", "32",
                        "--eval-every", "2"])
    assert summary["source"] == "synthetic" and summary["steps"] == 4 and len(summary["digest"]) == 64
    assert summary["precision"] == "fp32" and math.isfinite(summary["train_seconds"])


def test_a_world_size_that_does_not_divide_the_split_counts_twice_with_distributed_sampler():
    from labsrc.lessons.capstone import evaluation
    scores = run_ranks(evaluation.scores_by_share, 3, (256,), timeout_s=60)[0]
    strided, sampler = scores["strided"], scores["sampler"]
    alone = evaluation.one_process_scores(256)
    assert strided["count"] == 256 and strided["accuracy"] == alone["accuracy"]
    assert strided["loss"] == pytest.approx(alone["loss"], abs=1e-5)
    assert sampler["count"] == 258, "DistributedSampler pads 256 to 3 x 86, counting 2 samples twice"
