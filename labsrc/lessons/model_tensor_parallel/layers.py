"""Tensor parallelism from collectives: the f/g autograd pair, column- and row-parallel linear, Megatron MLP and attention.

Shapes: x is (batch, seq, hidden); torch's Linear keeps its weight as (out_features, in_features), so the
"column" shard of the math's A in Y = X A (A is (in, out)) is a block of rows of `weight` (dim 0), and the
"row" shard of A is a block of columns of `weight` (dim 1).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as functional
from torch import nn

ALL_REDUCE_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass
class Traffic:
    """What the autograd functions handed to all_reduce on this rank: calls and payload bytes, per phase."""

    calls: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})
    payload_bytes: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})

    def add(self, phase: str, tensor: torch.Tensor) -> None:
        self.calls[phase] += 1
        self.payload_bytes[phase] += tensor.numel() * tensor.element_size()

    @property
    def total_bytes(self) -> int:
        return sum(self.payload_bytes.values())


def all_reduce_sum(tensor: torch.Tensor, traffic: Traffic, phase: str, group=None) -> torch.Tensor:
    """Sum `tensor` over the group in place, counted in traffic, waiting at most ALL_REDUCE_TIMEOUT."""
    traffic.add(phase, tensor)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    work.wait(ALL_REDUCE_TIMEOUT)
    return tensor


class CopyToParallel(torch.autograd.Function):
    """Megatron's "f": identity forward; backward sums the gradient over the tensor-parallel ranks.

    Every rank feeds the same x into its shard; each shard's gradient with respect to x is only its
    part of the whole, so the parts are summed on the way back.
    """

    @staticmethod
    def forward(context, x, traffic, group):
        context.traffic, context.group = traffic, group
        return x.view_as(x)

    @staticmethod
    def backward(context, grad):
        return all_reduce_sum(grad.contiguous().clone(), context.traffic, "backward", context.group), None, None


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's "g", the conjugate of f: forward sums the partial outputs; backward is the identity."""

    @staticmethod
    def forward(context, partial, traffic, group):
        return all_reduce_sum(partial.contiguous().clone(), traffic, "forward", group)

    @staticmethod
    def backward(context, grad):
        return grad, None, None


def column_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's block of output features: weight (out, in) -> (out/n, in); a bias (out,) -> (out/n,)."""
    return weight.chunk(world_size, dim=0)[rank].clone()


def row_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's block of input features: weight (out, in) -> (out, in/n)."""
    return weight.chunk(world_size, dim=1)[rank].clone()


def require_whole(shard: torch.Tensor, dense: torch.Tensor, dim: int, style: str) -> None:
    """A shard must keep every feature along `dim` of the dense (out, in) weight; say which cut is wrong if not."""
    if shard.dim() != 2 or shard.shape[dim] != dense.shape[dim]:
        kept = ("output features (rows, dim 0)", "input features (columns, dim 1)")
        raise ValueError(f"{style}-parallel shard {tuple(shard.shape)} of the {tuple(dense.shape)} weight does not keep "
                         f"all {kept[dim]}: a {style}-parallel layer cuts only the {kept[1 - dim]}.")


class ColumnParallelLinear(nn.Module):
    """x (..., in) -> this rank's slice of the output (..., out/n); f on the input, no communication forward."""

    def __init__(self, dense: nn.Linear, rank: int, world_size: int, traffic: Traffic, group=None):
        super().__init__()
        self.weight = nn.Parameter(column_shard(dense.weight.detach(), rank, world_size))
        require_whole(self.weight, dense.weight, 1, "column")
        self.bias = nn.Parameter(column_shard(dense.bias.detach(), rank, world_size))
        self.traffic, self.group = traffic, group

    def forward(self, x):
        return functional.linear(CopyToParallel.apply(x, self.traffic, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's slice of the input (..., in/n) -> the full output (..., out); g sums the partial products.

    The bias is added once, after the sum (added on every rank before it, it would count n times).
    """

    def __init__(self, dense: nn.Linear, rank: int, world_size: int, traffic: Traffic, group=None):
        super().__init__()
        self.weight = nn.Parameter(row_shard(dense.weight.detach(), rank, world_size))
        require_whole(self.weight, dense.weight, 0, "row")
        self.bias = nn.Parameter(dense.bias.detach().clone())
        self.traffic, self.group = traffic, group

    def forward(self, x_slice):
        partial = functional.linear(x_slice, self.weight)
        return ReduceFromParallel.apply(partial, self.traffic, self.group) + self.bias


class DenseMLP(nn.Module):
    """The transformer MLP: (batch, seq, hidden) -> fc1 -> GELU -> fc2 -> (batch, seq, hidden)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(functional.gelu(self.fc1(x)))


class TensorParallelMLP(nn.Module):
    """Megatron's MLP: column-parallel fc1, GELU on each rank's slice, row-parallel fc2.

    One all-reduce forward (g, in fc2) and one backward (f, in fc1); the GELU needs none because each
    rank holds whole columns of fc1's output.
    """

    def __init__(self, dense: DenseMLP, rank: int, world_size: int, traffic: Traffic, group=None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(dense.fc1, rank, world_size, traffic, group)
        self.fc2 = RowParallelLinear(dense.fc2, rank, world_size, traffic, group)

    def forward(self, x):
        return self.fc2(functional.gelu(self.fc1(x)))


class DenseAttention(nn.Module):
    """Causal self-attention with `heads` heads: (batch, seq, hidden) -> (batch, seq, hidden)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.out(attend(self.query(x), self.key(x), self.value(x), self.heads))


def attend(query, key, value, heads: int) -> torch.Tensor:
    """(batch, seq, heads * head_dim) three times -> causal attention per head -> (batch, seq, heads * head_dim)."""
    batch, seq, width = query.shape
    split = [t.view(batch, seq, heads, width // heads).transpose(1, 2) for t in (query, key, value)]
    mixed = functional.scaled_dot_product_attention(*split, is_causal=True)
    return mixed.transpose(1, 2).reshape(batch, seq, width)


class TensorParallelAttention(nn.Module):
    """Attention split by heads: rank r computes heads [r*h/n, (r+1)*h/n) whole, then a row-parallel output.

    query/key/value are column-parallel (a block of heads each); the output projection is row-parallel.
    Like the MLP: one all-reduce forward, one backward (the three f's are fused into one by sharing x).
    """

    def __init__(self, dense: DenseAttention, rank: int, world_size: int, traffic: Traffic, group=None):
        super().__init__()
        if dense.heads % world_size:
            raise ValueError(f"{dense.heads} heads do not split over {world_size} ranks")
        self.local_heads = dense.heads // world_size
        self.traffic, self.group = traffic, group
        self.query, self.key, self.value = (ColumnParallelLinear(layer, rank, world_size, traffic, group)
                                            for layer in (dense.query, dense.key, dense.value))
        self.out = RowParallelLinear(dense.out, rank, world_size, traffic, group)

    def forward(self, x):
        shared = CopyToParallel.apply(x, self.traffic, self.group)
        local = [functional.linear(shared, layer.weight, layer.bias) for layer in (self.query, self.key, self.value)]
        return self.out(attend(*local, self.local_heads))


def megatron_block(style: str, dense_shape, rank: int, world_size: int) -> tuple[int, int, int]:
    """(dim, start, stop) of the (out, in) weight rank holds in Megatron's layout: column -> rows, row -> columns;
    blocks of ceil(size / n), as torch.chunk cuts."""
    dim = 0 if style == "column" else 1
    size = dense_shape[dim]
    block = -(-size // world_size)
    return dim, min(rank * block, size), min((rank + 1) * block, size)


def locate_shard(dense_weight: torch.Tensor, shard: torch.Tensor, first_dim: int = 0) -> tuple[int, int, int] | None:
    """Where shard sits in dense_weight (out, in): (dim, start, stop) of the contiguous block it equals, else None.

    Found by comparing values, not derived from the rank, so a wrong cut shows where it really is (or nowhere);
    first_dim is tried first (it decides only when the shard is the whole weight).
    """
    for dim in (first_dim, 1 - first_dim):
        other = 1 - dim
        if shard.dim() != 2 or shard.shape[other] != dense_weight.shape[other]:
            continue
        size = shard.shape[dim]
        for start in range(dense_weight.shape[dim] - size + 1):
            if torch.equal(dense_weight.narrow(dim, start, size), shard):
                return dim, start, start + size
    return None


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def replicated_bytes(module: nn.Module) -> int:
    """Bytes every rank keeps whole: the biases of row-parallel layers."""
    return sum(layer.bias.numel() * layer.bias.element_size()
               for layer in module.modules() if isinstance(layer, RowParallelLinear))


def expected_payload_bytes(batch: int, seq: int, hidden: int, element_size: int = 4) -> dict:
    """All-reduce payload of one Megatron block (MLP or attention) per step: one (batch, seq, hidden) each way."""
    activation = batch * seq * hidden * element_size
    return {"forward": activation, "backward": activation}


def ring_bytes_sent(payload_bytes: int, world_size: int) -> float:
    """What each rank sends in a ring all-reduce of payload_bytes: 2(n-1)/n of it."""
    return 2 * (world_size - 1) / world_size * payload_bytes


def sharded_gradients(dense: nn.Module, parallel: nn.Module, rank: int, world_size: int) -> dict:
    """{name: (this rank's gradient, the dense gradient cut the same way)} for every parameter of parallel."""
    dense_params = dict(dense.named_parameters())
    pairs = {}
    for name, module in parallel.named_modules():
        if isinstance(module, ColumnParallelLinear):
            cut = column_shard
        elif isinstance(module, RowParallelLinear):
            cut = row_shard
        else:
            continue
        reference = dense_params[f"{name}.weight"].grad
        pairs[f"{name}.weight"] = (module.weight.grad, cut(reference, rank, world_size))
        bias = dense_params[f"{name}.bias"].grad
        pairs[f"{name}.bias"] = (module.bias.grad, bias if cut is row_shard else column_shard(bias, rank, world_size))
    return pairs


def max_error(pairs) -> float:
    """Largest absolute difference over (got, expected) tensor pairs."""
    return max(float((got - expected).detach().abs().max()) for got, expected in pairs)


def compare_with_dense(dense: nn.Module, parallel: nn.Module, x: torch.Tensor, rank: int, world_size: int) -> dict:
    """Forward and backward both on the same x (batch, seq, hidden); errors of output, input and weight gradients.

    The loss is sum(output * probe) with a fixed probe, so every output element gets a different gradient.
    """
    probe = torch.linspace(-1, 1, x.numel(), device=x.device).view_as(x)
    x_dense, x_parallel = x.clone().requires_grad_(), x.clone().requires_grad_()
    dense_out, parallel_out = dense(x_dense), parallel(x_parallel)
    (dense_out * probe).sum().backward()
    (parallel_out * probe).sum().backward()
    gradients = sharded_gradients(dense, parallel, rank, world_size)
    return {"output_error": max_error([(parallel_out, dense_out)]),
            "input_grad_error": max_error([(x_parallel.grad, x_dense.grad)]),
            "weight_grad_error": max_error(gradients.values()),
            "output_scale": float(dense_out.detach().abs().max()),
            "outputs": (parallel_out.detach(), dense_out.detach()),
            "gradients": gradients}


def make_input(batch: int, seq: int, hidden: int, device, seed: int) -> torch.Tensor:
    """The same (batch, seq, hidden) input on every rank, from a seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, hidden, generator=generator).to(device)


def make_dense(kind: str, hidden: int, heads: int, device, seed: int) -> nn.Module:
    """The same dense block on every rank: 'mlp' (ffn = 4 * hidden) or 'attention'."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = DenseMLP(hidden, 4 * hidden) if kind == "mlp" else DenseAttention(hidden, heads)
    return module.to(device)


def tolerance(scale: float) -> float:
    """Float32 agreement for sums split n ways: 1e-5 relative to the output's magnitude (absolute below 1)."""
    return 1e-5 * max(1.0, scale)
