"""Lesson 07: every split model against the unsplit one on forked gloo ranks; bytes, memory and busy-time overlap."""
import pytest
import torch

from labsrc.core.forked import RankError, run_ranks
from labsrc.core.world import RequestError
from labsrc.lessons.model_tensor_parallel import cost, dtensor as library, layers as tp, naive, vocab
from labsrc.lessons.model_tensor_parallel.lab import Options

HIDDEN, HEADS, BATCH, SEQ = 32, 4, 2, 8


def block_on_rank(ctx, kind):
    dense = tp.make_dense(kind, HIDDEN, HEADS, ctx.device, seed=0)
    traffic = tp.Traffic()
    parallel_class = tp.TensorParallelMLP if kind == "mlp" else tp.TensorParallelAttention
    parallel = parallel_class(dense, ctx.rank, ctx.world_size, traffic)
    result = tp.compare_with_dense(dense, parallel, tp.make_input(BATCH, SEQ, HIDDEN, ctx.device, seed=1),
                                   ctx.rank, ctx.world_size)
    return {"outputs": result["outputs"], "gradients": result["gradients"], "calls": dict(traffic.calls),
            "bytes": dict(traffic.payload_bytes), "shard_bytes": tp.parameter_bytes(parallel),
            "dense_bytes": tp.parameter_bytes(dense), "replicated_bytes": tp.replicated_bytes(parallel)}


@pytest.mark.parametrize("kind", ["mlp", "attention"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_block_equals_dense(kind, world_size):
    for result in run_ranks(block_on_rank, world_size, (kind,)):
        torch.testing.assert_close(*result["outputs"])
        for name, (got, expected) in result["gradients"].items():
            torch.testing.assert_close(got, expected, msg=lambda m: f"{kind} {name}: {m}")


@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_all_reduce_bytes_and_memory_match_formulas(kind):
    world_size = 4
    expected = tp.expected_payload_bytes(BATCH, SEQ, HIDDEN)
    for result in run_ranks(block_on_rank, world_size, (kind,)):
        assert result["calls"] == {"forward": 1, "backward": 1}
        assert result["bytes"] == expected
        replicated = result["replicated_bytes"]
        assert result["shard_bytes"] - replicated == (result["dense_bytes"] - replicated) / world_size


def without_forward_all_reduce(ctx):
    """The row-parallel layer with its all-reduce removed must no longer match the dense MLP."""
    original = tp.ReduceFromParallel.forward
    tp.ReduceFromParallel.forward = staticmethod(lambda context, partial, traffic, group: partial.clone())
    try:
        return block_on_rank(ctx, "mlp")["outputs"]
    finally:
        tp.ReduceFromParallel.forward = original


def test_missing_all_reduce_breaks_equality():
    got, expected = run_ranks(without_forward_all_reduce, 2)[0]
    assert not torch.allclose(got, expected, atol=1e-4)


def test_shards_cut_the_right_dimension():
    weight = torch.arange(24.0).view(6, 4)
    assert tp.column_shard(weight, 1, 2).shape == (3, 4)
    assert tp.row_shard(weight, 1, 2).shape == (6, 2)
    torch.testing.assert_close(torch.cat([tp.column_shard(weight, r, 2) for r in range(2)], 0), weight)
    torch.testing.assert_close(torch.cat([tp.row_shard(weight, r, 2) for r in range(2)], 1), weight)


def test_locate_shard_finds_blocks_by_value_and_rejects_strided_ones():
    weight = torch.randn(8, 6)
    assert tp.locate_shard(weight, tp.column_shard(weight, 1, 2)) == (0, 4, 8) == tp.megatron_block("column", [8, 6], 1, 2)
    assert tp.locate_shard(weight, tp.row_shard(weight, 1, 2), first_dim=1) == (1, 3, 6) == tp.megatron_block("row", [8, 6], 1, 2)
    assert tp.locate_shard(weight, weight[1::2].clone()) is None  # interleaved rows: no contiguous block
    assert tp.locate_shard(weight, weight, first_dim=1) == (1, 0, 6)


def test_a_shard_cut_along_the_wrong_dim_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(tp, "column_shard", tp.row_shard)
    with pytest.raises(ValueError, match="does not keep all input features"):
        tp.ColumnParallelLinear(torch.nn.Linear(6, 8), 0, 2, tp.Traffic())


def naive_on_rank(ctx, layers):
    stack = naive.make_stack(layers, 64, ctx.device, seed=0)
    stage = naive.stage_of(stack, ctx.rank, ctx.world_size)
    x = tp.make_input(16, 1, 64, ctx.device, seed=1).squeeze(1)
    target = tp.make_input(16, 1, 64, ctx.device, seed=2).squeeze(1)
    errors = naive.stage_gradient_errors(stack, stage, x, target, ctx.rank, ctx.world_size)
    return errors, naive.busy_timeline(stage, x, target, ctx.rank, ctx.world_size, steps=3)


@pytest.mark.parametrize("world_size, layers", [(2, 4), (3, 5)])
def test_naive_split_gradients_equal_dense_and_ranks_take_turns(world_size, layers):
    results = run_ranks(naive_on_rank, world_size, (layers,))
    assert sum(errors["parameters"] for errors, _ in results) == 2 * layers
    for errors, _ in results:
        assert errors["grad_error"] < 1e-6 and errors["loss_error"] < 1e-6
    intervals = [busy for _, timeline in results for busy in timeline]
    overlap = naive.busy_overlap(intervals)
    assert overlap["overlap_fraction"] < 0.01, overlap
    assert naive.order_violations(intervals) == []


def test_order_violations_name_a_rank_that_started_before_receiving():
    spans = [naive.Busy(0, 0, "forward", 0.0, 2.0), naive.Busy(1, 0, "forward", 1.5, 3.0),
             naive.Busy(1, 0, "backward", 3.0, 4.0), naive.Busy(0, 0, "backward", 4.5, 5.0)]
    assert naive.order_violations(spans) == [{"step": 0, "rank": 1, "phase": "forward", "waits_for": 0, "early_s": 0.5}]
    spans[3] = naive.Busy(0, 0, "backward", 3.5, 5.0)
    assert [v["phase"] for v in naive.order_violations(spans)] == ["forward", "backward"]


def test_busy_overlap_counts_simultaneous_time():
    spans = [naive.Busy(0, 0, "forward", 0.0, 2.0), naive.Busy(1, 0, "forward", 1.0, 3.0),
             naive.Busy(1, 0, "backward", 5.0, 6.0)]
    overlap = naive.busy_overlap(spans)
    assert overlap["overlap_s"] == 1.0
    assert overlap["busy_s"] == {0: 2.0, 1: 3.0}
    assert overlap["overlap_fraction"] == pytest.approx(1.0 / 5.0)


def test_stage_bounds_cover_every_layer_once():
    assert [naive.stage_bounds(5, r, 3) for r in range(3)] == [(0, 1), (1, 3), (3, 5)]
    with pytest.raises(ValueError):
        naive.stage_bounds(1, 0, 2)


def library_on_rank(ctx):
    x = tp.make_input(BATCH, SEQ, HIDDEN, ctx.device, seed=1)
    handwritten = library.compare_with_handwritten(tp.make_dense("mlp", HIDDEN, HEADS, ctx.device, 0), x,
                                                   ctx.rank, ctx.world_size)
    sequence = library.compare_sequence_parallel(tp.make_dense("mlp", HIDDEN, HEADS, ctx.device, 0), x,
                                                 ctx.rank, ctx.world_size)
    return handwritten, sequence


def test_torch_tensor_parallel_matches_handwritten_and_dense():
    for handwritten, sequence in run_ranks(library_on_rank, 2):
        assert handwritten["output_vs_handwritten"] < 1e-5
        assert handwritten["grad_vs_handwritten"] < 1e-5
        assert handwritten["output_vs_dense"] < 1e-5
        assert handwritten["weight_shapes"]["fc1.weight"] == [2 * HIDDEN, HIDDEN]  # 4*hidden rows over 2 ranks
        assert sequence["output_error"] < 1e-5
        assert sequence["input_grad_error"] < 1e-5
        assert sequence["partial_gradients"] == ["norm.bias", "norm.weight"]   # the sequence-sharded norm's
        assert set(sequence["grad_errors"]) == {"norm.weight", "norm.bias", "mlp.fc1.weight", "mlp.fc1.bias",
                                                "mlp.fc2.weight", "mlp.fc2.bias"}
        assert max(sequence["grad_errors"].values()) < 1e-5 * max(1, sequence["gradient_scale"])
        assert sequence["local_shape"] == [BATCH, SEQ // 2, HIDDEN]


def two_dimensional_on_rank(ctx):
    dense = tp.make_dense("mlp", HIDDEN, HEADS, ctx.device, 0)
    return library.compare_two_dimensional(dense, tp.make_input(4, SEQ, HIDDEN, ctx.device, seed=1),
                                           ctx.rank, ctx.world_size)


def test_two_dimensional_mesh_gradients_equal_dense():
    results = run_ranks(two_dimensional_on_rank, 4, timeout_s=120)
    assert {(r["data_rank"], r["tensor_rank"]) for r in results} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for result in results:
        assert result["batch_rows"] == 2
        assert result["grad_error"] < result["tolerance"] <= 1e-3


def test_cost_model_crossover_where_bytes_are_equal():
    hidden, blocks = 256, 2
    tokens = cost.crossover_tokens(hidden)
    tensor_bytes = sum(cost.tensor_parallel_messages(1, hidden, blocks)) * tokens
    assert tensor_bytes == pytest.approx(sum(cost.data_parallel_messages(hidden, blocks)))
    assert len(cost.tensor_parallel_messages(64, hidden, blocks)) == 2 * blocks
    dense = tp.DenseMLP(hidden, 4 * hidden)
    assert cost.mlp_parameters(hidden) == sum(p.numel() for p in dense.parameters())


def test_options_refuse_bad_values():
    with pytest.raises(RequestError, match="multiple of heads"):
        Options.make(hidden=30, heads=4)
    with pytest.raises(RequestError):
        Options.make(naive_steps=0)
    assert Options.make(hidden=128, cost_tokens="16 64").to_argv() == ["--hidden", "128", "--cost-tokens", "16", "64"]


def test_heads_that_do_not_split_are_refused():
    with pytest.raises(RankError, match="do not split"):
        run_ranks(lambda ctx: tp.TensorParallelAttention(tp.DenseAttention(12, 3), ctx.rank, 2, tp.Traffic()), 2)


def test_vocab_parallel_loss_equals_dense_from_collectives_and_loss_parallel():
    for rank_result in vocab.vocab_on_forked_ranks(vocab=256, hidden=16, batch=2, seq=8, world_size=2, seed=1):
        mine, library_version = rank_result["collectives"], rank_result["loss_parallel"]
        assert not mine["naive_exp_finite"]   # the logits overflow exp() without the max subtracted
        for result in (mine, library_version):
            assert result["loss_error"] < 1e-5 * max(1, mine["dense_loss"])
            assert result["embedding_grad_error"] < 1e-5 and result["head_grad_error"] < 1e-5
        assert (mine["loss_calls"], mine["loss_bytes"]) == (3, 3 * 2 * 8 * 4)   # max, sum of exp, target logit
        assert mine["local_logits_bytes"] * 2 == mine["gathered_logits_bytes"] == 2 * 8 * 256 * 4
        assert library_version["local_logits_shape"] == [2, 8, 128]


def test_gelu_needs_no_communication_after_a_column_split_but_does_after_a_row_split():
    errors = vocab.nonlinearity_between_splits(tp.make_dense("mlp", 32, 4, "cpu", 0), tp.make_input(2, 4, 32, "cpu", 1), 2)
    assert errors["column_error"] < 1e-6 and errors["row_with_all_reduce_error"] < 1e-5
    assert errors["row_without_all_reduce_error"] > 0.05 * errors["scale"]


def test_vocab_checks_every_shard_boundary_and_an_off_by_one_at_the_upper_bound_fails(monkeypatch):
    assert vocab.shard_boundaries(256, 2) == [0, 127, 128, 255]
    for rank_result in vocab.vocab_on_forked_ranks(vocab=256, hidden=16, batch=2, seq=8, world_size=2, seed=1):
        assert rank_result["boundary_targets"] == rank_result["boundary_ids"] == rank_result["boundaries"]
    correct = vocab.vocab_parallel_cross_entropy

    def upper_bound_included(local_logits, targets, vocab_start, traffic, group=None):
        # the planted off-by-one: a target equal to the next shard's first id also counts on this rank
        width = local_logits.shape[-1]
        shifted = targets.clone()
        shifted[targets == vocab_start + width] = vocab_start + width - 1
        return correct(local_logits, shifted, vocab_start, traffic, group)

    monkeypatch.setattr(vocab, "vocab_parallel_cross_entropy", upper_bound_included)
    results = vocab.vocab_on_forked_ranks(vocab=256, hidden=16, batch=2, seq=8, world_size=2, seed=1)
    assert max(r["collectives"]["loss_error"] / max(1, r["collectives"]["dense_loss"]) for r in results) > 1e-3


def test_activation_memory_follows_korthikanti_terms_and_sequence_parallel_equals_dense():
    from labsrc.lessons.model_tensor_parallel import activations
    for kept in activations.activations_on_forked_ranks(batch=2, seq=16, hidden=64, world_size=2):
        unit = kept["batch"] * kept["seq"] * kept["hidden"] * kept["element_size"]
        measured = {layout: size / unit for layout, size in kept["bytes"].items()}
        for layout, expected in (("dense", 10), ("tensor", 2 + 8 / 2), ("megatron_sp", 10 / 2), ("torch_sp", 5.5)):
            assert measured[layout] == pytest.approx(expected, rel=0.01), (layout, measured)
        assert max(kept[k] for k in ("output_error", "input_grad_error", "weight_grad_error")) < 1e-5 * kept["scale"]


def test_activation_memory_sees_a_gathered_input_kept_whole(monkeypatch):
    from labsrc.lessons.model_tensor_parallel import activations

    def keeps_whole(context, shard, weight, bias):
        whole = activations.gather_sequence(shard)
        context.save_for_backward(whole, weight)   # the planted mistake: the gathered input kept, not the shard
        return torch.nn.functional.linear(whole, weight, bias)

    def backward_from_whole(context, grad):
        whole, weight = context.saved_tensors
        return (activations.scatter_sequence(grad @ weight), grad.flatten(0, -2).T @ whole.flatten(0, -2),
                grad.flatten(0, -2).sum(0))

    monkeypatch.setattr(activations.GatheredLinear, "forward", staticmethod(keeps_whole))
    monkeypatch.setattr(activations.GatheredLinear, "backward", staticmethod(backward_from_whole))
    kept = activations.activations_on_forked_ranks(batch=2, seq=16, hidden=64, world_size=2)[0]
    unit = kept["batch"] * kept["seq"] * kept["hidden"] * kept["element_size"]
    assert kept["bytes"]["megatron_sp"] / unit > 5 * 1.05   # 5.5: what torch's eager plan keeps
    assert kept["weight_grad_error"] < 1e-5 * kept["scale"]   # still the right numbers: only the memory shows it


def test_torch_plans_make_the_collectives_of_f_and_g():
    for made in library.collectives_on_forked_ranks(world_size=2):
        assert made["colwise_rowwise"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}
        sequence = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
        assert made["sequence_parallel"] == {"forward": sequence, "backward": sequence}
