"""Timed training steps for the benchmark: the step split into phases, FLOPs, MFU, peak memory, provenance."""
from __future__ import annotations

import contextlib
import datetime
import gc
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from labsrc.core.world import RankContext
from labsrc.training.loop import autocast, tf32
from labsrc.training.timing import timed

# Dense peak FLOP/s (no sparsity: the datasheets' tensor-core figures "with sparsity" halved) per device and
# math mode. Sources: "NVIDIA H100 Tensor Core GPU" datasheet (H100 SXM5, H100 PCIe, H100 NVL), "NVIDIA H200
# Tensor Core GPU" datasheet (H200 SXM, H200 NVL), "NVIDIA A100 Tensor Core GPU" datasheet (A100 SXM4 and PCIe).
# fp32 is the non-tensor-core FP32 figure; tf32, bf16 and fp16 are tensor-core figures.
PEAK_TFLOPS = {
    "H100 SXM": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    "H100": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},  # "NVIDIA H100 80GB HBM3" is the SXM part
    "H200 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    "H200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},  # the SXM part
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
}
COMMUNICATION_METHOD = ("backward with DDP minus the same backward under DDP's no_sync() (no all-reduce), "
                        "medians over the timed steps; 0 without DDP")


def peak_tflops(device: torch.device, precision: str, given: float | None = None) -> float | None:
    """The device's dense peak for this math mode: given, else looked up by GPU name; None when unknown."""
    if given:
        return given
    if device.type != "cuda":
        return None
    return lookup_peak(torch.cuda.get_device_name(device), precision)


def lookup_peak(device_name: str, precision: str) -> float | None:
    """Peak TFLOP/s for a GPU name as CUDA reports it ("NVIDIA H100 80GB HBM3"); the longest match wins."""
    name = device_name.replace(" ", "").upper()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key.replace(" ", "").upper() in name:
            return PEAK_TFLOPS[key][precision]
    return None


def count_flops(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, precision: str) -> int:
    """FLOPs of one forward + backward, counted by torch.utils.flop_counter (matmuls and convolutions).

    images: (N, 3, H, W), labels: (N,). On the meta device nothing is computed, only counted (no autocast
    there; the count does not depend on the dtype).
    """
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False)
    meta = images.device.type == "meta"
    with counter:  # one context: entering it again would start the count afresh
        with contextlib.nullcontext() if meta else autocast(images.device, precision):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def count_forward_flops(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, precision: str) -> int:
    """FLOPs of the forward pass alone (loss included), counted as count_flops counts: the yardstick its total
    is checked against. The backward computes a gradient for the weights and one for the activations, each a
    product as large as the forward's, so count_flops / count_forward_flops is about 3 (a little less: the first
    layer needs no gradient for its input). images: (N, 3, H, W), labels: (N,).
    """
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        with contextlib.nullcontext() if images.device.type == "meta" else autocast(images.device, precision):
            F.cross_entropy(model(images), labels)
    return counter.get_total_flops()


def compile_or_fallback(model: nn.Module, enabled: bool, backend: str = "inductor", example=None,
                        precision: str = "fp32"):
    """(model, compiled, reason): torch.compile'd and tried once on `example`, or eager with the reason why.

    example: (N, 3, H, W) images of the shape that will be timed. torch.compile itself is lazy: most failures
    (no C++ compiler, an unsupported operation) only appear on the first call, so that call is made here,
    forward and backward under the same autocast as the timed steps.
    """
    if not enabled:
        return model, False, "not requested"
    try:
        compiled = torch.compile(model, backend=backend)
        if example is not None:
            with autocast(example.device, precision):
                output = compiled(example)
            output.float().sum().backward()
            model.zero_grad(set_to_none=True)
        return compiled, True, "compiled"
    except Exception as error:  # any compiler failure must leave a working eager model
        reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
        print(f"torch.compile failed ({reason}); falling back to eager mode")
        return model, False, reason


def timed_steps(model, batches, optimizer, device, precision: str, steps: int, warmup: int, ddp=None,
                memory_format=torch.preserve_format) -> list[dict]:
    """Per step: seconds in data, forward, backward, optimizer; with DDP also backward under no_sync.

    batches yield (images (N, 3, H, W), labels (N,)); images are brought to `memory_format` in the data phase
    (a DataLoader's collate stacks them back into NCHW even when the dataset holds channels_last tensors).

    Each phase is its own `timed(device)` block (the device is synchronised at both ends), so each phase's
    time is its own; communication under DDP is estimated as backward - backward without synchronisation
    (a separate pass every step). TF32 is set for the run and restored after it.
    """
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    rows = []
    with tf32(precision == "tf32"):
        for step in range(warmup + steps):
            row = _timed_phases(model, batches, optimizer, device, precision, scaler, memory_format)
            if ddp is not None:
                row["local_backward_s"] = _local_backward_s(model, ddp, row.pop("batch"), device, precision, scaler)
                optimizer.zero_grad(set_to_none=True)
            row.pop("batch", None)
            if step >= warmup:
                rows.append(row)
    return rows


def _timed_phases(model, batches, optimizer, device, precision, scaler, memory_format) -> dict:
    """One step, each phase timed on its own: {data_s, forward_s, backward_s, optimizer_s, batch}."""
    with timed(device) as data_time:
        images, labels = next(batches)
        images = images.to(device, non_blocking=True, memory_format=memory_format)
        labels = labels.to(device, non_blocking=True)
    with timed(device) as forward_time:
        with autocast(device, precision):
            loss = F.cross_entropy(model(images), labels)
    with timed(device) as backward_time:
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
    with timed(device) as optimizer_time:
        scaler.step(optimizer)
        scaler.update()
    return {"data_s": data_time["s"], "forward_s": forward_time["s"], "backward_s": backward_time["s"],
            "optimizer_s": optimizer_time["s"], "batch": (images, labels)}


def _local_backward_s(model, ddp, batch, device, precision, scaler) -> float:
    """Seconds of the same backward under DDP's no_sync(): the backward without its all-reduce."""
    images, labels = batch
    with ddp.no_sync():
        with autocast(device, precision):
            local_loss = F.cross_entropy(model(images), labels)
        with timed(device) as backward_time:
            scaler.scale(local_loss).backward()
    return backward_time["s"]


@contextlib.contextmanager
def world_of_one(device: torch.device | None = None, timeout_s: float = 60.0):
    """`with world_of_one(device) as ctx:` a 1-rank process group (nccl on a GPU, else gloo), destroyed after.

    DDP needs a process group even for one rank; this one rendezvouses on a fresh file store (no port),
    and objects still holding it (DDP's reducer) are collected before it is destroyed.
    """
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process: use it instead of a world of one")
    device = device or torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    folder = tempfile.mkdtemp(prefix="labsrc-world-of-one-")
    dist.init_process_group(backend, init_method=f"file://{os.path.join(folder, 'store')}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield RankContext(0, 0, 1, device, backend)
    finally:
        gc.collect()
        dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)


def summarise(rows: list[dict]) -> dict:
    """Median of each phase; communication = backward - local backward (0 without DDP); the step's total."""
    median = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    communication = max(0.0, median["backward_s"] - median.get("local_backward_s", median["backward_s"]))
    split = {"data_s": median["data_s"], "forward_s": median["forward_s"],
             "backward_s": median["backward_s"] - communication, "communication_s": communication,
             "optimizer_s": median["optimizer_s"]}
    split["step_s"] = sum(split.values())
    return split


def peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"peak_memory_bytes": torch.cuda.max_memory_allocated(device), "peak_memory_kind": "CUDA allocated"}
    return {"peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_memory_kind": "process peak RSS (host memory, includes Python and torch)"}


def provenance(device: torch.device) -> dict:
    import torchvision
    info = {"torch": torch.__version__, "torchvision": torchvision.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "platform": platform.platform(), "cpu_cores": os.cpu_count(),
            "device": str(device), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        with contextlib.suppress(Exception):
            import subprocess
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=10).stdout.split("\n")[0].strip()
    else:
        info["device_name"] = platform.processor() or platform.machine()
    return info
