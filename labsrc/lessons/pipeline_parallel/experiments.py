"""What one rank runs for each experiment of lesson 08: gradient checks, a timed schedule, saved-tensor peaks."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from labsrc.lessons.pipeline_parallel import chunked, schedules
from labsrc.lessons.pipeline_parallel.chunked_executor import run_chunks
from labsrc.lessons.pipeline_parallel.executor import SavedTensorMeter, run_stage
from labsrc.lessons.pipeline_parallel.library import TWO_STAGES_A_RANK, run_library_schedule, stages_held
from labsrc.lessons.pipeline_parallel.stages import (full_batch_loss, gradient_error, gradient_scale, make_batch,
                                                     make_model, split_model, unsplit_gradients)

ActionsFunction = Callable[[int, int, int], list]
"""(stage, stages, micro_batches) -> that stage's action list."""


@contextmanager
def counting_backwards(modules: list) -> Iterator[list[int]]:
    """Yields one count per module: the backwards that reached it (accumulated into its first parameter)."""
    counts = [0] * len(modules)

    def hook_for(index):
        def hook(_parameter):
            counts[index] += 1
        return hook

    handles = [next(module.parameters()).register_post_accumulate_grad_hook(hook_for(index))
               for index, module in enumerate(modules)]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def _report(parts: list, reference: list, backwards: list[int]) -> dict:
    """{"max_error", "scale", "backwards"} for the parts a rank held (see labs.pipeline_parallel.GradientCheck)."""
    return {"max_error": max(gradient_error(part, reference) for part in parts),
            "scale": gradient_scale(parts, reference), "backwards": list(backwards)}


def hand_written_check(ctx, schedule: str | ActionsFunction, micro_batches: int, width: int = 16,
                       batch: int = 8, seed: int = 0, timeout_s: float = 30.0) -> dict:
    """This rank's stage, trained by a hand-written schedule, against the unsplit model: error, scale, backwards run.

    schedule: a name in schedules.SCHEDULES or a function giving the action lists. The model has
    2 blocks per stage; the batch [batch, width] is cut into micro_batches (naive: 1).
    """
    stages = ctx.world_size
    if isinstance(schedule, str):
        micro_batches = schedules.effective_micro_batches(schedule, micro_batches)
        actions = schedules.actions_for(schedule, ctx.rank, stages, micro_batches)
    else:
        actions = schedule(ctx.rank, stages, micro_batches)
    model = make_model(width, 2 * stages, seed)
    inputs, targets = make_batch(batch, width, seed, ctx.device)
    reference = unsplit_gradients(model, inputs, targets)
    part = split_model(model, stages, ctx.device)[ctx.rank]
    with counting_backwards([part[1]]) as backwards:
        run_stage(part[1], actions, ctx.rank, stages, inputs, targets, micro_batches, timeout_s)
    return _report([part], reference, backwards)


def hand_written_error(ctx, schedule: str | ActionsFunction, micro_batches: int, **sizes) -> float:
    """Largest |gradient - unsplit gradient| over this rank's stage after a hand-written schedule."""
    return hand_written_check(ctx, schedule, micro_batches, **sizes)["max_error"]


def library_check(ctx, schedule: str, micro_batches: int, width: int = 16, batch: int = 8, seed: int = 0) -> dict:
    """The same comparison for torch.distributed.pipelining's schedule (interleaved: 2 stages a rank)."""
    stages = 2 * ctx.world_size if schedule in TWO_STAGES_A_RANK else ctx.world_size
    # gloo moves CPU tensors only: ranks sharing a GPU through gloo run torch's schedules on the CPU
    device = torch.device("cpu") if ctx.backend == "gloo" else ctx.device
    model = make_model(width, 2 * ctx.world_size, seed)
    inputs, targets = make_batch(batch, width, seed, device)
    reference = unsplit_gradients(model, inputs, targets)
    parts = split_model(model, stages, device)
    held = [parts[index] for index in stages_held(schedule, ctx.rank, ctx.world_size)]
    with counting_backwards([module for _, module in held]) as backwards:
        run_library_schedule(schedule, parts, ctx.rank, ctx.world_size, inputs, targets, micro_batches)
    return _report(held, reference, backwards)


def library_error(ctx, schedule: str, micro_batches: int, **sizes) -> float:
    """Largest |gradient - unsplit gradient| over the stages this rank holds after torch's schedule."""
    return library_check(ctx, schedule, micro_batches, **sizes)["max_error"]


def timed_schedule(ctx, schedule: str, micro_batches: int, width: int, blocks_per_stage: int,
                   micro_batch_size: int, box_s: float = 0.0, timeout_s: float = 60.0) -> list[dict]:
    """This stage's timeline for one step of a schedule; every micro-batch has micro_batch_size samples.

    The batch grows with micro_batches so each box costs the same whatever m is. Ranks start together
    (a barrier); times are perf_counter seconds, one clock for every rank of one machine. box_s: see
    executor.run_stage (0: every box lasts as long as its compute).
    """
    stages = ctx.world_size
    model = make_model(width, blocks_per_stage * stages, seed=0)
    _, module = split_model(model, stages, ctx.device)[ctx.rank]
    inputs, targets = make_batch(micro_batch_size * micro_batches, width, 0, ctx.device)
    actions = schedules.actions_for(schedule, ctx.rank, stages, micro_batches)
    dist.barrier()
    return run_stage(module, actions, ctx.rank, stages, inputs, targets, micro_batches, timeout_s, box_s=box_s)


def saved_tensor_peak(ctx, schedule: str, micro_batches: int, width: int = 64, micro_batch_size: int = 8,
                      timeout_s: float = 30.0) -> dict:
    """Peak bytes of activations saved for backward on this stage during one step, and one micro-batch's worth.

    Also the peak CUDA memory above the start (None on the CPU).
    """
    stages = ctx.world_size
    model = make_model(width, 2 * stages, seed=0)
    _, module = split_model(model, stages, ctx.device)[ctx.rank]
    inputs, targets = make_batch(micro_batch_size * micro_batches, width, 0, ctx.device)
    one = SavedTensorMeter(module)
    with torch.autograd.graph.saved_tensors_hooks(one.pack, one.unpack):
        outputs = module(inputs[:micro_batch_size])       # what one F keeps, the last stage's loss included
        if ctx.rank == stages - 1:
            full_batch_loss(outputs, targets[:micro_batch_size])
        del outputs
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        baseline = torch.cuda.memory_allocated(ctx.device)
    meter = SavedTensorMeter(module)
    actions = schedules.actions_for(schedule, ctx.rank, stages, micro_batches)
    run_stage(module, actions, ctx.rank, stages, inputs, targets, micro_batches, timeout_s, meter)
    cuda_peak = torch.cuda.max_memory_allocated(ctx.device) - baseline if cuda else None
    return {"peak_bytes": meter.peak, "micro_batch_bytes": one.peak, "cuda_peak_bytes": cuda_peak,
            "in_flight": schedules.peak_in_flight(actions)}


CHUNKED_SCHEDULES = chunked.CHUNKED_SCHEDULES
chunked_lists = chunked.chunked_lists


def _chunked_run(ctx, schedule: str, micro_batches: int, model, inputs, targets, timeout_s: float, box_s: float,
                 count: bool = False) -> tuple[dict, dict, list[int]]:
    """Run this rank's chunks of model: ({virtual stage: (blocks, module)}, {"timeline", "sends"}, backwards that
    reached each chunk's parameters)."""
    lists, virtual_stages = chunked_lists(schedule, ctx.world_size, micro_batches)
    chunked.simulate(lists, virtual_stages, {"F": 1, "B": 1, "W": 1})   # raises, naming the stuck actions, not hangs
    parts = split_model(model, virtual_stages, ctx.device)
    held = {vs: parts[vs] for vs in range(ctx.rank, virtual_stages, ctx.world_size)}
    with counting_backwards([module for _, module in held.values()] if count else []) as backwards:
        run = run_chunks({vs: module for vs, (_, module) in held.items()}, lists[ctx.rank], ctx.world_size,
                         virtual_stages, inputs, targets, micro_batches, timeout_s, box_s)
    return held, run, backwards


def chunked_check(ctx, schedule: str, micro_batches: int, width: int = 16, batch: int = 8, seed: int = 0,
                  timeout_s: float = 30.0) -> dict:
    """This rank's chunks after a hand-written interleaved or zero-bubble step, against the unsplit model."""
    model = make_model(width, 4 * ctx.world_size, seed)
    inputs, targets = make_batch(batch, width, seed, ctx.device)
    reference = unsplit_gradients(model, inputs, targets)
    held, _, backwards = _chunked_run(ctx, schedule, micro_batches, model, inputs, targets, timeout_s, 0.0, True)
    return _report(list(held.values()), reference, backwards)


def timed_chunked(ctx, schedule: str, micro_batches: int, width: int, blocks_per_stage: int, micro_batch_size: int,
                  box_s: float = 0.0, timeout_s: float = 60.0) -> dict:
    """One timed step of a chunked schedule: {"timeline", "sends"}. Every F, B (and W) box lasts box_s: for
    interleaved 1F1B, each of the 2 chunks holds half a stage's blocks but is padded to a whole box (a box of
    box_s / 2 would make the per-hop overhead twice as large a share; the idle fraction's formula does not depend
    on the box's length); zero bubble: a whole backward = B + W = 2 boxes, as t_B = 2 t_F (B and W each run half
    of a backward's matrix products: backward_split, counted in notebook 08)."""
    model = make_model(width, blocks_per_stage * ctx.world_size, seed=0)
    inputs, targets = make_batch(micro_batch_size * micro_batches, width, 0, ctx.device)
    dist.barrier()
    return _chunked_run(ctx, schedule, micro_batches, model, inputs, targets, timeout_s, box_s)[1]


def chunked_saved_tensor_peak(ctx, schedule: str, micro_batches: int, width: int = 64, micro_batch_size: int = 8,
                              timeout_s: float = 30.0) -> dict:
    """Peak activation bytes this rank kept during one step of a chunked schedule (saved_tensor_peak's model,
    cut into chunks), and what one micro-batch's forward keeps on each of its chunks."""
    import torch.nn as nn
    model = make_model(width, 2 * ctx.world_size, seed=0)
    lists, virtual_stages = chunked_lists(schedule, ctx.world_size, micro_batches)
    chunked.simulate(lists, virtual_stages, {"F": 1, "B": 1, "W": 1})   # raises, naming the stuck actions, not hangs
    parts = split_model(model, virtual_stages, ctx.device)
    held = {vs: parts[vs][1] for vs in range(ctx.rank, virtual_stages, ctx.world_size)}
    inputs, targets = make_batch(micro_batch_size * micro_batches, width, 0, ctx.device)
    chunk_bytes = {}
    for vs, module in held.items():
        one = SavedTensorMeter(module)
        with torch.autograd.graph.saved_tensors_hooks(one.pack, one.unpack):
            outputs = module(inputs[:micro_batch_size].clone().requires_grad_())   # a received input needs grad
            if vs == virtual_stages - 1:
                full_batch_loss(outputs, targets[:micro_batch_size])
            del outputs
        chunk_bytes[vs] = one.peak
    meter = SavedTensorMeter(nn.ModuleList(held.values()))
    run_chunks(held, lists[ctx.rank], ctx.world_size, virtual_stages, inputs, targets, micro_batches, timeout_s,
               meter=meter)
    return {"peak_bytes": meter.peak, "chunk_bytes": {str(vs): b for vs, b in chunk_bytes.items()},
            "expected_bytes": chunked.kept_bytes_peak(lists[ctx.rank], chunk_bytes)}
