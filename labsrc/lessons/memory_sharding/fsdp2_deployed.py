"""FSDP2 the way it is deployed, on 4 gloo ranks: the model built on the meta device and materialised shard by
shard, fully_shard per block then the root, activation checkpointing per block, reshard_after_forward True /
False / an int, HSDP and FSDP + tensor parallelism on 2-D meshes, and FSDP2's collectives counted.

    run_ranks(deployed_experiments, 4)   # one call: every experiment on the same 4 ranks
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

from labsrc.lessons.memory_sharding.memory import saved_activation_bytes
from labsrc.lessons.memory_sharding.transformer import TinyTransformer, loss_of, tiny_transformer, token_batches
from labsrc.lessons.memory_sharding.zero import counted_collectives


def init_local_shards(model: nn.Module, seed: int = 0) -> None:
    """Initialise every parameter shard where it lives, after to_empty: N(0, 0.02) weights, norms at 1.

    Each shard draws from its own generator, keyed by the seed and its place on the mesh's sharded dims, so no two
    shards repeat each other, and replicas (HSDP's replicate dim) draw the same values. On a CPU mesh
    reset_parameters() on DTensors cannot do this: torch warns, and every rank draws the same shard.
    """
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            local, index = parameter, 0
            if isinstance(parameter, DTensor):
                local = parameter.to_local()
                coordinate = parameter.device_mesh.get_coordinate()
                for position, placement in zip(coordinate, parameter.placements):
                    if placement.is_shard():
                        index = index * 1000 + position + 1
            generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
            if "norm" in name:
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02, generator=generator)


def shards_repeat(model: nn.Module) -> bool:
    """True when two ranks hold the same values in a sharded weight matrix (they drew the same random numbers)."""
    for parameter in model.parameters():
        if isinstance(parameter, DTensor) and parameter.dim() == 2:
            pieces = parameter.full_tensor().chunk(dist.get_world_size())
            if any(torch.equal(a, b) for i, a in enumerate(pieces) for b in pieces[i + 1:]):
                return True
    return False


def init_check(seed: int = 0) -> dict:
    """The same meta-built, sharded model initialised two ways, every rank seeded alike (as launchers do)."""
    result = {}
    for way in ("reset_parameters", "init_local_shards"):
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = TinyTransformer(vocab=48, dim=16, blocks=1)  # every dim 0 divides by 2 and 4: equal shards
        _shard_blocks(model)
        model.to_empty(device="cpu")
        if way == "reset_parameters":
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        else:
            init_local_shards(model, seed)
        result[way] = shards_repeat(model)
    return result


def _resident_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset this process's peak resident memory (Linux: writing 5 to /proc/self/clear_refs); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def _shard_blocks(model: TinyTransformer, **options) -> TinyTransformer:
    """fully_shard each block (one all-gather per block), then the root (embedding, final norm, head)."""
    for block in model.blocks:
        fully_shard(block, **options)
    return fully_shard(model, **options)


def build_peak(meta: bool, dim: int, blocks: int) -> dict:
    """Peak resident memory this rank gains while building and sharding a model of dim/blocks, measured.

    meta=True: built on the meta device (shapes only), sharded, then to_empty + init_local_shards allocate and
    initialise this rank's shards only. meta=False: built in full, then sharded. A small model is sharded first,
    so that lazy imports and first-call set-up are not counted.
    """
    with torch.device("meta"):
        warm = TinyTransformer(dim=8, blocks=1)
    _shard_blocks(warm).to_empty(device="cpu")
    del warm
    if not _reset_peak() or _resident_bytes("VmRSS") is None:
        return {"measured": False}
    start = _resident_bytes("VmRSS")
    context = torch.device("meta") if meta else contextlib.nullcontext()
    with context:
        model = TinyTransformer(dim=dim, blocks=blocks)
    _shard_blocks(model)
    if meta:
        model.to_empty(device="cpu")
        init_local_shards(model)
    peak = _resident_bytes("VmHWM") - start
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"measured": True, "peak": peak, "local": local, "full": full}


def _sharded_copy(reference: nn.Module, shard) -> nn.Module:
    """The reference's weights in a model built on meta and sharded by shard(model), the way a checkpoint loads:
    rank 0 alone passes the full state dict, every other rank {}. torch broadcasts each tensor whole from rank 0,
    one at a time, and each rank keeps its slice (torch/distributed/_state_dict_utils.py, _broadcast_tensors): a
    rank holds one full tensor at a time beyond its shards, rank 0 the whole state dict."""
    with torch.device("meta"):
        model = TinyTransformer()
    shard(model)
    model.to_empty(device="cpu")
    full = reference.state_dict() if dist.get_rank() == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * 4 for t in tensors)


def train_and_count(shard, batches, data_rank: int, data_ranks: int, checkpoint_blocks: bool = False) -> dict:
    """Train a copy sharded by shard(model) for len(batches) SGD steps on slice data_rank of data_ranks, beside
    one process on whole batches: the largest parameter gap after the last step, the bytes of parameters this
    rank holds between forward and backward, FSDP2's collectives in the last step (CommDebugMode) and the bytes
    each sent (counted_collectives), and the parameters' bytes with dim 0 padded to a multiple of the world size."""
    reference = tiny_transformer()
    model = _sharded_copy(reference, shard)
    model.checkpoint_blocks = checkpoint_blocks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    between, counts = 0, {}
    for tokens, targets in batches:
        loss_of(reference(tokens), targets).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        tokens, targets = tokens.chunk(data_ranks)[data_rank], targets.chunk(data_ranks)[data_rank]
        with CommDebugMode() as comm, counted_collectives() as sent:
            loss = loss_of(model(tokens), targets)
            between = _local_bytes(model.parameters())
            loss.backward()
        counts = {str(op).split(".")[-1].strip("_"): n for op, n in comm.get_comm_counts().items()}
        optimizer.step()
        optimizer.zero_grad()
    full = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for name, p in model.named_parameters()}
    gap = max(float((full[name] - p.detach()).abs().max()) for name, p in reference.named_parameters())
    n = dist.get_world_size()
    return {"gap": gap, "between": between, "counts": counts, "sent": sent,
            "full_bytes": sum(p.numel() * 4 for p in reference.parameters()),
            "padded_bytes": sum(-(-p.shape[0] // n) * n * p[0].numel() * 4 for p in reference.parameters())}


def tensor_parallel_block(block: nn.Module, mesh, one_f: bool = False) -> None:
    """Lesson 07's recipe on one block: q, k, v and the MLP's first Linear cut by columns (whole heads per rank),
    the attention output and the MLP's second Linear by rows.

    q, k and v are three modules: each all-reduces its own input gradient in backward (three f's). one_f=True
    hands the attention module its input as a Replicate DTensor (torchtitan's PrepareModuleInput), so the three
    gradients add up as one Partial tensor and are all-reduced once: Megatron's single f."""
    plan = {"attention.query": ColwiseParallel(), "attention.key": ColwiseParallel(),
            "attention.value": ColwiseParallel(), "attention.out": RowwiseParallel(),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
    if one_f:
        plan["attention"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                               use_local_output=False)
    parallelize_module(block, mesh, plan)


def deployed_experiments(ctx, steps: int = 2, batch: int = 8, build_dim: int = 512, build_blocks: int = 4) -> dict:
    """Every experiment of this module on 4 ranks; returns what each measured, per set-up."""
    if ctx.world_size != 4:
        raise ValueError(f"these experiments use a 2 x 2 mesh: run them on 4 ranks, not {ctx.world_size}.")
    batches = token_batches(steps, batch, seed=1)
    rank = dist.get_rank()
    out = {"init": init_check(), "build": {kind: build_peak(kind == "meta", build_dim, build_blocks)
                                           for kind in ("meta", "full")}}
    for setting in (True, False, 2, None):
        out[f"reshard {setting}"] = train_and_count(
            lambda m, setting=setting: _shard_blocks(m, reshard_after_forward=setting), batches, rank, 4)
    out["checkpointed"] = train_and_count(lambda m: _shard_blocks(m), batches, rank, 4, checkpoint_blocks=True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out["hsdp"] = train_and_count(lambda m: _shard_blocks(m, mesh=mesh), batches, mesh["replicate"].get_local_rank()
                                  * 2 + mesh["shard"].get_local_rank(), 4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for name, one_f in (("fsdp + tp", False), ("fsdp + tp, one f", True)):
        def fsdp_and_tp(model, one_f=one_f):
            for block in model.blocks:
                tensor_parallel_block(block, mesh["tp"], one_f)
            return _shard_blocks(model, mesh=mesh["dp"])
        out[name] = train_and_count(fsdp_and_tp, batches, mesh["dp"].get_local_rank(), 2)
    return out
