"""DistributedSampler shards, set_epoch, padding vs drop_last, uneven inputs with and without Join, loaders."""
import hashlib
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from labsrc.core import runs
from labsrc.core.forked import run_ranks
from labsrc.core.plan import split_global_batch
from labsrc.core.world import RankContext, RequestError
from labsrc.lessons.data_loading import lab as data_loading_lab, sampling
from labsrc.lessons.data_loading.lab import Options, Partition, Skipped, Throughput, Uneven
from labsrc.training import data

CPU = torch.device("cpu")


def rank_context(rank: int, world_size: int) -> RankContext:
    return RankContext(rank, rank, world_size, CPU, "gloo")


@pytest.mark.parametrize("size, world_size", [(10, 2), (10, 3), (12, 4), (7, 4)])
def test_one_epoch_is_a_disjoint_cover_with_padding_counted(size, world_size):
    orders = sampling.epoch_orders(size, world_size, epochs=1)
    per_rank = -(-size // world_size)
    assert all(len(order[0]) == per_rank for order in orders.values())
    read = [i for order in orders.values() for i in order[0]]
    assert set(read) == set(range(size))
    duplicates = len(read) - size
    assert duplicates == per_rank * world_size - size
    assert (sampling.coverage(size, world_size, False)["duplicates"], 0) == (duplicates, 0)
    if duplicates == 0:  # no padding: the shards are disjoint
        assert sum(len(set(order[0])) for order in orders.values()) == size


@pytest.mark.parametrize("size, world_size", [(10, 3), (1001, 4), (64, 8), (5, 2)])
def test_drop_last_drops_and_padding_duplicates_as_the_formula_says(size, world_size):
    for drop_last in (False, True):
        counted = sampling.coverage(size, world_size, drop_last)
        assert (counted["duplicates"], counted["dropped"]) == sampling.expected_coverage(size, world_size, drop_last)
        assert counted["read"] == counted["per_rank"] * world_size
    if drop_last:
        shards = sampling.epoch_orders(size, world_size, 1, drop_last=True)
        read = [i for order in shards.values() for i in order[0]]
        assert len(read) == len(set(read)), "drop_last shards overlap"


def test_drop_last_exact_counts_for_ten_samples_on_three_ranks():
    padded, dropped = sampling.coverage(10, 3, False), sampling.coverage(10, 3, True)
    assert (padded["read"], padded["duplicates"], padded["dropped"]) == (12, 2, 0)
    assert (dropped["read"], dropped["duplicates"], dropped["dropped"]) == (9, 0, 1)


def test_without_set_epoch_every_epoch_repeats():
    with_epochs = sampling.epoch_orders(20, 2, epochs=3, set_epoch=True)
    without = sampling.epoch_orders(20, 2, epochs=3, set_epoch=False)
    for rank in range(2):
        assert without[rank][0] == without[rank][1] == without[rank][2]
        assert len({tuple(order) for order in with_epochs[rank]}) == 3
        assert with_epochs[rank][0] == without[rank][0], "epoch 0 is seeded the same either way"


def test_device_batches_use_the_distributed_sampler_partition():
    dataset = data.random_noise(23, image_size=2)
    for rank in range(3):
        resident = data.DeviceBatches(dataset, 2, rank_context(rank, 3), seed=5)
        sampler = DistributedSampler(dataset, num_replicas=3, rank=rank, shuffle=True, seed=5, drop_last=True)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            assert resident.epoch_indices(epoch).tolist() == list(sampler)


def test_slow_transform_costs_at_least_its_sleep_per_batch():
    dataset = sampling.SlowTransform(data.synthetic_images(64, 8), cost_s=0.002)
    loader, sampler = data.make_loader(dataset, 8, rank_context(0, 1))
    seen = []
    timing = sampling.time_batches(data.forever(loader, sampler), 3, CPU,
                                   lambda images, labels: seen.append(images.shape))
    assert seen == [(8, 3, 8, 8)] * 4, "one warm-up step, then one compute call per timed step"
    assert len(timing["data_steps_s"]) == len(timing["compute_steps_s"]) == timing["steps"] == 3
    assert min(timing["data_steps_s"]) >= 8 * 0.002, "every batch of 8 sleeps 8 x 2 ms in this process"
    assert timing["data_s"] >= 8 * 0.002


def test_worker_processes_deliver_the_same_batches_as_the_main_process():
    """Run here, not in run_ranks: forked test ranks are daemons, which may not start loader workers."""
    dataset = sampling.SlowTransform(data.synthetic_images(48, 4), cost_s=0.001)
    batches = {}
    for workers in (0, 2):
        loader, sampler = data.make_loader(dataset, 8, rank_context(1, 2), num_workers=workers, seed=3)
        stream = data.forever(loader, sampler)
        batches[workers] = [next(stream) for _ in range(4)]  # 3 batches an epoch: crosses into epoch 1
        del stream, loader
    for (images0, labels0), (images2, labels2) in zip(batches[0], batches[2]):
        torch.testing.assert_close(images2, images0)
        assert labels2.tolist() == labels0.tolist()


def test_sweep_arms_offer_pin_memory_only_with_a_gpu():
    dataset = data.random_noise(8, image_size=2)
    arms = data_loading_lab.sweep_arms(rank_context(0, 1), dataset, 0.001, [0, 2])
    assert [(arm["source"], arm["num_workers"]) for arm in arms] == [("slow_transform", 0), ("slow_transform", 2),
                                                                      ("plain", 0)]
    assert not any(arm["pin_memory"] for arm in arms)
    if not torch.cuda.is_available():
        pytest.skip("pin_memory arm needs CUDA: no GPU here (the CPU arms were checked)")
    gpu = RankContext(0, 0, 1, torch.device("cuda", 0), "nccl")
    assert [arm["pin_memory"] for arm in data_loading_lab.sweep_arms(gpu, dataset, 0.001, [0])] == [False, False, True]


@pytest.mark.parametrize("values, named", [({"workers": (0, -1)}, "workers"), ({"steps": 0}, "steps"),
                                           ({"cost_ms": -1}, "cost_ms"), ({"join_timeout_s": 0}, "join_timeout_s"),
                                           ({"joined_timeout_s": 0}, "joined_timeout_s"),
                                           ({"global_batch": -8}, "global_batch")])
def test_options_refuse_bad_values_naming_the_option(values, named):
    with pytest.raises(RequestError, match=named):
        Options.make(**values)


def test_options_round_trip_through_the_command_line():
    options = Options.make(workers="0 2", cost_ms=1, global_batch=64)
    assert options.workers == (0, 2)
    assert Options.parse(options.to_argv()) == options


def test_global_batch_must_split_over_the_ranks():
    ci = data_loading_lab.resolve_profile(Options.make(profile="ci"))
    assert split_global_batch(96, ci, 4) // 4 == 24
    assert split_global_batch(0, ci, 3) // 3 == ci.global_batch // 3, "the profile's batch, rounded down"
    with pytest.raises(RequestError, match="multiple of 3"):
        split_global_batch(64, ci, 3)


def test_arms_are_found_by_their_keys_not_their_labels():
    rows = [Throughput(source=source, num_workers=workers, pin_memory=False, label="any text", batch=4,
                       transform_cost_s=0.0, steps=1, data_s=0.0, compute_s=0.0, data_steps_s=[], compute_steps_s=[])
            for source, workers in [("slow_transform", 0), ("slow_transform", 2), ("resident", 0)]]
    assert sampling.find_arm(rows, "slow_transform", num_workers=2) is rows[1]
    assert sampling.find_arm(rows, "resident") is rows[2]
    with pytest.raises(KeyError):
        sampling.find_arm(rows, "plain")
    assert sampling.transform_floor_s(8, 0.002, 0) == sampling.transform_floor_s(8, 0.002, 1) == 8 * 0.002
    assert sampling.transform_floor_s(8, 0.002, 4) == 8 * 0.002 / 4
    assert sampling.data_bound(0.2, 0.1) and not sampling.data_bound(0.1, 0.2)


def _lab_in_process(ctx, run_dir):
    options = Options.make(profile="ci", workers=(0,), steps=2, join_timeout_s=1, cost_ms=1)
    records = runs.RecordWriter(run_dir, ctx.rank)
    try:
        return data_loading_lab.data_loading_lab(ctx, records, options)
    finally:
        records.close()


@pytest.fixture(scope="module")
def lab_run(tmp_path_factory):
    """The whole lab body once on 2 forked gloo ranks: (summary, {rank: records})."""
    run_dir = tmp_path_factory.mktemp("data_loading")
    summaries = run_ranks(_lab_in_process, 2, args=(run_dir,), timeout_s=90)
    return summaries[0], runs.read_records(run_dir)


def _of(records, record_class):
    """{rank: [typed record, ...]} of one kind."""
    return {rank: [record_class.from_dict(r) for r in rows if r["kind"] == record_class.KIND]
            for rank, rows in records.items()}


def test_lab_records_each_ranks_own_sampler_orders(lab_run):
    summary, records = lab_run
    assert summary["dataset_size"] == 11, "the default is a size 2 ranks do not divide: padding has work to do"
    for rank, rows in _of(records, Partition).items():
        by_flags = {(row.set_epoch, row.drop_last): row.epochs for row in rows}
        assert sorted(by_flags) == sorted(data_loading_lab.PARTITIONS)
        for (set_epoch, drop_last), orders in by_flags.items():
            assert orders == sampling.rank_epoch_orders(summary["dataset_size"], rank, 2, summary["epochs"],
                                                            set_epoch=set_epoch, drop_last=drop_last)


def _uneven(records, join):
    """[Uneven record of rank 0, of rank 1] with or without Join."""
    return [next(row for row in rows if row.join == join) for _, rows in sorted(_of(records, Uneven).items())]


def test_join_lets_uneven_ranks_finish_with_the_replayed_weights(lab_run):
    summary, records = lab_run
    joined = _uneven(records, join=True)
    assert summary["batches_per_rank"] == [3, 4]
    assert [r.steps for r in joined] == summary["batches_per_rank"]
    assert [r.error for r in joined] == [None, None]
    reference = sampling.uneven_reference(summary["batches_per_rank"], seed=0)
    for record in joined:
        torch.testing.assert_close(torch.tensor(record.weight), reference.flatten())
    by_active = sampling.uneven_reference(summary["batches_per_rank"], seed=0, divide_by_initial_world_size=False)
    assert not torch.allclose(torch.tensor(joined[1].weight), by_active.flatten()), "Join's default divisor"


def test_without_join_the_longer_rank_waits_until_the_timeout(lab_run):
    summary, records = lab_run
    short, long = _uneven(records, join=False)
    assert (short.steps, short.error) == (3, None), "the rank with fewer batches finishes its own"
    assert long.steps == 3 and long.planned == 4, "the 4th step can never complete"
    assert long.error_type in ("RuntimeError", "DistBackendError"), long.error
    assert long.waited_s >= 0.5 * summary["join_timeout_s"], "the wait ended before the timeout"
    assert not long.error.startswith("["), "the C++ source location is cut from the recorded error"
    for record in (short, long):
        assert len(record.step_end_s) == record.steps and record.step_end_s == sorted(record.step_end_s)
    assert long.left_s >= long.step_end_s[-1] + 0.5 * summary["join_timeout_s"], "the timeline's wait"
    assert short.left_s == pytest.approx(short.step_end_s[-1], abs=0.05), "the short rank leaves after its last step"


def _join_that_does_not_shadow(ctx, run_dir):
    """train_uneven inside a disabled Join (it answers no collective): the longer rank must time out."""
    from unittest import mock
    from torch.distributed.algorithms import join as join_module
    real_join = join_module.Join
    disabled = lambda joinables: real_join(joinables, enable=False)
    with mock.patch.object(join_module, "Join", disabled):
        return sampling.train_uneven(ctx, [1, 2], join=True, timeout_s=1.0)


def test_a_join_that_does_not_shadow_leaves_the_longer_rank_stuck(tmp_path):
    short, long = run_ranks(_join_that_does_not_shadow, 2, args=(tmp_path,), timeout_s=60)
    assert (short["steps"], short["error"]) == (1, None)
    assert long["steps"] == 1 and long["error_type"] is not None, "the notebook's Join assert must catch this"


def test_lab_sweep_times_every_arm_and_skips_pin_memory_without_gpu(lab_run):
    summary, records = lab_run
    rows = _of(records, Throughput)[0]
    assert [(row.source, row.num_workers) for row in rows] == [("slow_transform", 0), ("plain", 0), ("resident", 0)]
    assert [row.label for row in rows] == ["slow transform, 0 worker(s)", "no slow transform, 0 worker(s)",
                                           "resident on the device"]
    assert all(row.batch == summary["batch_per_rank"] == 32 for row in rows), "ci: global batch 64 on 2 ranks"
    slow = sampling.find_arm(rows, "slow_transform")
    assert slow.data_s >= sampling.transform_floor_s(slow.batch, slow.transform_cost_s, 0)
    assert len(_of(records, Skipped)[0]) == 1, "run_ranks' ranks run on the CPU, GPU or not: pin_memory is skipped"


def test_image_folder_loads_a_folder_of_pngs(tmp_path):
    from PIL import Image
    for label in ("cat", "dog"):
        (tmp_path / label).mkdir()
        for index in range(3):
            Image.fromarray(np.full((20, 24, 3), 40 * index, dtype=np.uint8)).save(tmp_path / label / f"{index}.png")
    dataset = data.image_folder(tmp_path, image_size=16)
    images, label = dataset[4]
    assert len(dataset) == 6 and dataset.classes == ["cat", "dog"]
    assert images.shape == (3, 16, 16) and label == 1
    torch.testing.assert_close(images, torch.full((3, 16, 16), 40 / 255))
    batch_images, batch_labels = next(iter(data.make_loader(dataset, 3, rank_context(0, 2), shuffle=False)[0]))
    assert batch_images.shape == (3, 3, 16, 16) and batch_labels.tolist() == [0, 0, 1]


def _write_fake_cifar(root):
    """Six 4-image batches and the meta file, in the cifar-10-batches-py pickle format; returns their md5s."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 255, (4, 3072), dtype=np.uint8), "labels": list(range(4))}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"class{i}" for i in range(10)]}))
    return {path.name: hashlib.md5(path.read_bytes()).hexdigest() for path in folder.iterdir()}


def test_cifar10_through_torchvision_on_files_we_made(tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR10
    md5 = _write_fake_cifar(tmp_path)
    monkeypatch.setattr(CIFAR10, "train_list", [[f"data_batch_{i}", md5[f"data_batch_{i}"]] for i in range(1, 6)])
    monkeypatch.setattr(CIFAR10, "test_list", [["test_batch", md5["test_batch"]]])
    monkeypatch.setattr(CIFAR10, "meta", {"filename": "batches.meta", "key": "label_names", "md5": md5["batches.meta"]})
    train, test = data.cifar10(tmp_path, train=True), data.cifar10(tmp_path, train=False)
    assert len(train) == 20 and len(test) == 4
    image, label = train[0]
    assert image.shape == (3, 32, 32) and label == 0 and train.classes[3] == "class3"
    raw = pickle.loads((tmp_path / "cifar-10-batches-py" / "test_batch").read_bytes())["data"][1]
    expected = torch.tensor(raw, dtype=torch.float32).reshape(3, 32, 32) / 255
    expected = (expected - torch.tensor(data.CIFAR_MEAN)[:, None, None]) / torch.tensor(data.CIFAR_STD)[:, None, None]
    torch.testing.assert_close(test[1][0], expected)


def test_cifar10_is_none_when_absent(tmp_path):
    assert data.cifar10(tmp_path) is None


def test_padding_check_accepts_torch_and_rejects_other_padding():
    for size, world_size in [(11, 2), (10, 4), (3, 8), (12, 4)]:
        shards = [orders[0] for orders in sampling.epoch_orders(size, world_size, 1).values()]
        assert sampling.padding_repeats_the_start(shards, size)
        counted = sampling.count_reads(shards, size)
        padding, _ = sampling.expected_coverage(size, world_size, False)
        assert counted["dropped"] == 0 and counted["duplicates"] == padding
    shards = [orders[0] for orders in sampling.epoch_orders(11, 2, 1).values()]
    shards[1][-1] = next(index for index in shards[1] if index != shards[0][0])  # padded with another sample
    assert not sampling.padding_repeats_the_start(shards, 11)


@pytest.mark.parametrize("size, world_size", [(11, 2), (10, 4), (3, 8)])
def test_the_concept_picture_deals_torchs_padded_order(size, world_size):
    from labsrc.lessons.data_loading import plots
    for epoch in (0, 1):
        order = plots.padded_order(size, world_size, epoch)
        assert len(order) == -(-size // world_size) * world_size
        assert order[:size] == torch.randperm(size, generator=torch.Generator().manual_seed(epoch)).tolist()
        assert all(order[size + extra] == order[extra % size] for extra in range(len(order) - size)), "padding"
        for rank in range(world_size):
            assert order[rank::world_size] == plots.torch_shard(size, rank, world_size, epoch)
    assert plots.padded_order(size, world_size, 0) != plots.padded_order(size, world_size, 1), "set_epoch reshuffles"


def test_the_concept_picture_draws_one_box_per_position_and_shard_item():
    import matplotlib
    matplotlib.use("Agg")
    from labsrc.lessons.data_loading import plots
    ax = plots.sampler_shards(11, 2, epochs=(0, 1))
    assert len(ax.patches) == 2 * (12 + 12), "each epoch: the 12 padded positions, then 6 per rank"
    assert sum(patch.get_hatch() == "///" for patch in ax.patches) == 2 * 2, "one padded box per epoch, twice"


def _result(lab_run):
    from labsrc.launch import RunResult
    summary, records = lab_run
    return RunResult("data_loading", 2, None, 0, 0.0, summary, records)


def test_the_measured_figures_draw_from_the_records(lab_run):
    import matplotlib
    matplotlib.use("Agg")
    from labsrc.lessons.data_loading import plots
    result = _result(lab_run)
    axes = plots.partition_panels(result)
    hatched = [sum(patch.get_hatch() == "///" for patch in ax.patches) for ax in axes]
    assert hatched == [3, 3, 0], "11 on 2 ranks: one padded position per epoch, none with drop_last"
    for join in (False, True):
        ax = plots.uneven_timeline(result, join)
        labels = [label.get_text() for label in ax.get_yticklabels()]
        assert labels == (["rank 0: 3 of 3", "rank 1: 4 of 4"] if join else ["rank 0: 3 of 3", "rank 1: 3 of 4"])
    ax = plots.step_split(result)
    assert [line.get_linestyle() for line in ax.lines if len(line.get_xdata())] == ["--"], "ci: 0 workers only"
    plots.partitions(result, set_epoch=False)
