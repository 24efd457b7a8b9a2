"""Notebook 10b's exercise checker accepts the reference resume_or_start and names each planted mistake."""
import os
from pathlib import Path

import pytest
import torch

from labsrc import elastic_fault_tolerance as eft
from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.exercises.elastic_membership import check_resume

resume_or_start = load_solution("elastic_membership", "resume_or_start")


def test_the_solution_passes(capsys):
    check_resume(resume_or_start)
    assert "passed" in capsys.readouterr().out


def by_the_counter(run, path):
    """The common pattern: resume when the counter says a restart happened."""
    if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) > 0:
        eft.load_snapshot(run, path)
        return run.steps_done
    return 0


def always_load(run, path):
    eft.load_snapshot(run, path)
    return run.steps_done


def model_only(run, path):
    if Path(path).exists():
        state = torch.load(path, weights_only=False)
        run.model.load_state_dict(state["model"])
        run.steps_done = state["step"]
    return run.steps_done


def loads_but_returns_0(run, path):
    if Path(path).exists():
        eft.load_snapshot(run, path)
    return 0


def says_yes(run, path):
    if Path(path).exists():
        eft.load_snapshot(run, path)
    return True


@pytest.mark.parametrize("answer, named", [
    (by_the_counter, "the returning node .* started from scratch. Did it trust the counter"),
    (always_load, "the first start .* raised FileNotFoundError"),
    (model_only, "optimizer, scheduler, scaler, sampler differ from the snapshot's"),
    (loads_but_returns_0, "your function returned 0"),
    (says_yes, "return the step to start from \\(an int\\), not True"),
])
def test_each_mistake_is_named(answer, named):
    with pytest.raises(ExerciseFailed, match=named):
        check_resume(answer)


def test_a_per_rank_batch_kept_when_the_world_shrinks_loses_samples(monkeypatch):
    """The global batch must stay: a rank that keeps its 4 samples per step at world size 1 skips half the epoch."""
    monkeypatch.setattr(eft, "rank_share", lambda ids, rank, world_size: ids[rank * 4:(rank + 1) * 4])
    with pytest.raises(ExerciseFailed, match="did not see each sample once"):
        check_resume(resume_or_start)
