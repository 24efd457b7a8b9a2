"""DeepSpeed ZeRO stages 0-3 train the lesson's model step for step like one process (skipped without DeepSpeed)."""
import pytest

from labsrc.core.forked import run_ranks
from labsrc.lessons.memory_sharding import deepspeed_zero as ds, zero_runs as runs

installed, reason = ds.available()
pytestmark = pytest.mark.skipif(not installed, reason=reason)
DEPTH, WIDTH, LR = 2, 16, 0.01


def _train(ctx, stage, batches, trajectory):
    got = ds.train_deepspeed(ctx, stage, DEPTH, WIDTH, batches, LR)
    return [runs.largest_gap(step, reference) for step, reference in zip(got, trajectory)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_zero_stage_matches_one_process(stage):
    batches = runs.make_batches(3, 8, seed=2)
    trajectory = runs.unsharded_trajectory(DEPTH, WIDTH, batches, LR)
    for gaps in run_ranks(_train, 2, (stage, batches, trajectory), timeout_s=240):
        assert len(gaps) == 3 and max(gaps) < 1e-5, gaps


def test_config_keeps_the_batch_arithmetic():
    config = ds.zero_config(3, 16, 2)
    assert config["train_batch_size"] == config["train_micro_batch_size_per_gpu"] * 2
    assert config["zero_optimization"]["stage"] == 3
