"""Figures of the sync experiment (notebook 01) from the dp_vs_ddp lab's records; numbers from its sync module."""
from __future__ import annotations

from labsrc.core.figures import bars, curves
from labsrc.lessons.dp_vs_ddp import sync
from labsrc.lessons.dp_vs_ddp.lab import Buffers, DdpStep, SingleStep, StepTiming

PHASE_LABELS = {"forward": "forward", "backward": "backward", "all_reduce": "all-reduce", "optimizer": "optimizer"}


def loss_curves(result, axes=None):
    """Two panels: without BatchNorm, and with it (per-rank vs global statistics), each beside one process."""
    import matplotlib.pyplot as plt
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    ddp_steps, single_steps = result.of(DdpStep), result.of(SingleStep, rank=0)
    ddp = {v.key: sync.mean_loss_per_step(r for r in ddp_steps if r.variant == v.key)
           for v in sync.VARIANTS}
    single = {norm: sync.mean_loss_per_step(r for r in single_steps if r.batch_norm == norm)
              for norm in (False, True)}
    wide, dashed = {"linewidth": 4, "alpha": 0.4}, {"linestyle": "--", "marker": "."}
    alone = "one process, whole global batch"
    plain = {f"DDP, {result.nproc} ranks": ddp["plain"], alone: single[False]}
    curves(plain, "No BatchNorm: the same curve", "step", "training loss", ax=axes[0],
           styles=dict(zip(plain, [wide, dashed])))
    normed = {f"DDP, {v.label}": ddp[v.key] for v in sync.VARIANTS if v.batch_norm}
    normed[alone] = single[True]
    curves(normed, "BatchNorm: global statistics close the gap", "step", "training loss", ax=axes[1],
           styles=dict(zip(normed, [{"marker": "x"}, wide, dashed])))
    for ax in axes:  # below the axes, not on them: the curves run through every corner
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
    axes[0].figure.tight_layout()
    return axes


def step_breakdown(result, ax=None):
    """A bar per phase of the timed DDP step (sync.step_breakdown_ms)."""
    phases = sync.step_breakdown_ms(result.of(StepTiming))
    title = f"DDP step of {result.summary['model']} on {result.nproc} ranks, median per phase"
    return bars({PHASE_LABELS[name]: ms for name, ms in phases.items()}, title, "ms", ax=ax)


def step_comparison(dataparallel_ms: float, ddp_ms: float, result, ax=None):
    """DataParallel's step on every GPU beside DDP's, same model and global batch."""
    values = {"DataParallel, 1 process": dataparallel_ms, f"DDP, {result.nproc} processes": ddp_ms}
    return bars(values, f"{result.summary['model']}, global batch {result.summary['global_batch']}: step time",
                "ms per step", ax=ax)


def buffer_spread(result, ax=None):
    """How far the ranks' BatchNorm running statistics are apart, as each forward sees them."""
    values = {f"buffer sync {'on' if r.buffer_sync else 'off'}": r.spread_seen_by_forward
              for r in result.of(Buffers, rank=0)}
    return bars(values, "BatchNorm running stats: max gap between ranks at forward", "max |rank - rank 0|",
                ax=ax)
