"""The same pipelines with torch.distributed.pipelining: PipelineStage around our own stage modules, a Schedule."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

LIBRARY_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble")
TWO_STAGES_A_RANK = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble")


def stages_held(schedule: str, rank: int, ranks: int) -> list[int]:
    """Stage indices this rank holds: one (rank) per rank; round-robin (rank, rank + p) when interleaved; a V
    (rank, 2p - 1 - rank) for ZBV, so rank 0 holds the first and the last stage."""
    if schedule == "zbv_zero_bubble":
        return [rank, 2 * ranks - 1 - rank]
    return [rank, rank + ranks] if schedule in TWO_STAGES_A_RANK else [rank]


def schedule_class(schedule: str):
    """The torch.distributed.pipelining class for a schedule name."""
    from torch.distributed import pipelining
    return {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
            "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
            "interleaved_zero_bubble": pipelining.ScheduleInterleavedZeroBubble,   # backward split into B and W
            "zbv_zero_bubble": pipelining.ScheduleZBVZeroBubble}[schedule]


def micro_batch_loss(outputs, targets):
    """The loss of one micro-batch, a mean like the full-batch loss; scale_grads=True then divides by m."""
    return F.mse_loss(outputs, targets)


def run_library_schedule(schedule: str, parts: list[tuple[range, nn.Module]], rank: int, ranks: int,
                         inputs, targets, micro_batches: int) -> list[tuple[range, nn.Module]]:
    """One training step's forward and backward through torch's schedule; returns the parts this rank held.

    parts: every stage's (block indices, module), len(parts) = stages (2 x ranks when interleaved).
    inputs, targets [batch, width]: rank 0 feeds inputs, the rank holding the last stage the targets.
    The gradients left in the held modules equal the full-batch mean loss's, because scale_grads=True
    divides the sum of the micro-batch mean losses' gradients by micro_batches.
    """
    from torch.distributed.pipelining import PipelineStage
    held = stages_held(schedule, rank, ranks)
    device = inputs.device
    pipeline_stages = [PipelineStage(parts[index][1], index, len(parts), device) for index in held]
    runner_class = schedule_class(schedule)
    first = pipeline_stages if schedule in TWO_STAGES_A_RANK else pipeline_stages[0]
    runner = runner_class(first, micro_batches, loss_fn=micro_batch_loss, scale_grads=True)
    holds_first, holds_last = 0 in held, len(parts) - 1 in held
    arguments = (inputs,) if holds_first else ()
    losses: list = []
    if holds_last:
        runner.step(*arguments, target=targets, losses=losses)
    else:
        runner.step(*arguments)
    return [parts[index] for index in held]
