"""Deck 08's figures: ideal schedules, measured Gantt charts and the GPipe bubble sweep from a ci run."""
from __future__ import annotations


def make(save):
    from labsrc import launch
    from labsrc.core.plan import make_plan
    from labsrc.lessons.pipeline_parallel.lab import ActionTiming
    from labsrc.lessons.pipeline_parallel import analysis
    from labsrc.lessons.pipeline_parallel import plots
    plan = make_plan()
    stages, m = plan.world_size, 4
    result = launch.run("pipeline_parallel", nproc=stages, timeout=600, backend=plan.backend, check_micro_batches=m)
    ideal = {name: analysis.ideal_timeline(name, stages, 1 if name == "naive" else m, 1.0)
             for name in ("naive", "gpipe", "1f1b")}
    save("ideal_schedules", plots.show_ideal(ideal), measured=False)
    timings = result.of(ActionTiming)
    box_s = result.summary["box_ms"] / 1000
    sweep = analysis.bubble_sweep(timings, "gpipe")
    pairs = {f"GPipe m={m}": (analysis.timeline_of(timings, "gpipe", m, sweep[m]["kept"]),
                              analysis.ideal_timeline("gpipe", stages, m, box_s)),
             f"1F1B m={m}": (analysis.timeline_of(timings, "1f1b", m),
                             analysis.ideal_timeline("1f1b", stages, m, box_s))}
    save("schedules_measured", plots.show_schedules(pairs, box_s))
    save("bubble", plots.show_bubble(sweep, stages, tolerance=0.10).figure)
