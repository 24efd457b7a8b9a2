"""DeepSpeed ZeRO stages 0-3 on the same small model, step for step beside one process (an optional extra).

DeepSpeed is not in the default set-up: `make deepspeed` installs requirements-deepspeed.txt (DS_BUILD_OPS=0,
no ops compiled at install). On the CPU it runs with DS_ACCELERATOR=cpu, which picks gloo (oneCCL when its torch
bindings are installed). Even so, the first deepspeed.initialize compiles one small C++ op, its shared-memory
collectives (deepspeed_shm_comm), with the system's c++ and ninja, and probing which ops could be built links
against libaio (Debian: libaio-dev); the build is cached under TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions).
"""
from __future__ import annotations

import importlib.util
from contextlib import contextmanager

import torch
from torch import nn

from labsrc.core.processes import environment_set
from labsrc.lessons.memory_sharding.memory import deep_mlp

MISSING = "DeepSpeed is not installed: `make deepspeed` adds it"


def available() -> tuple[bool, str]:
    """(installed, why not) without importing DeepSpeed (its import takes seconds)."""
    if importlib.util.find_spec("deepspeed") is None:
        return False, MISSING
    return True, ""


def zero_config(stage: int, global_batch: int, world_size: int) -> dict:
    """The ZeRO configuration, field by field (fp32, so every stage can be compared with one process exactly)."""
    return {
        "train_batch_size": global_batch,  # samples per optimizer step over all ranks
        "train_micro_batch_size_per_gpu": global_batch // world_size,  # per rank per forward ("gpu" even on CPU)
        "gradient_accumulation_steps": 1,  # train_batch_size = micro batch x accumulation x ranks
        "zero_force_ds_cpu_optimizer": False,  # allow our torch AdamW (DeepSpeed would want its compiled one)
        "zero_optimization": {
            "stage": stage,  # 0 DDP, 1 optimizer state, 2 + gradients, 3 + parameters (FSDP2's fully_shard)
            "overlap_comm": False,  # overlap reduction with backward (FSDP2 always overlaps on GPUs)
            "contiguous_gradients": True,  # copy gradients into one buffer as they arrive (less fragmentation)
            "reduce_bucket_size": 5e5,  # elements per gradient reduction (DDP's bucket_cap_mb)
            "stage3_param_persistence_threshold": 0,  # parameters smaller than this stay whole: 0 shards them all
            "stage3_prefetch_bucket_size": 5e4,  # elements gathered ahead of use (FSDP2's prefetching)
            "stage3_max_live_parameters": 1e6,  # gathered elements allowed at once before freeing
            "stage3_max_reuse_distance": 0,  # free a gathered parameter at once (reshard_after_forward=True)
            "stage3_gather_16bit_weights_on_model_save": False,  # save shards, not a gathered full model
        },
    }


@contextmanager
def deepspeed_environment(ctx):
    """The variables DeepSpeed reads to find its rank, set for the block and restored after."""
    values = {"DS_ACCELERATOR": "cpu", "RANK": str(ctx.rank), "LOCAL_RANK": str(ctx.local_rank),
              "WORLD_SIZE": str(ctx.world_size), "LOCAL_WORLD_SIZE": str(ctx.world_size)}
    with environment_set(values):
        yield


def train_deepspeed(ctx, stage: int, depth: int, width: int, batches, lr: float) -> list[dict]:
    """Train deep_mlp with DeepSpeed ZeRO `stage` on this rank's slice of each batch; full parameters per step."""
    import deepspeed
    with deepspeed_environment(ctx):
        model = deep_mlp(depth, width)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config=zero_config(stage, len(batches[0][0]), ctx.world_size))
        trajectory = []
        for x, y in batches:
            x, y = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
                trajectory.append({name: p.detach().clone() for name, p in engine.module.named_parameters()})
        engine.destroy()
    return trajectory
