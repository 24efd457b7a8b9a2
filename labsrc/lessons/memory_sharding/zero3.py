"""ZeRO stage 3 by hand: each layer's weights live as one shard per rank, all-gathered for forward and backward only.

    model = FullyShardedModel(nn.Sequential(...), compute_dtype=torch.bfloat16)
    loss(model(x)).backward(); model.finish_gradient_sync(); optimizer.step()   # optimizer over model.parameters()
"""
from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from labsrc.lessons.memory_sharding.zero import Traffic, all_gather_counted, flatten, reduce_scatter_counted


class _GatherWeights(torch.autograd.Function):
    """Forward: all_gather the shards (k,) -> (n*k,) in the compute dtype. Backward: reduce_scatter the gradient."""

    @staticmethod
    def forward(ctx, shard, layer):
        ctx.layer = layer
        return layer.gather()

    @staticmethod
    def backward(ctx, grad_full):
        ctx.layer.scatter_gradient(grad_full)
        return None, None  # the shard's gradient arrives in finish_gradient_sync, once every rank has sent its part


class ShardedLayer(nn.Module):
    """One layer whose parameters are a flat fp32 shard (padded/n,); the full weights exist only while needed."""

    def __init__(self, layer: nn.Module, traffic: Traffic, compute_dtype=None):
        super().__init__()
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.names = [name for name, _ in layer.named_parameters()]
        self.shapes = [p.shape for _, p in layer.named_parameters()]
        flat = flatten([p for _, p in layer.named_parameters()], self.world_size, torch.float32)
        self.shard = nn.Parameter(flat.view(self.world_size, -1)[self.rank].clone())
        layer.to("meta")  # the full-size weights are dropped: only their shapes stay
        self.layer = [layer]  # a list, so the meta-device layer is not registered as a submodule
        self.traffic, self.compute_dtype = traffic, compute_dtype
        self.regathered: torch.Tensor | None = None
        self.pending_gradient: torch.Tensor | None = None
        self.alive = weakref.WeakSet()  # full weight buffers not yet freed, to show that they are

    def gather(self) -> torch.Tensor:
        """(padded,) full flat weights in the compute dtype, from every rank's shard."""
        full = all_gather_counted(self.shard.detach().to(self.compute_dtype or self.shard.dtype), self.traffic)
        self.alive.add(full)
        return full

    def scatter_gradient(self, grad_full: torch.Tensor) -> None:
        """Sum the (padded,) gradient over ranks in fp32; keep this rank's (padded/n,) slice until finish."""
        shard = reduce_scatter_counted(grad_full.to(torch.float32), self.traffic)
        self.pending_gradient = shard if self.pending_gradient is None else self.pending_gradient + shard
        self.regathered = None  # backward is done with this layer's full weights: free them

    @staticmethod
    def _pack(full: torch.Tensor):
        pointer = full.untyped_storage().data_ptr()  # the address only: holding `full` here would keep it alive

        def pack(saved: torch.Tensor):
            if saved.untyped_storage().data_ptr() == pointer:
                return ("weights", saved.shape, saved.stride(), saved.storage_offset())  # keep where, not what
            return saved
        return pack

    def _unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        if self.regathered is None:  # backward needs the weights again: all_gather once for this layer
            self.regathered = self.gather()
        _, shape, stride, offset = packed
        return self.regathered.as_strided(shape, stride, offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = _GatherWeights.apply(self.shard, self)
        pieces = full[:sum(s.numel() for s in self.shapes)].split([s.numel() for s in self.shapes])
        weights = {name: piece.view(shape) for name, piece, shape in zip(self.names, pieces, self.shapes)}
        with torch.autograd.graph.saved_tensors_hooks(self._pack(full), self._unpack):
            out = functional_call(self.layer[0], weights, (x.to(full.dtype),))
        return out  # `full` is referenced by nothing saved: it is freed here (reshard after forward)

    def finish_gradient_sync(self) -> None:
        """The averaged gradient of this rank's shard, as the shard's .grad (what optimizer.step() reads)."""
        if self.pending_gradient is not None:
            self.shard.grad = self.pending_gradient / self.world_size
            self.pending_gradient = None


class FullyShardedModel(nn.Module):
    """A Sequential whose every layer with parameters is a ShardedLayer; the optimizer sees only the shards."""

    def __init__(self, model: nn.Sequential, traffic: Traffic | None = None, compute_dtype=None):
        super().__init__()
        self.traffic = traffic if traffic is not None else Traffic()
        self.layers = nn.Sequential(*[ShardedLayer(layer, self.traffic, compute_dtype)
                                      if any(True for _ in layer.parameters()) else layer for layer in model])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).to(torch.float32)

    def sharded_layers(self) -> list[ShardedLayer]:
        return [layer for layer in self.layers if isinstance(layer, ShardedLayer)]

    def finish_gradient_sync(self) -> None:
        """Call after backward, before optimizer.step(): every shard gets its averaged gradient."""
        for layer in self.sharded_layers():
            layer.finish_gradient_sync()

    def full_weights_alive(self, patience_s: float = 2.0) -> int:
        """How many full (gathered) weight buffers still exist: 0 between forward and backward.

        A gathered buffer was once seen to outlive forward by a moment on one gloo rank of a heavily loaded
        machine (something outside Python still held it), so the count is polled for up to patience_s; a
        buffer that forward kept for backward never goes.
        """
        deadline = time.monotonic() + patience_s
        while (alive := sum(len(layer.alive) for layer in self.sharded_layers())) and time.monotonic() < deadline:
            time.sleep(0.01)
        return alive

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter at full size, gathered from the shards (for checking and for saving)."""
        state = {}
        for index, layer in enumerate(self.layers):
            if isinstance(layer, ShardedLayer):
                full = all_gather_counted(layer.shard.detach(), Traffic())
                offset = 0
                for name, shape in zip(layer.names, layer.shapes):
                    state[f"{index}.{name}"] = full[offset:offset + shape.numel()].view(shape).clone()
                    offset += shape.numel()
        return state
