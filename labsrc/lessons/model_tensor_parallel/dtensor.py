"""The same tensor parallelism with DeviceMesh and torch.distributed.tensor.parallel, checked against the hand-written one.

Import paths used (torch 2.11-2.14): torch.distributed.device_mesh.init_device_mesh,
torch.distributed.tensor.parallel.parallelize_module / ColwiseParallel / RowwiseParallel / SequenceParallel,
torch.distributed.tensor.Shard / DTensor. Their collectives wait at most the process group's timeout (the
lab's pg_timeout_s); the one all_reduce called here directly waits at most ALL_REDUCE_TIMEOUT.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from labsrc.lessons.model_tensor_parallel import layers as tp


def mesh_of(device: torch.device, shape: tuple[int, ...], names: tuple[str, ...]):
    """A DeviceMesh over every rank (a process group per mesh axis), on the ranks' device type."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def plain(tensor) -> torch.Tensor:
    """A local, finished, detached tensor from what a parallelized module returns (AsyncCollectiveTensor,
    DTensor or a plain tensor)."""
    from torch.distributed.tensor import DTensor
    tensor = tensor.detach()
    if hasattr(tensor, "wait"):
        tensor = tensor.wait()
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def parallel_mlp(dense: tp.DenseMLP, mesh) -> nn.Module:
    """A copy of dense with fc1 column-wise and fc2 row-wise over the mesh: the plan of TensorParallelMLP."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    return parallelize_module(copy.deepcopy(dense), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def local_gradients(module: nn.Module) -> dict:
    """{name: this rank's piece of the gradient} for a parallelized module's parameters."""
    return {name: plain(p.grad) for name, p in module.named_parameters()}


def compare_with_handwritten(dense: tp.DenseMLP, x: torch.Tensor, rank: int, world_size: int) -> dict:
    """ColwiseParallel/RowwiseParallel MLP vs TensorParallelMLP vs dense on x (batch, seq, hidden): largest
    differences of outputs and of every rank-local gradient piece."""
    mesh = mesh_of(x.device, (world_size,), ("tensor",))
    handwritten = tp.TensorParallelMLP(dense, rank, world_size, tp.Traffic())
    library = parallel_mlp(dense, mesh)
    probe = torch.linspace(-1, 1, x.numel(), device=x.device).view_as(x)
    outputs = {}
    for name, module in (("handwritten", handwritten), ("library", library), ("dense", dense)):
        output = module(x)
        (output * probe).sum().backward()
        outputs[name] = plain(output)
    library_grads = local_gradients(library)
    handwritten_grads = {name: p.grad for name, p in handwritten.named_parameters()}
    return {"output_vs_handwritten": tp.max_error([(outputs["library"], outputs["handwritten"])]),
            "output_vs_dense": tp.max_error([(outputs["library"], outputs["dense"])]),
            "grad_vs_handwritten": tp.max_error([(library_grads[n], handwritten_grads[n]) for n in handwritten_grads]),
            "weight_shapes": {n: list(g.shape) for n, g in library_grads.items()}}


class NormMLP(nn.Module):
    """LayerNorm then the MLP: (batch, seq, hidden) -> (batch, seq, hidden); the block sequence parallelism splits."""

    def __init__(self, dense: tp.DenseMLP, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = copy.deepcopy(dense)

        with torch.no_grad():   # not all ones and zeros, so the norm's gradients are not trivial
            self.norm.weight.copy_(torch.linspace(0.5, 1.5, hidden))
            self.norm.bias.copy_(torch.linspace(-0.2, 0.2, hidden))

    def forward(self, x):
        return self.mlp(self.norm(x))


def parallel_sequence_block(block: NormMLP) -> nn.Module:
    """A copy of block parallelized with torch's sequence-parallel plan over every rank: the norm on this rank's
    slice of the sequence, an all-gather into fc1, a reduce-scatter out of fc2 (input and output (b, s/t, h))."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    device = next(block.parameters()).device
    mesh = mesh_of(device, (dist.get_world_size(),), ("tensor",))
    plan = {"norm": SequenceParallel(), "mlp.fc1": ColwiseParallel(input_layouts=Shard(1)),
            "mlp.fc2": RowwiseParallel(output_layouts=Shard(1))}
    return parallelize_module(copy.deepcopy(block), mesh, plan)


def finish_partial_gradients(module: nn.Module) -> dict:
    """{name: this rank's finished gradient} for a parallelized module: a gradient DTensor still Partial(sum) is
    all-reduced over its mesh axis first (redistribute to Replicate).

    Under sequence parallelism each rank's LayerNorm sees only its slice of the sequence, so its weight and bias
    gradients are partial sums: torch keeps them as Partial(sum) DTensors, and `.to_local()` of one reads this
    rank's share only. Megatron all-reduces the norm gradients over the tensor-parallel group for the same reason.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate
    finished = {}
    for name, parameter in module.named_parameters():
        grad = parameter.grad
        if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
            grad = grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)   # the all-reduce
        finished[name] = plain(grad)
    return finished


def compare_sequence_parallel(dense: tp.DenseMLP, x: torch.Tensor, rank: int, world_size: int) -> dict:
    """SequenceParallel LayerNorm on this rank's slice of the sequence, all-gather into ColwiseParallel fc1,
    reduce-scatter out of RowwiseParallel fc2, against the dense block: the output slice (batch, seq/n, hidden),
    the input gradient's slice and every parameter's gradient (norm weight and bias included), each cut like its
    placement. The norm's weight and bias are not all ones and zeros, so their gradients are not trivial."""
    from torch.distributed.tensor import Partial, Shard
    block = NormMLP(dense, x.shape[-1]).to(x.device)
    reference = copy.deepcopy(block)
    parallel = parallel_sequence_block(block)
    probe = torch.linspace(-1, 1, x.numel(), device=x.device).view_as(x)
    local_x = x.chunk(world_size, dim=1)[rank].clone().requires_grad_()
    output = parallel(local_x)
    (output * probe.chunk(world_size, dim=1)[rank]).sum().backward()
    partial = sorted(name for name, p in parallel.named_parameters()
                     if any(isinstance(placement, Partial) for placement in p.grad.placements))
    gradients = finish_partial_gradients(parallel)
    whole_x = x.clone().requires_grad_()
    expected = reference(whole_x)
    (expected * probe).sum().backward()
    errors = {}
    for name, parameter in parallel.named_parameters():
        placement, whole = parameter.placements[0], dict(reference.named_parameters())[name].grad
        cut = whole.chunk(world_size, dim=placement.dim)[rank] if isinstance(placement, Shard) else whole
        errors[name] = tp.max_error([(gradients[name], cut)])
    return {"output_error": tp.max_error([(plain(output), expected.detach().chunk(world_size, dim=1)[rank])]),
            "input_grad_error": tp.max_error([(local_x.grad, whole_x.grad.chunk(world_size, dim=1)[rank])]),
            "grad_errors": errors, "partial_gradients": partial, "local_shape": list(plain(output).shape),
            "gradient_scale": max(float(p.grad.abs().max()) for p in reference.parameters())}


def compare_two_dimensional(dense: tp.DenseMLP, x: torch.Tensor, rank: int, world_size: int) -> dict:
    """A (data, tensor) mesh of shape (n/2, 2): each data group takes its slice of the batch through a
    tensor-parallel MLP, gradients are summed over the data axis; every gradient piece vs the dense model's
    gradient of the whole batch, cut like the piece's placement."""
    from torch.distributed.tensor import Shard
    tensor_size = 2
    mesh = mesh_of(x.device, (world_size // tensor_size, tensor_size), ("data", "tensor"))
    data_rank, tensor_rank = mesh.get_local_rank("data"), mesh.get_local_rank("tensor")
    library = parallel_mlp(dense, mesh["tensor"])
    probe = torch.linspace(-1, 1, x.numel(), device=x.device).view_as(x)
    batch_slice = slice(data_rank * x.shape[0] * tensor_size // world_size,
                        (data_rank + 1) * x.shape[0] * tensor_size // world_size)
    (library(x[batch_slice]) * probe[batch_slice]).sum().backward()
    (dense(x) * probe).sum().backward()
    dense_grads, errors = dict(dense.named_parameters()), []
    for name, parameter in library.named_parameters():
        piece = plain(parameter.grad).contiguous()
        dist.all_reduce(piece, group=mesh.get_group("data"), async_op=True).wait(tp.ALL_REDUCE_TIMEOUT)
        placement = parameter.placements[0]
        whole = dense_grads[name].grad
        expected = whole.chunk(tensor_size, dim=placement.dim)[tensor_rank] if isinstance(placement, Shard) else whole
        errors.append((piece, expected))
    return {"grad_error": tp.max_error(errors), "tolerance": tp.tolerance(max(float(e.abs().max()) for _, e in errors)),
            "data_rank": data_rank, "tensor_rank": tensor_rank,
            "batch_rows": batch_slice.stop - batch_slice.start}


def _two_dimensional_rank(ctx, hidden: int, heads: int, batch: int, seq: int, seed: int) -> dict:
    dense = tp.make_dense("mlp", hidden, heads, ctx.device, seed)
    return compare_two_dimensional(dense, tp.make_input(batch, seq, hidden, ctx.device, seed + 3), ctx.rank,
                                   ctx.world_size)


def two_dimensional_on_forked_ranks(hidden: int, heads: int, batch: int, seq: int, seed: int = 0,
                                    world_size: int = 4) -> list[dict]:
    """compare_two_dimensional on world_size forked gloo CPU ranks (no torchrun launch): one dict per rank."""
    from labsrc.core.forked import run_ranks
    return run_ranks(_two_dimensional_rank, world_size, (hidden, heads, batch, seq, seed), timeout_s=120)


def count_collectives(module: nn.Module, x: torch.Tensor) -> dict:
    """{"forward": {collective: calls}, "backward": {...}} that torch's parallelized module made on this rank,
    counted with torch.distributed.tensor.debug.CommDebugMode (sum(output) as the loss)."""
    from torch.distributed.tensor.debug import CommDebugMode
    counts = {}
    with CommDebugMode() as forward:
        output = module(x.clone().requires_grad_())   # an input that needs its gradient, as inside a model
    counts["forward"] = {str(op).split(".")[-1]: n for op, n in forward.get_comm_counts().items()}
    with CommDebugMode() as backward:
        output.sum().backward()
    counts["backward"] = {str(op).split(".")[-1]: n for op, n in backward.get_comm_counts().items()}
    return counts


def _collectives_rank(ctx, hidden: int, batch: int, seq: int, seed: int) -> dict:
    dense = tp.make_dense("mlp", hidden, 1, ctx.device, seed)
    x = tp.make_input(batch, seq, hidden, ctx.device, seed + 1)
    mesh = mesh_of(x.device, (ctx.world_size,), ("tensor",))
    return {"colwise_rowwise": count_collectives(parallel_mlp(dense, mesh), x),
            "sequence_parallel": count_collectives(parallel_sequence_block(NormMLP(dense, hidden)),
                                                   x.chunk(ctx.world_size, dim=1)[ctx.rank].clone())}


def collectives_on_forked_ranks(hidden: int = 32, batch: int = 2, seq: int = 8, seed: int = 0,
                                world_size: int = 2) -> list[dict]:
    """The collectives torch's two plans make, forward and backward, on world_size forked gloo CPU ranks."""
    from labsrc.core.forked import run_ranks
    return run_ranks(_collectives_rank, world_size, (hidden, batch, seq, seed), timeout_s=120)


def count_optimizer_collectives(hidden: int, batch: int, seq: int, seed: int, rank: int, world_size: int,
                                device: torch.device) -> dict:
    """All-reduces made by optimizer.step() on the sequence-parallel block, counted with CommDebugMode: AdamW and
    SGD on the Partial(sum) norm gradients as backward left them, then AdamW after redistributing them first."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.debug import CommDebugMode

    def all_reduces(mode) -> int:
        return sum(n for op, n in mode.get_comm_counts().items() if "all_reduce" in str(op))

    counts = {}
    for name, make_optimizer, redistribute_first in (
            ("AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-2), False),
            ("SGD", lambda ps: torch.optim.SGD(ps, lr=1e-2), False),
            ("AdamW after redistributing", lambda ps: torch.optim.AdamW(ps, lr=1e-2), True)):
        dense = tp.make_dense("mlp", hidden, 1, device, seed)
        x = tp.make_input(batch, seq, hidden, device, seed + 1)
        block = parallel_sequence_block(NormMLP(dense, hidden))
        output = block(x.chunk(world_size, dim=1)[rank].clone())
        output.pow(2).sum().backward()
        partial = [p for p in block.parameters() if any(pl.is_partial() for pl in p.grad.placements)]
        with CommDebugMode() as redistributing:
            if redistribute_first:
                for p in partial:
                    p.grad = p.grad.redistribute(placements=[Replicate()])
        optimizer = make_optimizer(list(block.parameters()))
        with CommDebugMode() as stepping:
            optimizer.step()
        counts[name] = {"partial_gradients": len(partial), "redistribute": all_reduces(redistributing),
                        "step": all_reduces(stepping)}
    return counts


def _optimizer_rank(ctx, hidden: int, batch: int, seq: int, seed: int) -> dict:
    return count_optimizer_collectives(hidden, batch, seq, seed, ctx.rank, ctx.world_size, ctx.device)


def optimizer_collectives_on_forked_ranks(hidden: int = 32, batch: int = 2, seq: int = 8, seed: int = 0,
                                          world_size: int = 2) -> list[dict]:
    """The all-reduces optimizer.step() makes on Partial(sum) norm gradients, on world_size forked gloo CPU ranks."""
    from labsrc.core.forked import run_ranks
    return run_ranks(_optimizer_rank, world_size, (hidden, batch, seq, seed), timeout_s=120)
