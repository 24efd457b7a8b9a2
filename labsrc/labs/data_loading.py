"""Data loading on n ranks: shards per epoch, uneven inputs with and without Join, and where a step's time goes.

    torchrun --nproc-per-node 2 -m labsrc.labs.data_loading --profile ci
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from labsrc.training import data
from labsrc import data_loading
from labsrc.core.lab import base_parser, resolve_profile, run_lab
from labsrc.training.models import build_model


def default_workers(profile) -> list[int]:
    """num_workers values to sweep: none, two, and the profile's own count."""
    return sorted({0, 2, profile.num_workers})


def sweep_arms(ctx, dataset, cost_s: float, workers: list[int]) -> list[dict]:
    """The loaders to time: the slow transform with each num_workers, without it (pin_memory on and off
    where there is a GPU), each arm as {name, dataset, num_workers, pin_memory, transform_cost_s}."""
    slow = data_loading.SlowTransform(dataset, cost_s)
    arms = [{"name": f"slow transform, {count} worker(s)", "dataset": slow, "num_workers": count,
             "pin_memory": False, "transform_cost_s": cost_s} for count in workers]
    pins = [False, True] if ctx.device.type == "cuda" else [False]
    arms += [{"name": "no slow transform, 0 workers" + (", pin_memory" if pin else ""), "dataset": dataset,
              "num_workers": 0, "pin_memory": pin, "transform_cost_s": 0.0} for pin in pins]
    return arms


def throughput_sweep(ctx, records, profile, cost_s: float, workers: list[int], steps: int, seed: int) -> None:
    """Per-step data wait vs compute for each loader arm, then for batches resident on the device."""
    dataset = data.synthetic_images(profile.num_samples, profile.image_size, seed=seed)
    batch = profile.global_batch // ctx.world_size
    model = build_model(profile.model).to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=profile.lr)

    def step(images, labels):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()

    if ctx.device.type != "cuda":
        records.write("skipped", arm="pin_memory",
                      reason="pin_memory page-locks host memory for fast copies to a GPU; there is no GPU here")
    arms = sweep_arms(ctx, dataset, cost_s, workers)
    for index, arm in enumerate(arms):
        loader, sampler = data.make_loader(arm["dataset"], batch, ctx, num_workers=arm["num_workers"],
                                           seed=seed, pin_memory=arm["pin_memory"])
        timing = data_loading.time_batches(data.forever(loader, sampler), steps, ctx.device, step)
        records.write("throughput", arm=arm["name"], num_workers=arm["num_workers"], pin_memory=arm["pin_memory"],
                      batch=batch, transform_cost_s=arm["transform_cost_s"], **timing)
        records.progress(index + 1, len(arms) + 1)
        del loader, sampler  # ends this arm's worker processes before the next arm is timed
    resident = data.DeviceBatches(dataset, batch, ctx, seed=seed)
    timing = data_loading.time_batches(resident, steps, ctx.device, step)
    records.write("throughput", arm="resident on the device", num_workers=0, pin_memory=False, batch=batch,
                  transform_cost_s=0.0, **timing)
    records.progress(len(arms) + 1, len(arms) + 1)


def data_loading_lab(ctx, records, args) -> dict:
    profile = resolve_profile(args)
    for set_epoch in (True, False):
        orders = data_loading.rank_epoch_orders(args.dataset_size, ctx.rank, ctx.world_size, args.epochs,
                                            set_epoch=set_epoch, seed=args.seed)
        records.write("partition", set_epoch=set_epoch, epochs=orders)
    batches = [args.uneven_base + rank for rank in range(ctx.world_size)]
    if ctx.world_size > 1:
        stuck = data_loading.train_uneven_without_join(ctx, batches, args.join_timeout_s, args.seed)
        records.write("no_join", **stuck)
    joined = data_loading.train_uneven_with_join(ctx, batches, args.seed)
    records.write("join", steps=joined["steps"], weight=joined["weight"].flatten().tolist())
    workers = args.workers or default_workers(profile)
    throughput_sweep(ctx, records, profile, args.cost_ms / 1000, workers, args.steps, args.seed)
    return {"profile": profile.name, "dataset_size": args.dataset_size, "epochs": args.epochs,
            "cost_ms": args.cost_ms, "workers": workers, "steps": args.steps, "batches_per_rank": batches,
            "join_timeout_s": args.join_timeout_s}


def launch_data_loading(nproc: int, cost_ms: float = 2.0, workers: tuple | str = (), timeout: float = 300.0):
    """Run this lab from a notebook (the default cell and the Run button both call this).

    workers: num_workers values to sweep, as a tuple or as text ("0 2"); empty: 0, 2 and the profile's.
    """
    from labsrc import launch
    if isinstance(workers, str):
        workers = tuple(int(w) for w in workers.replace(",", " ").split())
    args = ["--cost-ms", cost_ms] + (["--workers", *workers] if workers else [])
    return launch.run("data_loading", nproc=nproc, args=args, timeout=timeout)


def make_parser():
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--dataset-size", type=int, default=10, help="samples in the partition demo (small to read)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs in the partition demo")
    parser.add_argument("--uneven-base", type=int, default=3, help="rank r gets this + r batches (Join demo)")
    parser.add_argument("--join-timeout-s", type=float, default=1.5,
                        help="collective timeout that ends the no-Join hang (real jobs: 10-30 min)")
    parser.add_argument("--cost-ms", type=float, default=2.0,
                        help="milliseconds the slow transform takes per sample (a JPEG decode + augment)")
    parser.add_argument("--workers", type=int, nargs="*", default=None,
                        help="num_workers values to sweep (default: 0, 2 and the profile's)")
    parser.add_argument("--steps", type=int, default=6, help="timed batches per arm, after one warm-up")
    return parser


def main(argv=None):
    return run_lab("data_loading", data_loading_lab, make_parser().parse_args(argv))


if __name__ == "__main__":
    main()
