"""`python -m labsrc.bench`: images/s, the step split into phases, peak memory, FLOP/s and MFU, written as JSON.

    python -m labsrc.bench --model resnet18 --batch-size 512 --precision bf16 --compile --data device
    python -m labsrc.bench --world-size 2 --model tiny_cnn --image-size 16      # through torchrun
    python -m labsrc.bench --compare-loop                                      # the course loop vs a bare one
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from labsrc.training import benchmark, data
from labsrc.core.world import RankContext
from labsrc.training.models import build_model
from labsrc.performance_scaling import gradient_bytes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labsrc.bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny_cnn", choices=["tiny_cnn", "resnet18", "resnet50"],
                   help="model to train (resnet18: 32x32 CIFAR variant; resnet50: torchvision's, 224x224)")
    p.add_argument("--batch-size", type=int, default=64, help="images per step on each rank")
    p.add_argument("--image-size", type=int, default=32, help="side of the square input images")
    p.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16", "fp16"],
                   help="math mode: autocast dtype (fp16 adds a GradScaler); tf32 only matters on NVIDIA GPUs")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory format for model and inputs")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (falls back to eager on failure)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    p.add_argument("--data", default="device", choices=["device", "loader"],
                   help="device: the dataset resident on the device; loader: a DataLoader from host memory")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (with --data loader)")
    p.add_argument("--world-size", type=int, default=1, help="ranks; above 1 the bench runs itself under torchrun")
    p.add_argument("--ddp", action="store_true",
                   help="wrap in DDP even at world size 1 (launched through torchrun, like --world-size above 1)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator, caches)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak TFLOP/s for MFU; unset: looked up for known GPUs, none on a CPU")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write; unset: print only")
    p.add_argument("--compare-loop", action="store_true",
                   help="instead: time the course's training loop against a bare loop, and DDP at world size 1 "
                        "against no DDP, and print the ratios")
    p.add_argument("--rounds", type=int, default=15,
                   help="with --compare-loop: timed rounds per configuration in alternating order; the fastest counts")
    return p


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
    config = {key: value for key, value in vars(options).items() if key not in ("out", "compare_loop", "rounds")}
    config["out"] = str(options.out) if options.out else None
    return {"config": config, "world_size": ctx.world_size, "ddp": ddp is not None,
            "communication_method": benchmark.COMMUNICATION_METHOD, "compiled": compiled, "compile_reason": reason,
            "images_per_s": options.batch_size * ctx.world_size / split["step_s"], "split": split, "steps": rows,
            "flops_per_step_per_rank": flops, "gradient_bytes": gradient_bytes(plain),
            "achieved_tflops_per_rank": achieved / 1e12,
            "peak_tflops": peak, "mfu": achieved / (peak * 1e12) if peak else None,
            **benchmark.peak_memory(ctx.device), "provenance": benchmark.provenance(ctx.device)}


def run_in_process(flags: list[str] | str) -> dict:
    """`python -m labsrc.bench <flags>` at world size 1, in this process (a notebook cell); the result as a dict."""
    from labsrc.core.world import gpu_count
    options = parser().parse_args(flags.split() if isinstance(flags, str) else [str(f) for f in flags])
    if options.world_size > 1 or options.ddp or options.compare_loop:
        raise ValueError("in process the bench runs one rank without DDP: use main() for --world-size, --ddp "
                         "and --compare-loop")
    device = torch.device("cuda", 0) if gpu_count() else torch.device("cpu")
    return run_benchmark(RankContext(0, 0, 1, device, "none"), options)


def format_result(result: dict) -> str:
    """One line: images/s, the step split, FLOP/s and MFU, peak memory, and whether compiling worked."""
    split = result["split"]
    parts = ", ".join(f"{key[:-2]} {1000 * value:.2f} ms" for key, value in split.items() if key != "step_s")
    mfu = ("MFU n/a (peak unknown: pass --peak-tflops)" if result["mfu"] is None
           else f"MFU {100 * result['mfu']:.1f}%")
    compiled = f"compiled: {result['compiled']}"
    if not result["compiled"] and result["compile_reason"] != "not requested":
        compiled += f" ({result['compile_reason']})"
    return (f"{result['images_per_s']:.0f} images/s on {result['world_size']} rank(s); "
            f"step {1000 * split['step_s']:.2f} ms ({parts}); "
            f"{result['achieved_tflops_per_rank'] * 1000:.1f} GFLOP/s per rank, {mfu}; "
            f"{result['peak_memory_kind']} {result['peak_memory_bytes'] / 2**20:.0f} MiB; {compiled}")


def main(argv: list[str] | None = None) -> int:
    options = parser().parse_args(argv)
    if options.compare_loop:
        from labsrc.training.compare_loops import compare_loops
        print(json.dumps(compare_loops(options, options.rounds), indent=2))
        return 0
    if options.world_size > 1 or options.ddp:  # DDP needs a process group: torchrun sets one up
        from labsrc import launch
        forwarded = [a for a in (sys.argv[1:] if argv is None else argv)]
        outcome = launch.run("bench", nproc=options.world_size, args=forwarded, timeout=1800)
        result = outcome.summary["result"]
    else:
        from labsrc.core.world import setup, teardown
        ctx = setup()
        try:
            result = run_benchmark(ctx, options)
        finally:
            teardown(ctx)
    print(format_result(result))
    if options.out:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(json.dumps(result, indent=2))
        print(f"written to {options.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
