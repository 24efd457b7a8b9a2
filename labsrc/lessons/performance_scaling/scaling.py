"""Scaling arithmetic: strong and weak scaling, learning-rate scaling with warm-up, step time predicted for N GPUs."""
from __future__ import annotations

import contextlib
import math
import statistics

import torch

from labsrc.techniques.alpha_beta import AlphaBeta, ring_allreduce_time_s
from labsrc.training.loop import step
from labsrc.training.timing import timed

# Interconnect inputs for the extrapolation: published figures and stated assumptions, NOT measurements.
# - NVLink 4, H100 SXM: 900 GB/s per GPU in total, so 450 GB/s each way (NVIDIA H100 Tensor Core GPU datasheet).
# - InfiniBand NDR: 400 Gb/s = 50 GB/s per port each way; a DGX H100 has 8 single-port ConnectX-7 for its compute
#   fabric, one per GPU (NVIDIA DGX H100 User Guide, "Network Modules"; DGX BasePOD reference architecture).
# - alpha, the latency of one hop: assumed, of the order NCCL's own tuning model uses (NVIDIA/nccl
#   src/graph/tuning.cc, hwLat: 0.6-3.4 us per NVLink hop, 2.7-14 us per network hop, by protocol).
NVLINK = AlphaBeta(alpha_s=2e-6, beta_s_per_byte=1 / 450e9, r2=float("nan"))
INFINIBAND = AlphaBeta(alpha_s=5e-6, beta_s_per_byte=1 / 50e9, r2=float("nan"))
LINK_SOURCES = {
    "NVLink 4 (H100 SXM)": "450 GB/s each way per GPU: NVIDIA H100 datasheet (900 GB/s total); alpha 2 us assumed",
    "InfiniBand NDR": "50 GB/s per port, 8 ports per DGX H100 (one per GPU): NVIDIA DGX H100 User Guide; "
                      "alpha 5 us assumed",
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


def warmup_lr(step: int, base_lr: float, peak_lr: float, warmup_steps: int) -> float:
    """Goyal et al. (2017) gradual warm-up: from the base (small-batch) rate at step 0, up by a constant amount
    each step to the scaled peak k x base at step warmup_steps, then constant."""
    if step >= warmup_steps:
        return peak_lr
    return base_lr + (peak_lr - base_lr) * step / warmup_steps


def predict_step_s(compute_s: float, gradient_bytes: float, world_size: int, link: AlphaBeta,
                   overlap: float = 0.0) -> float:
    """Step time with a ring all-reduce of the gradients over per-message links `link`.

    step = compute + communication - overlap x min(compute, communication): overlap=0, communication after
    compute (an upper bound); overlap=1, fully hidden behind backward, so the step takes max(both).
    """
    communication = ring_allreduce_time_s(gradient_bytes, world_size, link)
    hidden = min(compute_s, communication) * overlap
    return compute_s + communication - hidden


def split_nodes(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(GPUs per node in use, nodes): up to one node's worth of GPUs fill one node."""
    if gpus <= gpus_per_node:
        return gpus, 1
    if gpus % gpus_per_node:
        raise ValueError(f"{gpus} GPUs do not fill whole nodes of {gpus_per_node}")
    return gpus_per_node, gpus // gpus_per_node


def ring_time_s(nbytes: float, gpus: int, gpus_per_node: int = 8, nvlink: AlphaBeta = NVLINK,
                nic: AlphaBeta = INFINIBAND, nics_per_node: int = 8) -> float:
    """All-reduce of nbytes as NCCL's flat ring: one ring through all n = gN GPUs, numbered node by node.

    bytes: each of the 2(n-1) steps sends a chunk of nbytes/n on every ring edge, so every edge carries
    2(n-1)/n nbytes: nccl-tests' busbw = algbw x 2(n-1)/n (doc/PERFORMANCE.md). NCCL runs one ring per NIC
    (a channel), each with nbytes/nics_per_node; every ring leaves each node once, so a node's NICs carry
    2(n-1)/n nbytes together, and each GPU's NVLink carries its own 2(n-1)/n nbytes.
    bandwidth: all edges send at once, so the slower of the two sets the pace (NVLink, or the node's NICs).
    latency: a chunk goes round the ring hop after hop, 2(n-1) hops, of which 2(N-1) cross the network
    (NCCL's tuning model, src/graph/tuning.cc). One node: exactly the plain ring formula over NVLink.
    """
    per_node, nodes = split_nodes(gpus, gpus_per_node)
    if nodes == 1:
        return ring_allreduce_time_s(nbytes, gpus, nvlink)
    latency = 2 * (gpus - nodes) * nvlink.alpha_s + 2 * (nodes - 1) * nic.alpha_s
    nvlink_s_per_byte = nvlink.beta_s_per_byte if per_node > 1 else 0.0
    slowest_s_per_byte = max(nvlink_s_per_byte, nic.beta_s_per_byte / nics_per_node)
    return latency + 2 * (gpus - 1) / gpus * nbytes * slowest_s_per_byte


def tree_time_s(nbytes: float, gpus: int, gpus_per_node: int = 8, nvlink: AlphaBeta = NVLINK,
                nic: AlphaBeta = INFINIBAND, nics_per_node: int = 8) -> float:
    """All-reduce of nbytes as NCCL's double binary tree: a chain inside each node, two binary trees across nodes.

    latency: reduce up and broadcast down, each through g-1 NVLink hops and ceil(log2 N) network hops (NCCL's
    tuning model has the same form with log2 N rounded down: equal for power-of-two node counts), so it grows
    with log2 of the node count, not with the GPU count.
    bandwidth: 2 x nbytes through the slower part. Inside the node each GPU of the chain sends nbytes up and
    nbytes down (NVLink); across nodes each node sends 2 x nbytes, half per tree, over its NICs. The chain and
    the trees pipeline their chunks, so, as for the ring, the slower part sets the pace (NCCL's tuning model:
    tree algbw = busbw / 2).
    """
    per_node, nodes = split_nodes(gpus, gpus_per_node)
    if gpus <= 1:
        return 0.0
    depth = math.ceil(math.log2(nodes)) if nodes > 1 else 0
    latency = 2 * ((per_node - 1) * nvlink.alpha_s + depth * nic.alpha_s)
    nvlink_s_per_byte = nvlink.beta_s_per_byte if per_node > 1 else 0.0
    nic_s_per_byte = nic.beta_s_per_byte / nics_per_node if nodes > 1 else 0.0
    return latency + 2 * nbytes * max(nvlink_s_per_byte, nic_s_per_byte)


def algorithm_times(nbytes: float, gpus: int, gpus_per_node: int = 8, **links) -> dict[str, float]:
    """{"ring": s, "tree": s, "faster": name}: the model's all-reduce time by algorithm, and the faster one.

    NCCL picks per collective and message size from its own tuning model (not this one); NCCL_ALGO forces one.
    """
    times = {"ring": ring_time_s(nbytes, gpus, gpus_per_node, **links),
             "tree": tree_time_s(nbytes, gpus, gpus_per_node, **links)}
    return {**times, "faster": min(times, key=times.get)}


def extrapolate(compute_s: float, gradient_bytes: float, gpus: list[int], gpus_per_node: int = 8,
                overlap: float = 0.0, **links) -> dict[str, list[dict]]:
    """Predicted step time and efficiency at each GPU count, for a ring and a tree all-reduce of the gradients.

    {"ring": rows, "tree": rows}, rows [{"gpus", "communication_s", "step_s", "efficiency"}]; efficiency =
    compute / step (weak scaling: the per-GPU batch, so compute, stays fixed).
    """
    rows: dict[str, list[dict]] = {"ring": [], "tree": []}
    for n in gpus:
        times = algorithm_times(gradient_bytes, n, gpus_per_node, **links)
        for name in rows:
            hidden = min(compute_s, times[name]) * overlap
            step = compute_s + times[name] - hidden
            rows[name].append({"gpus": n, "communication_s": times[name], "step_s": step,
                               "efficiency": compute_s / step})
    return rows


def gpus_above(efficiency: float, compute_s: float, gradient_bytes: float, link: AlphaBeta,
               max_gpus: int = 4096) -> int:
    """The largest n (up to max_gpus) whose predicted step (one ring, no overlap) keeps compute / step >= efficiency."""
    largest = 1
    for n in range(2, max_gpus + 1):
        if compute_s / predict_step_s(compute_s, gradient_bytes, n, link) >= efficiency:
            largest = n
    return largest


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


def paired_step_times(model, batches, optimizer, device, steps: int, no_sync, warmup: int = 2,
                      phase: dict | None = None) -> tuple[float, float, int]:
    """(fastest DDP step, fastest step under no_sync, DDP steps run): timed in turn, in blocks of two.

    On a shared machine the load drifts from second to second; timing the two kinds of step in turn keeps
    that drift out of their difference, which is the communication DDP adds. Each turn is a block of two
    steps of one kind, and only the second is timed. DDP decides whether to broadcast the module's buffers
    (BatchNorm's running statistics) from the PREVIOUS forward (torch/nn/parallel/distributed.py,
    _pre_forward reads require_forward_param_sync, which _post_forward sets). So the first no_sync step
    after a DDP step still broadcasts, and the first DDP step after a no_sync one does not. The second step
    of a block is the steady state of its kind. `phase`, if given, holds {"kind": "ddp" | "no_sync",
    "timed": bool} during each step, so a spy can tell which step did what.
    """
    seconds: dict[bool, list[float]] = {True: [], False: []}
    phase = {} if phase is None else phase
    for block in range(warmup + steps):
        for synced in (True, False):
            for timed_step in (False, True):
                phase.update(kind="ddp" if synced else "no_sync", timed=timed_step)
                elapsed = step_times(model, batches, optimizer, device, 1, warmup=0,
                                     no_sync=None if synced else no_sync)
                if timed_step:
                    seconds[synced].append(elapsed)
    phase.clear()
    return min(seconds[True][warmup:]), min(seconds[False][warmup:]), 2 * (warmup + steps)


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
