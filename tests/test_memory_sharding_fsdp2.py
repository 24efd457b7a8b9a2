"""Lesson 09's per-parameter FSDP by hand: equal to one process on a small transformer, and planted mistakes caught."""
import pytest
import torch
from torch import nn

from labsrc.core.forked import run_ranks
from labsrc.lessons.memory_sharding import fsdp2_by_hand as by_hand, fsdp2_runs
from labsrc.lessons.memory_sharding.transformer import token_batches


def _run(world_size, dtype, optimizer, lr):
    batches = token_batches(3, 12, seed=3)
    reference = fsdp2_runs.reference_run(batches, dtype, optimizer, lr)
    return run_ranks(fsdp2_runs.hand_fsdp_run, world_size, (batches, dtype, optimizer, lr, reference))


@pytest.mark.parametrize("world_size, dtype, optimizer, lr, tolerance", [
    (2, None, "adamw", 1e-3, 1e-6),
    (3, None, "sgd", 0.5, 1e-6),
    (2, torch.float16, "sgd", 0.5, 1e-4),
])
def test_the_sharded_transformer_follows_one_process(world_size, dtype, optimizer, lr, tolerance):
    for result in _run(world_size, dtype, optimizer, lr):
        for step in result["steps"]:
            assert step["grads_match"] and step["after_forward"] == 0 and step["after_backward"] == 0, step
            assert step["gradient_gap"] <= tolerance and step["gap"] <= tolerance, step
        ring = (world_size - 1) / world_size
        element = 2 if dtype is not None else 4
        assert result["sent"]["all_gather"] == pytest.approx(2 * 3 * result["padded"] * ring * element, abs=200)
        assert result["sent"]["reduce_scatter"] == pytest.approx(3 * result["padded"] * ring * 4, abs=200)
        assert result["peak_gathered"] <= result["largest_unit"] * element


def _planted(ctx, mistake):
    """Plant one mistake inside this rank, then train fp32 against one process."""
    if mistake == "replicated not averaged":
        def finish(self):
            flat = by_hand.flatten([p.grad for p in self.replicated], self.world_size)
            by_hand.all_reduce_counted(flat, self.traffic)
            by_hand.unflatten_into(flat, [p.grad for p in self.replicated])  # summed, not divided by n
        by_hand.PerParameterFSDP.finish_gradient_sync = finish
    elif mistake == "unreduced":
        by_hand.ShardedParameter.reduce_gradient = lambda self, full: (
            full.float().chunk(self.world_size)[dist_rank()].contiguous())
    elif mistake == "never freed":
        by_hand.ShardedParameter.free = lambda self: None
    batches = token_batches(2, 12, seed=3)
    reference = fsdp2_runs.reference_run(batches, None, "sgd", 0.5)
    return fsdp2_runs.hand_fsdp_run(ctx, batches, None, "sgd", 0.5, reference)


def dist_rank():
    return torch.distributed.get_rank()


@pytest.mark.parametrize("mistake", ["replicated not averaged", "unreduced", "never freed"])
def test_planted_mistakes_show(mistake):
    step = run_ranks(_planted, 2, (mistake,))[0]["steps"][0]
    if mistake == "never freed":
        assert step["after_forward"] > 0
    else:
        assert step["gradient_gap"] > 1e-4, step


def _embedding_first(ctx):
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))  # the flat stage 3 cannot take token ids
    by_hand.shard_model(model, compute_dtype=torch.bfloat16)
    out = model(torch.tensor([[1, 2, 3]]))
    out.float().sum().backward()
    return out.dtype, [tuple(p.grad.shape) for p in model.parameters()], [p.grad.dtype for p in model.parameters()]


def test_token_ids_pass_untouched_into_an_embedding():
    dtype, shapes, dtypes = run_ranks(_embedding_first, 2)[0]
    assert dtype == torch.bfloat16 and shapes == [(5, 4), (1, 4), (1,)] and set(dtypes) == {torch.float32}


def _fsdp2_counts(ctx, setting):
    from labsrc.lessons.memory_sharding import fsdp2_deployed as deployed
    return deployed.train_and_count(lambda m: deployed._shard_blocks(m, reshard_after_forward=setting),
                                    token_batches(1, 4, seed=1), ctx.rank, ctx.world_size)


@pytest.mark.parametrize("setting, gathers", [(True, 6), (False, 3), (None, 5)])  # None: the root kept
def test_fully_shard_from_meta_follows_one_process_and_counts_its_gathers(setting, gathers):
    for result in run_ranks(_fsdp2_counts, 2, (setting,)):
        assert result["gap"] < 1e-6
        assert result["counts"]["allgather_base"] == gathers and result["counts"]["reduce_scatter_base"] == 3


def test_the_trace_is_gather_compute_free_in_forward_and_reversed_in_backward():
    batches = token_batches(1, 8, seed=3)
    reference = fsdp2_runs.reference_run(batches, None, "sgd", 0.5)
    trace = run_ranks(fsdp2_runs.hand_fsdp_run, 2, (batches, None, "sgd", 0.5, reference))[0]["trace"]
    forward = [module for event, module, _ in trace if event == "all-gather"]
    modules = list(dict.fromkeys(forward))
    assert forward == modules + modules[::-1], "gathered once in forward, once more in backward, in reverse order"
    assert all(alive == 0 for event, _, alive in trace if event == "free"), "a module's weights outlived its forward"


def _init(ctx):
    from labsrc.lessons.memory_sharding import fsdp2_deployed as deployed
    return deployed.init_check()


def test_reset_parameters_repeats_shards_on_a_cpu_mesh_and_local_init_does_not():
    for result in run_ranks(_init, 2):
        assert result == {"reset_parameters": True, "init_local_shards": False}
