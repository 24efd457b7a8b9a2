"""Benchmarks of the course itself: its training loop against a bare PyTorch loop, DDP at world size 1 against none."""
from __future__ import annotations

import copy
import gc
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

from labsrc.training import data
from labsrc.core.world import RankContext, gpu_count
from labsrc.training.timing import synchronize
from labsrc.training.models import build_model
from labsrc.training.loop import TrainConfig, train

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
    synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    synchronize(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def compare_loops(options, rounds: int = 7) -> dict:
    """Each configuration timed `rounds` times in turn (ABC, CBA, ...), the fastest round kept; ratios returned.

    Two clocks: wall time (what a user waits) and, on a CPU, the process's CPU time, which other processes
    on a shared machine cannot inflate by taking the cores away (they still can through caches).
    """
    device = torch.device("cuda", 0) if gpu_count() else torch.device("cpu")
    threads = torch.get_num_threads()
    if device.type == "cpu":  # one intra-op thread: no OpenMP spinning, so CPU time measures the work itself
        torch.set_num_threads(1)
    used_threads = torch.get_num_threads()
    ctx = RankContext(0, 0, 1, device, "gloo")
    dataset = data.random_noise(max(4 * options.batch_size, 256), options.image_size, seed=0)
    batches = iter(data.DeviceBatches(dataset, options.batch_size, ctx))
    torch.manual_seed(0)
    base = build_model(options.model).to(device)
    folder = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1)
    models, runners = {}, {}
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
        models = {"bare loop": copy.deepcopy(base), "course loop": copy.deepcopy(base),
                  "course loop + DDP (world size 1)": DDP(copy.deepcopy(base))}
        optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for name, m in models.items()}
        runners = {
            "bare loop": lambda: bare_loop(models["bare loop"], batches, optimizers["bare loop"], options.steps),
            "course loop": lambda: course_loop(models["course loop"], batches, optimizers["course loop"],
                                               options.steps, ctx),
            "course loop + DDP (world size 1)": lambda: course_loop(
                models["course loop + DDP (world size 1)"], batches, optimizers["course loop + DDP (world size 1)"],
                options.steps, ctx),
        }
        for run in runners.values():  # warm-up
            run()
        best = {clock: {name: float("inf") for name in runners} for clock in ("wall", "cpu")}
        for round_index in range(rounds):
            order = list(runners) if round_index % 2 == 0 else list(reversed(runners))  # no seat is always first
            for name in order:
                for clock, seconds in zip(("wall", "cpu"), _seconds(runners[name], device)):
                    best[clock][name] = min(best[clock][name], seconds)
    finally:
        models.clear(), runners.clear()
        gc.collect()  # the DDP model's reducer goes while the process group it uses still exists
        dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)
        torch.set_num_threads(threads)
    ratios = {clock: {"course_over_bare": times["course loop"] / times["bare loop"],
                      "ddp_world1_over_no_ddp": times["course loop + DDP (world size 1)"] / times["course loop"]}
              for clock, times in best.items()}
    return {"device": str(device), "model": options.model, "batch_size": options.batch_size,
            "steps_per_round": options.steps, "rounds": rounds, "intra_op_threads": used_threads,
            "seconds_best_round": best["wall"], "cpu_seconds_best_round": best["cpu"],
            **ratios["wall"], "cpu_time_ratios": ratios["cpu"], "bar": f"each ratio at most {1 + SLOWER_AT_MOST:.2f}"}
