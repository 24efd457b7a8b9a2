"""Deck 13's figures: the scaled schedule, held-out accuracy and the scaling report of ci capstone runs."""
from __future__ import annotations


def schedule_figure():
    """The course's schedule at 1, 2 and 8 ranks of 128 samples (base 0.1 per 256, 10 warm-up steps of 100)."""
    from labsrc.lessons.capstone import recipe
    from labsrc.lessons.capstone import plots
    plans = {ranks: recipe.Schedule(0.1, 256, 128 * ranks, 10, 100) for ranks in (1, 2, 8)}
    curves = {f"{n} rank(s) x 128 = {p.global_batch}": [recipe.learning_rate(s, p) for s in range(100)]
              for n, p in plans.items()}
    return plots.schedules(curves).figure


def make(save):
    from labsrc.lessons.capstone import recipe
    from labsrc import launch
    from labsrc.core.plan import make_plan
    from labsrc.lessons.capstone.lab import Evaluation
    from labsrc.lessons.capstone import plots
    plan = make_plan()
    one_core_each = {"OMP_NUM_THREADS": "1"}  # as in the notebook: a core per rank, the stand-in for a GPU per rank
    runs = {n: launch.run("capstone", nproc=n, timeout=600, global_batch=plan.global_batch, env=one_core_each)
            for n in sorted({1, plan.world_size})}
    evaluations = {n: result.of(Evaluation) for n, result in runs.items()}
    report = recipe.scaling_report(
        {n: {"images_per_s": r.summary["steps"] * r.summary["global_batch"] / r.summary["train_seconds"],
             "evaluations": [vars(e) for e in evaluations[n]]} for n, r in runs.items()}, target=0.8)
    save("lr_schedule", schedule_figure(), measured=False)
    save("accuracy", plots.accuracy_curves({f"{n} rank(s)": rows for n, rows in evaluations.items()}, 0.8).figure)
    save("scaling", plots.scaling_bars(report)[0].figure)
