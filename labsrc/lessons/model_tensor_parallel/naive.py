"""Naive model parallelism: consecutive layers on consecutive ranks, activations sent forward and gradients back.

Busy intervals use time.perf_counter, which on Linux reads CLOCK_MONOTONIC: one clock for every process on
the machine, so intervals from different ranks on one machine can be laid side by side.
"""
from __future__ import annotations

import copy
import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as functional
from torch import nn

from labsrc.training.timing import synchronize

MESSAGE_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass(frozen=True)
class Busy:
    """One stretch of computing on one rank: which step, forward or backward, start and end (seconds)."""

    rank: int
    step: int
    phase: str
    start: float
    end: float


def make_stack(layers: int, hidden: int, device, seed: int) -> nn.Sequential:
    """layers x (Linear(hidden, hidden), Tanh): (batch, hidden) -> (batch, hidden), the same on every rank."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        blocks = [module for _ in range(layers) for module in (nn.Linear(hidden, hidden), nn.Tanh())]
    return nn.Sequential(*blocks).to(device)


def stage_bounds(layers: int, rank: int, world_size: int) -> tuple[int, int]:
    """[first, last) layer indices rank holds: consecutive blocks, as even as layers allow."""
    if layers < world_size:
        raise ValueError(f"{layers} layers cannot give each of {world_size} ranks at least one")
    return rank * layers // world_size, (rank + 1) * layers // world_size


def stage_of(stack: nn.Sequential, rank: int, world_size: int) -> nn.Sequential:
    """A copy of the layers rank holds (each layer is a Linear and its Tanh: two modules)."""
    first, last = stage_bounds(len(stack) // 2, rank, world_size)
    return copy.deepcopy(stack[2 * first: 2 * last])


def staged_on_host(device) -> bool:
    """gloo sends and receives host memory: ranks sharing a GPU through gloo pass messages via the CPU."""
    return device.type == "cuda" and dist.get_backend() == "gloo"


def send(tensor: torch.Tensor, to: int) -> None:
    """Send to rank `to`, waiting at most MESSAGE_TIMEOUT for it to be taken."""
    message = tensor.detach().cpu() if staged_on_host(tensor.device) else tensor.detach()
    dist.isend(message.contiguous(), to).wait(MESSAGE_TIMEOUT)


def receive(shape, source: int, device) -> torch.Tensor:
    """Receive a float32 tensor of `shape` from rank `source`, waiting at most MESSAGE_TIMEOUT."""
    buffer = torch.empty(shape, device="cpu" if staged_on_host(device) else device)
    dist.irecv(buffer, source).wait(MESSAGE_TIMEOUT)
    return buffer.to(device)


def naive_step(stage: nn.Module, x: torch.Tensor, target: torch.Tensor, rank: int, world_size: int,
               step: int = 0) -> tuple[list[Busy], float | None]:
    """One forward and backward through the split model; returns this rank's busy intervals and, on the last
    rank, the loss. x and target are (batch, hidden) on every rank (only rank 0 reads x, only the last target).

    rank r: receive the activation from r-1, compute its layers, send to r+1; then receive the gradient of
    its output from r+1, backward through its layers, send the gradient of its input to r-1.
    """
    device, last = x.device, rank == world_size - 1
    inputs = x if rank == 0 else receive(x.shape, rank - 1, device).requires_grad_()
    busy, loss = [], None
    start = clock(device)
    output = stage(inputs)
    if last:
        loss = functional.mse_loss(output, target)
    busy.append(Busy(rank, step, "forward", start, clock(device)))
    if not last:
        send(output.detach(), rank + 1)
        output_grad = receive(output.shape, rank + 1, device)
    start = clock(device)
    loss.backward() if last else output.backward(output_grad)
    busy.append(Busy(rank, step, "backward", start, clock(device)))
    if rank > 0:
        send(inputs.grad, rank - 1)
    return busy, None if loss is None else float(loss.detach())


def clock(device) -> float:
    """Seconds on the machine-wide monotonic clock, after the device's queued work."""
    synchronize(device)
    return time.perf_counter()


def dense_gradients(stack: nn.Sequential, x: torch.Tensor, target: torch.Tensor) -> tuple[float, list]:
    """The unsplit model's loss and its parameters' gradients, in order."""
    stack.zero_grad()
    loss = functional.mse_loss(stack(x), target)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in stack.parameters()]


def stage_gradient_errors(stack: nn.Sequential, stage: nn.Module, x, target, rank: int, world_size: int) -> dict:
    """Largest difference between this stage's gradients after naive_step and the dense model's same layers."""
    dense_loss, dense_grads = dense_gradients(stack, x, target)
    first, last = stage_bounds(len(stack) // 2, rank, world_size)
    expected = dense_grads[2 * first: 2 * last]  # each layer: weight, bias
    stage.zero_grad()
    _, loss = naive_step(stage, x, target, rank, world_size)
    got = [p.grad for p in stage.parameters()]
    error = max(float((g - e).abs().max()) for g, e in zip(got, expected))
    return {"grad_error": error, "loss_error": abs(loss - dense_loss) if loss is not None else 0.0,
            "parameters": len(got)}


def busy_timeline(stage: nn.Module, x, target, rank: int, world_size: int, steps: int) -> list[Busy]:
    """Busy intervals of `steps` naive steps (gradients zeroed each step, no optimizer)."""
    intervals = []
    for step in range(steps):
        stage.zero_grad()
        busy, _ = naive_step(stage, x, target, rank, world_size, step)
        intervals += busy
    return intervals


def overlap_seconds(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    """Total time inside an interval of `first` and an interval of `second` at once."""
    return sum(max(0.0, min(end_a, end_b) - max(start_a, start_b))
               for start_a, end_a in first for start_b, end_b in second)


def order_violations(intervals) -> list[dict]:
    """Intervals that started before the message they need can have been sent, on the shared clock.

    A forward of rank r needs rank r-1's activation of the same step, so it must start after rank r-1's
    forward ended; a backward of rank r needs rank r+1's gradient, so it must start after rank r+1's backward
    ended. Each violation: step, rank, phase, the rank it waits for, and how many seconds too early it began.
    """
    ends = {(i.rank, i.step, i.phase): i.end for i in intervals}
    violations = []
    for interval in intervals:
        sender = interval.rank - 1 if interval.phase == "forward" else interval.rank + 1
        needed = ends.get((sender, interval.step, interval.phase))
        if needed is not None and interval.start < needed:
            violations.append({"step": interval.step, "rank": interval.rank, "phase": interval.phase,
                               "waits_for": sender, "early_s": needed - interval.start})
    return violations


def busy_overlap(intervals: list[Busy]) -> dict:
    """Busy time per rank, time two ranks were busy at once (summed over pairs), and that over all busy time."""
    by_rank: dict[int, list] = {}
    for interval in intervals:
        by_rank.setdefault(interval.rank, []).append((interval.start, interval.end))
    ranks = sorted(by_rank)
    overlap = sum(overlap_seconds(by_rank[a], by_rank[b]) for i, a in enumerate(ranks) for b in ranks[i + 1:])
    busy = {rank: sum(end - start for start, end in spans) for rank, spans in by_rank.items()}
    span = max(i.end for i in intervals) - min(i.start for i in intervals)
    return {"busy_s": busy, "overlap_s": overlap, "overlap_fraction": overlap / sum(busy.values()),
            "span_s": span, "busy_fraction": {rank: seconds / span for rank, seconds in busy.items()}}
