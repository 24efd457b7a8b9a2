"""Notebook 12's checkers accept the reference solutions and reject planted wrong answers, naming the mistake."""
import pytest
import torch
import torch.distributed as dist

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.exercises import debugging_clinic as checks


def test_diagnose_solution_passes(capsys):
    checks.check_diagnose(load_solution("debugging_clinic", "diagnose"))
    assert "7 failures diagnosed" in capsys.readouterr().out


def test_diagnose_that_blames_every_failure_on_a_timeout_is_rejected():
    with pytest.raises(ExerciseFailed, match="'collective_mismatch'.*fingerprints"):
        checks.check_diagnose(lambda evidence: "skipped_collective")


def test_diagnose_that_misses_a_killed_rank_is_rejected():
    solution = load_solution("debugging_clinic", "diagnose")

    def ignores_fates(evidence):
        answer = solution(evidence)
        return "skipped_collective" if answer == "rank_died" else answer
    with pytest.raises(ExerciseFailed, match="'rank_died'.*no exit note"):
        checks.check_diagnose(ignores_fates)


def test_diagnose_with_an_unknown_key_is_rejected():
    with pytest.raises(ExerciseFailed, match="return one of"):
        checks.check_diagnose(lambda evidence: "gremlins")


def test_mean_loss_solution_passes(capsys):
    checks.check_mean_loss(load_solution("debugging_clinic", "mean_loss"))
    assert "mean loss" in capsys.readouterr().out


def rank0_only(ctx, loss):
    """The planted bug: only rank 0 joins the all_reduce."""
    total = torch.tensor([float(loss)])
    if ctx.rank == 0:
        dist.all_reduce(total)
    return total.item() / ctx.world_size


def summed(ctx, loss):
    total = torch.tensor([float(loss)])
    dist.all_reduce(total)
    return total.item()


def test_mean_loss_only_rank0_joins_is_rejected_as_a_hang():
    with pytest.raises(ExerciseFailed, match="never joined.*Every rank must call all_reduce"):
        checks.check_mean_loss(rank0_only, timeout_s=3.0)


def test_mean_loss_sum_is_rejected():
    with pytest.raises(ExerciseFailed, match="you returned the sum"):
        checks.check_mean_loss(summed)


def test_mean_loss_local_value_is_rejected():
    with pytest.raises(ExerciseFailed, match="this rank's own loss"):
        checks.check_mean_loss(lambda ctx, loss: loss)
