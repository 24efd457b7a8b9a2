"""Local SGD: every worker steps on its own batches and the workers average their parameters every k steps."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from labsrc.lessons.async_parameter_server.server import (Problem, batch_rows, full_loss, gradient, initial_parameters)


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


def local_sgd_reference(data, problem: Problem, workers: tuple[int, ...], steps: int, every: int,
                        lr: float) -> torch.Tensor:
    """One process: every worker's `every` SGD steps from the common parameters, then their mean (and after the last,
    partial round); final parameters (features,). DiLoCo's reference with outer lr 1 and no momentum."""
    return diloco_reference(data, problem, workers, steps, every, lr, outer_lr=1.0, outer_momentum=0.0)


def outer_step(global_parameters: torch.Tensor, averaged: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """DiLoCo's outer step: the pseudo-gradient θ_global − mean θ_local fed to the outer optimizer as a gradient."""
    global_parameters.grad = global_parameters.detach() - averaged
    optimizer.step()


def diloco(rank: int, data, problem: Problem, steps: int, every: int, lr: float, outer_lr: float,
           outer_momentum: float, group=None, timeout_s: float = 30.0) -> dict:
    """DiLoCo (Douillard et al. 2023) on this worker: `every` inner SGD steps from the global parameters, then
    average the workers' parameters (one all_reduce) and take an outer SGD step with Nesterov momentum on the
    pseudo-gradient; every worker then restarts from the new global parameters (and after the last, partial round).

    With outer_lr 1 and outer_momentum 0 the outer step lands on the average: plain local SGD up to rounding.
    Every worker holds the same global parameters and outer momentum (each applies the same averaged step).
    Returns the final global parameters, the all_reduce calls, and [(local steps done, loss of the global ones)].
    """
    global_parameters = torch.nn.Parameter(initial_parameters(problem))
    outer = torch.optim.SGD([global_parameters], lr=outer_lr, momentum=outer_momentum,
                            nesterov=outer_momentum > 0)
    parameters = global_parameters.detach().clone()
    calls, curve = 0, []
    for step in range(steps):
        parameters -= lr * gradient(*data, parameters, batch_rows(problem, rank, step))
        if (step + 1) % every == 0 or step + 1 == steps:
            average_parameters(parameters, group, timeout_s)
            calls += 1
            outer_step(global_parameters, parameters, outer)
            parameters = global_parameters.detach().clone()
            curve.append((step + 1, full_loss(*data, parameters)))
    return {"parameters": parameters, "calls": calls, "curve": curve}


def diloco_reference(data, problem: Problem, workers: tuple[int, ...], steps: int, every: int, lr: float,
                     outer_lr: float, outer_momentum: float) -> torch.Tensor:
    """One process, written out: each round every worker's inner steps from the global parameters, then
    pseudo-gradient g = θ − mean θ_local, momentum buffer b = μ b + g, θ ← θ − outer_lr (g + μ b) (Nesterov, as
    torch.optim.SGD(nesterov=True) computes it). Final global parameters (features,)."""
    theta, buffer = initial_parameters(problem), None
    local = [theta.clone() for _ in workers]
    for step in range(steps):
        local = [p - lr * gradient(*data, p, batch_rows(problem, w, step)) for p, w in zip(local, workers)]
        if (step + 1) % every == 0 or step + 1 == steps:
            pseudo = theta - torch.stack(local).mean(0)
            buffer = pseudo.clone() if buffer is None else outer_momentum * buffer + pseudo
            theta = theta - outer_lr * (pseudo + outer_momentum * buffer if outer_momentum > 0 else pseudo)
            local = [theta.clone() for _ in workers]
    return theta
