"""Notebook 10b's exercise checker accepts the reference resume_or_start and names each planted mistake."""
import os
from pathlib import Path

import pytest
import torch

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.elastic_fault_tolerance import resume as eft
from labsrc.lessons.elastic_fault_tolerance.membership_exercises import check_resume

resume_or_start = load_solution("elastic_membership", "resume_or_start")
COUNTER = "TORCHELASTIC_RESTART_COUNT"


def test_the_solution_passes(capsys):
    check_resume(resume_or_start)
    assert "passed" in capsys.readouterr().out


def missing_file_is_start(run, path):
    """Asking forgiveness: a missing file is the only error that means 'start from scratch'."""
    try:
        eft.load_snapshot(run, path)
    except FileNotFoundError:
        return 0
    return run.steps_done


def torch_load_and_restore(run, path):
    if not os.path.exists(path):
        return 0
    eft.restore(run, torch.load(path, weights_only=True))
    return run.steps_done


@pytest.mark.parametrize("answer", [missing_file_is_start, torch_load_and_restore])
def test_other_right_answers_pass(answer, capsys):
    check_resume(answer)
    assert "passed" in capsys.readouterr().out


def by_the_counter(run, path):
    """The common pattern: resume when the counter says a restart happened."""
    if int(os.environ[COUNTER]) > 0:
        eft.load_snapshot(run, path)
        return run.steps_done
    return 0


def rank_0_loads(run, path):
    """Rank 0 wrote the snapshot, so rank 0 reads it: the returning node's rank 1 starts from scratch."""
    if run.ctx.rank == 0 and Path(path).exists():
        eft.load_snapshot(run, path)
        return run.steps_done
    return 0


def always_load(run, path):
    eft.load_snapshot(run, path)
    return run.steps_done


def only_counters_0_and_1(run, path):
    if os.environ[COUNTER] in ("0", "1") and not Path(path).exists():
        return 0
    eft.load_snapshot(run, path)
    return run.steps_done


def model_only(run, path):
    if Path(path).exists():
        state = torch.load(path, weights_only=False)
        run.model.load_state_dict(state["model"])
        run.steps_done = state["step"]
    return run.steps_done


def old_rank_0s_rng(run, path):
    """Every part by hand, and the RNG stream of the old rank 0, which no longer is this rank's."""
    if not Path(path).exists():
        return 0
    state = eft.load_checked(path)
    run.model.load_state_dict(state["model"])
    for part in ("optimizer", "scheduler", "scaler", "sampler"):
        getattr(run, part).load_state_dict(state[part])
    run.steps_done = state["step"]
    eft.restore_rng(state["rng"][0])
    return run.steps_done


def learning_rate_scaled(run, path):
    """The linear scaling rule applied although the global batch stayed the same."""
    if not Path(path).exists():
        return 0
    eft.load_snapshot(run, path)
    for group in run.optimizer.param_groups:
        group["lr"] *= run.ctx.world_size / eft.load_checked(path)["world_size"]
    return run.steps_done


def per_rank_batch_kept(run, path):
    """The global batch changed with the world size: each rank keeps the 4 samples a step it had at world size 2."""
    if not Path(path).exists():
        return 0
    eft.load_snapshot(run, path)
    run.sampler.global_batch = run.setup.global_batch // 2 * run.ctx.world_size
    return run.steps_done


def loads_but_returns_0(run, path):
    if Path(path).exists():
        eft.load_snapshot(run, path)
    return 0


def steps_left(run, path):
    if Path(path).exists():
        eft.load_snapshot(run, path)
        return run.setup.total_steps - run.steps_done
    return 0


def says_yes(run, path):
    if Path(path).exists():
        eft.load_snapshot(run, path)
    return True


def any_error_is_a_start(run, path):
    try:
        eft.load_snapshot(run, path)
    except Exception:  # noqa: BLE001 - the planted mistake
        return 0
    return run.steps_done


def reseeds_a_fresh_start(run, path):
    if Path(path).exists():
        eft.load_snapshot(run, path)
        return run.steps_done
    eft.seed_everything(run.setup.seed + int(os.environ[COUNTER]))
    return 0


def another_file(run, path):
    if Path(path).exists():
        eft.load_snapshot(run, Path(path).with_suffix(".ckpt"))
        return run.steps_done
    return 0


@pytest.mark.parametrize("answer, named", [
    (by_the_counter, "the returning node's rank 1 .* started from scratch. Did it trust the counter"),
    (rank_0_loads, "the returning node's rank 1 .* started from scratch. Did it trust the counter \\(or the rank\\)"),
    (always_load, "the first start .* raised FileNotFoundError"),
    (only_counters_0_and_1, "TORCHELASTIC_RESTART_COUNT 2, no snapshot.* raised FileNotFoundError"),
    (model_only, "optimizer, scheduler, scaler, sampler, rng differ from what eft.load_snapshot"),
    (old_rank_0s_rng, "rng differs from .* at world size 1 none of them is this rank's: .* re-seeds"),
    (learning_rate_scaled, "optimizer differs .* the learning rate is .* so the learning rate stays too"),
    (per_rank_batch_kept, "did not see each sample once .* The global batch stays 8"),
    (loads_but_returns_0, "the snapshot is of step 8; your function returned 0"),
    (steps_left, "the snapshot is of step 8; your function returned 4"),
    (says_yes, "return the step to start from \\(an int\\), not True"),
    (any_error_is_a_start, "cut short mid-write .* returned 0. A snapshot that will not load is not 'no snapshot'"),
    (reseeds_a_fresh_start, "TORCHELASTIC_RESTART_COUNT 1, no snapshot.* returned 0 and changed rng"),
    (another_file, "the snapshot was at path \\(snapshot.pt\\), and your function raised FileNotFoundError"),
])
def test_each_mistake_is_named(answer, named):
    with pytest.raises(ExerciseFailed, match=named):
        check_resume(answer)


def test_a_per_rank_batch_kept_when_the_world_shrinks_loses_samples(monkeypatch):
    """The global batch must stay: a rank that keeps its 4 samples per step at world size 1 skips half the epoch."""
    monkeypatch.setattr(eft, "rank_share", lambda ids, rank, world_size: ids[rank * 4:(rank + 1) * 4])
    with pytest.raises(ExerciseFailed, match="did not see each sample once"):
        check_resume(resume_or_start)
