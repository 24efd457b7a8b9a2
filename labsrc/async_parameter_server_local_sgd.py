"""Local SGD: every worker steps on its own batches and the workers average their parameters every k steps."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from labsrc.async_parameter_server import (Problem, batch_rows, full_loss, gradient, initial_parameters)


def average_parameters(parameters: torch.Tensor, group=None, timeout_s: float = 30.0) -> None:
    """Replace parameters (features,) in place by their mean over the group's ranks: one all_reduce."""
    dist.all_reduce(parameters, op=dist.ReduceOp.SUM, group=group,
                    async_op=True).wait(datetime.timedelta(seconds=timeout_s))
    parameters.div_(dist.get_world_size(group))


def local_sgd(rank: int, data, problem: Problem, steps: int, every: int, lr: float, group=None,
              timeout_s: float = 30.0, average=average_parameters) -> dict:
    """steps local SGD steps on this worker's seeded batches, averaging every `every` steps (and after the last).

    Returns the final parameters (features,), the all_reduce calls and payload bytes it made, and the loss
    of the averaged parameters at each averaging point: [(local steps done, loss)].
    """
    parameters = initial_parameters(problem)
    calls, payload, curve = 0, 0, []
    for step in range(steps):
        rows = batch_rows(problem, rank, step)
        parameters -= lr * gradient(*data, parameters, rows)
        if (step + 1) % every == 0 or step + 1 == steps:
            average(parameters, group, timeout_s)
            calls += 1
            payload += parameters.numel() * parameters.element_size()
            curve.append((step + 1, full_loss(*data, parameters)))
    return {"parameters": parameters, "calls": calls, "payload_bytes": payload, "curve": curve}


def expected_calls(steps: int, every: int) -> int:
    """Averaging calls local_sgd makes: one every `every` steps, plus one after the last if steps % every."""
    return -(-steps // every)


def synchronous_sgd(data, problem: Problem, workers: tuple[int, ...], steps: int, lr: float) -> torch.Tensor:
    """One process: each step, the mean of every worker's gradient on its seeded batch; final parameters (features,).

    What local SGD with k = 1 must match up to rounding (averaging parameters after one step from the same start is
    averaging the gradients).
    """
    parameters = initial_parameters(problem)
    for step in range(steps):
        grads = [gradient(*data, parameters, batch_rows(problem, worker, step)) for worker in workers]
        parameters = parameters - lr * torch.stack(grads).mean(0)
    return parameters
