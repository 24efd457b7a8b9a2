"""Benchmarks of the course itself: its training loop against a bare PyTorch loop, DDP at world size 1 against none."""
from __future__ import annotations

import copy
import time
from functools import partial

import torch
from torch.nn import functional as F

from labsrc.core.hardware import Hardware, detect
from labsrc.training import data
from labsrc.training.benchmark import world_of_one
from labsrc.training.loop import TrainConfig, train
from labsrc.training.models import build_model
from labsrc.training.timing import timed

SLOWER_AT_MOST = 0.03
"""The course's bar: its loop, and DDP at world size 1, at most 3% slower than the bare alternative."""


def bare_loop(model, batches, optimizer, steps: int) -> None:
    """The loop as one would write it by hand: nothing but the step."""
    for _ in range(steps):
        images, labels = next(batches)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def course_loop(model, batches, optimizer, steps: int, ctx) -> None:
    train(model, batches, ctx, TrainConfig(steps=steps, lr=0.01, momentum=0.9, log_every=steps), optimizer=optimizer)


def _seconds(run, device) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds over all its threads) of one run, GPU work included."""
    cpu = time.process_time()
    with timed(device) as wall:
        run()
    return wall["s"], time.process_time() - cpu


def compare_loops(options, rounds: int = 7, hardware: Hardware | None = None) -> dict:
    """Each configuration timed `rounds` times in turn (ABC, CBA, ...), the fastest round kept; ratios returned.

    Two clocks: wall time (what a user waits) and, on a CPU, the process's CPU time, which other processes
    on a shared machine cannot inflate by taking the cores away (they still can through caches).
    """
    device = torch.device("cuda", 0) if (hardware or detect()).gpus else torch.device("cpu")
    threads = torch.get_num_threads()
    if device.type == "cpu":  # one intra-op thread: no OpenMP spinning, so CPU time measures the work itself
        torch.set_num_threads(1)
    used_threads = torch.get_num_threads()
    torch.manual_seed(0)
    base = build_model(options.model).to(device)
    try:
        with world_of_one(device) as ctx:
            best = _best_rounds(base, ctx, options, rounds)
    finally:
        torch.set_num_threads(threads)
    ratios = {clock: {"course_over_bare": times["course loop"] / times["bare loop"],
                      "ddp_world1_over_no_ddp": times["course loop + DDP (world size 1)"] / times["course loop"]}
              for clock, times in best.items()}
    return {"device": str(device), "model": options.model, "batch_size": options.batch_size,
            "steps_per_round": options.steps, "rounds": rounds, "intra_op_threads": used_threads,
            "seconds_best_round": best["wall"], "cpu_seconds_best_round": best["cpu"],
            **ratios["wall"], "cpu_time_ratios": ratios["cpu"], "bar": f"each ratio at most {1 + SLOWER_AT_MOST:.2f}"}


def _best_rounds(base, ctx, options, rounds: int) -> dict:
    """{clock: {configuration: fastest round's seconds}} for the bare loop, the course loop, and it under DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    dataset = data.random_noise(max(4 * options.batch_size, 256), options.image_size, seed=0)
    batches = iter(data.DeviceBatches(dataset, options.batch_size, ctx))
    models = {"bare loop": copy.deepcopy(base), "course loop": copy.deepcopy(base),
              "course loop + DDP (world size 1)": DDP(copy.deepcopy(base))}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for name, m in models.items()}
    runners = {name: partial(course_loop, models[name], batches, optimizers[name], options.steps, ctx)
               for name in models}
    runners["bare loop"] = partial(bare_loop, models["bare loop"], batches, optimizers["bare loop"], options.steps)
    for run in runners.values():  # warm-up
        run()
    best = {clock: {name: float("inf") for name in runners} for clock in ("wall", "cpu")}
    for round_index in range(rounds):
        order = list(runners) if round_index % 2 == 0 else list(reversed(runners))  # no seat is always first
        for name in order:
            for clock, seconds in zip(("wall", "cpu"), _seconds(runners[name], ctx.device)):
                best[clock][name] = min(best[clock][name], seconds)
    models.clear()  # the DDP model's reducer goes while the process group it uses still exists
    return best
