"""Deck 12's figure: what each DDP fix costs, where the step waits for data, threads per rank (forked ranks, ci)."""
from __future__ import annotations


def measured_costs() -> tuple[dict, dict, dict]:
    """The notebook's three measurements: DDP seconds per step by fix, wait per batch by num_workers, matmul seconds."""
    from labsrc.lessons.debugging_clinic import collective_bugs as clinic
    from labsrc.lessons.debugging_clinic import training_bugs as training
    from labsrc.core.forked import run_ranks
    ddp_step_s = {}
    for variant in ("find_unused", "static_graph", "all_used"):
        outcomes = clinic.run_case(training.ddp_case, variant, debug="INFO", timeout_s=5.0)
        ddp_step_s[variant] = max(outcome.detail["step_s"] for outcome in outcomes)
    data_wait_s = {workers: training.data_wait(num_workers=workers)["wait_s"] for workers in (0, 2)}
    matmul_s = {threads: max(rank["seconds"] for rank in run_ranks(training.matmul_seconds, 2, args=(threads,)))
                for threads in (1, 2)}
    return ddp_step_s, data_wait_s, matmul_s


def make(save):
    from labsrc.lessons.debugging_clinic import plots
    save("costs", plots.draw_costs(*measured_costs()))
