"""Checkers for notebook 04's exercises: DDP's bucket assignment, and an averaging comm hook, both against torch DDP."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc.core.exercises import ExerciseFailed, on_ranks, passed
from labsrc.core.forked import run_ranks
from labsrc.lessons.ddp_internals.inside_ddp import layered_model, torch_ddp_caps

# (Linear layers as (in, out), bucket_cap_mb): cases where the plausible mistakes give other buckets than torch's.
BUCKET_CASES = (
    ([(32, 32)] * 4, 8448 / 2**20),           # two layers are exactly the cap: a bucket closes on reaching it
    ([(8, 8), (8, 200), (200, 8), (8, 8)], 0.004),  # weights larger than the cap join the bucket they close
    ([(16, 16), (16, 64), (64, 64), (64, 16)], 0.008),
    ([(256, 256)] * 6, None),                 # bucket_cap_mb unset: the first bucket is capped at 1 MiB
)


def _linear_stack(layers: list[tuple[int, int]]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(inputs, outputs) for inputs, outputs in layers])


def _torch_buckets(ctx, cases) -> list[list[list[int]]]:
    """On one rank: the buckets torch DDP really all-reduces (after its rebuild), as parameter indices per bucket."""
    found = []
    for layers, cap_mb in cases:
        model = _linear_stack(layers)
        ddp = DDP(model, bucket_cap_mb=cap_mb)
        index_of = {p.data_ptr(): index for index, p in enumerate(model.parameters())}
        seen = {}

        def hook(state, bucket):
            seen[bucket.index()] = [index_of[p.data_ptr()] for p in bucket.parameters()]
            buffer = bucket.buffer().div_(dist.get_world_size())
            return dist.all_reduce(buffer, async_op=True).get_future().then(lambda done: done.value()[0])

        ddp.register_comm_hook(None, hook)
        inputs = torch.randn(4, layers[0][0])
        for _ in range(2):  # step 0 uses one bucket; step 1 the buckets DDP rebuilt from the ready order
            seen.clear()
            ddp(inputs).sum().backward()
        found.append([seen[index] for index in sorted(seen)])
    return found


def _closing(sizes: list[int], order: list[int], caps: tuple[int, int], before: bool = False,
             above: bool = False) -> list[list[int]]:
    """Buckets by a rule: `order` of indices; caps (first, rest); the plausible mistakes as switches."""
    buckets, current, size = [], [], 0
    for index in order:
        limit = caps[1] if buckets else caps[0]
        if before and current and size + sizes[index] > limit:
            buckets.append(current)
            current, size, limit = [], 0, caps[1]
        current.append(index)
        size += sizes[index]
        if (size > limit) if above else (size >= limit):
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def _bucket_verdict(answer, truth, sizes: list[int], first_cap: int, cap: int) -> str | None:
    if not isinstance(answer, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in answer):
        return f"return a list of buckets, each a list of parameter indices; got {type(answer).__name__}."
    answer = [[int(index) for index in bucket] for bucket in answer]
    if answer == truth:
        return None
    flat = sorted(index for bucket in answer for index in bucket)
    if flat != list(range(len(sizes))):
        repeated = sorted({i for i in flat if flat.count(i) > 1})
        if repeated:
            return (f"parameters {repeated} appear in more than one bucket: DDP never splits a parameter; a "
                    "parameter larger than the room left joins the bucket whole, and that bucket then closes.")
        return f"every parameter index 0..{len(sizes) - 1} must be in exactly one bucket (got {flat})."
    backward = list(reversed(range(len(sizes))))
    mistakes = [
        (_closing(sizes, list(range(len(sizes))), (first_cap, cap)),
         "you filled the buckets in forward (registration) order; DDP fills them in REVERSE order, last layer "
         "first, because backward produces the last layer's gradients first."),
        (_closing(sizes, backward, (cap, cap)),
         f"no first-bucket cap: the first bucket (the last layers) closes at first_cap_bytes ({first_cap} "
         "bytes here), the others at cap_bytes."),
        (_closing(sizes, backward, (first_cap, cap), before=True),
         "you closed a bucket before the parameter that would overflow it; DDP adds the parameter first "
         "and closes the bucket once its size has reached the cap (so a large parameter shares its bucket)."),
        (_closing(sizes, backward, (first_cap, cap), above=True),
         "a bucket closes as soon as its size REACHES the cap (>=), not only once it exceeds it."),
        (list(reversed(truth)),
         "the right buckets in the wrong order: bucket 0 is the one holding the LAST parameters (their gradients "
         "are ready first, so DDP all-reduces it first); return the buckets in the order you closed them."),
        ([sorted(bucket) for bucket in truth],
         "the right buckets, but list each bucket's indices in the order they enter it: last parameter first "
         "(descending), as DDP lays them out in the bucket."),
    ]
    for buckets, message in mistakes:
        if answer == buckets:
            return message
    return "not the buckets torch DDP built."


def check_assign_buckets(assign_buckets: Callable, world_size: int = 2) -> None:
    """assign_buckets(parameter_sizes_bytes, cap_bytes, first_cap_bytes) -> [[parameter index, ...], ...],
    bucket 0 first; compared with the buckets torch DDP all-reduces on forked gloo ranks."""
    truths = run_ranks(_torch_buckets, world_size, (BUCKET_CASES,), timeout_s=60)[0]
    for (layers, cap_mb), truth in zip(BUCKET_CASES, truths):
        sizes = [p.numel() * p.element_size() for p in _linear_stack(layers).parameters()]
        first_cap, cap = torch_ddp_caps(cap_mb)
        answer = assign_buckets(list(sizes), cap, first_cap)
        verdict = _bucket_verdict(answer, truth, sizes, first_cap, cap)
        if verdict:
            raise ExerciseFailed(f"sizes {sizes} bytes, cap_bytes {cap}, first_cap_bytes {first_cap}: torch DDP "
                                 f"built {truth}, you returned {answer}.\n{verdict}")
    passed(f"the buckets equal torch DDP's in all {len(BUCKET_CASES)} cases (reverse order, a first bucket "
           "with its own cap, a bucket closing once it reaches the cap, no parameter split)")


def _gradients(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _close(first: list[torch.Tensor], second: list[torch.Tensor], scale: float = 1.0) -> bool:
    return all(torch.allclose(a, scale * b, rtol=1e-5, atol=1e-7) for a, b in zip(first, second))


def _hook_rank(ctx, hook: Callable) -> str | None:
    """On one rank: two steps of torch DDP with the learner's hook against DDP's default reduction."""
    make = lambda: layered_model(layers=3, width=16)
    theirs, default, local = DDP(make(), bucket_cap_mb=0.002), DDP(make()), make()
    theirs.register_comm_hook(None, hook)
    generator = torch.Generator().manual_seed(ctx.rank)
    for _ in range(2):  # the second step runs on the buckets DDP rebuilt after the first
        images, labels = torch.randn(8, 16, generator=generator), torch.randint(10, (8,), generator=generator)
        for model in (theirs, default, local):
            model.zero_grad(set_to_none=True)
        try:
            F.cross_entropy(theirs(images), labels).backward()
        except Exception as error:  # DDP rejects what the hook returned
            return _hook_error(error)
        F.cross_entropy(default(images), labels).backward()
        F.cross_entropy(local(images), labels).backward()
        got, expected, own = _gradients(theirs), _gradients(default), _gradients(local)
        if not _close(got, expected):
            return _hook_mistake(got, expected, own, ctx.world_size)
    return None


def _hook_error(error: Exception) -> str:
    text = str(error)
    if "PyObject" in text:
        return ("DDP could not read your future's value: all_reduce(...).get_future() holds a LIST of tensors; "
                "chain .then(lambda fut: fut.value()[0]) so the future holds the bucket's tensor.")
    return f"DDP raised {type(error).__name__}: {text.splitlines()[0][:300]} (return a torch.futures.Future of a tensor)."


def _hook_mistake(got, expected, own, world_size: int) -> str:
    if _close(got, expected, world_size):
        return (f"your gradients are {world_size} x DDP's: not dividing by the world size. all_reduce SUMS the "
                "ranks' buckets; divide the buffer by the world size (before the all-reduce, as DDP does).")
    if _close(got, expected, 1.0 / world_size):
        return (f"your gradients are DDP's / {world_size}: dividing twice. Divide by the world size once, "
                "either before the all-reduce or after it.")
    if _close(got, own) or _close(got, own, 1.0 / world_size):
        return ("your future returns this rank's own gradient, not the all-reduced one: return the tensor the "
                "all-reduce wrote (fut.value()[0], or the buffer once the all-reduce has completed).")
    gap = max(float((a - b).abs().max()) for a, b in zip(got, expected))
    return f"gradients differ from DDP's default by up to {gap:.3g}."


def check_allreduce_average_hook(hook: Callable, world_size: int = 2) -> None:
    """hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[Tensor] holding the averaged bucket;
    registered on torch DDP on forked gloo ranks, its gradients compared with DDP's default ones."""
    on_ranks(_hook_rank, world_size, (hook,), timeout_s=60)
    passed(f"on {world_size} ranks, two steps (before and after DDP rebuilt its buckets): the hook's gradients "
           "equal DDP's default averaged gradients")
