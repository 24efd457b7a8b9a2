"""ZeRO stages 1-3 written by hand from reduce_scatter and all_gather, with the bytes each rank sends counted.

Every rank holds a flat, padded copy of the parameters cut into n equal shards; rank r owns shard r.
Stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the parameters.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from labsrc.techniques.collectives import all_gather, reduce_scatter


@dataclass
class Traffic:
    """Bytes this rank sends, per collective, counted as a ring sends them: (n-1)/n of the buffer each."""

    sent: dict = field(default_factory=dict)

    def add(self, collective: str, buffer: torch.Tensor, world_size: int, passes: int = 1) -> None:
        nbytes = buffer.numel() * buffer.element_size() * passes * (world_size - 1) // world_size
        self.sent[collective] = self.sent.get(collective, 0) + nbytes

    @property
    def total(self) -> int:
        return sum(self.sent.values())


# Where each collective's full buffer is, by position or keyword (output first, as torch.distributed orders them),
# and how many ring passes it makes: all_reduce 2, the others 1.
_FULL_BUFFER = {"all_reduce": (2, 0, ("tensor",)), "broadcast": (1, 0, ("tensor",)),
                "reduce_scatter_tensor": (1, 1, ("input",)), "reduce_scatter_single": (1, 1, ("input",)),
                "all_gather_into_tensor": (1, 0, ("output_tensor", "output")),
                "all_gather_single": (1, 0, ("output", "output_tensor")),
                "all_gather": (1, 0, ("tensor_list",)), "reduce_scatter": (1, 1, ("input_list",))}  # lists


@contextlib.contextmanager
def counted_collectives():
    """Count the bytes this process sends through torch.distributed's collectives while inside: yields {name: bytes}.

    Each call is measured from the buffer it is given, as a ring sends it: (n-1)/n of the full buffer per pass,
    n the size of the group it runs on. The functions are looked up on torch.distributed at call time by the
    course's helpers and by FSDP2, so wrapping them there sees every call; everything is restored on exit.
    """
    sent: dict[str, int] = {}
    originals = {name: getattr(dist, name) for name in _FULL_BUFFER if hasattr(dist, name)}

    def wrap(name, original):
        passes, position, keywords = _FULL_BUFFER[name]

        def counted(*args, **kwargs):
            full = args[position] if len(args) > position else next(kwargs[k] for k in keywords if k in kwargs)
            pieces = full if isinstance(full, (list, tuple)) else [full]
            n = dist.get_world_size(kwargs.get("group"))
            nbytes = passes * sum(t.numel() * t.element_size() for t in pieces) * (n - 1) // n
            sent[name] = sent.get(name, 0) + nbytes
            return original(*args, **kwargs)
        return counted

    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))
    try:
        yield sent
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def padded_size(numel: int, world_size: int) -> int:
    """The flat length rounded up to a multiple of the world size, so every shard has the same length."""
    return -(-numel // world_size) * world_size


def flatten(tensors: list[torch.Tensor], world_size: int, dtype=None) -> torch.Tensor:
    """(padded,) <- the tensors laid end to end, then zeros up to a multiple of world_size."""
    flat = torch.cat([t.detach().reshape(-1).to(dtype or t.dtype) for t in tensors])
    return torch.nn.functional.pad(flat, (0, padded_size(flat.numel(), world_size) - flat.numel()))


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy (padded,) back into the tensors, in order (the padding is dropped)."""
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def all_reduce_counted(flat: torch.Tensor, traffic: Traffic) -> None:
    """Sum over ranks in place; a ring all-reduce sends 2(n-1)/n of the buffer."""
    dist.all_reduce(flat)
    traffic.add("all_reduce", flat, dist.get_world_size(), passes=2)


def reduce_scatter_counted(full: torch.Tensor, traffic: Traffic) -> torch.Tensor:
    """(padded,) summed over ranks -> this rank's (padded/n,) slice of the sum.

    Counted as a ring reduce-scatter, (n-1)/n of the buffer, whenever the backend accepts the call. That is a
    model, not the wire: gloo accepts it but runs an all-reduce and slices (see collectives.reduce_scatter),
    twice the bytes. Only a backend that refuses the call is counted as the all-reduce it falls back to."""
    world_size = dist.get_world_size()
    shard = torch.empty(full.numel() // world_size, dtype=full.dtype, device=full.device)
    how = reduce_scatter(shard, full.contiguous())
    if how == "reduce_scatter":
        traffic.add("reduce_scatter", full, world_size)
    else:
        traffic.add("all_reduce", full, world_size, passes=2)
    return shard


def all_gather_counted(shard: torch.Tensor, traffic: Traffic) -> torch.Tensor:
    """(k,) on every rank -> (n*k,) in rank order."""
    world_size = dist.get_world_size()
    full = torch.empty(shard.numel() * world_size, dtype=shard.dtype, device=shard.device)
    all_gather(full, shard.contiguous())
    traffic.add("all_gather", full, world_size)
    return full


class ShardedOptimizer:
    """ZeRO stage 1 or 2 around any element-wise torch optimizer: `ShardedOptimizer(params, torch.optim.AdamW, lr=..)`.

    Rank r keeps an fp32 master copy of shard r of the flat parameters and the optimizer state of that shard
    only. step(): the gradients are reduce-scattered (rank r receives the sum of shard r) and divided by n,
    the inner optimizer updates the master shard, and all_gather puts every rank's updated shard back into
    the parameters. Stage 1 keeps each rank's full local gradients; stage 2 frees them after the
    reduce-scatter. Element-wise optimizers only (SGD, Adam, AdamW): one that needs a whole tensor (a norm
    per parameter) would see pieces.
    """

    def __init__(self, params, optimizer_class, stage: int = 1, traffic: Traffic | None = None, **optimizer_kwargs):
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer does stages 1 and 2 (got {stage}); stage 3 is FullyShardedModel.")
        self.params = [p for p in params if p.requires_grad]
        self.stage = stage
        self.traffic = traffic if traffic is not None else Traffic()
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.numel = sum(p.numel() for p in self.params)
        shard_size = padded_size(self.numel, self.world_size) // self.world_size
        start = self.rank * shard_size
        self.master = flatten(self.params, self.world_size, torch.float32)[start:start + shard_size].clone()
        self.master.requires_grad_(True)
        self.optimizer = optimizer_class([self.master], **optimizer_kwargs)
        self.gradient_shard: torch.Tensor | None = None

    def synchronize_gradients(self) -> None:
        """Reduce-scatter the gradients: this rank keeps the average of its shard only.

        Stage 1 keeps each rank's full local gradients, as views of one flat buffer (a DDP bucket), and writes
        the averaged shard over its own slice of that buffer; stage 2 frees the full gradients.
        """
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = flatten(grads, self.world_size)
        shard = reduce_scatter_counted(flat, self.traffic)
        for param in self.params:
            param.grad = None
        if self.stage == 1:
            mine = flat.view(self.world_size, -1)[self.rank]
            mine.copy_(shard / self.world_size)
            offset = 0
            for param in self.params:
                param.grad = flat[offset:offset + param.numel()].view_as(param)
                offset += param.numel()
            self.gradient_shard = mine
        else:
            self.gradient_shard = shard / self.world_size

    def step(self) -> None:
        """Update this rank's master shard, then all_gather every shard back into the parameters."""
        if self.gradient_shard is None:
            self.synchronize_gradients()
        self.master.grad = self.gradient_shard.to(torch.float32)
        self.optimizer.step()
        self.master.grad = None
        self.gradient_shard = None
        dtype = self.params[0].dtype
        full = all_gather_counted(self.master.detach().to(dtype), self.traffic)
        with torch.no_grad():
            unflatten_into(full, self.params)

    def zero_grad(self) -> None:
        self.gradient_shard = None
        for param in self.params:
            param.grad = None

    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: the fp32 master shard and the inner optimizer's state."""
        return tensor_bytes([self.master]) + tensor_bytes(
            [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)])


def tensor_bytes(tensors) -> int:
    """Bytes the tensors' elements take (views of one storage counted by their own size)."""
    return sum(t.numel() * t.element_size() for t in tensors)
