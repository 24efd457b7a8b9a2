"""Mixed precision on n ranks: step time and memory per mode, and AMP under DDP with gradient accumulation.

    torchrun --nproc-per-node 2 -m labsrc.labs.mixed_precision --profile ci
"""
from __future__ import annotations

import contextlib
import platform

import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc import data, precision, sync
from labsrc.labs.common import base_parser, resolve_profile, run_lab
from labsrc.models import build_model
from labsrc.train import autocast


def modes_for(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The modes this device runs, and why the others are skipped."""
    if device.type == "cuda":
        modes = ["fp32", "tf32", "bf16", "fp16"] if torch.cuda.is_bf16_supported() else ["fp32", "tf32", "fp16"]
        return modes, {} if "bf16" in modes else {"bf16": "this GPU has no bf16 support"}
    return ["fp32", "bf16", "fp16"], {"tf32": "TF32 is a tensor-core format of NVIDIA GPUs (Ampere and newer)"}


def amp_ddp_accumulation(ctx, records, profile, micro_steps: int, seed: int) -> None:
    """DDP + autocast (bf16; fp16 with GradScaler on GPUs) + no_sync over micro_steps micro-batches."""
    torch.manual_seed(seed)
    model = DDP(build_model(profile.model).to(ctx.device))
    optimizer = torch.optim.SGD(model.parameters(), lr=profile.lr, momentum=0.9)
    mode = "fp16" if ctx.device.type == "cuda" else "bf16"
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=mode == "fp16")
    dataset = data.synthetic_images(profile.num_samples, profile.image_size, seed=seed)
    micro_batch = max(1, profile.global_batch // (ctx.world_size * micro_steps))
    batches = iter(data.DeviceBatches(dataset, micro_batch, ctx, seed=seed))
    for step in range(profile.steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(micro_steps):
            images, labels = next(batches)
            skip = model.no_sync() if micro < micro_steps - 1 else contextlib.nullcontext()
            with skip:  # forward and backward inside: DDP decides about syncing in forward
                with autocast(ctx.device, mode):
                    loss = F.cross_entropy(model(images), labels) / micro_steps
                scaler.scale(loss).backward()
            total += loss.detach()
        scaler.step(optimizer)
        scaler.update()
        records.write("amp_step", step=step, loss=float(total), mode=mode,
                      parameter_spread=sync.spread_across_ranks(list(model.parameters())))
        records.progress(step + 1, profile.steps)


def mixed_precision_lab(ctx, records, args) -> dict:
    profile = resolve_profile(args)
    modes, skipped = modes_for(ctx.device)
    dataset = data.synthetic_images(profile.global_batch, profile.image_size, seed=args.seed)
    images, labels = (t.to(ctx.device) for t in dataset.tensors)
    costs = precision.mode_costs(lambda: build_model(profile.model), images, labels, modes)
    for mode, cost in costs.items():
        records.write("mode", mode=mode, **cost)
    for mode, reason in skipped.items():
        records.write("skipped", mode=mode, reason=reason)
    amp_ddp_accumulation(ctx, records, profile, args.micro_steps, args.seed)
    device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else platform.processor() or "cpu"
    return {"profile": profile.name, "model": profile.model, "batch": profile.global_batch,
            "image_size": profile.image_size, "modes": costs, "micro_steps": args.micro_steps,
            "provenance": {"torch": torch.__version__, "cuda": torch.version.cuda, "device_name": device_name,
                           "python": platform.python_version()}}


def launch_mixed_precision(nproc: int, profile: str | None = None, timeout: float = 300.0):
    """Run this lab from a notebook (the default cell and the controls both call this)."""
    from labsrc import launch
    return launch.run("mixed_precision", nproc=nproc, args=["--profile", profile] if profile else [], timeout=timeout)


def main(argv=None):
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--micro-steps", type=int, default=2, help="micro-batches accumulated per optimizer step")
    return run_lab("mixed_precision", mixed_precision_lab, parser.parse_args(argv))


if __name__ == "__main__":
    main()
