"""Figures of the sync experiment (notebook 01), drawn from the dp_vs_ddp lab's records."""
from __future__ import annotations

import statistics

from labsrc.plots import bars, curves

PLAIN_VARIANT = "no BatchNorm"


def ddp_loss(result, variant: str) -> tuple[list[int], list[float]]:
    """(steps, loss) of one DDP run: the loss at a step is the mean of the ranks' losses."""
    by_step: dict[int, list[float]] = {}
    for record in result.of_kind("step"):
        if record["variant"] == variant:
            by_step.setdefault(record["step"], []).append(record["loss"])
    steps = sorted(by_step)
    return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]


def single_loss(result, batch_norm: bool) -> tuple[list[int], list[float]]:
    """(steps, loss) of rank 0's single-process run on the whole global batches."""
    rows = [r for r in result.of_kind("single_step", rank=0) if r["batch_norm"] == batch_norm]
    return [r["step"] for r in rows], [r["loss"] for r in rows]


def curve_gaps(result) -> dict[str, float]:
    """{variant: largest |DDP loss - single-process loss| over steps}, each beside its own single run."""
    gaps = {}
    for variant in result.summary["variants"]:
        _, ddp = ddp_loss(result, variant)
        _, single = single_loss(result, batch_norm=variant != PLAIN_VARIANT)
        if len(ddp) != len(single):
            raise ValueError(f"{variant}: {len(ddp)} DDP steps but {len(single)} single-process steps")
        gaps[variant] = max(abs(a - b) for a, b in zip(ddp, single))
    return gaps


def loss_curves(result, axes=None):
    """Two panels: without BatchNorm, and with it (per-rank vs global statistics), each beside one process."""
    import matplotlib.pyplot as plt
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    wide, dashed = {"linewidth": 4, "alpha": 0.4}, {"linestyle": "--", "marker": "."}
    plain = {f"DDP, {result.nproc} ranks": ddp_loss(result, PLAIN_VARIANT),
             "one process, whole global batch": single_loss(result, False)}
    curves(plain, "No BatchNorm: the same curve", "step", "training loss", ax=axes[0],
           styles=dict(zip(plain, [wide, dashed])))
    normed = {f"DDP, {v.split(', ')[1]}": ddp_loss(result, v) for v in result.summary["variants"][1:]}
    normed["one process, whole global batch"] = single_loss(result, True)
    curves(normed, "BatchNorm: global statistics close the gap", "step", "training loss", ax=axes[1],
           styles=dict(zip(normed, [{"marker": "x"}, wide, dashed])))
    return axes


def step_breakdown_ms(result) -> dict[str, float]:
    """Median milliseconds per phase over the timed steps and ranks: backward is the no_sync backward
    (compute only), all-reduce what DDP's backward takes beyond it."""
    steps = result.of_kind("timing")
    median = lambda key: 1000 * statistics.median(r[key] for r in steps)
    return {"forward": median("forward_s"), "backward": median("local_backward_s"),
            "all-reduce": max(0.0, median("backward_s") - median("local_backward_s")),
            "optimizer": median("optimizer_s")}


def step_breakdown(result, ax=None):
    """A bar per phase of the timed DDP step (step_breakdown_ms)."""
    title = f"DDP step of {result.summary['model']} on {result.nproc} ranks, median per phase"
    return bars(step_breakdown_ms(result), title, "ms", ax=ax)


def step_comparison(dataparallel_ms: float, result, ax=None):
    """DataParallel's step on every GPU beside DDP's (the sum of its median phases), same model and batch."""
    values = {"DataParallel, 1 process": dataparallel_ms,
              f"DDP, {result.nproc} processes": sum(step_breakdown_ms(result).values())}
    return bars(values, f"{result.summary['model']}, global batch {result.summary['global_batch']}: step time",
                "ms per step", ax=ax)


def buffer_spread(result, ax=None):
    """How far the ranks' BatchNorm running statistics are apart, as each forward sees them."""
    rows = result.of_kind("buffers", rank=0)
    values = {f"buffer sync {'on' if r['broadcast_buffers'] else 'off'}": r["spread_seen_by_forward"]
              for r in rows}
    return bars(values, "BatchNorm running stats: max gap between ranks at forward", "max |rank - rank 0|",
                ax=ax)
