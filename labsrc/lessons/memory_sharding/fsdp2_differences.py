"""Where the hand-written per-parameter FSDP (fsdp2_by_hand.py) and torch's fully_shard differ, measured on ranks.

Read against torch 2.14's torch/distributed/fsdp/_fully_shard/:
- units: one fully_shard call is one unit, its parameters packed into one all-gather (_fsdp_param_group.py,
  "copy-in"); the hand version wraps by module type and calls one collective per parameter;
- replicated parameters: fully_shard shards every parameter it manages, norms included (_fsdp_init.py,
  _get_managed_states); the hand version keeps unwrapped modules' parameters whole and all-reduces them;
- the root: reshard_after_forward=None (the default) keeps the root unit gathered after forward, since backward
  needs it first (_fully_shard.py, the docstring of reshard_after_forward); the hand version frees every module;
- reduce dtype: with param_dtype=bf16 and no reduce_dtype, fully_shard reduce-scatters in bf16 (_fsdp_api.py,
  MixedPrecisionPolicy); the hand version always reduces in fp32;
- overlap: fully_shard prefetches the next unit's all-gather and runs collectives on their own CUDA streams
  (_fsdp_param_group.py); the hand version gathers and reduces in line, one after the other;
- the optimizer's view: fully_shard hands out the unpadded rows (a narrow of the padded shard, _fsdp_param.py);
  the hand version's parameter is the padded shard, zero rows included;
- averaging: fully_shard reduces with ReduceOp.AVG for fp32/bf16 and divides before and after for fp16
  (_fsdp_collectives.py, _get_gradient_divide_factors); the hand version sums, then divides by n.
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from labsrc.lessons.memory_sharding.fsdp2_by_hand import shard_model
from labsrc.lessons.memory_sharding.transformer import loss_of, tiny_transformer, token_batches
from labsrc.lessons.memory_sharding.zero import counted_collectives

SHOWN = ("head.weight", "norm.weight")


def shard_blocks(model, **options):
    """fully_shard each block, then the root (embedding, final norm, head)."""
    for block in model.blocks:
        fully_shard(block, **options)
    return fully_shard(model, **options)


def what_the_optimizer_sees(ctx) -> dict:
    """The shapes of SHOWN parameters on this rank: the hand version's parameters, fully_shard's local tensors."""
    hand = tiny_transformer()
    shard_model(hand)
    torch_model = shard_blocks(tiny_transformer())
    return {"hand": {name: tuple(p.shape) for name, p in hand.named_parameters() if name in SHOWN},
            "fully_shard": {name: tuple(p.to_local().shape) for name, p in torch_model.named_parameters()
                            if name in SHOWN}}


def reduce_scatter_bytes(ctx) -> dict:
    """Bytes fully_shard hands to reduce-scatter in one backward under a bf16 param_dtype, per reduce_dtype."""
    tokens, targets = token_batches(1, 8, seed=1)[0]
    tokens, targets = tokens.chunk(ctx.world_size)[ctx.rank], targets.chunk(ctx.world_size)[ctx.rank]
    sent = {}
    for reduce_dtype in (None, torch.float32):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        model = shard_blocks(tiny_transformer(), mp_policy=policy)
        loss = loss_of(model(tokens), targets)
        with counted_collectives() as counted:
            loss.backward()
        sent[str(reduce_dtype).replace("torch.", "")] = sum(v for k, v in counted.items()
                                                            if k.startswith("reduce_scatter"))
    return sent
