"""Deck 10's figures: the restart timeline and the membership timeline, from ci runs of the elastic_fault_tolerance lab."""
from __future__ import annotations


def make(save):
    from labsrc import launch
    from labsrc.lessons.elastic_fault_tolerance.membership import shrink_then_grow
    from labsrc.lessons.elastic_fault_tolerance import plots
    restarted = launch.run("elastic_fault_tolerance", nproc=2, timeout=150, max_restarts=3, pg_timeout_s=5,
                           failures=("exception", "kill", "hang"), echo=False)
    save("restart_timeline", plots.restart_timeline(restarted).figure)
    started = launch.start("elastic_fault_tolerance", nproc=1, nnodes="1:2", timeout=150, max_restarts=3,
                           reference=False, epochs=8, step_sleep_s=0.3, pg_timeout_s=10, echo=False)
    try:
        shrink_then_grow(started, timeout_s=90)
    finally:
        elastic = started.wait()
    save("membership_timeline", plots.membership_timeline(elastic).figure)
