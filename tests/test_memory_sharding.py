"""Lesson 09: hand-written ZeRO stages, FSDP2 and distributed checkpoints against one process, on forked gloo ranks."""
import pytest
import torch

from labsrc.core.forked import run_ranks
from labsrc.core.world import RequestError
from labsrc.lessons.memory_sharding import memory, torch_sharding as production, zero_runs as runs
from labsrc.lessons.memory_sharding.lab import Options
from labsrc.lessons.memory_sharding.zero import Traffic

DEPTH, WIDTH, LR = 2, 16, 0.01


def batches():
    return runs.make_batches(3, 12, seed=4)


def reference():
    return runs.unsharded_trajectory(DEPTH, WIDTH, batches(), LR)


def reference_gradients():
    return runs.unsharded_gradients(DEPTH, WIDTH, batches(), LR)


def _stage(ctx, stage, trajectory, gradients):
    if stage == 3:
        return runs.fully_sharded_run(ctx, DEPTH, WIDTH, batches(), LR, Traffic(), trajectory=trajectory,
                                      gradients=gradients)
    return runs.sharded_optimizer_run(ctx, stage, DEPTH, WIDTH, batches(), LR, Traffic(), trajectory=trajectory,
                                      gradients=gradients)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size", [2, 3])
def test_hand_written_stages_follow_one_process(stage, world_size):
    for result in run_ranks(_stage, world_size, (stage, reference(), reference_gradients())):
        assert len(result["gaps"]) == 3 and max(result["gaps"]) < 1e-6, result["gaps"]
        assert len(result["gradient_gaps"]) == 3 and max(result["gradient_gaps"]) < 1e-6, result["gradient_gaps"]


def _summed_not_averaged(ctx, trajectory, gradients):
    from labsrc.lessons.memory_sharding import zero
    original = zero.ShardedOptimizer.synchronize_gradients

    def times_n(self):  # the reduce-scattered sum, never divided by n
        original(self)
        self.gradient_shard = self.gradient_shard * self.world_size
    zero.ShardedOptimizer.synchronize_gradients = times_n
    try:
        return runs.sharded_optimizer_run(ctx, 2, DEPTH, WIDTH, batches(), LR, Traffic(), trajectory=trajectory,
                                          gradients=gradients)
    finally:
        zero.ShardedOptimizer.synchronize_gradients = original


def test_a_gradient_not_divided_by_n_shows_in_the_gradient_not_in_adams_parameters():
    result = run_ranks(_summed_not_averaged, 2, (reference(), reference_gradients()))[0]
    assert min(result["gradient_gaps"]) > 1e-3, result["gradient_gaps"]
    assert max(result["gaps"]) < 1e-4, result["gaps"]  # Adam's update changes only through eps: a small drift


def _held(ctx, stage):
    traffic = Traffic()
    if stage == 3:
        result = runs.fully_sharded_run(ctx, DEPTH, WIDTH, batches(), LR, traffic)
    else:
        result = runs.sharded_optimizer_run(ctx, stage, DEPTH, WIDTH, batches(), LR, traffic, dtype=torch.bfloat16)
    return result, traffic.total


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_held_and_sent_match_the_formulas(stage):
    parameters = memory.count_parameters(memory.deep_mlp(DEPTH, WIDTH))
    layout = memory.FP32 if stage == 3 else memory.MIXED
    formula = memory.per_rank_formula(parameters, 3, stage, layout)
    for result, sent in run_ranks(_held, 3, (stage,)):
        for category, expected in formula.items():
            assert abs(result["held"][category] - expected) <= 0.1 * expected, (category, result["held"])
        ideal = 3 * memory.communication_formula(parameters, 3, stage, 4 if stage == 3 else 2)  # bf16 in 1-2
        assert 0.85 * ideal <= sent <= 1.02 * ideal, (sent, ideal)


def test_formulas_divide_what_each_stage_shards():
    bytes_ = {s: memory.per_rank_formula(1000, 4, s) for s in range(4)}
    assert sum(bytes_[0].values()) == 16000
    assert bytes_[1] == {"parameters": 2000, "gradients": 2000, "optimizer": 3000}
    assert bytes_[2]["gradients"] == 500 and bytes_[3]["parameters"] == 500
    assert memory.communication_formula(1000, 4, 3) * 2 == 3 * memory.communication_formula(1000, 4, 0)


def _skip_reduce_scatter(ctx, trajectory):
    from labsrc.lessons.memory_sharding import zero
    original = zero.reduce_scatter_counted

    def local_slice(full, traffic):  # a rank that never hears the others' gradients
        return full.view(ctx.world_size, -1)[ctx.rank].clone() * ctx.world_size
    zero.reduce_scatter_counted = local_slice
    try:
        return runs.sharded_optimizer_run(ctx, 2, DEPTH, WIDTH, batches(), LR, Traffic(), trajectory=trajectory)
    finally:
        zero.reduce_scatter_counted = original


def test_skipping_the_reduce_scatter_breaks_equality():
    assert max(run_ranks(_skip_reduce_scatter, 2, (reference(),))[0]["gaps"]) > 1e-4


def test_checkpointing_saves_k_plus_n_over_k_blocks_with_the_same_gradients():
    rows = memory.checkpoint_sweep(8, 32, 4, [1, 2, 4, 8], repeats=1)
    assert [r["saved_bytes"] for r in rows] == [r["predicted_bytes"] for r in rows]
    assert all(r["gradient_gap"] == 0.0 for r in rows)
    assert min(rows, key=lambda r: r["saved_bytes"])["segments"] in (2, 4) and memory.best_segments(16) == 4


def _fsdp(ctx, setting, reference_parameters):
    result = production.train_fsdp(ctx, DEPTH, WIDTH, setting, batches(), LR)
    return runs.largest_gap(result["parameters"], reference_parameters), result


@pytest.mark.parametrize("setting", ["reshard", "keep", "offload"])
def test_fsdp2_matches_one_process(setting):
    parameters = memory.count_parameters(memory.deep_mlp(DEPTH, WIDTH))
    for gap, result in run_ranks(_fsdp, 2, (setting, reference()[-1])):
        assert gap < 1e-6
        assert result["parameter_bytes"] == 4 * parameters // 2
        assert result["between_bytes"] == (4 * parameters if setting == "keep" else 4 * parameters // 2)


def test_checkpoint_saved_on_four_ranks_loads_on_two(tmp_path):
    folder = str(tmp_path / "checkpoint")
    saved = run_ranks(production.save_sharded, 4, (folder, DEPTH, WIDTH, batches(), LR))[0]
    loaded = run_ranks(production.load_sharded, 2, (folder, DEPTH, WIDTH, LR))[0]
    for part in ("model", "optimizer"):
        assert saved[part].keys() == loaded[part].keys() and saved[part], part
        for name, tensor in saved[part].items():
            torch.testing.assert_close(loaded[part][name], tensor, rtol=0, atol=0)
    assert any(name.endswith("exp_avg_sq") for name in saved["optimizer"])
    assert loaded["optimizer_steps"] == [3.0]


def test_options_refuse_a_zero_size():
    with pytest.raises(RequestError):
        Options.make(depth=0).validate()
