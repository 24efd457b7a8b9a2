"""Checker for notebook 01b's exercise: your whole DDP script, run under the probe on ranks and judged TODO by TODO.

The script runs three times: on the plan's ranks; on one rank with the given make_optimizer raising on purpose (is
the group left in a `finally`?); and on 3 simulated nodes of one rank each, where RANK differs from LOCAL_RANK
and a world size written into the script shows. How each TODO is judged: docs/ddp_script.md.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from labsrc.core.exercises import ExerciseFailed, passed
from labsrc.lessons.dp_vs_ddp.script_reference import (course_script, load_script, reference_path, reference_run,
                                                       todos_left)
from labsrc.lessons.dp_vs_ddp.script_runs import ProbedRun, probe_run
from labsrc.lessons.dp_vs_ddp.script_side_checks import failure_check, pretend_gpus_check
from labsrc.lessons.dp_vs_ddp.script_verdicts import Expected, Stage, judge, metric_call, printed_losses

NODES = 3  # the third run: 3 simulated nodes of one rank (a world size other than 2, RANK != LOCAL_RANK)
ALL_TODOS = list(range(1, 9))


def expected(world_size: int, backend: str, gpus: int, nnodes: int = 1) -> Expected:
    course = course_script()
    return Expected(world_size, backend, gpus, course.TIMEOUT.total_seconds(), course.EPOCHS, course.DATASET_SIZE,
                    course.SEED, nnodes)


def judged(run: ProbedRun, backend: str, gpus: int, nnodes: int = 1) -> list[Stage]:
    """The run's eight stages; on a machine without GPUs, TODO 1 is judged on 2 pretend GPUs instead."""
    left = todos_left(run.script)
    stages = judge(run.reports, run.output, run.checkpoint, reference_run(run.world_size),
                   expected(run.world_size, backend, gpus, nnodes), left)
    choose_device = getattr(load_script(run.script), "choose_device", None)
    if not gpus and 1 not in left and choose_device is not None:
        problem = pretend_gpus_check(choose_device)
        stages[0] = Stage(1, "failed", problem) if problem else Stage(1, "ok", "on 2 pretend GPUs (no GPU here)")
    elif not gpus and 1 not in left:  # a script without choose_device: its GPU cannot be seen on this machine
        stages[0] = Stage(1, "failed", "no GPU here, so the GPU your script picks is tried on pretend GPUs, through "
                                       "choose_device(local_rank, backend) -> (backend, device): write that function")
    return stages


def show(stages: list[Stage], heading: str, brief: bool = False) -> None:
    """One line per TODO under the heading; brief: one line in all when every TODO is ok or not judged here."""
    if brief and all(stage.status in ("ok", "not judged") for stage in stages):
        print(f"{heading} all 8 TODOs ok")
        return
    print(heading)
    for stage in stages:
        print("  " + stage.line())


def first_problem(stages: list[Stage]) -> Stage | None:
    return next((stage for stage in stages if stage.status in ("failed", "not written")), None)


def said(problem: Stage, script: Path) -> str:
    if problem.status == "not written":
        return (f"TODO {problem.todo} ({problem.title}) is still to do in {script.name}: replace its "
                "`raise NotImplementedError` (TODO 8: its `pass`).")
    return f"TODO {problem.todo} ({problem.title}): {problem.detail}"


def written(script: Path) -> bool:
    """Whether a learner's file is worth running: the blank page has no NotImplementedError left; the outline has
    at least one TODO replaced."""
    left = todos_left(script)
    return "NotImplementedError" not in Path(script).read_text() or (bool(left) and left != ALL_TODOS)


def yours_or_reference(your_script, blank_script, verb: str = "checked") -> Path:
    """The file the notebook uses: your blank page once it is written, else your outline once you started it, else
    the reference solution, said loudly."""
    for script in (Path(blank_script), Path(your_script)):
        if written(script):
            return script.resolve()
    reference = reference_path(needed_for=f"{Path(your_script).name} and {Path(blank_script).name} are untouched")
    print(f"REFERENCE SOLUTION {verb}, not yours: {Path(your_script).name} and {Path(blank_script).name} are "
          "untouched.")
    return reference


def lesson_run(your_script, blank_script, plan, timeout: float = 120.0) -> ProbedRun:
    """Section 3's run: your script on the plan's ranks, its TODOs judged; if it does not run to the end, the
    reference solution's run instead, said loudly, so the cells after it have a whole run to show."""
    gpus = torch.cuda.device_count() if plan.device == "cuda" else 0
    script = yours_or_reference(your_script, blank_script, "run")
    run = probe_run(script, plan.world_size, plan.backend, Path(tempfile.mkdtemp(prefix="ddp_script_")), timeout,
                    echo=True)
    show(judged(run, plan.backend, gpus), f"{script.name} on {plan.world_size} {plan.backend} ranks, "
                                          f"{run.wall_time_s:.1f} s:")
    if run.finished or script == reference_path():
        return run
    print(f"\nREFERENCE SOLUTION run below, not yours: {script.name} did not run to the end.")
    reference = reference_path(needed_for=f"{script.name} did not run to the end")
    return lesson_run(reference, reference, plan, timeout)


def epoch_losses(run: ProbedRun) -> tuple[list[float], list[list[float]]]:
    """(what rank 0 printed as each epoch's loss, [rank][epoch] each rank's own loss). The printed number is the
    one closest to one process's loss; each rank's own loss is its [summed loss, sample count] before the
    all_reduce."""
    course = course_script()
    calls = [[metric_call([c for c in report["all_reduce"] if c["epochs_begun"] == epoch + 1], course.DATASET_SIZE)
              for epoch in range(course.EPOCHS)] for report in run.reports]
    printed = printed_losses(run.output, "[rank0] ", reference_run(run.world_size).epoch_losses)
    if None in printed or not all(call for rank in calls for call in rank):
        return [], []
    own = [[call["before"][0] / call["before"][1] for call in rank] for rank in calls]
    return [value for value, _ in printed], own


def loss_table(run: ProbedRun) -> None:
    """Per epoch: the loss rank 0 printed, one process's on the same global batches, and each rank's own."""
    logged, own = epoch_losses(run)
    for epoch, loss in enumerate(logged):
        ranks = ", ".join(f"rank {rank} {losses[epoch]:.4f}" for rank, losses in enumerate(own))
        alone = reference_run(run.world_size).epoch_losses[epoch]
        print(f"epoch {epoch}: rank 0 printed {loss:.4f}, one process {alone:.4f} | each rank's own loss: {ranks}")
    print("the ranks' weights at the end, summed:", [round(r["parameter_checksum"], 6) for r in run.reports])


def check_ddp_script(script, world_size: int | None = None, timeout: float = 120.0) -> None:
    """Run `script` three ways (see the module) and judge each TODO; raises ExerciseFailed at the first problem."""
    from labsrc.core.plan import make_plan
    plan = make_plan()
    world_size = world_size or plan.world_size
    gpus = torch.cuda.device_count() if plan.device == "cuda" else 0
    script = Path(script).expanduser().resolve()
    if not script.is_file():
        raise ExerciseFailed(f"no script at {script}.")
    with tempfile.TemporaryDirectory(prefix="ddp_script_check_") as folder:
        run = probe_run(script, world_size, plan.backend, Path(folder) / "ranks", timeout)
        stages = judged_first = judged(run, plan.backend, gpus)
        show(stages, f"1. {script.name} on {world_size} {plan.backend} ranks:")
        problem = first_problem(stages)
        if problem:
            raise ExerciseFailed(said(problem, script))
        print("2. on one rank, make_optimizer raising on purpose (this run fails by design):")
        failure = probe_run(script, 1, plan.backend, Path(folder) / "failure", timeout, fail=True)
        problem = failure_check(failure.reports)
        print(f"   {'FAILED' if problem else 'ok: the group was left all the same'}")
        if problem:
            raise ExerciseFailed(f"TODO 8 (group left in finally): {problem}")
        nodes = probe_run(script, NODES, "gloo", Path(folder) / "nodes", timeout, nnodes=NODES)
        stages = judged(nodes, "gloo", gpus, NODES)
        show(stages, f"3. on {NODES} simulated nodes of one rank each (RANK 0-{NODES - 1}, LOCAL_RANK 0 on each):",
             brief=True)
        problem = first_problem(stages)
        if problem:
            raise ExerciseFailed(f"on {NODES} simulated nodes, {said(problem, script)}")
    device = judged_first[0]
    timed = run.reports[0]["group"]["timeout_s"] is not None
    passed(f"{script.name}: every TODO holds on {world_size} {plan.backend} ranks, with training raising, and on "
           f"{NODES} simulated nodes." + ("" if timed else " Not judged: the group's timeout (this torch's group "
                                          "does not expose it).") +
           (f" TODO 1 was judged {device.detail}." if device.status == "ok" and not gpus else ""))
