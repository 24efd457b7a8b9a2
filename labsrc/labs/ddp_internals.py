"""DDP internals on n ranks: DDP by hand vs torch DDP, buckets, no_sync, unused parameters, bucket views, compression, overlap.

    torchrun --nproc-per-node 2 -m labsrc.labs.ddp_internals --profile ci
"""
from __future__ import annotations

import contextlib
import copy
import os
import statistics

import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc import ddp_internals, handmade_ddp, dp_vs_ddp
from labsrc.core import runs
from labsrc.core.lab import base_parser, resolve_profile, run_lab

PARTS = ("equivalence", "buckets", "no_sync", "settings", "overlap")


def rank_batch(rank: int, size: int, width: int, step: int = 0, device="cpu"):
    """Rank `rank`'s (size, width) inputs and (size,) labels for a step; different on every rank, same in every process."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(size, width, generator=generator).to(device),
            torch.randint(10, (size,), generator=generator).to(device))


def layer_width(profile) -> int:
    """Width of the layered model's Linear layers: 8 features per image row, so gradients grow with the profile."""
    return 8 * profile.image_size


def equivalence(ctx, records, width: int, batch: int, steps: int = 3) -> None:
    """Handmade (a) and (b), torch DDP and one process on the union of the batches, after `steps` SGD steps."""
    make = lambda: ddp_internals.layered_model(width=width).to(ctx.device)
    models = {"torch DDP": DDP(make()), "handmade: all-reduce after backward": handmade_ddp.AllReduceAfterBackward(make()),
              "handmade: buckets from hooks": handmade_ddp.BucketedDDP(make(), bucket_cap_mb=0.1)}
    single = make()
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in {**models, "single": single}.items()}
    for step in range(steps):
        images, labels = rank_batch(ctx.rank, batch, width, step, ctx.device)
        for name, model in models.items():
            ddp_internals.one_step(model, images, labels)
            if isinstance(model, handmade_ddp.AllReduceAfterBackward):
                model.sync_gradients()
            elif isinstance(model, handmade_ddp.BucketedDDP):
                model.finish_gradient_sync()
            optimizers[name].step()
        everyone = [rank_batch(rank, batch, width, step, ctx.device) for rank in range(ctx.world_size)]
        ddp_internals.one_step(single, torch.cat([b[0] for b in everyone]), torch.cat([b[1] for b in everyone]))
        optimizers["single"].step()
    reference = dict(single.named_parameters())
    torch_ddp = {k.removeprefix("module."): p for k, p in models["torch DDP"].named_parameters()}
    for name, model in models.items():
        mine = {k.removeprefix("module."): p for k, p in model.named_parameters()}
        calls = getattr(model, "allreduce_calls", None)
        records.write("equivalence", version=name, steps=steps,
                      params_vs_single_process=dp_vs_ddp.largest_gap(mine, reference),
                      params_vs_torch_ddp=dp_vs_ddp.largest_gap(mine, torch_ddp),
                      grads_vs_single_process=dp_vs_ddp.largest_gap(dp_vs_ddp.gradients(model), dp_vs_ddp.gradients(single)),
                      grads_vs_torch_ddp=dp_vs_ddp.largest_gap(dp_vs_ddp.gradients(model), dp_vs_ddp.gradients(models["torch DDP"])),
                      allreduce_calls_per_step=None if calls is None else calls // steps,
                      parameters=len(mine), buckets=len(getattr(model, "buckets", [])) or None)


def bucket_sweep(ctx, records, width: int, batch: int, caps_mb: list[float], repeats: int) -> None:
    """torch DDP's all-reduce calls per step and step time for each bucket_cap_mb, beside the buckets predicted."""
    parameters = list(ddp_internals.layered_model(width=width).parameters())
    for cap in caps_mb:
        model = DDP(ddp_internals.layered_model(width=width).to(ctx.device), bucket_cap_mb=cap)
        counter = ddp_internals.CommCounter()
        model.register_comm_hook(counter, ddp_internals.counting_hook())
        seconds, calls = [], []
        for step in range(repeats + 1):  # step 0: one bucket, then DDP rebuilds them in gradient-ready order
            images, labels = rank_batch(ctx.rank, batch, width, step, ctx.device)
            counter.reset()
            with runs.timed(ctx.device) as elapsed:
                ddp_internals.one_step(model, images, labels)
            seconds.append(elapsed["s"])
            calls.append(counter.calls)
        first_cap, cap_bytes = ddp_internals.torch_ddp_caps(cap)
        records.write("buckets", cap_mb=cap, allreduce_calls=calls[-1], calls_per_step=calls,
                      step_s=statistics.median(seconds[1:]), bytes_per_step=counter.bytes,
                      gradient_bytes=sum(p.numel() * p.element_size() for p in parameters),
                      predicted_buckets=len(handmade_ddp.assign_buckets(parameters, cap_bytes, first_cap)))


def accumulate(model, batches, counter, forward_inside: bool = True) -> list[int]:
    """Gradient accumulation over micro-batches, no_sync on all but the last; all-reduces per micro-step.

    DDP decides in forward() whether the coming backward synchronises, so forward must run inside
    no_sync() too; with forward_inside=False only backward is inside, and every micro-step all-reduces.
    """
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


def accumulation(ctx, records, width: int, batch: int, micro_steps: int, bucket_cap_mb: float = 0.1) -> None:
    """k micro-batches with no_sync on the first k-1: all-reduces counted, gradient vs one large batch."""
    model = DDP(ddp_internals.layered_model(width=width).to(ctx.device), bucket_cap_mb=bucket_cap_mb)
    counter = ddp_internals.CommCounter()
    model.register_comm_hook(counter, ddp_internals.counting_hook())
    batches = [rank_batch(ctx.rank, max(1, batch // micro_steps), width, step, ctx.device)
               for step in range(micro_steps)]
    ddp_internals.one_step(model, *batches[0])  # let DDP rebuild its buckets first
    calls_wrong = accumulate(model, batches, counter, forward_inside=False)
    calls = accumulate(model, batches, counter, forward_inside=True)
    accumulated = dp_vs_ddp.gradients(model)
    large = copy.deepcopy(model)
    ddp_internals.one_step(large, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    records.write("no_sync", micro_steps=micro_steps, calls_per_micro_step=calls,
                  calls_with_forward_outside_no_sync=calls_wrong, buckets_per_step=counter.calls,
                  vs_large_batch=dp_vs_ddp.largest_gap(accumulated, dp_vs_ddp.gradients(large)))


def settings(ctx, records, width: int, batch: int) -> None:
    """Unused parameters (and static_graph), gradient_as_bucket_view, compression hooks."""
    images, labels = rank_batch(ctx.rank, batch, 16, 0, ctx.device)
    records.write("unused_parameters", **ddp_internals.unused_parameter_outcomes(images, labels))
    images, labels = rank_batch(ctx.rank, batch, width, 0, ctx.device)
    make = lambda: ddp_internals.layered_model(width=width).to(ctx.device)
    records.write("bucket_view", **ddp_internals.bucket_view_comparison(make, images, labels, bucket_cap_mb=0.1))
    records.write("compression", **ddp_internals.compression_comparison(make, images, labels))


def overlap(ctx, records, width: int, batch: int, run_dir: str, bucket_cap_mb: float = 0.25) -> None:
    """A profiled DDP step (small buckets, so several all-reduces run during backward) and the handmade schedule."""
    make = lambda: ddp_internals.layered_model(layers=8, width=2 * width).to(ctx.device)
    model = DDP(make(), bucket_cap_mb=bucket_cap_mb)
    images, labels = rank_batch(ctx.rank, batch, 2 * width, 0, ctx.device)
    ddp_internals.one_step(model, images, labels)  # warm-up and bucket rebuild
    trace = os.path.join(run_dir, f"rank{ctx.rank}.pt.trace.json")
    records.write("profile", trace=trace, spans=ddp_internals.profiled_step(model, images, labels, trace))
    handmade = handmade_ddp.BucketedDDP(make(), bucket_cap_mb=bucket_cap_mb)
    for _ in range(2):  # the second step is recorded: nothing left to warm up
        ddp_internals.one_step(handmade, images, labels)
        handmade.finish_gradient_sync()
    origin = handmade.events[0][1]
    records.write("handmade_schedule", buckets=len(handmade.buckets),
                  events=[(name, 1000 * (t - origin)) for name, t in handmade.events])


def ddp_internals(ctx, records, args) -> dict:
    profile = resolve_profile(args)
    width = args.width or layer_width(profile)
    batch = max(1, profile.global_batch // ctx.world_size)  # samples per rank per step
    parts = {
        "equivalence": lambda: equivalence(ctx, records, width, batch),
        "buckets": lambda: bucket_sweep(ctx, records, width, batch, args.caps_mb, profile.repeats),
        "no_sync": lambda: accumulation(ctx, records, width, batch, args.micro_steps),
        "settings": lambda: settings(ctx, records, width, batch),
        "overlap": lambda: overlap(ctx, records, width, batch, str(records.run_dir)),
    }
    for done, part in enumerate(args.parts, start=1):
        parts[part]()
        records.progress(done, len(args.parts))
    return {"profile": profile.name, "width": width, "batch_per_rank": batch, "caps_mb": args.caps_mb,
            "micro_steps": args.micro_steps, "parts": args.parts}


def launch_ddp_internals(nproc: int, caps_mb=(0.05, 0.1, 0.25, 1.0, 25.0), parts=PARTS, width: int = 0,
                         timeout: float = 300.0):
    """Run this lab from a notebook (the default cell and the controls both call this).

    caps_mb: bucket_cap_mb values, or a string of them ("0.5 2 8"); parts: which experiments to run;
    width: the layered model's width (0: from the profile).
    """
    from labsrc import launch
    if isinstance(caps_mb, str):
        caps_mb = tuple(float(c) for c in caps_mb.replace(",", " ").split())
    if isinstance(parts, str):
        parts = tuple(parts.replace(",", " ").split())
    return launch.run("ddp_internals", nproc=nproc, timeout=timeout,
                      args=["--width", width, "--caps-mb", *caps_mb, "--parts", *parts])


def main(argv=None):
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=0, help="Linear width of the layered model (0: 8 x image_size)")
    parser.add_argument("--caps-mb", type=float, nargs="+", default=[0.05, 0.1, 0.25, 1.0, 25.0],
                        help="bucket_cap_mb values to sweep")
    parser.add_argument("--micro-steps", type=int, default=4, help="micro-batches per optimizer step with no_sync")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="experiments to run")
    return run_lab("ddp_internals", ddp_internals, parser.parse_args(argv))


if __name__ == "__main__":
    main()
