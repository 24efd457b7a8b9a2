"""DDP internals on n ranks: DDP by hand vs torch DDP, buckets, no_sync, unused parameters, bucket views, compression, overlap.

    torchrun --nproc-per-node 2 -m labsrc.labs.ddp_internals --profile ci
"""
from __future__ import annotations

import copy
import os
import statistics
import time

import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc import ddp_tools, handmade_ddp, sync
from labsrc.labs.common import base_parser, run_lab


def rank_batch(ctx, size: int, width: int, step: int = 0):
    """This rank's (size, width) inputs and (size,) labels for a step; different on every rank."""
    generator = torch.Generator().manual_seed(1000 * step + ctx.rank)
    return torch.randn(size, width, generator=generator).to(ctx.device), \
        torch.randint(10, (size,), generator=generator).to(ctx.device)


def equivalence(ctx, records, width: int, steps: int = 3) -> None:
    """Handmade (a) and (b), torch DDP and one process on the union of the batches, after `steps` SGD steps."""
    make = lambda: ddp_tools.layered_model(width=width).to(ctx.device)
    models = {"torch DDP": DDP(make()), "handmade: all-reduce after backward": handmade_ddp.AllReduceAfterBackward(make()),
              "handmade: buckets from hooks": handmade_ddp.BucketedDDP(make(), bucket_cap_mb=0.1)}
    single = make()
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in {**models, "single": single}.items()}
    for step in range(steps):
        images, labels = rank_batch(ctx, 16, width, step)
        for name, model in models.items():
            ddp_tools.one_step(model, images, labels)
            if isinstance(model, handmade_ddp.AllReduceAfterBackward):
                model.sync_gradients()
            elif isinstance(model, handmade_ddp.BucketedDDP):
                model.finish_gradient_sync()
            optimizers[name].step()
        everyone = [rank_batch(ctx.__class__(r, r, ctx.world_size, ctx.device, ""), 16, width, step)
                    for r in range(ctx.world_size)]
        ddp_tools.one_step(single, torch.cat([b[0] for b in everyone]), torch.cat([b[1] for b in everyone]))
        optimizers["single"].step()
    reference = dict(single.named_parameters())
    for name, model in models.items():
        mine = {k.removeprefix("module."): p for k, p in model.named_parameters()}
        records.write("equivalence", version=name, vs_single_process=sync.largest_gap(mine, reference),
                      vs_torch_ddp=sync.largest_gap(mine, {k.removeprefix("module."): p for k, p
                                                           in models["torch DDP"].named_parameters()}),
                      allreduce_calls=getattr(model, "allreduce_calls", None))


def bucket_sweep(ctx, records, width: int, caps_mb: list[float], steps: int = 4) -> None:
    """torch DDP's all-reduce calls per step and step time for each bucket_cap_mb, beside the handmade buckets."""
    for cap in caps_mb:
        model = DDP(ddp_tools.layered_model(width=width).to(ctx.device), bucket_cap_mb=cap)
        counter = ddp_tools.CommCounter()
        model.register_comm_hook(counter, ddp_tools.counting_hook())
        seconds, calls = [], []
        for step in range(steps + 1):  # step 0: DDP rebuilds its buckets in gradient-ready order after it
            images, labels = rank_batch(ctx, 32, width, step)
            counter.reset()
            start = time.perf_counter()
            ddp_tools.one_step(model, images, labels)
            seconds.append(time.perf_counter() - start)
            calls.append(counter.calls)
        parameters = list(ddp_tools.layered_model(width=width).parameters())
        records.write("buckets", cap_mb=cap, allreduce_calls=calls[-1], calls_first_step=calls[0],
                      step_s=statistics.median(seconds[1:]), bytes_per_step=counter.bytes,
                      handmade_buckets=len(handmade_ddp.assign_buckets(parameters, int(cap * 2**20))))


def accumulate(model, batches, counter, forward_inside: bool = True) -> list[int]:
    """Gradient accumulation over micro-batches, no_sync on all but the last; all-reduces per micro-step.

    DDP decides in forward() whether the coming backward synchronises, so forward must run inside
    no_sync() too; with forward_inside=False only backward is inside, and every micro-step all-reduces.
    """
    import contextlib
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


def accumulation(ctx, records, width: int, micro_steps: int) -> None:
    """k micro-batches with no_sync on the first k-1: all-reduces counted, gradient vs one large batch."""
    model = DDP(ddp_tools.layered_model(width=width).to(ctx.device))
    counter = ddp_tools.CommCounter()
    model.register_comm_hook(counter, ddp_tools.counting_hook())
    batches = [rank_batch(ctx, 8, width, step) for step in range(micro_steps)]
    ddp_tools.one_step(model, *batches[0])  # let DDP rebuild its buckets first
    calls_wrong = accumulate(model, batches, counter, forward_inside=False)
    calls = accumulate(model, batches, counter, forward_inside=True)
    accumulated = sync.gradients(model)
    large = copy.deepcopy(model)
    ddp_tools.one_step(large, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    records.write("no_sync", micro_steps=micro_steps, calls_per_micro_step=calls,
                  calls_with_forward_outside_no_sync=calls_wrong, buckets_per_step=counter.calls,
                  vs_large_batch=sync.largest_gap(accumulated, sync.gradients(large)))


def settings(ctx, records, width: int) -> None:
    """Unused parameters, gradient_as_bucket_view, compression hooks."""
    images, labels = rank_batch(ctx, 16, 16)
    records.write("unused_parameters", **ddp_tools.unused_parameter_outcomes(images, labels))
    images, labels = rank_batch(ctx, 32, width)
    make = lambda: ddp_tools.layered_model(width=width).to(ctx.device)
    records.write("bucket_view", **ddp_tools.bucket_view_comparison(make, images, labels, bucket_cap_mb=0.1))
    records.write("compression", **ddp_tools.compression_comparison(make, images, labels))


def overlap(ctx, records, width: int, run_dir: str) -> None:
    """A profiled DDP step (small buckets so several all-reduces run during backward) and the handmade schedule."""
    model = DDP(ddp_tools.layered_model(layers=8, width=2 * width).to(ctx.device), bucket_cap_mb=0.25)
    images, labels = rank_batch(ctx, 64, 2 * width)
    ddp_tools.one_step(model, images, labels)  # warm-up and bucket rebuild
    trace = os.path.join(run_dir, f"trace_rank{ctx.rank}.json")
    spans = ddp_tools.profiled_step(model, images, labels, trace)
    records.write("profile", trace=trace, spans=spans)
    handmade = handmade_ddp.BucketedDDP(ddp_tools.layered_model(layers=8, width=2 * width).to(ctx.device), 0.25)
    ddp_tools.one_step(handmade, images, labels)
    handmade.finish_gradient_sync()
    origin = handmade.events[0][1]
    records.write("handmade_schedule", events=[(name, 1000 * (t - origin)) for name, t in handmade.events])


def ddp_internals(ctx, records, args) -> dict:
    steps = ["equivalence", "buckets", "no_sync", "settings", "overlap"]
    equivalence(ctx, records, args.width)
    records.progress(1, len(steps))
    bucket_sweep(ctx, records, args.width, args.caps_mb)
    records.progress(2, len(steps))
    accumulation(ctx, records, args.width, args.micro_steps)
    records.progress(3, len(steps))
    settings(ctx, records, args.width)
    records.progress(4, len(steps))
    overlap(ctx, records, args.width, str(records.run_dir))
    records.progress(5, len(steps))
    return {"width": args.width, "caps_mb": args.caps_mb, "micro_steps": args.micro_steps}


def launch_ddp_internals(nproc: int, width: int = 128, caps_mb: tuple = (0.05, 0.1, 0.25, 1.0, 25.0),
                         timeout: float = 300.0):
    """Run this lab from a notebook (the default cell and the controls both call this)."""
    from labsrc import launch
    if isinstance(caps_mb, str):
        caps_mb = tuple(float(c) for c in caps_mb.replace(",", " ").split())
    return launch.run("ddp_internals", nproc=nproc, args=["--width", width, "--caps-mb", *caps_mb], timeout=timeout)


def main(argv=None):
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128, help="width of the layered model's Linear layers")
    parser.add_argument("--caps-mb", type=float, nargs="+", default=[0.05, 0.1, 0.25, 1.0, 25.0],
                        help="bucket_cap_mb values to sweep")
    parser.add_argument("--micro-steps", type=int, default=4, help="micro-batches per optimizer step with no_sync")
    return run_lab("ddp_internals", ddp_internals, parser.parse_args(argv))


if __name__ == "__main__":
    main()
