"""The vocabulary split across ranks: a vocab-parallel embedding, LM head and cross-entropy, from collectives and
with torch's loss_parallel, against the dense model; and why fc1 is split by columns (GELU between the layers).

Written after Megatron-LM's VocabParallelEmbedding and vocab_parallel_cross_entropy (Shoeybi et al. 2019, §3):
each rank holds rows [r·V/n, (r+1)·V/n) of the embedding and of the output head, so no rank ever holds a
(tokens, V) logits tensor. torch: ColwiseParallel(output_layouts=Shard(-1)) on the head and
torch.distributed.tensor.parallel.loss_parallel() around F.cross_entropy (torch 2.11-2.14).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from labsrc.lessons.model_tensor_parallel import layers as tp


class DenseLanguageModel(nn.Module):
    """ids (batch, seq) -> embedding (batch, seq, hidden) -> head -> logits (batch, seq, vocab)."""

    def __init__(self, vocab: int, hidden: int, logit_scale: float):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            self.head.weight.mul_(logit_scale)   # logits of tens to hundreds: exp() overflows float32 above ~88

    def forward(self, ids):
        return self.head(self.embedding(ids))


def make_language_model(vocab: int, hidden: int, seed: int, logit_scale: float = 40.0) -> DenseLanguageModel:
    """The same dense model on every rank, from a seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DenseLanguageModel(vocab, hidden, logit_scale)


class VocabParallelLanguageModel(nn.Module):
    """This rank's rows of the embedding and of the head: ids (batch, seq) -> local logits (batch, seq, V/n).

    Embedding: ids outside this rank's rows look up zeros, and g sums the ranks' rows (one all-reduce of
    batch·seq·hidden). Head: f, then this rank's V/n output features (column-parallel, no bias).
    """

    def __init__(self, dense: DenseLanguageModel, rank: int, world_size: int, traffic: tp.Traffic, group=None):
        super().__init__()
        vocab = dense.embedding.num_embeddings
        if vocab % world_size:
            raise ValueError(f"a vocabulary of {vocab} does not split over {world_size} ranks: pad it to a multiple")
        self.start, self.stop = rank * vocab // world_size, (rank + 1) * vocab // world_size
        self.embedding = nn.Parameter(dense.embedding.weight.detach()[self.start:self.stop].clone())
        self.head = nn.Parameter(tp.column_shard(dense.head.weight.detach(), rank, world_size))
        self.traffic, self.group = traffic, group

    def forward(self, ids):
        mine = (ids >= self.start) & (ids < self.stop)
        rows = functional.embedding((ids - self.start).clamp(0, self.stop - self.start - 1), self.embedding)
        hidden = tp.ReduceFromParallel.apply(rows * mine.unsqueeze(-1), self.traffic, self.group)
        return functional.linear(tp.CopyToParallel.apply(hidden, self.traffic, self.group), self.head)


def all_reduce_max(tensor: torch.Tensor, traffic: tp.Traffic, group=None) -> torch.Tensor:
    """The largest value over the group, in place, counted in traffic, waiting at most ALL_REDUCE_TIMEOUT."""
    traffic.add("forward", tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True).wait(tp.ALL_REDUCE_TIMEOUT)
    return tensor


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 traffic: tp.Traffic, group=None) -> torch.Tensor:
    """Mean cross-entropy of logits split over the vocabulary: local_logits (tokens, V/n), targets (tokens,).

    Three all-reduces of `tokens` numbers each, never the (tokens, V) logits:
    1. max: every rank subtracts the same, global, largest logit of each token (exp() of a logit above ~88
       overflows float32; a rank's own maximum would shift each rank's exps by a different amount);
    2. sum of exp over each rank's V/n logits: the softmax denominator;
    3. the target's logit, found on the one rank whose rows hold it (zero elsewhere).
    The sums are g (backward: identity), so each rank's logits get softmax - one_hot on their own V/n columns.
    The max needs no gradient: the loss does not change when every logit of a token moves by the same amount.
    """
    largest = all_reduce_max(local_logits.detach().max(dim=-1).values.contiguous(), traffic, group)
    shifted = local_logits - largest.unsqueeze(-1)
    sum_exp = tp.ReduceFromParallel.apply(shifted.exp().sum(dim=-1), traffic, group)
    width = local_logits.shape[-1]
    mine = (targets >= vocab_start) & (targets < vocab_start + width)
    index = (targets - vocab_start).clamp(0, width - 1).unsqueeze(-1)
    target_logit = tp.ReduceFromParallel.apply(shifted.gather(-1, index).squeeze(-1) * mine, traffic, group)
    return (sum_exp.log() - target_logit).mean()


def compare_vocab_parallel(dense: DenseLanguageModel, ids: torch.Tensor, targets: torch.Tensor, rank: int,
                           world_size: int) -> dict:
    """The collectives version against the dense model: loss, embedding and head gradient rows; bytes counted
    per phase (model: embedding and head; loss: the three all-reduces), beside what all-gathering the logits
    would move and hold."""
    model_traffic, loss_traffic = tp.Traffic(), tp.Traffic()
    parallel = VocabParallelLanguageModel(dense, rank, world_size, model_traffic)
    local_logits = parallel(ids).flatten(0, 1)
    loss = vocab_parallel_cross_entropy(local_logits, targets.flatten(), parallel.start, loss_traffic)
    loss.backward()
    reference = copy.deepcopy(dense)
    dense_loss = functional.cross_entropy(reference(ids).flatten(0, 1), targets.flatten())
    dense_loss.backward()
    tokens, vocab = targets.numel(), dense.embedding.num_embeddings
    return {"loss": loss.item(), "dense_loss": dense_loss.item(), "loss_error": abs(loss.item() - dense_loss.item()),
            "embedding_grad_error": tp.max_error([(parallel.embedding.grad,
                                                   reference.embedding.weight.grad[parallel.start:parallel.stop])]),
            "head_grad_error": tp.max_error([(parallel.head.grad, tp.column_shard(reference.head.weight.grad, rank,
                                                                                  world_size))]),
            "loss_calls": loss_traffic.calls["forward"], "loss_bytes": loss_traffic.total_bytes,
            "model_calls": dict(model_traffic.calls), "model_bytes": dict(model_traffic.payload_bytes),
            "gathered_logits_bytes": tokens * vocab * local_logits.element_size(),
            "local_logits_bytes": local_logits.numel() * local_logits.element_size(),
            "naive_exp_finite": bool(torch.isfinite(reference(ids).detach().exp().sum(-1)).all())}


def compare_loss_parallel(dense: DenseLanguageModel, ids: torch.Tensor, targets: torch.Tensor, rank: int,
                          world_size: int) -> dict:
    """torch's version: RowwiseParallel embedding, ColwiseParallel head with logits left Shard(-1) as a DTensor,
    F.cross_entropy inside loss_parallel(); loss and gradient pieces against the dense model."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)
    from labsrc.lessons.model_tensor_parallel.dtensor import mesh_of, plain
    mesh = mesh_of(ids.device, (world_size,), ("tensor",))
    plan = {"embedding": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    parallel = parallelize_module(copy.deepcopy(dense), mesh, plan)
    logits = parallel(ids)
    with loss_parallel():
        loss = functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    reference = copy.deepcopy(dense)
    dense_loss = functional.cross_entropy(reference(ids).flatten(0, 1), targets.flatten())
    dense_loss.backward()
    grads = {name: plain(p.grad.redistribute(p.device_mesh, p.placements))   # placed like the weight it updates
             for name, p in parallel.named_parameters()}
    return {"loss_error": abs(plain(loss).item() - dense_loss.item()),
            "embedding_grad_error": tp.max_error([(grads["embedding.weight"],
                                                   reference.embedding.weight.grad.chunk(world_size)[rank])]),
            "head_grad_error": tp.max_error([(grads["head.weight"], reference.head.weight.grad.chunk(world_size)[rank])]),
            "grad_placements": {name: str(p.grad.placements) for name, p in parallel.named_parameters()},
            "local_logits_shape": list(plain(logits).shape)}


def shard_boundaries(vocab: int, world_size: int) -> list[int]:
    """The first and last id of every rank's rows: where an off-by-one in a shard's bounds shows."""
    return sorted({i for r in range(world_size) for i in (r * vocab // world_size, (r + 1) * vocab // world_size - 1)})


def ids_with_boundaries(vocab: int, batch: int, seq: int, world_size: int, generator) -> torch.Tensor:
    """Random ids (batch, seq), the first of them replaced by every shard boundary (random ids rarely hit one)."""
    ids = torch.randint(vocab, (batch, seq), generator=generator)
    boundaries = torch.tensor(shard_boundaries(vocab, world_size))
    ids.view(-1)[:len(boundaries)] = boundaries
    return ids


def _vocab_rank(ctx, vocab: int, hidden: int, batch: int, seq: int, seed: int) -> dict:
    dense = make_language_model(vocab, hidden, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    ids, targets = (ids_with_boundaries(vocab, batch, seq, ctx.world_size, generator) for _ in range(2))
    boundaries = set(shard_boundaries(vocab, ctx.world_size))
    return {"collectives": compare_vocab_parallel(dense, ids, targets, ctx.rank, ctx.world_size),
            "loss_parallel": compare_loss_parallel(dense, ids, targets, ctx.rank, ctx.world_size),
            "boundaries": sorted(boundaries),
            "boundary_targets": sorted(boundaries & set(targets.flatten().tolist())),
            "boundary_ids": sorted(boundaries & set(ids.flatten().tolist()))}


def vocab_on_forked_ranks(vocab: int = 1024, hidden: int = 32, batch: int = 4, seq: int = 16, seed: int = 0,
                          world_size: int = 2) -> list[dict]:
    """Both vocab-parallel versions on world_size forked gloo CPU ranks: one dict per rank."""
    from labsrc.core.forked import run_ranks
    return run_ranks(_vocab_rank, world_size, (vocab, hidden, batch, seq, seed), timeout_s=120)


def nonlinearity_between_splits(dense: tp.DenseMLP, x: torch.Tensor, world_size: int) -> dict:
    """Why fc1 is column-parallel: GELU of each rank's column slice is the slice of the dense GELU (no
    communication between fc1 and fc2), but GELU of each rank's partial row-product summed afterwards is not
    GELU of the sum (a row-parallel fc1 needs an all-reduce before the GELU). Largest differences, one process."""
    weight, bias = dense.fc1.weight.detach(), dense.fc1.bias.detach()
    whole = functional.gelu(functional.linear(x, weight, bias))
    column = torch.cat([functional.gelu(functional.linear(x, w, b))
                        for w, b in zip(weight.chunk(world_size, 0), bias.chunk(world_size, 0))], dim=-1)
    partials = [functional.linear(x_slice, w) for x_slice, w in zip(x.chunk(world_size, -1), weight.chunk(world_size, 1))]
    row_gelu_then_sum = sum(functional.gelu(p + bias / world_size) for p in partials)   # GELU on each part, summed
    row_sum_then_gelu = functional.gelu(sum(partials) + bias)
    return {"column_error": float((column - whole).abs().max()),
            "row_without_all_reduce_error": float((row_gelu_then_sum - whole).abs().max()),
            "row_with_all_reduce_error": float((row_sum_then_gelu - whole).abs().max()),
            "scale": float(whole.abs().max())}
