"""Planted training bugs of notebook 12: unused parameters under DDP, a forgotten set_epoch, starved and oversubscribed steps."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from labsrc.lessons.debugging_clinic.collective_bugs import Outcome, attempt

DDP_VARIANTS = ("broken", "find_unused", "static_graph", "all_used")


class TwoHeads(nn.Module):
    """A trunk and two heads; forward uses head `aux` only when asked (the bug: it never is)."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.trunk = nn.Linear(width, width)
        self.main = nn.Linear(width, 1)
        self.aux = nn.Linear(width, 1)

    def forward(self, x, use_aux: bool = False):
        """x (batch, width) -> (batch, 1)."""
        hidden = torch.relu(self.trunk(x))
        return self.main(hidden) + (self.aux(hidden) if use_aux else 0)


def ddp_training(ctx, variant: str, steps: int = 20) -> Outcome:
    """`steps` DDP steps of TwoHeads; the aux head is unused except in the 'all_used' variant.

    broken: plain DDP (its reducer waits for aux's gradient, which never comes: the second step raises);
    find_unused: find_unused_parameters=True (the graph is searched every step); static_graph: static_graph=True
    (the unused set is learnt once). detail: seconds per step after the first two.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG=INFO: the error names the unused parameters
    torch.manual_seed(0)
    model = DDP(TwoHeads(), find_unused_parameters=variant == "find_unused", static_graph=variant == "static_graph")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(32, 64)

    def train():
        for step in range(steps):
            if step == 2:
                started = time.perf_counter()
            optimizer.zero_grad()
            model(batch, use_aux=variant == "all_used").square().mean().backward()
            optimizer.step()
        return {"step_s": (time.perf_counter() - started) / (steps - 2)}
    return attempt("unused_parameters", variant, ctx.rank, train)


ALTERNATING_VARIANTS = ("static_graph", "find_unused")


def ddp_alternating(ctx, variant: str, steps: int = 6) -> Outcome:
    """aux is used on odd steps only (`use_aux = step % 2`): the used set changes from step to step.

    static_graph: DDP learnt in step 0 that aux is unused, so step 1, which uses it, raises; find_unused: the
    graph walk marks the unused set anew each step. detail: per step, aux.weight's gradient summed on this rank
    (None where unused), to compare across ranks (all-reduced, so equal).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.set_debug_level_from_env()
    torch.manual_seed(0)
    model = DDP(TwoHeads(), find_unused_parameters=variant == "find_unused", static_graph=variant == "static_graph")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(32, 64) + ctx.rank  # different data per rank: equal gradients only if all-reduced
    aux_grads: list = []

    def train():
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            model(batch, use_aux=step % 2 == 1).square().mean().backward()
            grad = model.module.aux.weight.grad
            aux_grads.append(None if grad is None else float(grad.sum()))
            optimizer.step()
        return {"aux_grads": aux_grads}
    outcome = attempt("alternating_use", variant, ctx.rank, train)
    outcome.detail = {"aux_grads": aux_grads, "steps_done": len(aux_grads)}
    return outcome


def alternating_case(ctx, variant: str, timeout_s: float) -> Outcome:
    """run_case's signature for ddp_alternating."""
    return ddp_alternating(ctx, variant)


def ddp_case(ctx, variant: str, timeout_s: float) -> Outcome:
    """run_case's signature for ddp_training (DDP's own collectives use the default group)."""
    return ddp_training(ctx, variant)


# -- a forgotten set_epoch --------------------------------------------------------------------------------------

def epoch_orders(dataset_size: int, epochs: int, call_set_epoch: bool, rank: int = 0,
                 world_size: int = 2) -> list[list[int]]:
    """The indices rank `rank` sees in each epoch from a shuffling DistributedSampler, with or without set_epoch."""
    sampler = DistributedSampler(range(dataset_size), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    orders = []
    for epoch in range(epochs):
        if call_set_epoch:
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def distinct_orders(orders: list[list[int]]) -> int:
    return len({tuple(order) for order in orders})


# -- data loading starving the step -------------------------------------------------------------------------------

class SlowDataset(Dataset):
    """Samples that take item_s seconds each to produce (decoding, augmenting): (width,) tensors."""

    def __init__(self, size: int, item_s: float, width: int = 8):
        self.size, self.item_s, self.width = size, item_s, width

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        time.sleep(self.item_s)
        return torch.full((self.width,), float(index))


def data_wait(num_workers: int, batches: int = 8, batch_size: int = 8, item_s: float = 0.003,
              step_s: float = 0.03) -> dict:
    """Seconds the loop waits for each batch when a step takes step_s (a device step, stood in for by a sleep).

    With num_workers=0 the loop itself makes every sample (batch_size * item_s per batch, none overlapped);
    workers make the next batches while the step runs.
    """
    loader = DataLoader(SlowDataset(batches * batch_size, item_s), batch_size=batch_size,
                        num_workers=num_workers, prefetch_factor=2 if num_workers else None)
    waits = []
    iterator = iter(loader)
    for _ in range(batches):
        started = time.perf_counter()
        next(iterator)
        waits.append(time.perf_counter() - started)
        time.sleep(step_s)
    del iterator
    steady = waits[1:]  # the first batch pays for starting the workers
    return {"num_workers": num_workers, "wait_s": sum(steady) / len(steady),
            "produce_s": batch_size * item_s, "step_s": step_s}


# -- threads: oversubscription and the import-order advice --------------------------------------------------------

def matmul_seconds(ctx, threads: int, size: int = 384, repeats: int = 12) -> dict:
    """`repeats` (size, size) matmuls with torch.set_num_threads(threads): {threads in force, seconds}.

    threads is read back from torch while the matmuls run (what the rank really used); the old count comes back.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size)
        a @ a
        started = time.perf_counter()
        for _ in range(repeats):
            a @ a
        return {"threads": torch.get_num_threads(), "seconds": time.perf_counter() - started}
    finally:
        torch.set_num_threads(previous)


PROBE = r'''
import json, os, sys, time
if sys.argv[1] == "numpy_first":
    import numpy, torch
else:
    import torch, numpy
before = torch.get_num_threads()
if sys.argv[2] != "-":
    os.environ["OMP_NUM_THREADS"] = sys.argv[2]
a = torch.randn(256, 256)
started = time.perf_counter()
for _ in range(20):
    a @ a
print(json.dumps({"threads_at_import": before, "threads": torch.get_num_threads(),
                  "seconds": time.perf_counter() - started}))
'''

PROBES = {  # name: (import order, OMP_NUM_THREADS set after import or "-", OMP_NUM_THREADS before start)
    "torch_then_numpy": ("torch_first", "-", "1"),
    "numpy_then_torch": ("numpy_first", "-", "1"),
    "omp_set_after_import": ("torch_first", "1", None),
}


def import_order_probes(timeout_s: float = 60.0) -> dict[str, dict]:
    """Fresh interpreters (in parallel): does import order, or OMP_NUM_THREADS set after import, change threads?"""
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    running = {}
    for name, (order, late, early) in PROBES.items():
        env = dict(base, **({"OMP_NUM_THREADS": early} if early else {}))
        running[name] = subprocess.Popen([sys.executable, "-c", PROBE, order, late], env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    results = {}
    try:
        for name, process in running.items():
            out, _ = process.communicate(timeout=timeout_s)
            results[name] = json.loads(out.strip().splitlines()[-1])
    finally:
        for process in running.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return results
