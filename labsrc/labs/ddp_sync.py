"""The DDP sync experiment on n ranks: broadcast at construction, equal gradients, identical parameters, buffers, loss curves.

    torchrun --nproc-per-node 2 -m labsrc.labs.ddp_sync --profile ci
"""
from __future__ import annotations

import copy

import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc import data, sync
from labsrc.labs.common import base_parser, resolve_profile, run_lab
from labsrc.metrics import timed
from labsrc.models import TinyCNN
from labsrc.train import TrainConfig, train


def global_batch(profile, seed: int):
    """The same (G, 3, H, W) images and (G,) labels on every rank."""
    dataset = data.synthetic_images(profile.global_batch, profile.image_size, seed=seed)
    return dataset.tensors


def construction_broadcast(ctx, records, seed: int) -> DDP:
    """Seed every rank differently, then wrap in DDP: rank 0's parameters and buffers win."""
    torch.manual_seed(seed + 1000 * ctx.rank)
    model = TinyCNN(batch_norm=False).to(ctx.device)
    before = sync.spread_across_ranks(list(model.parameters()))
    wrapped = DDP(model)
    after = sync.spread_across_ranks(list(wrapped.parameters()))
    records.write("broadcast", before=before, after=after)
    return wrapped


def gradient_equivalence(ctx, records, model: DDP, images, labels) -> None:
    """DDP's gradient, the hand-averaged one and the single-process full-batch one, compared."""
    images, labels = images.to(ctx.device), labels.to(ctx.device)
    reference = sync.full_batch_gradients(model.module, images, labels)
    mine, my_labels = sync.shard(images, ctx.rank, ctx.world_size), sync.shard(labels, ctx.rank, ctx.world_size)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(mine), my_labels).backward()
    ddp_gradients = sync.gradients(model)
    by_hand = copy.deepcopy(model.module)
    by_hand.zero_grad(set_to_none=True)
    F.cross_entropy(by_hand(mine), my_labels).backward()
    local = sync.gradients(by_hand)
    sync.average_gradients(by_hand, ctx.world_size)
    hand_gradients = sync.gradients(by_hand)
    records.write("gradients",
                  ddp_vs_full_batch=sync.largest_gap(ddp_gradients, reference),
                  hand_vs_full_batch=sync.largest_gap(hand_gradients, reference),
                  local_vs_full_batch=sync.largest_gap(local, reference),
                  spread_across_ranks=sync.spread_across_ranks(list(ddp_gradients.values())),
                  largest_gradient=max(g.abs().max().item() for g in reference.values()),
                  shard_size=int(mine.shape[0]))


def train_and_compare(ctx, records, model: DDP, profile, seed: int) -> None:
    """DDP training with every step's phases timed and parameters compared across ranks after each step;
    then rank 0 trains a copy of the same start in one process on the same global batches."""
    start_state = copy.deepcopy(model.module.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=profile.lr, momentum=0.9)
    dataset = data.synthetic_images(profile.num_samples, profile.image_size, seed=seed)
    batches = iter(data.DeviceBatches(dataset, profile.global_batch // ctx.world_size, ctx, seed=seed))
    for step in range(profile.steps):
        images, labels = next(batches)
        with timed(ctx.device) as forward:
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        with timed(ctx.device) as backward:
            loss.backward()
        with timed(ctx.device) as update:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with model.no_sync(), timed(ctx.device) as local_backward:  # same backward, no communication
            F.cross_entropy(model(images), labels).backward()
        optimizer.zero_grad(set_to_none=True)
        records.write("step", step=step, loss=loss.item(), forward_s=forward["s"], backward_s=backward["s"],
                      local_backward_s=local_backward["s"], optimizer_s=update["s"],
                      parameter_spread=sync.spread_across_ranks(list(model.parameters())))
        records.progress(step + 1, profile.steps + (profile.steps if ctx.is_main else 0))
    if ctx.is_main:
        single = TinyCNN(batch_norm=False).to(ctx.device)
        single.load_state_dict(start_state)
        whole = data.DeviceBatches(dataset, profile.global_batch, ctx.__class__(0, 0, 1, ctx.device, "none"),
                                   seed=seed)
        result = train(single, iter(whole), ctx, TrainConfig(steps=profile.steps, lr=profile.lr, momentum=0.9,
                                                             log_every=profile.steps))
        for step, value in enumerate(result["losses"]):
            records.write("single_step", step=step, loss=value)
        records.progress(2 * profile.steps, 2 * profile.steps)


def batch_norm_buffers(ctx, records, profile, seed: int) -> None:
    """Rank-local BatchNorm statistics, DDP's buffer broadcast, and the global statistics SyncBatchNorm uses."""
    images, labels = global_batch(profile, seed + 1)
    mine = sync.shard(images, ctx.rank, ctx.world_size).to(ctx.device)
    for broadcast in (False, True):
        torch.manual_seed(seed)
        model = DDP(TinyCNN(batch_norm=True).to(ctx.device), **sync.buffer_sync_option(broadcast))
        seen: list = []
        model.module.register_forward_pre_hook(
            lambda module, args: seen.append([b.clone() for b in sync.batch_norm_buffers(module)]))
        for _ in range(3):
            model(mine).sum().backward()
        records.write("buffers", broadcast_buffers=broadcast,
                      spread_seen_by_forward=sync.spread_across_ranks(seen[-1]),
                      spread_after_forward=sync.spread_across_ranks(sync.batch_norm_buffers(model.module)))
    first_layer = TinyCNN(batch_norm=True).features[0].to(ctx.device)
    with torch.no_grad():
        features = first_layer(mine)
        whole = first_layer(images.to(ctx.device))
        global_mean, global_var = sync.global_batch_statistics(features)
        rank_mean = features.mean(dim=[0, 2, 3])
        full_mean, full_var = whole.mean(dim=[0, 2, 3]), whole.var(dim=[0, 2, 3], unbiased=False)
    records.write("statistics", rank_mean_vs_full=(rank_mean - full_mean).abs().max().item(),
                  synced_mean_vs_full=(global_mean - full_mean).abs().max().item(),
                  synced_var_vs_full=(global_var - full_var).abs().max().item(),
                  sync_batch_norm_ran=_sync_batch_norm_on_gpu(ctx, mine, full_mean))


def _sync_batch_norm_on_gpu(ctx, mine, full_mean) -> float | None:
    """torch's SyncBatchNorm itself (GPU only): its running mean after one step vs the full-batch mean."""
    if ctx.device.type != "cuda":
        return None
    model = DDP(torch.nn.SyncBatchNorm.convert_sync_batchnorm(TinyCNN(batch_norm=True)).to(ctx.device))
    layer = model.module.features[1]
    layer.momentum = 1.0  # running mean := this batch's (global) mean
    features = model.module.features[0](mine)
    layer(features)
    return (layer.running_mean - full_mean).abs().max().item()


def ddp_sync(ctx, records, args) -> dict:
    profile = resolve_profile(args)
    model = construction_broadcast(ctx, records, args.seed)
    images, labels = global_batch(profile, args.seed)
    gradient_equivalence(ctx, records, model, images, labels)
    batch_norm_buffers(ctx, records, profile, args.seed)
    train_and_compare(ctx, records, model, profile, args.seed)
    return {"profile": profile.name, "global_batch": profile.global_batch, "steps": profile.steps}


def launch_sync_experiment(nproc: int, profile: str | None = None, timeout: float = 600.0):
    """Run this lab on nproc ranks from a notebook (the default cell and the controls both call this)."""
    from labsrc import launch
    return launch.run("ddp_sync", nproc=nproc, args=["--profile", profile] if profile else [],
                      timeout=timeout)


def main(argv=None):
    parser = base_parser(__doc__.splitlines()[0])
    return run_lab("ddp_sync", ddp_sync, parser.parse_args(argv))


if __name__ == "__main__":
    main()
