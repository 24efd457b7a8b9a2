"""FSDP2's design by hand: every parameter of the chosen module types sharded along dim 0, for any nn.Module.

    fsdp = shard_model(model, wrap=(nn.Linear, nn.Embedding), compute_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters())       # any torch optimizer: it sees fp32 shards
    loss_of(model(tokens), targets).backward(); fsdp.finish_gradient_sync(); optimizer.step()

A wrapped module's parameter of shape (rows, ...) becomes rank r's piece rows_padded/n x ... (rows padded up to a
multiple of n), an fp32 nn.Parameter under its original name. A forward pre-hook all-gathers the full weights in
the compute dtype and puts them in the module for its forward; a forward hook frees them (their memory is resized
to zero; autograd's saved views keep only the address). A hook on the module's output gradient all-gathers them
again into the same memory before the module's backward, and the gather's own backward reduce-scatters the
gradient in fp32, divides it by n, hands it to the shard as its .grad, and frees the full weights. Parameters of
other modules (norm weights) stay whole on every rank; finish_gradient_sync() all-reduces and averages their
gradients. Floating-point inputs of a wrapped module are cast to the compute dtype (inputs of an unwrapped one
to fp32); token ids, masks and other non-float inputs pass untouched.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from labsrc.lessons.memory_sharding.zero import (Traffic, all_reduce_counted, flatten, reduce_scatter_counted,
                                                 unflatten_into)
from labsrc.techniques.collectives import all_gather


class ShardedParameter:
    """One parameter of a wrapped module: its fp32 dim-0 shard and, while needed, its gathered full weights."""

    def __init__(self, module: nn.Module, name: str, world_size: int, rank: int, compute_dtype, traffic: Traffic):
        full = getattr(module, name).detach()
        self.module, self.name, self.shape = module, name, full.shape
        self.world_size, self.traffic = world_size, traffic
        self.compute_dtype = compute_dtype or full.dtype
        padded_rows = -(-full.shape[0] // world_size) * world_size
        padded = nn.functional.pad(full.float(), [0, 0] * (full.dim() - 1) + [0, padded_rows - full.shape[0]])
        self.shard = nn.Parameter(padded.chunk(world_size)[rank].clone())  # (padded_rows / n, ...) fp32
        self.padded_shape = padded.shape
        self.gathered: torch.Tensor | None = None  # (padded_rows, ...) in the compute dtype, or None

    def gather_into(self, output: torch.Tensor) -> None:
        """All-gather every rank's shard, in the compute dtype, into output (padded_rows, ...)."""
        all_gather(output.view(-1), self.shard.detach().to(self.compute_dtype).reshape(-1))
        self.traffic.add("all_gather", output, self.world_size)

    def full_weights(self) -> torch.Tensor:
        """The full (rows, ...) weights for forward, tied to the shard by autograd (backward = reduce-scatter)."""
        return _Gather.apply(self.shard, self)[:self.shape[0]]

    def regather(self) -> bool:
        """Before backward: put the full weights back into the memory forward's saved views point at (True if
        gathered now)."""
        storage = self.gathered.untyped_storage() if self.gathered is not None else None
        if storage is None or storage.nbytes() > 0:
            return False  # never gathered in this step, or still there
        storage.resize_(self.gathered.numel() * self.gathered.element_size())
        # A second tensor on the same memory: writing through it leaves the saved views' version counter alone.
        alias = torch.empty(0, dtype=self.gathered.dtype).set_(storage, 0, self.gathered.shape)
        self.gather_into(alias)
        return True

    def free(self) -> None:
        """Give the full weights' memory back; the views autograd saved keep only their address."""
        if self.gathered is not None:
            self.gathered.untyped_storage().resize_(0)

    def reduce_gradient(self, full_gradient: torch.Tensor) -> torch.Tensor:
        """(padded_rows, ...) this rank's gradient -> (padded_rows / n, ...) the average over ranks, in fp32."""
        shard = reduce_scatter_counted(full_gradient.float().contiguous().view(-1), self.traffic)
        return shard.view(self.shard.shape) / self.world_size


class _Gather(torch.autograd.Function):
    """Forward: the shard (k, ...) -> the gathered (n k, ...) in the compute dtype. Backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, parameter: ShardedParameter) -> torch.Tensor:
        ctx.parameter = parameter
        full = torch.empty(parameter.padded_shape, dtype=parameter.compute_dtype)
        parameter.gather_into(full)
        parameter.gathered = full
        parameter.on_gather(full)
        return full

    @staticmethod
    def backward(ctx, full_gradient: torch.Tensor):
        gradient = ctx.parameter.reduce_gradient(full_gradient)
        ctx.parameter.free()  # backward is done with this module's weights
        ctx.parameter.on_reduced()
        return gradient, None


def cast_floats(value, dtype):
    """Floating-point tensors to dtype; everything else (token ids, masks, None) untouched."""
    if torch.is_tensor(value) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floats(v, dtype) for v in value)
    return value


class PerParameterFSDP:
    """What shard_model returns: the sharded parameters, the replicated ones, and the gradient sync."""

    def __init__(self, model: nn.Module, wrap: tuple, compute_dtype, traffic: Traffic | None):
        self.model, self.compute_dtype = model, compute_dtype
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.traffic = traffic if traffic is not None else Traffic()
        self.alive = weakref.WeakSet()  # every gathered full-weight tensor not yet garbage
        self.peak_unsharded = 0  # the most gathered bytes alive at once, read as each module starts its forward
        self.units: dict[nn.Module, list[ShardedParameter]] = {}
        self.names = {module: name for name, module in model.named_modules()}
        self.trace: list[tuple[str, str, int]] = []  # (event, module name, gathered bytes alive after it)
        for module in model.modules():
            if isinstance(module, wrap) and any(True for _ in module.parameters(recurse=False)):
                self.units[module] = [self._shard(module, name) for name, _ in module.named_parameters(recurse=False)]
                module.register_forward_pre_hook(self._before_forward, with_kwargs=True)
                module.register_forward_hook(self._after_forward)
            elif not isinstance(module, wrap) and any(True for _ in module.parameters(recurse=False)):
                module.register_forward_pre_hook(lambda module, args: cast_floats(args, torch.float32))
        sharded = {id(p.shard) for unit in self.units.values() for p in unit}
        self.replicated = [p for p in model.parameters() if id(p) not in sharded]

    def _shard(self, module: nn.Module, name: str) -> ShardedParameter:
        parameter = ShardedParameter(module, name, self.world_size, self.rank, self.compute_dtype, self.traffic)
        parameter.on_gather = self.alive.add
        parameter.on_reduced = lambda: self._record("reduce-scatter, free", module)
        module._parameters[name] = parameter.shard  # the shard, under the original name: what optimizers see
        return parameter

    def _record(self, event: str, module: nn.Module) -> None:
        self.trace.append((event, self.names[module], self.unsharded_bytes()))

    def _before_forward(self, module, args, kwargs):
        for parameter in self.units[module]:
            module._parameters[parameter.name] = parameter.full_weights()  # a plain tensor, for this forward only
        self._record("all-gather", module)
        self.peak_unsharded = max(self.peak_unsharded, self.unsharded_bytes())
        dtype = self.compute_dtype or torch.float32
        return cast_floats(args, dtype), {key: cast_floats(value, dtype) for key, value in kwargs.items()}

    def _after_forward(self, module, args, output):
        parameters = self.units[module]
        for parameter in parameters:
            module._parameters[parameter.name] = parameter.shard
            parameter.free()  # reshard after forward
        self._record("free", module)
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for tensor in outputs:
            if torch.is_tensor(tensor) and tensor.requires_grad:  # pre-backward: gather again, once
                tensor.register_hook(lambda gradient: self._before_backward(module))
        return output

    def _before_backward(self, module) -> None:
        if any([parameter.regather() for parameter in self.units[module]]):
            self._record("all-gather", module)  # again, for backward

    def finish_gradient_sync(self) -> None:
        """After backward: all-reduce and average the replicated parameters' gradients (sharded ones are done)."""
        with_gradient = [p for p in self.replicated if p.grad is not None]
        if with_gradient:
            flat = flatten([p.grad for p in with_gradient], self.world_size)
            all_reduce_counted(flat, self.traffic)
            unflatten_into(flat / self.world_size, [p.grad for p in with_gradient])

    def unsharded_bytes(self) -> int:
        """Bytes of gathered full weights still in memory (0 between forward and backward, and after backward)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in list(self.alive)}
        return sum(storages.values())

    def sharded_numel(self) -> tuple[int, int]:
        """(elements of the sharded parameters, the same padded to a multiple of n rows)."""
        parameters = [p for unit in self.units.values() for p in unit]
        return (sum(p.shape.numel() for p in parameters),
                sum(p.padded_shape.numel() for p in parameters))

    def full_state_dict(self, gradients: bool = False) -> dict[str, torch.Tensor]:
        """{original name: full fp32 tensor}, gathered from every rank's shards (every rank takes part); with
        gradients=True the same for the parameters' .grad (after finish_gradient_sync)."""
        owner = {id(p.shard): p for unit in self.units.values() for p in unit}
        state = {}
        for name, parameter in self.model.named_parameters():
            value = parameter.grad if gradients else parameter
            if id(parameter) in owner:
                sharded = owner[id(parameter)]
                full = torch.empty(sharded.padded_shape, dtype=torch.float32)
                all_gather(full.view(-1), value.detach().float().reshape(-1))
                state[name] = full[:sharded.shape[0]].clone()
            else:
                state[name] = value.detach().float().clone()
        return state


def shard_model(model: nn.Module, wrap: tuple = (nn.Linear, nn.Embedding), compute_dtype=None,
                traffic: Traffic | None = None) -> PerParameterFSDP:
    """Shard `model` in place over the default process group (every rank must pass the same weights)."""
    if not dist.is_initialized():
        raise RuntimeError("shard_model needs torch.distributed initialised: run it on ranks (launch.run or run_ranks).")
    return PerParameterFSDP(model, tuple(wrap), compute_dtype, traffic)
