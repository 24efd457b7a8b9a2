"""DataParallel, the older way: one process scatters the batch, replicates the module, gathers the outputs."""
from __future__ import annotations

import contextlib
import copy
import time

import torch
from torch import nn
from torch.nn import functional as F

from labsrc.lessons.dp_vs_ddp.sync import full_batch_gradients, gradients, largest_gap
from labsrc.training.loop import tf32


def replica_gradients_summed(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, replicas: int) -> dict:
    """DataParallel's arithmetic in one process: {name: the replicas' gradients summed, not divided}.

    images: (G, ...), labels: (G,). Each of `replicas` copies of the model runs one chunk of the batch
    (scatter); the outputs are concatenated (gather) and ONE mean loss is taken over all G samples; each
    copy's gradient is then summed, as DataParallel's backward reduce-adds the replicas' gradients onto
    the first GPU's parameters (torch/nn/parallel/_functions.py: Broadcast.backward -> ReduceAddCoalesced).
    """
    copies = [copy.deepcopy(model) for _ in range(replicas)]
    for replica in copies:
        replica.zero_grad(set_to_none=True)
    outputs = torch.cat([replica(chunk) for replica, chunk in zip(copies, images.chunk(replicas))])
    F.cross_entropy(outputs, labels).backward()
    per_replica = [gradients(replica) for replica in copies]
    return {name: sum(grads[name] for grads in per_replica) for name in per_replica[0]}


def synchronize_all(gpus: int) -> None:
    """Wait for the queued work of every GPU (DataParallel's replicas run on all of them)."""
    for index in range(gpus):
        torch.cuda.synchronize(index)


def dataparallel_step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, repeats: int = 3,
                      lr: float = 0.05) -> dict:
    """Training steps through nn.DataParallel: what each call of the module saw, its gradient, the step time.

    images: (N, 3, H, W), labels: (N,). With 2+ GPUs the batch is scattered in chunks along dim 0 to
    device_ids, the module replicated onto each GPU, and the outputs gathered on the first; the step
    (forward, backward, SGD update) is timed, the fastest of `repeats` steps after a warm-up. With fewer
    GPUs DataParallel calls the module as it is, once, with the whole batch. Calls are listed in device
    order. The warm-up step runs in float32 (TF32 off) and its gradient is compared with one process's
    full-batch gradient: gradient_vs_full_batch.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    model = model.to(device)
    images, labels = images.to(device), labels.to(device)
    with tf32(False):
        reference = full_batch_gradients(model, images, labels)
    calls: list[dict] = []  # one entry per replica call; replicas share the module's hooks
    hook = model.register_forward_pre_hook(
        lambda module, args: calls.append({"shape": list(args[0].shape), "device": str(args[0].device)}))
    parallel = nn.DataParallel(model, device_ids=list(range(gpus)) or None)
    optimizer = torch.optim.SGD(parallel.parameters(), lr=lr)
    seconds, first_step_calls, gap = [], [], None
    for index in range(1 + repeats if gpus >= 2 else 1):
        synchronize_all(gpus)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with tf32(False) if index == 0 else contextlib.nullcontext():
            outputs = parallel(images)
            F.cross_entropy(outputs, labels).backward()
        if index == 0:
            gap = largest_gap(gradients(model), reference)
        optimizer.step()
        synchronize_all(gpus)
        seconds.append(time.perf_counter() - start)
        first_step_calls = first_step_calls or sorted(calls, key=lambda call: torch.device(call["device"]).index or 0)
    hook.remove()
    return {"gpus": gpus, "device_ids": list(parallel.device_ids), "calls": first_step_calls,
            "chunks": [call["shape"][0] for call in first_step_calls], "output_device": str(outputs.device),
            "replicated": len(first_step_calls) > 1, "step_s": min(seconds[1:]) if gpus >= 2 else None,
            "gradient_vs_full_batch": gap,
            "largest_gradient": max(g.abs().max().item() for g in reference.values())}
