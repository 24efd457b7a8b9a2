"""Activation memory under tensor and sequence parallelism: the bytes autograd keeps for backward, measured with
saved_tensors_hooks, against Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", arXiv:2205.05198, §4 and Table 2).

The block is LayerNorm + MLP (h -> 4h -> h), x (batch b, seq s, hidden h). The paper's terms for it, without
dropout and counted in numbers (not bytes): the norm's input sbh, fc1's input sbh, GELU's input 4sbh, fc2's
input 4sbh, 10sbh in all. Tensor parallelism over t ranks cuts the last two: 2sbh + 8sbh/t. Sequence
parallelism also cuts the first two along the sequence: 10sbh/t. That needs fc1 to keep its input's sequence
shard and gather it again in backward (Megatron's column-parallel linear does; `GatheredLinear` below does the same).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from labsrc.lessons.model_tensor_parallel import layers as tp

NUMBERS_PER_TOKEN = {"dense": (10, 0), "tensor": (2, 8), "megatron_sp": (0, 10)}
"""Korthikanti et al. Table 2, this block's terms: (numbers per token and hidden unit kept whole, cut by t)."""


def predicted_numbers(layout: str, batch: int, seq: int, hidden: int, world_size: int) -> float:
    """The numbers one rank keeps for backward, by the paper's terms for this block (norm statistics left out)."""
    whole, split = NUMBERS_PER_TOKEN[layout]
    return batch * seq * hidden * (whole + split / world_size)


def saved_bytes(step) -> int:
    """Run step() (forward and backward) and return the bytes autograd kept for backward on this rank.

    Each storage is counted once (the same activation is often saved by two ops); parameters are left out.
    A DTensor counts its local piece.
    """
    kept, parameters = {}, set()

    def pack(tensor):
        local = getattr(tensor, "_local_tensor", tensor)
        storage = local.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    def forget_parameters(module):
        for parameter in module.parameters():
            local = getattr(parameter, "_local_tensor", parameter)
            parameters.add(local.untyped_storage().data_ptr())

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step(forget_parameters)
    return sum(size for pointer, size in kept.items() if pointer not in parameters)


def gather_sequence(shard: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather (batch, seq/t, h) shards along the sequence into (batch, seq, h)."""
    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, shard.contiguous(), group=group, async_op=True).wait(tp.ALL_REDUCE_TIMEOUT)
    return torch.cat(pieces, dim=1)


def scatter_sequence(whole: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce-scatter (batch, seq, h) partial sums into this rank's summed (batch, seq/t, h) shard."""
    pieces = [piece.contiguous() for piece in whole.chunk(dist.get_world_size(group), dim=1)]
    shard = torch.empty_like(pieces[0])
    dist.reduce_scatter(shard, pieces, group=group, async_op=True).wait(tp.ALL_REDUCE_TIMEOUT)
    return shard


class GatheredLinear(torch.autograd.Function):
    """Column-parallel linear under sequence parallelism: gather the sequence, multiply, keep only the shard.

    Backward gathers the input again for the weight gradient and reduce-scatters the input gradient.
    """

    @staticmethod
    def forward(context, shard, weight, bias):
        context.save_for_backward(shard, weight)                  # the shard, seq/t long, not the whole input
        return functional.linear(gather_sequence(shard), weight, bias)

    @staticmethod
    def backward(context, grad):
        shard, weight = context.saved_tensors
        whole = gather_sequence(shard)                            # gathered a second time
        grad_weight = grad.flatten(0, -2).T @ whole.flatten(0, -2)
        return scatter_sequence(grad @ weight), grad_weight, grad.flatten(0, -2).sum(0)


class ScatteredSum(torch.autograd.Function):
    """Row-parallel output under sequence parallelism: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(context, partial):
        return scatter_sequence(partial)

    @staticmethod
    def backward(context, grad):
        return gather_sequence(grad)


class SequenceParallelBlock(nn.Module):
    """Megatron-style LayerNorm + MLP on this rank's (batch, seq/t, h) slice: every activation cut t ways."""

    def __init__(self, dense: nn.Module, rank: int, world_size: int):
        super().__init__()
        self.norm = copy.deepcopy(dense.norm)   # whole weights; their gradients are partial sums over the ranks
        self.fc1_weight = nn.Parameter(tp.column_shard(dense.mlp.fc1.weight.detach(), rank, world_size))
        self.fc1_bias = nn.Parameter(tp.column_shard(dense.mlp.fc1.bias.detach(), rank, world_size))
        self.fc2_weight = nn.Parameter(tp.row_shard(dense.mlp.fc2.weight.detach(), rank, world_size))
        self.fc2_bias = nn.Parameter(dense.mlp.fc2.bias.detach().clone())   # whole, added to this rank's slice

    def forward(self, shard):
        features = functional.gelu(GatheredLinear.apply(self.norm(shard), self.fc1_weight, self.fc1_bias))
        return ScatteredSum.apply(functional.linear(features, self.fc2_weight)) + self.fc2_bias


def measure_block(ctx, batch: int, seq: int, hidden: int, seed: int) -> dict:
    """On one rank: bytes kept for backward by the dense block, the tensor-parallel one, torch's SequenceParallel
    plan and the Megatron-style SequenceParallelBlock; and the latter's output and gradients against dense."""
    from labsrc.lessons.model_tensor_parallel.dtensor import NormMLP, parallel_sequence_block
    rank, world_size = ctx.rank, ctx.world_size
    dense = NormMLP(tp.make_dense("mlp", hidden, 1, "cpu", seed), hidden)
    x = tp.make_input(batch, seq, hidden, "cpu", seed + 1)
    mine = x.chunk(world_size, dim=1)[rank].clone()
    norm, handwritten = copy.deepcopy(dense.norm), tp.TensorParallelMLP(dense.mlp, rank, world_size, tp.Traffic())
    sequence_block, library_block = SequenceParallelBlock(dense, rank, world_size), parallel_sequence_block(dense)

    def run(module, inputs):
        def step(forget):
            forget(module)
            output = module(inputs)
            output.sum().backward()
        return step

    measured = {"dense": saved_bytes(run(dense, x.clone().requires_grad_())),
                "tensor": saved_bytes(run(nn.Sequential(norm, handwritten), x.clone().requires_grad_())),
                "megatron_sp": saved_bytes(run(sequence_block, mine.clone().requires_grad_())),
                "torch_sp": saved_bytes(run(library_block, mine.clone().requires_grad_()))}
    return {"bytes": measured, "element_size": x.element_size(), "batch": batch, "seq": seq, "hidden": hidden,
            "world_size": world_size, **compare_sequence_block(dense, sequence_block, x, rank, world_size)}


def compare_sequence_block(dense: nn.Module, block: SequenceParallelBlock, x: torch.Tensor, rank: int,
                           world_size: int) -> dict:
    """SequenceParallelBlock against the dense block: output and input-gradient slices, every weight gradient
    (the norm's and fc2's bias all-reduced first: each rank saw only its slice of the sequence)."""
    reference, block = copy.deepcopy(dense), copy.deepcopy(block)
    whole = x.clone().requires_grad_()
    expected = reference(whole)
    expected.sum().backward()
    mine = x.chunk(world_size, dim=1)[rank].clone().requires_grad_()
    output = block(mine)
    output.sum().backward()
    for parameter in (*block.norm.parameters(), block.fc2_bias):   # each rank saw its slice of the sequence only
        dist.all_reduce(parameter.grad, async_op=True).wait(tp.ALL_REDUCE_TIMEOUT)
    fc1, fc2 = reference.mlp.fc1, reference.mlp.fc2
    pairs = [(block.norm.weight.grad, reference.norm.weight.grad), (block.norm.bias.grad, reference.norm.bias.grad),
             (block.fc1_weight.grad, tp.column_shard(fc1.weight.grad, rank, world_size)),
             (block.fc1_bias.grad, tp.column_shard(fc1.bias.grad, rank, world_size)),
             (block.fc2_weight.grad, tp.row_shard(fc2.weight.grad, rank, world_size)),
             (block.fc2_bias.grad, fc2.bias.grad)]
    return {"output_error": tp.max_error([(output, expected.detach().chunk(world_size, dim=1)[rank])]),
            "input_grad_error": tp.max_error([(mine.grad, whole.grad.chunk(world_size, dim=1)[rank])]),
            "weight_grad_error": tp.max_error(pairs),
            "scale": max(1.0, float(expected.detach().abs().max()), max(float(e.abs().max()) for _, e in pairs))}


def activations_on_forked_ranks(batch: int = 2, seq: int = 32, hidden: int = 64, seed: int = 0,
                                world_size: int = 2) -> list[dict]:
    """measure_block on world_size forked gloo CPU ranks: one dict per rank."""
    from labsrc.core.forked import run_ranks
    return run_ranks(measure_block, world_size, (batch, seq, hidden, seed), timeout_s=120)
