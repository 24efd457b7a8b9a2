"""Looking inside torch DDP: counting its all-reduces, no_sync, its unused-parameter error, bucket views, compression, a profiler timeline."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc.training.loop import step


def layered_model(layers: int = 6, width: int = 128, classes: int = 10, seed: int = 0) -> nn.Module:
    """A stack of equal Linear layers, (N, width) -> (N, classes): gradients of known sizes, easy to put in buckets.

    Each hidden layer holds width * (width + 1) float32 values; the seed makes every process build the same one.
    """
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(width, classes))


@dataclass
class CommCounter:
    """State of a counting communication hook: all-reduce calls, bytes sent, dtypes, DDP's bucket storages."""

    calls: int = 0
    bytes: int = 0
    dtypes: set = field(default_factory=set)
    bucket_storages: dict = field(default_factory=dict)  # data_ptr -> bytes of each bucket DDP handed over
    bucket_members: dict = field(default_factory=dict)  # bucket index -> data_ptrs of its parameters, in order

    def reset(self) -> None:
        self.calls, self.bytes = 0, 0
        self.bucket_members.clear()

    def count(self, bucket, sent: torch.Tensor) -> None:
        """One all-reduce of `sent` for DDP's GradBucket `bucket`: its bytes, dtype, storage and parameters."""
        storage = bucket.buffer().untyped_storage()
        self.bucket_storages[storage.data_ptr()] = storage.nbytes()
        self.bucket_members[bucket.index()] = [p.data_ptr() for p in bucket.parameters()]
        self.calls += 1
        self.bytes += sent.numel() * sent.element_size()
        self.dtypes.add(str(sent.dtype).removeprefix("torch."))

    def buckets(self, model: nn.Module) -> list[list[int]]:
        """The buckets seen since the last reset, bucket 0 first, as indices into model.parameters()."""
        index_of = {p.data_ptr(): index for index, p in enumerate(model.parameters())}
        return [[index_of[ptr] for ptr in self.bucket_members[b]] for b in sorted(self.bucket_members)]


def counting_hook(dtype: torch.dtype | None = None):
    """A DDP comm hook that all-reduces each bucket (cast to `dtype` if given) and counts what it sent.

    Does what torch's allreduce_hook / fp16_compress_hook / bf16_compress_hook do: divide by the world
    size (before summing, as DDP's reducer does without a hook), all-reduce (SUM) asynchronously, and
    (compressed) copy the result back into the fp32 bucket: only the bytes on the wire shrink.
    The bytes counted are those of the tensor actually handed to all_reduce.
    """
    def hook(counter, bucket):  # DDP calls it with each full bucket; it looks `bucket` up by name
        buffer = bucket.buffer()  # (bucket elements,) the bucket's flat fp32 gradients
        sent = buffer if dtype is None else buffer.to(dtype)
        sent.div_(dist.get_world_size())  # divide first, then sum: the average
        counter.count(bucket, sent)
        future = dist.all_reduce(sent, async_op=True).get_future()  # a Future of [sent], summed over ranks
        if dtype is None:
            return future.then(lambda done: done.value()[0])  # DDP wants a Future of one tensor
        return future.then(lambda done: buffer.copy_(done.value()[0]))  # back into the fp32 bucket
    return hook


def torch_ddp_caps(bucket_cap_mb: float | None) -> tuple[int, int]:
    """(first bucket cap, cap) in bytes that torch DDP rebuilds its buckets with (torch 2.11-2.14).

    Left unset, the cap is 25 MiB and the first bucket only 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES), so
    the last layers' all-reduce starts early; an explicit bucket_cap_mb applies to every bucket.
    """
    if bucket_cap_mb is None:
        return dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20
    cap = int(bucket_cap_mb * 2**20)
    return cap, cap


def accumulate(model: DDP, batches: list, counter: CommCounter, forward_inside: bool = True) -> list[int]:
    """Gradient accumulation over micro-batches [(images, labels), ...], no_sync on all but the last.

    Returns the all-reduces counted in each micro-step. DDP decides in forward() whether the coming
    backward synchronises, so forward must run inside no_sync() too; with forward_inside=False only
    backward is inside, and every micro-step all-reduces. Each micro-loss is divided by the number of
    micro-batches, so the accumulated gradient is the mean over all of them.
    """
    model.zero_grad(set_to_none=True)
    calls = []
    for index, (images, labels) in enumerate(batches):
        counter.reset()
        last = index == len(batches) - 1
        skip = contextlib.nullcontext() if last else model.no_sync()
        with skip if forward_inside else contextlib.nullcontext():
            loss = F.cross_entropy(model(images), labels) / len(batches)
        with contextlib.nullcontext() if forward_inside else skip:
            loss.backward()
        calls.append(counter.calls)
    return calls


class WithUnusedBranch(nn.Module):
    """A model whose `spare` layer never takes part in forward: its gradient never arrives."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.used = nn.Linear(width, 10)
        self.spare = nn.Linear(width, 10)

    def forward(self, inputs):  # (N, width) -> (N, 10)
        return self.used(inputs)


UNUSED_SETTINGS = {"default": {}, "find_unused_parameters": {"find_unused_parameters": True},
                   "static_graph": {"static_graph": True}}


def unused_parameter_outcomes(images: torch.Tensor, labels: torch.Tensor) -> list[dict]:
    """Two steps of a model with an unused layer under each of UNUSED_SETTINGS: what happened in each.

    Returns [{"setting", "ok", "error_type", "error"}]: error is the first line of what DDP raised.
    """
    outcomes = []
    for setting, options in UNUSED_SETTINGS.items():
        torch.manual_seed(0)
        model = DDP(WithUnusedBranch(images.shape[1]).to(images.device), **options)
        outcome = {"setting": setting, "ok": True, "error_type": None, "error": None}
        try:
            for _ in range(2):
                step(model, None, images, labels)
        except RuntimeError as error:
            outcome.update(ok=False, error_type=type(error).__name__, error=str(error).strip().splitlines()[0])
        outcomes.append(outcome)
    return outcomes


def gradient_storages(model: nn.Module, counter: CommCounter) -> dict:
    """Where gradients live: distinct storages behind the .grad tensors and DDP's buckets, and their bytes."""
    grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
             for p in model.parameters() if p.grad is not None}
    everything = {**counter.bucket_storages, **grads}
    return {"grad_storages": len(grads), "bucket_storages": len(counter.bucket_storages),
            "grads_inside_buckets": set(grads) <= set(counter.bucket_storages),
            "distinct_storages": len(everything), "storage_bytes": sum(everything.values()),
            "gradient_bytes": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                                  if p.grad is not None)}


def bucket_view_comparison(make_model, images, labels, bucket_cap_mb: float) -> list[dict]:
    """gradient_as_bucket_view off and on: the bytes of every distinct gradient storage, measured.

    Off: DDP's buckets hold a copy of every gradient, so gradients are stored twice.
    On: each .grad is a view into its bucket, so they are stored once (zero_grad's set_to_none still makes
    DDP copy each new gradient into its bucket at every backward; only the copy back out is saved). One row per setting, {"as_view", ...storages}.
    """
    rows = []
    for as_view in (False, True):
        if images.is_cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        model = DDP(make_model(), bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=as_view)
        counter = CommCounter()
        model.register_comm_hook(counter, counting_hook())
        for _ in range(2):  # the second step runs with the buckets DDP rebuilt after the first
            counter.bucket_storages.clear()
            step(model, None, images, labels)
        row = {"as_view": as_view, **gradient_storages(model, counter), "cuda_allocated_bytes": None}
        if images.is_cuda:  # on a GPU the allocator's own count says the same
            row["cuda_allocated_bytes"] = torch.cuda.memory_allocated() - before
        rows.append(row)
        del model
    return rows


COMPRESSION = {"fp32": ("fp32 all-reduce", None, default_hooks.allreduce_hook),
               "fp16": ("fp16 compression", torch.float16, default_hooks.fp16_compress_hook),
               "bf16": ("bf16 compression", torch.bfloat16, default_hooks.bf16_compress_hook)}


def compression_comparison(make_model, images, labels) -> list[dict]:
    """fp32 all-reduce vs fp16/bf16 compression: bytes sent per step (counted) and the gradient error.

    The counting hooks compute what torch's fp16_compress_hook and bf16_compress_hook compute;
    same_as_torch_hook checks that gradient for gradient (gloo all-reduces 16-bit tensors on the CPU too).
    One row per scheme (a key of COMPRESSION), the error measured against the fp32 all-reduce.
    """
    rows, reference = [], None
    for scheme, (label, dtype, torch_hook) in COMPRESSION.items():
        model, theirs = DDP(make_model()), DDP(make_model())
        counter = CommCounter()
        model.register_comm_hook(counter, counting_hook(dtype))
        theirs.register_comm_hook(None, torch_hook)
        step(model, None, images, labels)
        step(theirs, None, images, labels)
        grads = [p.grad.clone() for p in model.parameters()]
        reference = reference or grads
        rows.append({"scheme": scheme, "label": label, "bytes": counter.bytes, "calls": counter.calls,
                     "dtypes": sorted(counter.dtypes),
                     "max_error": max((g - r).abs().max().item() for g, r in zip(grads, reference)),
                     "same_as_torch_hook": all(torch.equal(g, p.grad) for g, p in zip(grads, theirs.parameters()))})
    return rows


SPAN_LABELS = {"backward": "backward op", "allreduce_launched": "all-reduce launched",
               "allreduce_running": "all-reduce running"}


def span_kind(name: str, on_device: bool = False) -> str | None:
    """Which lane (a key of SPAN_LABELS) a profiler event belongs to, from torch's own event name.

    `c10d::allreduce_` is the launch. gloo's `gloo:all_reduce` runs on gloo's own threads; with NCCL the
    host-side `nccl:all_reduce` only enqueues (skipped), and the NCCL kernel on the GPU is what runs.
    """
    if name.startswith("autograd::engine::evaluate_function"):
        return "backward"
    if name.startswith("c10d::allreduce"):
        return "allreduce_launched"
    if name.startswith("nccl:") and not on_device:
        return None
    if "allreduce" in name.lower().replace("_", ""):  # gloo:all_reduce, ncclDevKernel_AllReduce_...
        return "allreduce_running"
    return None


def profiled_step(model: DDP, images, labels, trace_path: str) -> list[dict]:
    """Profile one DDP step, keep the Chrome trace (Perfetto, TensorBoard), return its backward and all-reduce spans.

    Spans are {"kind": a key of SPAN_LABELS, "op": profiler name, "start": ms, "end": ms}, times from the first span.
    """
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if images.is_cuda else [])
    with profile(activities=activities) as profiler:
        step(model, None, images, labels)
        if images.is_cuda:
            torch.cuda.synchronize()
    profiler.export_chrome_trace(trace_path)
    spans = []
    for event in profiler.events():
        kind = span_kind(event.name, on_device=event.device_type != torch.autograd.DeviceType.CPU)
        if kind:
            spans.append({"kind": kind, "op": event.name, "start": event.time_range.start / 1000.0,
                          "end": event.time_range.end / 1000.0})  # microseconds -> milliseconds
    origin = min((s["start"] for s in spans), default=0.0)
    for span in spans:
        span["start"] -= origin
        span["end"] -= origin
    return sorted(spans, key=lambda span: span["start"])


def covered_ms(intervals: list[tuple[float, float]], until: float = float("inf")) -> float:
    """Length of the union of (start, end) intervals up to `until`: overlapping ones counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, until)
        if end > start:
            total += end - start
        reach = max(reach, end)
    return total


def overlap_ms(spans: list[dict]) -> dict:
    """When backward ends, when all-reduces are launched and the last ends, how long some ran (in all, during backward).

    spans: as profiled_step returns them. gloo runs all-reduces on two threads, so running spans can
    overlap each other: their union is measured.
    """
    backward_end = max(s["end"] for s in spans if s["kind"] == "backward")
    launched = [s["start"] for s in spans if s["kind"] == "allreduce_launched"]
    running = [(s["start"], s["end"]) for s in spans if s["kind"] == "allreduce_running"]
    return {"backward_end": backward_end, "first_launch": min(launched),
            "launched_during_backward": sum(t < backward_end for t in launched), "launched": len(launched),
            "running_ms": covered_ms(running), "running_ms_during_backward": covered_ms(running, backward_end),
            "running_end": max((end for _, end in running), default=backward_end)}
