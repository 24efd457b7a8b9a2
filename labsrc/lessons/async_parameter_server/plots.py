"""Figures of notebook 11 (parameter server): staleness, clock gaps, loss curves, bytes into the server, local SGD."""
from __future__ import annotations

from labsrc.core.figures import new_axes
from labsrc.lessons.async_parameter_server.lab import Bottleneck, Diloco, LocalSgd, Update

RUNS = ("sync", "async", "bounded", "ssp")
COLOURS = {"sync": "tab:blue", "async": "tab:orange", "bounded": "tab:green", "ssp": "tab:purple"}


def staleness_histogram(result, bound: int):
    """How stale each gradient was when it arrived, async against bounded (rejected ones hatched)."""
    updates = result.of(Update, rank=0)
    ax = new_axes("Staleness of every gradient at the server", "staleness (updates since the worker pulled)",
                  "gradients")
    largest = max(u.staleness for u in updates if u.experiment in ("async", "bounded"))
    for offset, key in ((-0.2, "async"), (0.2, "bounded")):
        for applied, hatch in ((True, None), (False, "//")):
            counts = [sum(1 for u in updates if u.experiment == key and u.applied == applied and u.staleness == s)
                      for s in range(largest + 1)]
            bottom = None if applied else [sum(1 for u in updates if u.experiment == key and u.applied and
                                               u.staleness == s) for s in range(largest + 1)]
            ax.bar([s + offset for s in range(largest + 1)], counts, width=0.4, bottom=bottom,
                   color=COLOURS[key], hatch=hatch, alpha=0.8 if applied else 0.35,
                   label=f"{key} {'applied' if applied else 'rejected'}")
    ax.axvline(bound + 0.5, color="black", linestyle="--", label=f"bound = {bound}")
    ax.legend()
    return ax.figure


def loss_curves(result):
    """Full-data loss of the server's parameters against gradients applied and against wall time."""
    import matplotlib.pyplot as plt
    figure, (by_count, by_time) = plt.subplots(1, 2, figsize=(11, 3.8))
    updates = result.of(Update, rank=0)
    for key in RUNS:
        applied = [u for u in updates if u.experiment == key and u.applied]
        count = list(range(1, len(applied) + 1))
        by_count.plot(count, [u.loss for u in applied], color=COLOURS[key], label=key)
        by_time.plot([u.seconds for u in applied], [u.loss for u in applied], color=COLOURS[key], label=key)
    for ax, xlabel in ((by_count, "gradients applied"), (by_time, "seconds since the run started")):
        new_axes("Loss on the whole data set", xlabel, "mean squared error", ax)
        ax.set_yscale("log")
        ax.legend()
    figure.tight_layout()
    return figure


def bytes_into_server(result):
    """Bytes into the server per round (every worker pushes one gradient) against a ring all-reduce's per rank."""
    rows = sorted(result.of(Bottleneck, rank=0), key=lambda row: row.workers)
    ax = new_axes("One gradient from every worker", "workers", "bytes")
    workers = [row.workers for row in rows]
    ax.plot(workers, [row.server_in for row in rows], "o-", label="into the parameter server (formula)")
    ax.plot(workers, [row.allreduce_formula for row in rows], "s-", label="ring all-reduce, per rank: 2(n-1)/n N")
    counted = [row for row in rows if row.counted_server_in is not None]
    ax.plot([row.workers for row in counted], [row.counted_server_in for row in counted], "kx", markersize=10,
            label="into the server, counted in this launch")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.legend()
    return ax.figure


def local_sgd_curves(result):
    """Loss of the averaged parameters at each averaging point, one line per k (worker 1's records)."""
    runs = [run for run in result.of(LocalSgd) if run.rank == min(r.rank for r in result.of(LocalSgd))]
    ax = new_axes("Local SGD: averaging every k steps", "local steps per worker", "mean squared error")
    for run in runs:
        ax.plot([point[0] for point in run.curve], [point[1] for point in run.curve], ".-",
                label=f"k = {run.every}: {run.calls} all_reduce calls")
    ax.set_yscale("log")
    ax.legend()
    return ax.figure


def clock_gaps(result, clock_bound: int):
    """How many clocks each worker was ahead of the slowest when told to go on: async, reject policy and SSP."""
    updates = result.of(Update, rank=0)
    ax = new_axes("Clock gap at each reply", "gradient handled (arrival order)", "clocks ahead of the slowest worker")
    for key in ("async", "bounded", "ssp"):
        replies = sorted((u for u in updates if u.experiment == key and u.clock_gap is not None), key=lambda u: u.order)
        ax.plot([u.order for u in replies], [u.clock_gap for u in replies], ".", markersize=3, color=COLOURS[key],
                label=key)
    ax.axhline(clock_bound, color="black", linestyle="--", linewidth=0.8, zorder=0,
               label=f"SSP bound s = {clock_bound}")
    ax.set_yscale("symlog", linthresh=4)
    ax.set_ylim(bottom=-0.3)
    ax.legend()
    return ax.figure


def diloco_curves(result):
    """Loss of the global parameters after each DiLoCo outer step, per (inner lr, outer lr, outer momentum)."""
    runs = [run for run in result.of(Diloco) if run.rank == min(r.rank for r in result.of(Diloco))]
    ax = new_axes("DiLoCo: outer step on the averaged pseudo-gradient", "local steps per worker", "mean squared error")
    for run in runs:
        style = "-" if run.outer_momentum == 0 else ("--" if run.outer_lr == 1.0 else ":")
        ax.plot([point[0] for point in run.curve], [point[1] for point in run.curve], "o" + style,
                color="tab:blue" if run.inner_lr == max(r.inner_lr for r in runs) else "tab:red",
                label=f"inner lr {run.inner_lr}, outer lr {run.outer_lr}, momentum {run.outer_momentum}")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    return ax.figure
