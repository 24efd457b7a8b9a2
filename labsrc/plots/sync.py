"""Figures of the sync experiment (notebook 01), drawn from the ddp_sync lab's records."""
from __future__ import annotations

import statistics

from labsrc.plots import bars, curves, mean_over_ranks


def loss_curves(result, ax=None):
    """DDP's loss (mean of the ranks' losses) beside single-process training on the same global batches."""
    ddp_steps, ddp_loss = mean_over_ranks(result, "step", "loss")
    single = result.of_kind("single_step", rank=0)
    series = {f"DDP, {result.nproc} ranks (mean of rank losses)": (ddp_steps, ddp_loss),
              "one process, whole global batch": ([r["step"] for r in single], [r["loss"] for r in single])}
    styles = {name: style for name, style in zip(series, [{"linewidth": 4, "alpha": 0.4},
                                                         {"linestyle": "--", "marker": "."}])}
    return curves(series, "Same global batch, same curve", "step", "training loss", ax=ax, styles=styles)


def step_breakdown_ms(result) -> dict[str, float]:
    """Median milliseconds per phase over steps and ranks; communication = DDP backward - local backward."""
    steps = result.of_kind("step")[1:] or result.of_kind("step")  # the first step pays for warm-up
    median = lambda key: 1000 * statistics.median(r[key] for r in steps)
    return {"forward": median("forward_s"), "backward (local compute)": median("local_backward_s"),
            "backward extra under DDP (all-reduce)": max(0.0, median("backward_s") - median("local_backward_s")),
            "optimizer": median("optimizer_s")}


def step_breakdown(result, ax=None):
    return bars(step_breakdown_ms(result), f"DDP step on {result.nproc} ranks, median per phase", "ms", ax=ax)


def buffer_spread(result, ax=None):
    """How far the ranks' BatchNorm running statistics are apart, as each forward sees them."""
    rows = result.of_kind("buffers", rank=0)
    values = {f"buffer sync {'on' if r['broadcast_buffers'] else 'off'}": r["spread_seen_by_forward"]
              for r in rows}
    return bars(values, "BatchNorm running stats: max gap between ranks at forward", "max |rank - rank 0|",
                ax=ax)
