"""Run one rank's list of (kind, micro-batch, virtual stage) with send/recv: several model chunks per rank
(interleaved 1F1B) and the backward split into B (input gradient, sent upstream at once) and W (weight gradient,
whenever the list says). The one-stage executor (executor.run_stage) is the case of one chunk and no W."""
from __future__ import annotations

import time
from contextlib import nullcontext
from datetime import timedelta

import torch
from torch import nn

from labsrc.lessons.pipeline_parallel.backward_split import (CountingOps, backward_input, backward_weight,
                                                             forward_keeping_layer_outputs)
from labsrc.lessons.pipeline_parallel.executor import _finish_box, _receive, _send, _wait_for_send
from labsrc.lessons.pipeline_parallel.stages import full_batch_loss
from labsrc.training.timing import synchronize


def message_tag(virtual_stage: int, j: int, micro_batches: int, gradient: bool) -> int:
    """A tag per (receiving virtual stage, micro-batch, direction): with several chunks a rank pair carries
    activations and gradients of different virtual stages, which must not be confused."""
    return 2 * (virtual_stage * micro_batches + j) + int(gradient)


def run_chunks(modules: dict[int, nn.Module], actions: list, ranks: int, virtual_stages: int, inputs: torch.Tensor,
               targets: torch.Tensor, micro_batches: int, timeout_s: float = 60.0, box_s: float = 0.0,
               meter=None) -> dict:
    """Run this rank's actions in order; gradients accumulate in each chunk's module. Returns {"timeline", "sends"}.

    modules: {virtual stage: its module} for the chunks this rank holds (virtual stage vs lives on rank vs % p).
    "B" with a "W" of the same micro-batch in the list computes only the input gradient, and keeps each layer's
    output gradient, from which W computes the weight gradients (backward_split); "B" alone is the whole backward. box_s: every action lasts at least
    box_s (see executor.run_stage). Timeline entries: {"action", "micro_batch", "virtual_stage", "start", "end"}.
    meter: an executor.SavedTensorMeter counting the activations autograd keeps, if given.
    """
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack) if meter else nullcontext():
        return _run(modules, actions, ranks, virtual_stages, inputs, targets, micro_batches, timeout_s, box_s)


def _run(modules, actions, ranks, virtual_stages, inputs, targets, micro_batches, timeout_s, box_s) -> dict:
    device, timeout = inputs.device, timedelta(seconds=timeout_s)
    micro_inputs, micro_targets = inputs.chunk(micro_batches), targets.chunk(micro_batches)
    split = {(j, vs) for kind, j, vs in actions if kind == "W"}
    kept: dict[tuple[int, int], list] = {}   # (j, vs) -> [stage input, output or loss, gradient received or None,
    #                                                    [(layer, its output)], [their gradients, from B]]
    sends, timeline, halves = [], [], {}
    for kind, j, vs in actions:
        if kind == "F":
            stage_input = (micro_inputs[j].clone().requires_grad_() if vs == 0 else
                           _receive(micro_inputs[j].shape, inputs.dtype, device, (vs - 1) % ranks,
                                    message_tag(vs, j, micro_batches, False), timeout))
        else:
            entry = kept[(j, vs)]
            if entry[2] is None and vs < virtual_stages - 1:
                entry[2] = _receive(entry[1].shape, entry[1].dtype, device, (vs + 1) % ranks,
                                    message_tag(vs, j, micro_batches, True), timeout)
        synchronize(device)
        start = time.perf_counter()
        if kind == "F":
            output, layer_outputs = forward_keeping_layer_outputs(modules[vs], stage_input)
            if vs == virtual_stages - 1:
                output = full_batch_loss(output, micro_targets[j]) / micro_batches
            kept[(j, vs)] = [stage_input, output, None, layer_outputs if (j, vs) in split else None, None]
            layer_outputs = None
        elif kind == "B" and (j, vs) in split:
            input_gradient, entry[4] = backward_input(*entry[:4])
        elif kind == "B":
            stage_input, output, gradient, _, _ = kept.pop((j, vs))
            output.backward(gradient)
            input_gradient = stage_input.grad
        else:
            backward_weight(entry[3], entry[4])
        _finish_box(device, start, box_s)
        timeline.append({"action": kind, "micro_batch": j, "virtual_stage": vs, "start": start,
                         "end": time.perf_counter()})
        if kind == "F" and vs < virtual_stages - 1:
            sends.append((_send(output.detach(), (vs + 1) % ranks, message_tag(vs + 1, j, micro_batches, False)),
                          (vs + 1) % ranks, j))
        if kind == "B" and vs > 0:
            sends.append((_send(input_gradient, (vs - 1) % ranks, message_tag(vs - 1, j, micro_batches, True)),
                          (vs - 1) % ranks, j))
        if kind != "F" and (j, vs) in split:
            halves[(j, vs)] = halves.get((j, vs), 0) + 1
            if halves[(j, vs)] == 2:
                kept.pop((j, vs))   # B and W both done: the graph and its saved activations can go,
                entry = stage_input = output = None   # with the names still bound to them here
    for (work, _), destination, j in sends:
        _wait_for_send(work, timeout, destination, j)
    return {"timeline": timeline, "sends": len(sends)}


def step_work(module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, micro_batches: int) -> dict:
    """One step of one whole stage, run by run_chunks above (one rank, no messages) and counted by a dispatch mode:
    {"whole": each backward whole (F j, B j), "split": each backward as B j then W j}, each a CountingOps (aten
    operators run, matrix-product FLOPs). The forwards are the same, so the difference is what B + W add."""
    import copy
    counted = {}
    for name, actions in (("whole", [(kind, j, 0) for j in range(micro_batches) for kind in "FB"]),
                          ("split", [(kind, j, 0) for j in range(micro_batches) for kind in "FBW"])):
        with CountingOps() as counted[name]:
            run_chunks({0: copy.deepcopy(module)}, actions, 1, 1, inputs, targets, micro_batches)
    return counted
