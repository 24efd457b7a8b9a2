"""Lesson 13's evaluation over a world size that does not divide the held-out split: strided shares vs DistributedSampler."""
from __future__ import annotations

import torch

from labsrc.core.world import RankContext
from labsrc.lessons.capstone.recipe import offline_split
from labsrc.lessons.capstone.training_run import evaluate, sampler_share
from labsrc.training.models import build_model


def model_and_held_out(held_out_size: int, image_size: int = 8, seed: int = 0):
    """(a seeded, untrained tiny CNN, a synthetic held-out split of held_out_size samples): the same everywhere."""
    _, held_out = offline_split(16, held_out_size, image_size, seed)
    torch.manual_seed(seed)
    return build_model("tiny_cnn"), held_out


def scores_by_share(ctx, held_out_size: int) -> dict[str, dict]:
    """On every rank of a process group: {"strided" | "sampler": the all-reduced scores} of the same model when
    each rank scores its share as the capstone run's evaluate does (strided shares, its default), then its
    DistributedSampler share. Run it on forked ranks (run_ranks)."""
    model, held_out = model_and_held_out(held_out_size)
    return {"strided": evaluate(model, held_out, ctx, "fp32"),  # the share the capstone run evaluates with
            "sampler": evaluate(model, held_out, ctx, "fp32", share=sampler_share)}


def one_process_scores(held_out_size: int) -> dict:
    """The same model scoring the whole split in this process (no process group): what both should give."""
    model, held_out = model_and_held_out(held_out_size)
    return evaluate(model, held_out, RankContext(0, 0, 1, torch.device("cpu"), "none"), "fp32")
