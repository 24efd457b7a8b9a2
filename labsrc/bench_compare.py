"""Benchmarks of the course itself: its training loop against a bare PyTorch loop, DDP at world size 1 against none."""
from __future__ import annotations

import copy
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

from labsrc import data
from labsrc.dist import RankContext, gpu_count
from labsrc.metrics import synchronize
from labsrc.models import build_model
from labsrc.train import TrainConfig, train


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


def _seconds(run, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def compare_loops(options, rounds: int = 7) -> dict:
    """Each configuration timed `rounds` times in turn (ABAB...), the fastest round kept; ratios printed."""
    device = torch.device("cuda", 0) if gpu_count() else torch.device("cpu")
    ctx = RankContext(0, 0, 1, device, "gloo")
    dataset = data.random_noise(max(4 * options.batch_size, 256), options.image_size, seed=0)
    batches = iter(data.DeviceBatches(dataset, options.batch_size, ctx))
    torch.manual_seed(0)
    base = build_model(options.model).to(device)
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
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
        best = {name: float("inf") for name in runners}
        for _ in range(rounds):
            for name, run in runners.items():
                best[name] = min(best[name], _seconds(run, device))
    finally:
        dist.destroy_process_group()
    return {"device": str(device), "model": options.model, "batch_size": options.batch_size,
            "steps_per_round": options.steps, "rounds": rounds,
            "seconds_best_round": best,
            "course_over_bare": best["course loop"] / best["bare loop"],
            "ddp_world1_over_no_ddp": best["course loop + DDP (world size 1)"] / best["course loop"]}
