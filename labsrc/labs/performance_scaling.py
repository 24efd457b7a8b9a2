"""Scaling on n ranks: DDP step time and the same step without communication, per batch size, and an all-reduce fit.

    torchrun --nproc-per-node 2 -m labsrc.labs.performance_scaling --profile ci --batches 32 64
"""
from __future__ import annotations

import gc

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc import alpha_beta, collectives, performance_scaling
from labsrc.training import data
from labsrc.core.lab import base_parser, resolve_profile, run_lab
from labsrc.training.models import build_model


def measure(ctx, profile, per_rank_batch: int, steps: int, seed: int = 0, ddp: bool = True) -> dict:
    """Fastest step time of this rank at this per-rank batch: with DDP, and without communication."""
    torch.manual_seed(seed)
    model = build_model(profile.model).to(ctx.device)
    wrapped = DDP(model) if ddp else model
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=profile.lr, momentum=0.9)
    dataset = data.synthetic_images(max(profile.num_samples, 4 * per_rank_batch), profile.image_size, seed=seed)
    batches = iter(data.DeviceBatches(dataset, per_rank_batch, ctx.__class__(0, 0, 1, ctx.device, ""), seed=seed))
    if ddp:
        step_s, local_s = performance_scaling.paired_step_times(wrapped, batches, optimizer, ctx.device, steps, wrapped.no_sync)
    else:
        step_s = local_s = performance_scaling.step_times(wrapped, batches, optimizer, ctx.device, steps)
    return {"per_rank_batch": per_rank_batch, "step_s": step_s, "local_step_s": local_s,
            "gradient_bytes": performance_scaling.gradient_bytes(model)}


def scaling_lab(ctx, records, args) -> dict:
    profile = resolve_profile(args)
    for index, batch in enumerate(args.batches):
        records.write("scaling", world_size=ctx.world_size, **measure(ctx, profile, batch, args.steps, args.seed))
        records.progress(index + 1, len(args.batches) + 1)
    points = []
    for size in profile.sweep_sizes:
        points.append((4 * size, collectives.time_algorithm(collectives.torch_all_reduce, size, ctx, profile.repeats)))
        records.write("allreduce", bytes=points[-1][0], seconds=points[-1][1])
    fit = alpha_beta.fit(*zip(*points))
    records.progress(len(args.batches) + 1, len(args.batches) + 1)
    gc.collect()  # DDP's reducers (held in reference cycles) go now, while the process group they use still exists
    return {"profile": profile.name, "model": profile.model,
            "fit": {"alpha_s": fit.alpha_s, "beta_s_per_byte": fit.beta_s_per_byte, "r2": fit.r2}}


def launch_scaling(nproc: int, batches: tuple | str, steps: int = 5, profile: str | None = None,
                   timeout: float = 600.0):
    """Run this lab from a notebook (the default cell and the controls both call this).

    batches: per-rank batch sizes, as a tuple or as text ("32 64").
    """
    from labsrc import launch
    if isinstance(batches, str):
        batches = tuple(int(b) for b in batches.split())
    args = ["--batches", *batches, "--steps", steps] + (["--profile", profile] if profile else [])
    return launch.run("performance_scaling", nproc=nproc, args=args, timeout=timeout)


def main(argv=None):
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", required=True, help="per-rank batch sizes to time")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    return run_lab("performance_scaling", scaling_lab, parser.parse_args(argv))


if __name__ == "__main__":
    main()
