"""Deck 09b's figure from a ci run: FSDP's gather-compute-free, traced by the hand-written hooks on 2 ranks."""
from __future__ import annotations


def make(save):
    from labsrc.core.forked import run_ranks
    from labsrc.lessons.memory_sharding import fsdp2_plots, fsdp2_runs
    from labsrc.lessons.memory_sharding.transformer import token_batches
    batches = token_batches(1, 12, seed=3)
    reference = fsdp2_runs.reference_run(batches, None, "adamw", 1e-3)
    trace = run_ranks(fsdp2_runs.hand_fsdp_run, 2, (batches, None, "adamw", 1e-3, reference))[0]["trace"]
    save("gather_compute_free", fsdp2_plots.gather_compute_free(trace))
