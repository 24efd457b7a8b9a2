"""Run one stage's action list with send/recv: activations go down the pipe, gradients come back up."""
from __future__ import annotations

import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from labsrc.lessons.pipeline_parallel.stages import full_batch_loss
from labsrc.training.timing import synchronize


class SavedTensorMeter:
    """Bytes of tensors autograd keeps for backward (activations, not parameters), alive now and at peak.

    Used as `with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)`; a tensor saved
    twice (one op's output is the next one's input) is counted once, and leaves the count when the last
    graph node holding it is freed by backward.
    """

    def __init__(self, module: nn.Module):
        self.parameters = {p.data_ptr() for p in module.parameters()}
        self.holders: dict[int, int] = {}   # data_ptr -> how many saved references
        self.alive = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor):
        pointer = tensor.data_ptr()
        if pointer in self.parameters:
            return tensor
        if self.holders.get(pointer, 0) == 0:
            self.alive += tensor.numel() * tensor.element_size()
            self.peak = max(self.peak, self.alive)
        self.holders[pointer] = self.holders.get(pointer, 0) + 1
        # detached: holding a saved output itself (and so its grad_fn) would keep the graph alive in a cycle
        return _Held(tensor.detach(), self)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def release(self, tensor: torch.Tensor) -> None:
        pointer = tensor.data_ptr()
        self.holders[pointer] -= 1
        if self.holders[pointer] == 0:
            del self.holders[pointer]
            self.alive -= tensor.numel() * tensor.element_size()


class _Held:
    """A saved tensor; when autograd drops it, the meter counts it as freed."""

    def __init__(self, tensor, meter):
        self.tensor, self.meter = tensor, meter

    def __del__(self):
        self.meter.release(self.tensor)


def run_stage(module: nn.Module, actions: list, stage: int, stages: int, inputs: torch.Tensor,
              targets: torch.Tensor, micro_batches: int, timeout_s: float = 60.0,
              meter: SavedTensorMeter | None = None, box_s: float = 0.0) -> list[dict]:
    """Run this stage's actions in order; parameter gradients accumulate in module. Returns its timeline.

    inputs, targets: the whole batch [batch, width] (stage 0 reads inputs, the last stage targets).
    Each micro-batch's loss is divided by micro_batches, so the summed gradients equal the full-batch
    mean loss's. Timeline: per action {"action", "micro_batch", "start", "end"} (perf_counter seconds,
    compute only: a stage waiting for a message is idle). Every receive and send waits at most timeout_s.
    box_s > 0 makes every F and B last at least box_s: the compute, then a wait for the rest (equal
    boxes, as the bubble formula assumes, even when shared CPU cores make the compute itself jitter).
    """
    device = inputs.device
    timeout = timedelta(seconds=timeout_s)
    micro_inputs, micro_targets = inputs.chunk(micro_batches), targets.chunk(micro_batches)
    kept: dict[int, tuple] = {}   # micro-batch -> (stage input, output or loss) until its backward
    sends: list = []
    receivers: list[tuple[int, int]] = []   # (rank, micro-batch) of each send, for a clear timeout
    timeline = []
    hooks = torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack) if meter else nullcontext()
    with hooks:
        for kind, j in actions:
            if kind == "F":
                stage_input = (micro_inputs[j] if stage == 0
                               else _receive(micro_inputs[j].shape, inputs.dtype, device, stage - 1, j, timeout))
                synchronize(device)
                start = time.perf_counter()
                output = module(stage_input)
                if stage == stages - 1:
                    output = full_batch_loss(output, micro_targets[j]) / micro_batches
                _finish_box(device, start, box_s)
                timeline.append({"action": "F", "micro_batch": j, "start": start, "end": time.perf_counter()})
                if stage < stages - 1:
                    sends.append(_send(output.detach(), stage + 1, j))
                    receivers.append((stage + 1, j))
                kept[j] = (stage_input, output)
            else:
                stage_input, output = kept.pop(j)
                gradient = None
                if stage < stages - 1:
                    gradient = _receive(output.shape, output.dtype, device, stage + 1, j, timeout)
                synchronize(device)
                start = time.perf_counter()
                output.backward(gradient)
                _finish_box(device, start, box_s)
                timeline.append({"action": "B", "micro_batch": j, "start": start, "end": time.perf_counter()})
                if stage > 0:
                    sends.append(_send(stage_input.grad, stage - 1, j))
                    receivers.append((stage - 1, j))
                del stage_input, output
    for (work, _), (destination, j) in zip(sends, receivers):
        _wait_for_send(work, timeout, destination, j)
    return timeline


def _wait_for_send(work, timeout: timedelta, destination: int, tag: int) -> None:
    """Wait for a send to be taken; gloo's send completes only once the other rank has posted its receive."""
    try:
        work.wait(timeout)
    except RuntimeError as error:
        what = "gradient" if destination < dist.get_rank() else "activation"
        raise TimeoutError(f"rank {dist.get_rank()} sent the {what} of micro-batch {tag} to rank {destination}, "
                           f"which did not receive it within {timeout.total_seconds():g} s: does that stage's "
                           f"action list skip it?") from error


def _finish_box(device, start: float, box_s: float, spin_s: float = 0.008) -> None:
    """Wait for the device's queued work, then wait until box_s has passed since start.

    Sleep for most of it, then busy-wait the last spin_s: a process woken from sleep on a loaded
    machine may wait milliseconds for a core, and those would be measured as bubble between boxes.
    """
    synchronize(device)
    deadline = start + box_s
    if deadline - spin_s > time.perf_counter():
        time.sleep(deadline - spin_s - time.perf_counter())
    while time.perf_counter() < deadline:
        pass


def _through_host(device) -> bool:
    """gloo moves CPU tensors only: ranks sharing a GPU through gloo send their tensors via host memory."""
    return device.type == "cuda" and dist.get_backend() == "gloo"


def _send(tensor: torch.Tensor, destination: int, tag: int) -> tuple:
    """Start sending tensor (tag: the micro-batch); returns (work, the buffer it reads, kept alive until waited)."""
    buffer = tensor.detach().cpu() if _through_host(tensor.device) else tensor.detach().contiguous()
    return dist.isend(buffer.contiguous(), destination, tag=tag), buffer


def _receive(shape, dtype, device, source: int, tag: int, timeout: timedelta) -> torch.Tensor:
    """A tensor from rank `source` (tag: the micro-batch), marked to collect its gradient.

    Raises TimeoutError naming the stage and the micro-batch when nothing arrives within timeout.
    """
    buffer = torch.empty(shape, dtype=dtype, device="cpu" if _through_host(device) else device)
    try:
        dist.irecv(buffer, source, tag=tag).wait(timeout)
    except RuntimeError as error:
        what = "gradient" if source > dist.get_rank() else "activation"
        raise TimeoutError(f"rank {dist.get_rank()} waited {timeout.total_seconds():g} s for the {what} of "
                           f"micro-batch {tag} from rank {source}, which never sent it: does that stage's "
                           f"action list skip it?") from error
    return buffer.to(device).requires_grad_()
