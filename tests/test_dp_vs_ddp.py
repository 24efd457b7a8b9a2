"""The sync experiment's equivalences on gloo ranks: gradients, parameters, broadcast, buffers, global BatchNorm."""
import copy

import pytest
import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc.core.forked import run_ranks
from labsrc.lessons.dp_vs_ddp import batch_norm, dataparallel, sync
from labsrc.training.data import synthetic_images
from labsrc.training.models import TinyCNN


@pytest.fixture(scope="module", autouse=True)
def ddp_imports_loaded():
    """DDP's first construction imports torch._dynamo (about 2 s); import it once here, before forking."""
    import torch._dynamo  # noqa: F401


def _batch(size=32, side=8):
    return synthetic_images(size, side, seed=7).tensors


def _mine(ctx, tensor):
    return sync.shard(tensor, ctx.rank, ctx.world_size)


def _gradients_three_ways(ctx):
    torch.manual_seed(0)
    model = DDP(TinyCNN(batch_norm=False))
    images, labels = _batch()
    reference = sync.full_batch_gradients(model.module, images, labels)
    F.cross_entropy(model(_mine(ctx, images)), _mine(ctx, labels)).backward()
    by_hand = copy.deepcopy(model.module)
    by_hand.zero_grad(set_to_none=True)
    F.cross_entropy(by_hand(_mine(ctx, images)), _mine(ctx, labels)).backward()
    sync.average_gradients(by_hand, ctx.world_size)
    return reference, sync.gradients(model), sync.gradients(by_hand)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_and_hand_averaged_gradients_equal_the_full_batch_gradient(world_size):
    for reference, ddp_gradients, hand_gradients in run_ranks(_gradients_three_ways, world_size):
        assert reference.keys() == ddp_gradients.keys() == hand_gradients.keys() and reference
        for name in reference:
            torch.testing.assert_close(ddp_gradients[name], reference[name], rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(hand_gradients[name], reference[name], rtol=1e-4, atol=1e-6)


def _broadcast_then_train(ctx):
    torch.manual_seed(100 + ctx.rank)
    model = TinyCNN(batch_norm=True)
    with torch.no_grad():
        model(torch.randn(4, 3, 8, 8))  # rank-dependent running statistics
    spreads = {"parameters": sync.spread_across_ranks(list(model.parameters())),
               "buffers": sync.spread_across_ranks(sync.batch_norm_buffers(model))}
    model = DDP(model)
    spreads["parameters after"] = sync.spread_across_ranks(list(model.parameters()))
    spreads["buffers after"] = sync.spread_across_ranks(sync.batch_norm_buffers(model.module))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images, labels = _batch()
    steps = []
    for step in range(3):
        torch.manual_seed(step * 10 + ctx.rank)  # different data on every rank
        index = torch.randint(len(labels), (8,))
        optimizer.zero_grad()
        F.cross_entropy(model(images[index]), labels[index]).backward()
        optimizer.step()
        steps.append(sync.spread_across_ranks(list(model.parameters())))
    return spreads, steps


def test_construction_broadcasts_parameters_and_buffers_and_parameters_stay_identical():
    (spreads0, steps0), (spreads1, steps1) = run_ranks(_broadcast_then_train, 2)
    assert spreads0 == spreads1
    assert spreads0["parameters"] > 0 and spreads0["buffers"] > 0, "ranks should start different"
    assert spreads0["parameters after"] == spreads0["buffers after"] == 0.0
    assert steps0 == steps1 == [0.0, 0.0, 0.0]


def _buffers(ctx, enabled):
    torch.manual_seed(0)
    model = DDP(TinyCNN(), **sync.buffer_sync_option(enabled))
    seen = []
    model.module.register_forward_pre_hook(lambda m, a: seen.append([b.clone() for b in sync.batch_norm_buffers(m)]))
    images, _ = _batch()
    for _ in range(2):
        model(_mine(ctx, images)).sum().backward()
    return sync.spread_across_ranks(seen[-1])


def test_buffer_sync_gives_every_forward_rank_zeros_buffers():
    assert run_ranks(_buffers, 2, args=(True,)) == [0.0, 0.0]
    assert min(run_ranks(_buffers, 2, args=(False,))) > 0.0


def _global_batch_norm(ctx):
    images, labels = _batch()
    mean, variance, count = batch_norm.global_batch_statistics(_mine(ctx, images))
    torch.manual_seed(0)
    model = TinyCNN(batch_norm=True)
    reference = sync.full_batch_gradients(model, images, labels)
    local = DDP(copy.deepcopy(model))
    F.cross_entropy(local(_mine(ctx, images)), _mine(ctx, labels)).backward()
    synced = DDP(batch_norm.with_global_batch_norm(copy.deepcopy(model), ctx.device))
    F.cross_entropy(synced(_mine(ctx, images)), _mine(ctx, labels)).backward()
    layer = synced.module.features[1]
    return {"mean": mean, "variance": variance, "count": count.item(), "layer": type(layer).__name__,
            "running_mean": layer.running_mean.clone(), "running_var": layer.running_var.clone(),
            "reference": reference, "local": sync.gradients(local), "global": sync.gradients(synced)}


def test_global_batch_norm_gives_the_full_batch_statistics_and_gradient():
    images, _ = _batch()
    channels = TinyCNN(batch_norm=True).features[0].out_channels
    for result in run_ranks(_global_batch_norm, 2):
        assert result["count"] == 32 * 8 * 8 and result["layer"] == "GlobalBatchNorm2d"
        torch.testing.assert_close(result["mean"], images.mean(dim=[0, 2, 3]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["variance"], images.var(dim=[0, 2, 3], unbiased=False),
                                   rtol=1e-4, atol=1e-5)
        assert result["running_mean"].shape == result["running_var"].shape == (channels,)
        for name, expected in result["reference"].items():
            torch.testing.assert_close(result["global"][name], expected, rtol=1e-4, atol=1e-6)
        assert sync.largest_gap(result["local"], result["reference"]) > 1e-4, "per-rank BN should differ"


def _global_running_statistics(ctx):
    layer = batch_norm.with_global_batch_norm(torch.nn.Sequential(torch.nn.BatchNorm2d(3, momentum=0.5)), ctx.device)
    images, _ = _batch()
    return layer(_mine(ctx, images)), layer[0].running_mean, layer[0].running_var


def test_global_batch_norm_output_and_running_statistics_equal_one_process_batch_norm():
    images, _ = _batch()
    full = torch.nn.BatchNorm2d(3, momentum=0.5)
    expected = full(images)
    for rank, (output, running_mean, running_var) in enumerate(run_ranks(_global_running_statistics, 2)):
        torch.testing.assert_close(output, expected.chunk(2)[rank], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(running_mean, full.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(running_var, full.running_var, rtol=1e-5, atol=1e-6)


def test_global_batch_norm_alone_is_plain_batch_norm():
    layer = batch_norm.with_global_batch_norm(torch.nn.Sequential(torch.nn.BatchNorm2d(3)), torch.device("cpu"))
    images, _ = _batch()
    torch.testing.assert_close(layer(images), torch.nn.BatchNorm2d(3)(images))


def test_shard_refuses_a_batch_that_does_not_split_evenly():
    with pytest.raises(ValueError, match="does not split evenly"):
        sync.shard(torch.zeros(10), 0, 3)


def test_dataparallel_shows_what_the_module_saw():
    images, labels = _batch(8)
    report = dataparallel.dataparallel_step(TinyCNN(), images, labels, repeats=2)
    assert sum(report["chunks"]) == 8
    assert report["chunks"] == [int(c.shape[0]) for c in images.chunk(max(1, report["gpus"]))]
    if report["gpus"] < 2:  # no scatter, no replicas: one call with the whole batch
        assert report["calls"] == [{"shape": [8, 3, 8, 8], "device": "cuda:0" if report["gpus"] else "cpu"}]
        assert not report["replicated"] and report["step_s"] is None
    else:
        assert len(report["calls"]) == report["gpus"] and report["step_s"] > 0
    assert report["gradient_vs_full_batch"] <= 1e-6 + 1e-4 * report["largest_gradient"]


def test_dataparallel_arithmetic_sums_replica_gradients_without_dividing():
    images, labels = _batch(12)
    torch.manual_seed(3)
    model = TinyCNN(batch_norm=False)
    reference = sync.full_batch_gradients(model, images, labels)
    summed = dataparallel.replica_gradients_summed(model, images, labels, replicas=3)
    assert sync.largest_gap(summed, reference) <= 1e-6
    divided = {name: g / 3 for name, g in summed.items()}  # what dividing by the replica count would give
    assert sync.largest_gap(divided, reference) > 1e-3


def _denominators_and_noise(ctx):
    from labsrc.lessons.dp_vs_ddp.loss_mean import denominator_gaps, noise_steps
    noise = noise_steps(ctx, seed=0, steps=3, per_rank_batch=4, image_size=8, lr=0.1)
    return denominator_gaps(ctx, seed=0), list(noise)


@pytest.mark.parametrize("world_size", [2, 3])
def test_unequal_token_counts_break_the_mean_of_means_and_count_weighting_repairs_it(world_size):
    results = run_ranks(_denominators_and_noise, world_size)
    gaps = results[0][0]
    tolerance = 1e-6 + 1e-4 * gaps.largest_gradient
    assert gaps.count_weighted <= tolerance and gaps.equal_counts <= tolerance
    assert gaps.mean_of_means > 100 * tolerance
    losses = [[loss for _, loss, _ in steps] for _, steps in results]
    for step in range(3):  # noise data: every rank its own loss, the same parameters
        assert len({rank_losses[step] for rank_losses in losses}) == world_size
    assert all(spread == 0.0 for _, steps in results for _, _, spread in steps)


def test_losses_differ_every_step_names_the_steps_where_two_ranks_agree():
    from labsrc.lessons.dp_vs_ddp.loss_mean import losses_differ_every_step
    from labsrc.lessons.dp_vs_ddp.lab import NoiseStep
    records = [NoiseStep(0, 1.0, 0.0, rank=0), NoiseStep(0, 2.0, 0.0, rank=1),
               NoiseStep(1, 1.5, 0.0, rank=0), NoiseStep(1, 1.5, 0.0, rank=1)]
    assert losses_differ_every_step(records) == [1]


def test_options_refuse_a_negative_batch_and_a_batch_that_does_not_split_over_the_ranks():
    from labsrc.core.profiles import PROFILES
    from labsrc.core.world import RequestError
    from labsrc.core.plan import split_global_batch
    from labsrc.lessons.dp_vs_ddp.lab import Options
    with pytest.raises(RequestError, match="global_batch"):
        Options.make(global_batch=-4)
    with pytest.raises(RequestError, match="choose a multiple of 3, e.g. 30 or 33"):
        split_global_batch(32, PROFILES["ci"], 3)
    assert split_global_batch(33, PROFILES["ci"], 3) == 33
    assert split_global_batch(0, PROFILES["ci"], 3) == 63  # the profile's 64, rounded down


def _step(variant, step, loss, rank):
    from labsrc.lessons.dp_vs_ddp.lab import DdpStep
    return DdpStep(variant, step, loss, 0.0, rank=rank)


def test_curve_gaps_compare_the_rank_mean_with_one_process_per_variant():
    from labsrc.lessons.dp_vs_ddp.lab import SingleStep
    ddp = [_step(v.key, s, loss, rank) for v in sync.VARIANTS for s in range(2)
           for rank, loss in enumerate((1.0, 3.0 + v.global_statistics))]
    single = [SingleStep(norm, s, 2.0) for norm in (False, True) for s in range(2)]
    assert sync.curve_gaps(ddp, single) == {"plain": 0.0, "batch_norm_local": 0.0, "batch_norm_global": 0.5}
    with pytest.raises(ValueError, match="plain: 2 DDP steps but 1 single-process steps"):
        sync.curve_gaps(ddp, single[1:])


@pytest.mark.slow
def test_lab_records_every_experiment(tmp_path, monkeypatch):
    from labsrc import launch
    from labsrc.lessons.dp_vs_ddp.lab import DdpStep, Denominators, Gradients, NoiseStep, SingleStep, StepTiming
    monkeypatch.setenv("LABSRC_RUNS", str(tmp_path))
    result = launch.run("dp_vs_ddp", nproc=2, timeout=180, profile="ci", global_batch=32)
    assert result.summary["global_batch"] == 32 and result.summary["per_rank_batch"] == 16
    assert {r.rank: r.shard_size for r in result.of(Gradients)} == {0: 16, 1: 16}
    assert max(r.parameter_spread for r in result.of(DdpStep)) == 0.0
    steps = result.summary["steps"]
    assert len(result.of(DdpStep)) == 2 * 3 * steps and len(result.of(SingleStep)) == 2 * steps
    timing = result.of(StepTiming)
    assert len(timing) == 2 * result.summary["timed_steps"] and {r.model for r in timing} == {"tiny_cnn"}
    assert all(r.backward_s > 0 and r.local_backward_s > 0 for r in timing)
    noise = result.of(NoiseStep)
    assert len(noise) == 2 * steps and max(r.parameter_spread for r in noise) == 0.0
    assert {r.rank for r in result.of(Denominators)} == {0, 1}
    gaps = sync.curve_gaps(result.of(DdpStep), result.of(SingleStep))
    assert gaps["plain"] < 1e-3 and gaps["batch_norm_global"] < 1e-3
    assert gaps["batch_norm_local"] > 10 * gaps["batch_norm_global"]


def _ddp_beside_one_process(ctx):
    import itertools
    dataset = synthetic_images(96, 8, seed=3)  # 48 samples per rank: 6 steps of 8 an epoch, so 8 steps cross one
    torch.manual_seed(0)
    model = TinyCNN(batch_norm=False)
    alone = copy.deepcopy(model)
    ddp = [loss for loss, _ in itertools.islice(sync.train_ddp(model, dataset, ctx.device, 8, 0.05, 2, seed=1), 8)]
    return ddp, list(itertools.islice(sync.train_alone(alone, dataset, ctx.device, 16, 0.05, 2, seed=1), 8))


def test_train_ddp_follows_one_process_on_the_union_of_the_shards_across_epochs():
    (rank0, alone), (rank1, _) = run_ranks(_ddp_beside_one_process, 2)
    assert all(a != b for a, b in zip(rank0, rank1)), "each rank's loss is on its own shard"
    for step, (a, b, single) in enumerate(zip(rank0, rank1, alone)):
        assert abs((a + b) / 2 - single) < 1e-4, f"step {step}: DDP's mean loss left the one-process loss"
