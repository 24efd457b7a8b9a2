"""DDP written by hand: (a) all-reduce every gradient after backward; (b) buckets all-reduced from gradient hooks during backward."""
from __future__ import annotations

import copy
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn


class ScheduleEvent(NamedTuple):
    """One moment of BucketedDDP's schedule."""

    kind: str
    """hook (a parameter's gradient became ready) or all_reduce (a bucket's all-reduce was launched)."""
    index: int
    """The parameter's index (hook) or the bucket's (all_reduce)."""
    time: float
    """time.perf_counter() seconds."""


def broadcast_parameters(module: nn.Module) -> None:
    """Make every rank start from rank 0's parameters and buffers, as DDP's constructor does."""
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=0)


class AllReduceAfterBackward(nn.Module):
    """Version (a): after loss.backward(), call sync_gradients(): one all-reduce per parameter, no overlap."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.allreduce_calls = 0
        broadcast_parameters(module)

    def forward(self, *inputs):
        return self.module(*inputs)

    def sync_gradients(self) -> None:
        for parameter in self.module.parameters():
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad)
                parameter.grad.div_(self.world_size)
                self.allreduce_calls += 1


def assign_buckets(parameters: list[nn.Parameter], cap_bytes: int, first_cap_bytes: int | None = None) -> list[list[int]]:
    """Parameter indices grouped into buckets that close as soon as they reach their cap in bytes.

    Reverse order, as DDP does: backward produces the last layer's gradients first, so the first bucket
    fills first and its all-reduce can start while backward is still running. first_cap_bytes (default:
    cap_bytes) limits the first bucket only; torch DDP uses 1 MiB there when bucket_cap_mb is left unset.
    A parameter is never split: one larger than the room left joins the bucket whole, which then closes.
    """
    buckets, current, size = [], [], 0
    for index in reversed(range(len(parameters))):
        current.append(index)
        size += parameters[index].numel() * parameters[index].element_size()
        limit = cap_bytes if buckets or first_cap_bytes is None else first_cap_bytes
        if size >= limit:  # DDP's rule: a bucket closes once it reaches the cap
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class BucketedDDP(nn.Module):
    """Version (b): gradients copied into flat buckets and all-reduced asynchronously as each bucket fills.

    A post-accumulate-grad hook on every parameter counts the bucket's ready gradients; once a bucket is full
    it is flattened and `all_reduce(async_op=True)` starts, while backward goes on computing the earlier
    layers. Buckets are launched in index order, as DDP's reducer does, so every rank issues the same
    collectives in the same order even if a later bucket happens to fill first. finish_gradient_sync()
    (call it before optimizer.step()) waits for every bucket, divides by the world size and copies the
    averages back into .grad. Every parameter must get a gradient. `events` keeps the last step's schedule.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.parameters_in_order = [p for p in module.parameters() if p.requires_grad]
        self.buckets = assign_buckets(self.parameters_in_order, int(bucket_cap_mb * 2**20))  # last layer first
        self.bucket_of = {index: b for b, bucket in enumerate(self.buckets) for index in bucket}
        self.events, self.allreduce_calls = [], 0  # the last step's schedule, and all-reduces launched in all
        self._reset()
        broadcast_parameters(module)  # every rank starts from rank 0's model
        for index, parameter in enumerate(self.parameters_in_order):
            parameter.register_post_accumulate_grad_hook(self._make_hook(index))

    def _make_hook(self, index: int):
        def hook(parameter: torch.Tensor) -> None:  # called once parameter.grad is final for this backward
            self._log("hook", index)
            bucket = self.bucket_of[index]
            self.ready[bucket] += 1
            self._launch_full_buckets(bucket)
        return hook

    def _launch_full_buckets(self, filled: int) -> None:
        # Bucket 0, then 1, ..., each once it is full, whichever bucket just filled (`filled`, unused here;
        # ArrivalOrderDDP uses it): every rank's k-th all-reduce then carries the same bucket.
        while (self.next_bucket < len(self.buckets)
               and self.ready[self.next_bucket] == len(self.buckets[self.next_bucket])):
            self._launch(self.next_bucket)
            self.next_bucket += 1

    def _launch(self, bucket: int) -> None:
        grads = [self.parameters_in_order[i].grad for i in self.buckets[bucket]]
        flat = torch.cat([g.reshape(-1) for g in grads])  # the whole bucket as one message
        self._log("all_reduce", bucket)
        work = dist.all_reduce(flat, async_op=True)  # returns at once: backward goes on meanwhile
        self.pending.append((bucket, flat, work))

    def finish_gradient_sync(self) -> None:
        for bucket, flat, work in self.pending:
            work.wait()
            flat.div_(self.world_size)  # the sum over ranks -> the average
            offset = 0
            for index in self.buckets[bucket]:
                grad = self.parameters_in_order[index].grad
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self._reset()

    def _reset(self) -> None:
        self.ready = [0] * len(self.buckets)
        self.next_bucket = 0
        self.pending: list[tuple[int, torch.Tensor, dist.Work]] = []

    def _log(self, kind: str, index: int) -> None:
        """Keep this step's schedule (a new backward's first gradient clears the last one) and count all-reduces."""
        if kind == "hook" and not any(self.ready):
            self.events.clear()
        self.events.append(ScheduleEvent(kind, index, time.perf_counter()))
        self.allreduce_calls += kind == "all_reduce"

    def forward(self, *inputs):
        return self.module(*inputs)


class ArrivalOrderDDP(BucketedDDP):
    """The mistake index order prevents: each bucket's all-reduce launched the moment the bucket fills.

    Where ranks fill their buckets in different orders, rank 0's first all-reduce carries one bucket and rank
    1's another: a collective pairs whatever each rank hands it. Equal sizes: the sums mix different parameters,
    silently. Different sizes on gloo: the rank that receives more than it expects aborts ("Received data size
    doesn't match expected size. Is there a distributed collective mismatch in your code?") and the other
    waits until its timeout. NCCL does not check sizes: a hang or silently wrong sums.
    """

    def _launch_full_buckets(self, filled: int) -> None:
        if self.ready[filled] == len(self.buckets[filled]):
            self._launch(filled)


class TwoBranches(nn.Module):
    """(N, width) -> (N, width): relu(a(x)) + tanh(b(x)), two equal Linear branches, a and b.

    a_first says which branch forward runs first. Autograd runs the most recently created node first, so the
    branch forward ran second delivers its gradients first: with a_first differing across ranks, the ranks
    fill their buckets in different orders (rank-dependent compute, as data-dependent routing gives).
    """

    def __init__(self, width: int = 8, a_first: bool = True):
        super().__init__()
        self.a, self.b, self.a_first = nn.Linear(width, width), nn.Linear(width, width), a_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.a_first:
            left = torch.relu(self.a(x))
            return left + torch.tanh(self.b(x))
        right = torch.tanh(self.b(x))
        return torch.relu(self.a(x)) + right


def launch_order_outcome(ctx, width: int = 8) -> dict:
    """BucketedDDP (index order) and ArrivalOrderDDP on TwoBranches, one bucket per branch, rank-dependent order.

    Even ranks run branch a first, odd ranks b. Every rank starts from the same parameters and draws its own
    batch; the reference is each gradient all-reduced on its own. Returns {"index_order" | "arrival_order":
    {"filled": buckets in the order they filled on this rank, "launched": in the order their all-reduces
    started, "max_error": largest |averaged .grad - reference| over the reference's largest |value|}}.
    """
    generator = torch.Generator().manual_seed(1000 + ctx.rank)
    images = torch.randn(4, width, generator=generator)
    torch.manual_seed(0)
    template = TwoBranches(width, a_first=ctx.rank % 2 == 0)
    reference = copy.deepcopy(template)
    reference(images).square().mean().backward()
    expected = []
    for parameter in reference.parameters():
        dist.all_reduce(parameter.grad)
        expected.append(parameter.grad / dist.get_world_size())
    cap_mb = (width * width + width) * 4 / 2**20  # one branch's weight and bias: one bucket per branch
    outcome = {}
    for name, version in (("index_order", BucketedDDP), ("arrival_order", ArrivalOrderDDP)):
        model = version(copy.deepcopy(template), bucket_cap_mb=cap_mb)
        model(images).square().mean().backward()
        ready, filled = [0] * len(model.buckets), []
        for event in model.events:
            if event.kind == "hook":
                bucket = model.bucket_of[event.index]
                ready[bucket] += 1
                if ready[bucket] == len(model.buckets[bucket]):
                    filled.append(bucket)
        model.finish_gradient_sync()
        error = max((p.grad - e).abs().max().item() for p, e in zip(model.module.parameters(), expected))
        error /= max(e.abs().max().item() for e in expected)
        outcome[name] = {"filled": filled, "launched": [e.index for e in model.events if e.kind == "all_reduce"],
                         "max_error": error}
    return outcome

