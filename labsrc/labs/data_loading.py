"""Data loading on n ranks: shards per epoch, uneven inputs with Join, and where a step's time goes.

    torchrun --nproc-per-node 2 -m labsrc.labs.data_loading --profile ci
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from labsrc import data, sampling
from labsrc.labs.common import base_parser, resolve_profile, run_lab
from labsrc.models import build_model


def throughput_sweep(ctx, records, profile, cost_s: float, workers: list[int], steps: int, seed: int) -> None:
    """Per-step data wait vs compute for: loaders with a slow transform (each num_workers, pin_memory on
    GPUs), the same loader without the slow transform, and batches resident on the device."""
    dataset = data.synthetic_images(profile.num_samples, profile.image_size, seed=seed)
    batch = profile.global_batch // ctx.world_size
    model = build_model(profile.model).to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=profile.lr)

    def step(images, labels):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()

    arms = [(f"slow transform, {w} worker(s)", sampling.SlowTransform(dataset, cost_s), w, False) for w in workers]
    if ctx.device.type == "cuda":
        arms.append((f"slow transform, {max(workers)} worker(s), pin_memory", sampling.SlowTransform(dataset, cost_s),
                     max(workers), True))
    else:
        records.write("skipped", arm="pin_memory", reason="pin_memory only helps copies to a GPU; none here")
    arms.append(("no slow transform, 0 workers", dataset, 0, False))
    for index, (name, source, num_workers, pin) in enumerate(arms):
        timing = sampling.time_batches(sampling.loader(source, batch, num_workers, pin, seed), steps, ctx.device, step)
        records.write("throughput", arm=name, num_workers=num_workers, pin_memory=pin, batch=batch,
                      transform_cost_s=cost_s if source is not dataset else 0.0, **timing)
        records.progress(index + 1, len(arms) + 1)
    resident = data.DeviceBatches(dataset, batch, ctx, seed=seed)
    timing = sampling.time_batches(resident, steps, ctx.device, step)
    records.write("throughput", arm="resident on the device", num_workers=0, pin_memory=False, batch=batch,
                  transform_cost_s=0.0, **timing)
    records.progress(len(arms) + 1, len(arms) + 1)


def data_loading_lab(ctx, records, args) -> dict:
    profile = resolve_profile(args)
    mine = sampling.epoch_orders(args.dataset_size, ctx.world_size, epochs=3)[ctx.rank]
    records.write("partition", epochs=mine)
    batches = [args.uneven_base + rank for rank in range(ctx.world_size)]
    joined = sampling.train_uneven_with_join(ctx, batches, args.seed)
    records.write("join", steps=joined["steps"], weight=joined["weight"].flatten().tolist())
    throughput_sweep(ctx, records, profile, args.cost_ms / 1000, args.workers, args.steps, args.seed)
    return {"profile": profile.name, "cost_ms": args.cost_ms, "workers": args.workers, "batches_per_rank": batches}


def launch_data_loading(nproc: int, cost_ms: float = 1.0, workers: tuple | str = (0, 2), timeout: float = 300.0):
    """Run this lab from a notebook (the default cell and the controls both call this).

    workers: num_workers values to sweep, as a tuple or as text ("0 2").
    """
    from labsrc import launch
    if isinstance(workers, str):
        workers = tuple(int(w) for w in workers.replace(",", " ").split())
    args = ["--cost-ms", cost_ms, "--workers", *workers]
    return launch.run("data_loading", nproc=nproc, args=args, timeout=timeout)


def main(argv=None):
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--dataset-size", type=int, default=10, help="samples in the partition demo")
    parser.add_argument("--uneven-base", type=int, default=3, help="rank r gets this + r batches (Join demo)")
    parser.add_argument("--cost-ms", type=float, default=1.0, help="milliseconds the slow transform takes per sample")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="num_workers values to sweep")
    parser.add_argument("--steps", type=int, default=6, help="timed batches per arm")
    return run_lab("data_loading", data_loading_lab, parser.parse_args(argv))


if __name__ == "__main__":
    main()
