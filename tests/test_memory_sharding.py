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


def _stage2_keeping_full_gradients(ctx):
    from labsrc.lessons.memory_sharding import zero
    original = zero.ShardedOptimizer.synchronize_gradients

    def keeps_them(self):  # a stage 2 that holds on to its full flat gradients after the reduce-scatter
        grads = [p.grad for p in self.params]
        original(self)
        self.kept = zero.flatten(grads, self.world_size)
    zero.ShardedOptimizer.synchronize_gradients = keeps_them
    try:
        return runs.sharded_optimizer_run(ctx, 2, DEPTH, WIDTH, batches(), LR, Traffic(), dtype=torch.bfloat16)
    finally:
        zero.ShardedOptimizer.synchronize_gradients = original


def test_the_census_sees_full_gradients_kept_at_stage_2():
    """Notebook 09's per-stage check reads the census: a stage 2 keeping its full gradients must show 2 Psi, not 2 Psi/n."""
    parameters = memory.count_parameters(memory.deep_mlp(DEPTH, WIDTH))
    sharded = memory.per_rank_formula(parameters, 2, 2)["gradients"]
    for result in run_ranks(_stage2_keeping_full_gradients, 2):
        assert result["held"]["gradients"] >= 1.9 * sharded, result["held"]


def test_the_ownership_diagram_labels_each_stage_with_its_formula():
    """The kept bytes written under each cell of plots.zero_ownership are the ZeRO formulas per parameter, n = 4."""
    import matplotlib
    matplotlib.use("Agg")
    from labsrc.lessons.memory_sharding import plots
    figure = plots.zero_ownership(4)
    labels = [text.get_text() for axis in figure.axes for text in axis.texts]
    per_stage = [sum(memory.per_rank_formula(1, 4, stage).values()) for stage in range(4)]  # 16, 7, 5.5, 4
    assert per_stage == [16, 7, 5.5, 4]
    expected = [f"{value:g} B" for value in per_stage for _ in range(4)]
    assert labels == expected, labels


def test_the_lab_runs_without_the_fsdp_experiments():
    assert Options(fsdp=False).fsdp is False and Options().fsdp is True


def _fallback_counted(ctx):
    from labsrc.lessons.memory_sharding import zero
    original = zero.reduce_scatter

    def all_reduce_then_slice(output, full):  # what the helper does on a backend without reduce-scatter
        total = full.clone()
        torch.distributed.all_reduce(total)
        output.copy_(total.view(ctx.world_size, -1)[ctx.rank])
        return "all_reduce_then_slice"
    zero.reduce_scatter = all_reduce_then_slice
    try:
        traffic = Traffic()
        zero.reduce_scatter_counted(torch.ones(8), traffic)
        return traffic.sent
    finally:
        zero.reduce_scatter = original


def test_a_reduce_scatter_that_fell_back_to_all_reduce_is_counted_as_one():
    for sent in run_ranks(_fallback_counted, 2):
        assert sent == {"all_reduce": 2 * 8 * 4 // 2}, sent  # two passes of (n-1)/n of 32 bytes, not one
