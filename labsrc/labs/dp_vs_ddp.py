"""The DDP sync experiment on n ranks: broadcast, equal gradients, identical parameters, buffers, curves, step time.

    torchrun --nproc-per-node 2 -m labsrc.labs.dp_vs_ddp --profile ci
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc.training import data
from labsrc import dp_vs_ddp
from labsrc.core.lab import base_parser, resolve_profile, run_lab
from labsrc.training.timing import timed
from labsrc.training.models import TinyCNN, build_model
from labsrc.training.loop import set_tf32

# (name, BatchNorm in the model, BatchNorm statistics over the global batch): the training runs compared.
VARIANTS = (("no BatchNorm", False, False),
            ("BatchNorm, per-rank statistics", True, False),
            ("BatchNorm, global statistics", True, True))


def global_batch(size: int, profile, seed: int):
    """The same (G, 3, H, W) images and (G,) labels on every rank."""
    return data.synthetic_images(size, profile.image_size, seed=seed).tensors


def build(ctx, seed: int, batch_norm: bool, global_statistics: bool = False) -> torch.nn.Module:
    """TinyCNN from `seed`; with global_statistics its BatchNorm layers normalise over the global batch."""
    torch.manual_seed(seed)
    model = TinyCNN(batch_norm=batch_norm).to(ctx.device)
    return dp_vs_ddp.with_global_batch_norm(model, ctx.device) if global_statistics else model


def construction_broadcast(ctx, records, seed: int) -> None:
    """Seed every rank differently, then wrap in DDP: rank 0's parameters and buffers win."""
    model = build(ctx, seed + 1000 * ctx.rank, batch_norm=True)
    with torch.no_grad():  # give the buffers rank-dependent values too (fresh ones are all 0 and 1)
        model(torch.randn(8, 3, 8, 8, device=ctx.device))
    buffers = dp_vs_ddp.batch_norm_buffers(model)
    before = dp_vs_ddp.spread_across_ranks(list(model.parameters()))
    buffers_before = dp_vs_ddp.spread_across_ranks(buffers)
    wrapped = DDP(model)
    records.write("broadcast", before=before, after=dp_vs_ddp.spread_across_ranks(list(wrapped.parameters())),
                  buffers_before=buffers_before, buffers_after=dp_vs_ddp.spread_across_ranks(buffers))


def ddp_gradients(ctx, model: torch.nn.Module, images, labels) -> dict:
    """This rank's gradients after DDP's backward on its shard of the global batch."""
    wrapped = DDP(copy.deepcopy(model))
    mine = dp_vs_ddp.shard(images, ctx.rank, ctx.world_size), dp_vs_ddp.shard(labels, ctx.rank, ctx.world_size)
    F.cross_entropy(wrapped(mine[0]), mine[1]).backward()
    return dp_vs_ddp.gradients(wrapped)


def gradient_equivalence(ctx, records, images, labels, seed: int) -> None:
    """DDP's gradient, the hand-averaged one and the single-process full-batch one, compared."""
    images, labels = images.to(ctx.device), labels.to(ctx.device)
    model = build(ctx, seed, batch_norm=False)
    reference = dp_vs_ddp.full_batch_gradients(model, images, labels)
    with_ddp = ddp_gradients(ctx, model, images, labels)
    by_hand = copy.deepcopy(model)
    mine, my_labels = dp_vs_ddp.shard(images, ctx.rank, ctx.world_size), dp_vs_ddp.shard(labels, ctx.rank, ctx.world_size)
    F.cross_entropy(by_hand(mine), my_labels).backward()
    local = dp_vs_ddp.gradients(by_hand)
    dp_vs_ddp.average_gradients(by_hand, ctx.world_size)
    hand = dp_vs_ddp.gradients(by_hand)
    bn_model = build(ctx, seed, batch_norm=True)
    bn_reference = dp_vs_ddp.full_batch_gradients(bn_model, images, labels)
    bn_local = ddp_gradients(ctx, bn_model, images, labels)
    bn_global = ddp_gradients(ctx, dp_vs_ddp.with_global_batch_norm(copy.deepcopy(bn_model), ctx.device),
                              images, labels)
    records.write("gradients",
                  ddp_vs_full_batch=dp_vs_ddp.largest_gap(with_ddp, reference),
                  hand_vs_full_batch=dp_vs_ddp.largest_gap(hand, reference),
                  local_vs_full_batch=dp_vs_ddp.largest_gap(local, reference),
                  spread_across_ranks=dp_vs_ddp.spread_across_ranks(list(with_ddp.values())),
                  largest_gradient=max(g.abs().max().item() for g in reference.values()),
                  batch_norm_local_vs_full_batch=dp_vs_ddp.largest_gap(bn_local, bn_reference),
                  batch_norm_global_vs_full_batch=dp_vs_ddp.largest_gap(bn_global, bn_reference),
                  batch_norm_largest_gradient=max(g.abs().max().item() for g in bn_reference.values()),
                  shard_size=int(mine.shape[0]))


def batch_norm_experiments(ctx, records, images, seed: int) -> None:
    """Rank-local BatchNorm buffers with and without DDP's buffer sync; statistics of the global batch."""
    mine = dp_vs_ddp.shard(images, ctx.rank, ctx.world_size).to(ctx.device)
    for broadcast in (False, True):
        model = DDP(build(ctx, seed, batch_norm=True), **dp_vs_ddp.buffer_sync_option(broadcast))
        seen: list = []
        model.module.register_forward_pre_hook(
            lambda module, args: seen.append([b.clone() for b in dp_vs_ddp.batch_norm_buffers(module)]))
        for _ in range(3):
            model(mine).sum().backward()
        records.write("buffers", broadcast_buffers=broadcast,
                      spread_seen_by_forward=dp_vs_ddp.spread_across_ranks(seen[-1]),
                      spread_after_forward=dp_vs_ddp.spread_across_ranks(dp_vs_ddp.batch_norm_buffers(model.module)))
    features = build(ctx, seed, batch_norm=True).features[0]
    with torch.no_grad():
        whole, shard_features = features(images.to(ctx.device)), features(mine)
        reference = torch.nn.BatchNorm2d(whole.shape[1], momentum=1.0).to(ctx.device)
        full_output = dp_vs_ddp.shard(reference(whole), ctx.rank, ctx.world_size)
        local_output = torch.nn.BatchNorm2d(whole.shape[1]).to(ctx.device)(shard_features)
        layer = dp_vs_ddp.with_global_batch_norm(torch.nn.Sequential(torch.nn.BatchNorm2d(whole.shape[1])),
                                            ctx.device).to(ctx.device)
        layer[0].momentum = 1.0  # running statistics := this batch's
        global_output = layer(shard_features)
    records.write("statistics", layer=type(layer[0]).__name__,
                  local_output_vs_full=(local_output - full_output).abs().max().item(),
                  global_output_vs_full=(global_output - full_output).abs().max().item(),
                  global_running_mean_vs_full=(layer[0].running_mean - reference.running_mean).abs().max().item(),
                  global_running_var_vs_full=(layer[0].running_var - reference.running_var).abs().max().item())


def sgd_step(model, optimizer, images, labels) -> torch.Tensor:
    """One plain training step, the same for DDP and for the single process beside it; returns the loss."""
    loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


def train_ddp(ctx, records, profile, dataset, variant, seed: int) -> None:
    """One DDP run: per-step loss and the parameters' spread across ranks after each step."""
    name, batch_norm, global_statistics = variant
    model = DDP(build(ctx, seed, batch_norm, global_statistics))
    optimizer = torch.optim.SGD(model.parameters(), lr=profile.lr, momentum=0.9)
    batches = iter(data.DeviceBatches(dataset, profile.global_batch // ctx.world_size, ctx, seed=seed))
    for step in range(profile.steps):
        loss = sgd_step(model, optimizer, *next(batches))
        records.write("step", variant=name, step=step, loss=loss.item(),
                      parameter_spread=dp_vs_ddp.spread_across_ranks(list(model.parameters())))


def time_steps(ctx, records, profile, dataset, seed: int) -> None:
    """DDP steps of the profile's model, each phase timed; the backward again under no_sync (compute only).

    One warm-up step, then profile.repeats timed steps, one "timing" record each.
    """
    torch.manual_seed(seed)
    model = DDP(build_model(profile.model).to(ctx.device))
    optimizer = torch.optim.SGD(model.parameters(), lr=profile.lr, momentum=0.9)
    batches = iter(data.DeviceBatches(dataset, profile.global_batch // ctx.world_size, ctx, seed=seed))
    for step in range(1 + profile.repeats):
        images, labels = next(batches)
        with timed(ctx.device) as forward:
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        with timed(ctx.device) as backward:
            loss.backward()
        with timed(ctx.device) as update:
            optimizer.step()
        with model.no_sync():  # no_sync must cover the forward: DDP arms its reducer there
            local_loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            with timed(ctx.device) as local:
                local_loss.backward()
        optimizer.zero_grad(set_to_none=True)
        if step > 0:  # the first step pays for warm-up
            records.write("timing", model=profile.model, step=step, forward_s=forward["s"],
                          backward_s=backward["s"], local_backward_s=local["s"], optimizer_s=update["s"])


def train_single(ctx, records, profile, dataset, batch_norm: bool, seed: int) -> None:
    """Rank 0 alone: the same start, one process, the whole global batch each step (the union of the shards)."""
    alone = dataclasses.replace(ctx, rank=0, local_rank=0, world_size=1)
    model = build(ctx, seed, batch_norm)
    optimizer = torch.optim.SGD(model.parameters(), lr=profile.lr, momentum=0.9)
    batches = iter(data.DeviceBatches(dataset, profile.global_batch, alone, seed=seed))
    for step in range(profile.steps):
        loss = sgd_step(model, optimizer, *next(batches))
        records.write("single_step", batch_norm=batch_norm, step=step, loss=loss.item())


def dp_vs_ddp(ctx, records, args) -> dict:
    profile = resolve_profile(args)
    if args.global_batch:
        profile = profile.replace(global_batch=args.global_batch)
    if profile.global_batch % ctx.world_size:
        raise ValueError(f"global batch {profile.global_batch} does not split evenly over {ctx.world_size} "
                         f"ranks: choose a multiple of {ctx.world_size}")
    set_tf32(False)  # plain float32 on GPUs too: the comparisons are about the math, not TF32 rounding
    construction_broadcast(ctx, records, args.seed)
    images, labels = global_batch(profile.global_batch, profile, args.seed)
    gradient_equivalence(ctx, records, images, labels, args.seed)
    batch_norm_experiments(ctx, records, images, args.seed)
    dataset = data.synthetic_images(profile.num_samples, profile.image_size, seed=args.seed)
    runs = len(VARIANTS) + 1 + (2 if ctx.is_main else 0)
    for index, variant in enumerate(VARIANTS):
        train_ddp(ctx, records, profile, dataset, variant, args.seed)
        records.progress(index + 1, runs)
    time_steps(ctx, records, profile, dataset, args.seed)
    records.progress(len(VARIANTS) + 1, runs)
    if ctx.is_main:
        for index, batch_norm in enumerate((False, True)):
            train_single(ctx, records, profile, dataset, batch_norm, args.seed)
            records.progress(len(VARIANTS) + index + 2, runs)
    return {"profile": profile.name, "global_batch": profile.global_batch, "steps": profile.steps,
            "model": profile.model, "timed_steps": profile.repeats,
            "per_rank_batch": profile.global_batch // ctx.world_size, "variants": [v[0] for v in VARIANTS]}


def launch_sync_experiment(nproc: int, global_batch: int | None = None, profile: str | None = None,
                           timeout: float = 600.0):
    """Run this lab on nproc ranks from a notebook (the default cell and the controls both call this)."""
    from labsrc import launch
    args = ["--profile", profile] if profile else []
    args += ["--global-batch", global_batch] if global_batch else []
    return launch.run("dp_vs_ddp", nproc=nproc, args=args, timeout=timeout)


def main(argv=None):
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, default=None,
                        help="samples per step over all ranks (default: the profile's)")
    return run_lab("dp_vs_ddp", dp_vs_ddp, parser.parse_args(argv))


if __name__ == "__main__":
    main()
