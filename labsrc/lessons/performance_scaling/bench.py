"""The bench's measurement on one rank (lesson 06): build the model and its batches, time the steps, count FLOPs.

`python -m labsrc.bench` (the command) and the bench lab (under torchrun) both call `run_benchmark`.
"""
from __future__ import annotations

import dataclasses

import torch

from labsrc.core.world import RankContext
from labsrc.lessons.performance_scaling.scaling import gradient_bytes
from labsrc.training import benchmark, data
from labsrc.training.models import build_model


def build(options, ctx):
    """(model, batches) on ctx.device as the options ask; batches yield (N, 3, H, W) images and (N,) labels.

    Each rank draws its own random images (seeded by rank) from its own copy, resident on the device or read
    through a DataLoader from host memory.
    """
    alone = RankContext(0, 0, 1, ctx.device, ctx.backend)  # the data is this rank's own: no sharding
    num_classes = 1000 if options.model == "resnet50" else 10
    model = build_model(options.model, num_classes=num_classes).to(ctx.device)
    memory_format = torch.channels_last if options.channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    samples = max(4 * options.batch_size, 256)
    dataset = data.random_noise(samples, options.image_size, num_classes, seed=ctx.rank)
    images = dataset.tensors[0].contiguous(memory_format=memory_format)
    dataset = torch.utils.data.TensorDataset(images, dataset.tensors[1])
    if options.data == "device":
        batches = iter(data.DeviceBatches(dataset, options.batch_size, alone, seed=0))
    else:
        loader, sampler = data.make_loader(dataset, options.batch_size, alone,
                                           num_workers=options.num_workers, pin_memory=ctx.device.type == "cuda")
        batches = data.forever(loader, sampler)
    return model, batches


def run_benchmark(ctx, options) -> dict:
    """Benchmark one configuration on this rank (DDP when world size > 1 or --ddp); the result as a dict."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    plain, batches = build(options, ctx)
    memory_format = torch.channels_last if options.channels_last else torch.preserve_format
    images, labels = next(batches)
    images, labels = images.to(ctx.device, memory_format=memory_format), labels.to(ctx.device)
    flops = benchmark.count_flops(plain, images, labels, options.precision)
    first_conv = next(m for m in plain.modules() if isinstance(m, torch.nn.Conv2d))
    stored_nhwc = {"inputs": images.is_contiguous(memory_format=torch.channels_last),   # what the step is fed
                   "first_conv_weight": first_conv.weight.is_contiguous(memory_format=torch.channels_last)}
    forward_flops = benchmark.count_forward_flops(plain, images, labels, options.precision)
    ddp = DDP(plain) if ctx.distributed and (ctx.world_size > 1 or options.ddp) else None
    # Compiled after DDP wraps the model, as PyTorch recommends: Dynamo then splits the graph at DDP's bucket
    # boundaries so the all-reduces still overlap backward. The trial call runs the timed shape.
    model, compiled, reason = benchmark.compile_or_fallback(ddp or plain, options.compile, options.compile_backend,
                                                              images, options.precision)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    rows = benchmark.timed_steps(model, batches, optimizer, ctx.device, options.precision,
                                   options.steps, options.warmup, ddp, memory_format)
    split = benchmark.summarise(rows)
    peak = benchmark.peak_tflops(ctx.device, options.precision, options.peak_tflops)
    achieved = flops / split["step_s"]
    config = {key: value for key, value in dataclasses.asdict(options).items()
              if key not in ("compare_loop", "rounds")}
    return {"config": config, "world_size": ctx.world_size, "ddp": ddp is not None,
            "communication_method": benchmark.COMMUNICATION_METHOD, "compiled": compiled, "compile_reason": reason,
            "images_per_s": options.batch_size * ctx.world_size / split["step_s"], "split": split, "steps": rows,
            "flops_per_step_per_rank": flops, "forward_flops_per_step_per_rank": forward_flops,
            "gradient_bytes": gradient_bytes(plain), "channels_last_stored": stored_nhwc,
            "achieved_tflops_per_rank": achieved / 1e12,
            "peak_tflops": peak, "mfu": achieved / (peak * 1e12) if peak else None,
            **benchmark.peak_memory(ctx.device), "provenance": benchmark.provenance(ctx.device)}
