"""Mixed precision on n ranks: step time and memory per mode, and AMP under DDP with gradient accumulation.

    torchrun --nproc-per-node 2 -m labsrc.labs.mixed_precision --profile ci
"""
from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc.training import benchmark, data
from labsrc import mixed_precision, dp_vs_ddp
from labsrc.core.lab import base_parser, resolve_profile, run_lab
from labsrc.training.models import build_model


def modes_for(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The modes this device runs, and why the others are skipped."""
    if device.type != "cuda":
        return ["fp32", "bf16", "fp16"], {"tf32": "TF32 is a tensor-core format of NVIDIA GPUs (Ampere and newer)"}
    modes, skipped = ["fp32"], {}
    if torch.cuda.get_device_capability(device)[0] >= 8:
        modes.append("tf32")
    else:
        skipped["tf32"] = "TF32 needs an Ampere or newer GPU (compute capability 8.0)"
    if torch.cuda.is_bf16_supported():
        modes.append("bf16")
    else:
        skipped["bf16"] = "this GPU has no bf16 support"
    return modes + ["fp16"], skipped


def amp_ddp_accumulation(ctx, records, profile, micro_steps: int, seed: int) -> str:
    """DDP + autocast (bf16 on CPUs; fp16 + GradScaler on GPUs) + no_sync over micro_steps micro-batches.

    Records per step this rank's loss and how far parameters and the loss scale differ across ranks.
    """
    torch.manual_seed(seed)
    model = DDP(build_model(profile.model).to(ctx.device))
    optimizer = torch.optim.SGD(model.parameters(), lr=profile.lr, momentum=0.9)
    mode = "fp16" if ctx.device.type == "cuda" else "bf16"
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=mode == "fp16")
    dataset = data.synthetic_images(profile.num_samples, profile.image_size, seed=seed)
    micro_batch = max(1, profile.global_batch // (ctx.world_size * micro_steps))
    batches = iter(data.DeviceBatches(dataset, micro_batch, ctx, seed=seed))
    for step in range(profile.steps):
        micro_batches = [next(batches) for _ in range(micro_steps)]
        loss = mixed_precision.accumulation_step(model, optimizer, scaler, micro_batches, ctx.device, mode)
        scale = torch.tensor([scaler.get_scale() if scaler.is_enabled() else 1.0], device=ctx.device)
        records.write("amp_step", step=step, loss=loss.item(), mode=mode, micro_batch=micro_batch,
                      scale=scale.item(), scale_spread=dp_vs_ddp.spread_across_ranks([scale]),
                      parameter_spread=dp_vs_ddp.spread_across_ranks(list(model.parameters())))
        records.progress(step + 1, profile.steps)
    return mode


def mixed_precision_lab(ctx, records, args) -> dict:
    profile = resolve_profile(args)
    modes, skipped = modes_for(ctx.device)
    dataset = data.synthetic_images(profile.global_batch, profile.image_size, seed=args.seed)
    images, labels = (t.to(ctx.device) for t in dataset.tensors)
    costs = mixed_precision.mode_costs(lambda: build_model(profile.model), images, labels, modes, ctx)
    for mode, cost in costs.items():
        records.write("mode", mode=mode, **cost)
    for mode, reason in skipped.items():
        records.write("skipped", mode=mode, reason=reason)
    amp_mode = amp_ddp_accumulation(ctx, records, profile, args.micro_steps, args.seed)
    return {"profile": profile.name, "model": profile.model, "batch": profile.global_batch,
            "image_size": profile.image_size, "modes": costs, "skipped_modes": skipped,
            "micro_steps": args.micro_steps, "amp_ddp_mode": amp_mode,
            "provenance": benchmark.provenance(ctx.device)}


def launch_mixed_precision(nproc: int, profile: str | None = None, micro_steps: int = 2, timeout: float = 300.0):
    """Run this lab from a notebook (the default cell and the controls both call this)."""
    from labsrc import launch
    args = ["--micro-steps", micro_steps] + (["--profile", profile] if profile else [])
    return launch.run("mixed_precision", nproc=nproc, args=args, timeout=timeout)


def main(argv=None):
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--micro-steps", type=int, default=2, help="micro-batches accumulated per optimizer step")
    return run_lab("mixed_precision", mixed_precision_lab, parser.parse_args(argv))


if __name__ == "__main__":
    main()
