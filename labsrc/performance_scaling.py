"""Scaling arithmetic: strong and weak scaling, learning-rate scaling with warm-up, step time predicted for N GPUs."""
from __future__ import annotations

import contextlib
import statistics

import torch

from labsrc.alpha_beta import AlphaBeta, ring_allreduce_time_s
from labsrc.training.loop import step
from labsrc.training.timing import timed

# Link models for extrapolation. These are model inputs, not measurements:
# - NVLink 4 on H100 SXM: 900 GB/s total per GPU, i.e. 450 GB/s each way (NVIDIA H100 datasheet).
# - InfiniBand NDR: 400 Gb/s = 50 GB/s per port, one port per GPU (NVIDIA ConnectX-7 / Quantum-2 datasheets).
# - alpha: a per-step latency of the order of NCCL's small-message all-reduce time (tens of microseconds
#   inside a node, more across nodes); change them to your own 02_collectives fit.
LINKS = {
    "NVLink 4 (H100, one node)": AlphaBeta(alpha_s=10e-6, beta_s_per_byte=1 / 450e9, r2=float("nan")),
    "InfiniBand NDR 400 Gb/s": AlphaBeta(alpha_s=20e-6, beta_s_per_byte=1 / 50e9, r2=float("nan")),
}


def strong_scaling(step_s: dict[int, float]) -> dict[int, dict]:
    """Fixed global batch: speedup = T(1) / T(n), efficiency = speedup / n."""
    base = step_s[1]
    return {n: {"speedup": base / t, "efficiency": base / t / n} for n, t in sorted(step_s.items())}


def weak_scaling(step_s: dict[int, float]) -> dict[int, dict]:
    """Fixed batch per rank: n times the work per step, so speedup = n T(1) / T(n), efficiency = T(1) / T(n)."""
    base = step_s[1]
    return {n: {"speedup": n * base / t, "efficiency": base / t} for n, t in sorted(step_s.items())}


def scaled_lr(base_lr: float, base_batch: int, global_batch: int) -> float:
    """The linear scaling rule (Goyal et al., 2017): the learning rate grows with the global batch."""
    return base_lr * global_batch / base_batch


def warmup_lr(step: int, peak_lr: float, warmup_steps: int) -> float:
    """Linear warm-up from peak/warmup_steps to the peak over warmup_steps steps, then constant."""
    return peak_lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else peak_lr


def predict_step_s(compute_s: float, gradient_bytes: float, world_size: int, link: AlphaBeta,
                   overlap: float = 0.0) -> float:
    """Step time with a ring all-reduce of the gradients: compute + communication - overlap x min(both).

    overlap=0: communication after compute (an upper bound); overlap=1: fully hidden behind backward, so
    the step takes max(compute, communication).
    """
    communication = ring_allreduce_time_s(gradient_bytes, world_size, link)
    hidden = min(compute_s, communication) * overlap
    return compute_s + communication - hidden


def extrapolate(compute_s: float, gradient_bytes: float, gpus: list[int], gpus_per_node: int = 8,
                overlap: float = 0.0) -> dict[str, list[dict]]:
    """Predicted step time and efficiency at each GPU count: NVLink inside a node, InfiniBand across nodes.

    A flat ring spanning nodes runs at the speed of its slowest link, the InfiniBand one.
    """
    rows = {"within a node (NVLink)": [], "across nodes (InfiniBand)": []}
    for n in gpus:
        key, link = (("within a node (NVLink)", LINKS["NVLink 4 (H100, one node)"]) if n <= gpus_per_node
                     else ("across nodes (InfiniBand)", LINKS["InfiniBand NDR 400 Gb/s"]))
        step = predict_step_s(compute_s, gradient_bytes, n, link, overlap)
        rows[key].append({"gpus": n, "step_s": step, "efficiency": compute_s / step})
    return rows


def compute_s_from_flops(flops_per_step: float, peak_tflops: float, mfu: float) -> float:
    """Seconds of compute for a step's FLOPs on a device running at `mfu` of its peak (an assumed input)."""
    return flops_per_step / (peak_tflops * 1e12 * mfu)


def reference_record(bench_results: list[dict]) -> dict:
    """A results/performance_scaling file from `python -m labsrc.bench --world-size n --out ...` JSONs.

    The runs must share model and per-rank batch (weak scaling, as data-parallel training usually grows) and
    include world size 1; efficiency = T(1) / T(n). Each run's own provenance is kept beside the points.
    """
    by_size = {r["world_size"]: r for r in bench_results}
    if 1 not in by_size:
        raise ValueError("a scaling reference needs the world size 1 run: efficiency is relative to it")
    configs = {(r["config"]["model"], r["config"]["batch_size"], r["config"]["precision"]) for r in bench_results}
    if len(configs) != 1:
        raise ValueError(f"the runs differ in (model, per-rank batch, precision): {sorted(configs)}")
    base = by_size[1]["split"]["step_s"]
    points = [{"gpus": n, "step_s": r["split"]["step_s"], "images_per_s": r["images_per_s"],
               "efficiency": base / r["split"]["step_s"]} for n, r in sorted(by_size.items())]
    model, batch, precision = configs.pop()
    return {"model": model, "per_rank_batch": batch, "precision": precision, "scaling": points,
            "provenance": by_size[1]["provenance"], "runs": [r["provenance"] for _, r in sorted(by_size.items())]}


def paired_step_times(model, batches, optimizer, device, steps: int, no_sync, warmup: int = 2) -> tuple[float, float]:
    """(fastest DDP step, fastest step under no_sync): one of each in turn, so both see the same machine load.

    On a shared machine the load drifts from second to second; alternating the two kinds of step keeps that
    drift out of their difference, which is the communication DDP adds.
    """
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for step in range(warmup + steps):
        for synced in (True, False):
            seconds[synced].append(step_times(model, batches, optimizer, device, 1, warmup=0,
                                              no_sync=None if synced else no_sync))
    return min(seconds[True][warmup:]), min(seconds[False][warmup:])


def step_times(model, batches, optimizer, device, steps: int, warmup: int = 2, no_sync=None) -> float:
    """Seconds of the fastest full training step; with no_sync (a DDP model's) the step skips communication.

    The step is the course's one (`training.loop.step`), timed by the one timer (`training.timing.timed`).
    The fastest step is the one other work on the machine disturbed least: what the step costs. (A median
    still moves by tens of percent when other processes share the cores.)
    """
    seconds = []
    for index in range(warmup + steps):
        images, labels = next(batches)
        with timed(device) as elapsed, (no_sync() if no_sync is not None else contextlib.nullcontext()):
            step(model, optimizer, images, labels)
        if index >= warmup:
            seconds.append(elapsed["s"])
    return min(seconds)


def rank_mean(records: list[dict], per_rank_batch: int) -> dict:
    """Mean over ranks of a scaling lab's "scaling" records at one per-rank batch: step_s, local_step_s, bytes."""
    mine = [r for r in records if r["per_rank_batch"] == per_rank_batch]
    if not mine:
        raise ValueError(f"no scaling record at per-rank batch {per_rank_batch}")
    return {key: statistics.fmean(r[key] for r in mine) for key in ("step_s", "local_step_s", "gradient_bytes")}


def predict_ddp_step(calibration: dict, target: dict) -> dict:
    """The DDP step at a larger per-rank batch, predicted as compute + a communication cost that does not grow.

    calibration, target: rank_mean() results at two per-rank batches. What DDP adds is measured at the
    calibration batch (DDP step - the same step under no_sync); the prediction is the target's no_sync step
    plus that addition. relative_error = predicted / measured - 1.
    """
    added = calibration["step_s"] - calibration["local_step_s"]
    predicted = target["local_step_s"] + added
    return {"added_s": added, "predicted_s": predicted, "measured_s": target["step_s"],
            "relative_error": predicted / target["step_s"] - 1}


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of the gradients DDP all-reduces each step (one per trainable parameter element)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
