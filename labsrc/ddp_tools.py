"""Looking inside torch DDP: counting its all-reduces, its unused-parameter error, bucket views, compression, a profiler timeline."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def layered_model(layers: int = 6, width: int = 128, classes: int = 10, seed: int = 0) -> nn.Module:
    """A stack of equal Linear layers: gradients of known sizes, so bucket counts are easy to reason about."""
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(width, classes))


@dataclass
class CommCounter:
    """State of a counting communication hook: all-reduce calls and bytes handed to them."""

    calls: int = 0
    bytes: int = 0
    dtypes: set = field(default_factory=set)

    def reset(self) -> None:
        self.calls, self.bytes = 0, 0


def counting_hook(inner=default_hooks.allreduce_hook):
    """A DDP comm hook that counts each bucket's all-reduce, then runs `inner` (plain all-reduce by default)."""
    def hook(counter, bucket):  # no annotations: DDP checks them, and this module's are strings
        buffer = bucket.buffer()
        counter.calls += 1
        counter.bytes += buffer.numel() * (2 if inner is not default_hooks.allreduce_hook else buffer.element_size())
        return inner(None, bucket)
    return hook


def one_step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    return loss.detach()


class WithUnusedBranch(nn.Module):
    """A model whose `spare` layer never takes part in forward: its gradient never arrives."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.used = nn.Linear(width, 10)
        self.spare = nn.Linear(width, 10)

    def forward(self, inputs):
        return self.used(inputs)


def unused_parameter_outcomes(images: torch.Tensor, labels: torch.Tensor) -> dict[str, str]:
    """Two steps of a model with an unused layer under three DDP settings: what happened in each."""
    outcomes = {}
    for name, options in [("default", {}), ("find_unused_parameters=True", {"find_unused_parameters": True}),
                          ("static_graph=True", {"static_graph": True})]:
        torch.manual_seed(0)
        model = DDP(WithUnusedBranch(images.shape[1]), **options)
        try:
            for _ in range(2):
                one_step(model, images, labels)
            outcomes[name] = "ok"
        except RuntimeError as error:
            outcomes[name] = "RuntimeError: " + str(error).strip().splitlines()[0]
    return outcomes


def gradient_storages(model: nn.Module) -> dict:
    """How gradients are stored: distinct storages behind all .grad tensors and their bytes."""
    storages = {}
    for parameter in model.parameters():
        if parameter.grad is not None:
            storage = parameter.grad.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    gradient_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return {"distinct_storages": len(storages), "storage_bytes": sum(storages.values()),
            "gradient_bytes": gradient_bytes}


def bucket_view_comparison(make_model, images, labels, bucket_cap_mb: float) -> dict:
    """gradient_as_bucket_view off and on: where .grad lives, and the bytes that one copy of it costs.

    Off: DDP's buckets hold a copy of every gradient, so gradients are stored twice.
    On: each .grad is a view into its bucket: one copy, saving gradient_bytes.
    """
    results = {}
    for as_view in (False, True):
        model = DDP(make_model(), bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=as_view)
        for _ in range(2):  # the second step runs with the buckets DDP rebuilt after the first
            one_step(model, images, labels)
        results[f"view={as_view}"] = gradient_storages(model)
        if torch.cuda.is_available() and images.is_cuda:
            results[f"view={as_view}"]["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
    results["bytes_saved"] = results["view=False"]["gradient_bytes"]
    return results


def compression_comparison(make_model, images, labels) -> dict:
    """Plain fp32 all-reduce vs fp16/bf16 compression hooks: bytes sent per step and gradient error."""
    reference_model = DDP(make_model())
    counter = CommCounter()
    reference_model.register_comm_hook(counter, counting_hook())
    one_step(reference_model, images, labels)
    reference = [p.grad.clone() for p in reference_model.parameters()]
    rows = {"fp32 all-reduce": {"bytes": counter.bytes, "max_error": 0.0, "ok": True}}
    for name, inner in [("fp16 compression", default_hooks.fp16_compress_hook),
                        ("bf16 compression", default_hooks.bf16_compress_hook)]:
        model = DDP(make_model())
        counter = CommCounter()
        model.register_comm_hook(counter, counting_hook(inner))
        try:
            one_step(model, images, labels)
            error = max((p.grad - r).abs().max().item() for p, r in zip(model.parameters(), reference))
            rows[name] = {"bytes": counter.bytes, "max_error": error, "ok": True}
        except RuntimeError as failure:
            rows[name] = {"bytes": None, "max_error": None, "ok": False, "reason": str(failure).splitlines()[0]}
    return rows


def profiled_step(model: DDP, images, labels, trace_path: str) -> list[dict]:
    """Profile one DDP step, keep the trace file, and return the spans of backward ops and all-reduces."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if images.is_cuda else [])
    with profile(activities=activities) as profiler:
        one_step(model, images, labels)
    profiler.export_chrome_trace(trace_path)
    spans = []
    for event in profiler.events():
        name = event.name
        kind = ("all_reduce" if "allreduce" in name.lower().replace("_", "") else
                "backward" if name.startswith("autograd::engine::evaluate_function") else None)
        if kind:
            start = event.time_range.start / 1000.0  # microseconds -> milliseconds
            spans.append({"name": kind, "op": name, "start": start, "end": event.time_range.end / 1000.0})
    origin = min((s["start"] for s in spans), default=0.0)
    for span in spans:
        span["start"] -= origin
        span["end"] -= origin
    return spans
