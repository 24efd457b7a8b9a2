"""The sync experiment's equivalences on 2 gloo ranks: gradients, parameters, broadcast, buffers, statistics."""
import copy

import pytest
import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc import sync
from labsrc.data import synthetic_images
from labsrc.models import TinyCNN
from labsrc.testing import run_ranks


def _batch(size=32, side=8):
    return synthetic_images(size, side, seed=7).tensors


def _gradients_three_ways(ctx):
    torch.manual_seed(0)
    model = DDP(TinyCNN(batch_norm=False))
    images, labels = _batch()
    reference = sync.full_batch_gradients(model.module, images, labels)
    mine = sync.shard(images, ctx.rank, ctx.world_size), sync.shard(labels, ctx.rank, ctx.world_size)
    F.cross_entropy(model(mine[0]), mine[1]).backward()
    by_hand = copy.deepcopy(model.module)
    by_hand.zero_grad(set_to_none=True)
    F.cross_entropy(by_hand(mine[0]), mine[1]).backward()
    sync.average_gradients(by_hand, ctx.world_size)
    return reference, sync.gradients(model), sync.gradients(by_hand)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_and_hand_averaged_gradients_equal_the_full_batch_gradient(world_size):
    for reference, ddp_gradients, hand_gradients in run_ranks(_gradients_three_ways, world_size):
        for name in reference:
            torch.testing.assert_close(ddp_gradients[name], reference[name], rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(hand_gradients[name], reference[name], rtol=1e-4, atol=1e-6)


def _broadcast_then_train(ctx):
    torch.manual_seed(100 + ctx.rank)
    model = TinyCNN(batch_norm=False)
    before = sync.spread_across_ranks(list(model.parameters()))
    model = DDP(model)
    after = sync.spread_across_ranks(list(model.parameters()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images, labels = _batch()
    spreads = []
    for step in range(3):
        torch.manual_seed(step * 10 + ctx.rank)  # different data on every rank
        index = torch.randint(len(labels), (8,))
        optimizer.zero_grad()
        F.cross_entropy(model(images[index]), labels[index]).backward()
        optimizer.step()
        spreads.append(sync.spread_across_ranks(list(model.parameters())))
    return before, after, spreads


def test_construction_broadcasts_and_parameters_stay_identical():
    (before0, after0, spreads0), (before1, after1, spreads1) = run_ranks(_broadcast_then_train, 2)
    assert before0 == before1 > 0
    assert after0 == after1 == 0.0
    assert spreads0 == spreads1 == [0.0, 0.0, 0.0]


def _buffers(ctx, enabled):
    torch.manual_seed(0)
    model = DDP(TinyCNN(), **sync.buffer_sync_option(enabled))
    seen = []
    model.module.register_forward_pre_hook(lambda m, a: seen.append([b.clone() for b in sync.batch_norm_buffers(m)]))
    images, _ = _batch()
    for _ in range(2):
        model(sync.shard(images, ctx.rank, ctx.world_size)).sum().backward()
    return sync.spread_across_ranks(seen[-1])


def test_buffer_sync_gives_every_forward_rank_zeros_buffers():
    assert run_ranks(_buffers, 2, args=(True,)) == [0.0, 0.0]
    assert min(run_ranks(_buffers, 2, args=(False,))) > 0.0


def _statistics(ctx):
    images, _ = _batch()
    mean, var = sync.global_batch_statistics(sync.shard(images, ctx.rank, ctx.world_size))
    return mean, var


def test_global_batch_statistics_equal_the_full_batch_ones():
    images, _ = _batch()
    for mean, var in run_ranks(_statistics, 2):
        torch.testing.assert_close(mean, images.mean(dim=[0, 2, 3]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(var, images.var(dim=[0, 2, 3], unbiased=False), rtol=1e-4, atol=1e-5)


def test_shard_refuses_a_batch_that_does_not_split_evenly():
    with pytest.raises(ValueError, match="does not split evenly"):
        sync.shard(torch.zeros(10), 0, 3)


def test_dataparallel_without_two_gpus_calls_the_module_directly():
    images, labels = _batch(8)
    report = sync.dataparallel_step(TinyCNN(), images, labels)
    assert sum(report["chunks"]) == 8
    if report["gpus"] < 2:
        assert not report["replicated"] and report["step_s"] is None


@pytest.mark.slow
def test_lab_records_every_experiment(tmp_path, monkeypatch):
    from labsrc.labs.ddp_sync import launch_sync_experiment
    monkeypatch.setenv("LABSRC_RUNS", str(tmp_path))
    result = launch_sync_experiment(nproc=2, profile="ci", timeout=180)
    kinds = {r["kind"] for r in result.of_kind("context")} | {r["kind"] for rows in result.records.values() for r in rows}
    assert {"broadcast", "gradients", "buffers", "statistics", "step", "single_step"} <= kinds
    assert max(r["parameter_spread"] for r in result.of_kind("step")) == 0.0
