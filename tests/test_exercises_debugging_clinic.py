"""Notebook 12's checkers accept the reference solutions and reject planted wrong answers, naming the mistake."""
import pytest
import torch
import torch.distributed as dist

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.debugging_clinic import exercises as checks


def test_diagnose_solution_passes(capsys):
    checks.check_diagnose(load_solution("debugging_clinic", "diagnose"))
    assert "9 failures diagnosed" in capsys.readouterr().out


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


def reads_fates_first(evidence):
    """A plausible rule: a vanished rank died, a full-timeout wait is a skipped collective (the old evidence set
    passed it): wrong for NCCL's watchdog teardown and for a mismatched order without a debug mode."""
    message = evidence["message"]
    for stable, cause in (("Detected mismatch", "collective_mismatch"), ("monitoredBarrier", "rank_missing_from_barrier"),
                          ("finished reduction", "unused_parameters"), ("EADDRINUSE", "port_in_use")):
        if stable in message:
            return cause
    if evidence["exception"] == "DistStoreError":
        return "world_size_mismatch"
    if "vanished" in evidence["fates"].values():
        return "rank_died"
    return "skipped_collective"


def test_diagnose_that_reads_a_watchdog_teardown_as_a_death_is_rejected():
    def order_aware(evidence):
        fates = evidence["fates"].values()
        if fates and all(fate.startswith("raised") for fate in fates) and "Timed out" in evidence["message"]:
            return "collective_mismatch"
        return reads_fates_first(evidence)
    with pytest.raises(ExerciseFailed, match="Watchdog caught.*you said 'rank_died', but it is 'skipped_collective'"):
        checks.check_diagnose(order_aware)


def test_diagnose_that_calls_every_full_timeout_a_skipped_collective_is_rejected():
    def watchdog_aware(evidence):
        if "Watchdog caught" in evidence["message"]:
            return "skipped_collective"
        return reads_fates_first(evidence)
    with pytest.raises(ExerciseFailed, match="Timed out waiting.*'raised RuntimeError', 1: 'raised RuntimeError'.*"
                                             "you said 'skipped_collective', but it is 'collective_mismatch'"):
        checks.check_diagnose(watchdog_aware)


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
    with pytest.raises(ExerciseFailed, match="rank 0 returned the sum"):
        checks.check_mean_loss(summed)


def every_rank_prints(ctx, loss):
    """Right value, but every rank prints (the review's planted answer)."""
    total = torch.tensor([float(loss)])
    dist.all_reduce(total)
    print(f"mean loss {total.item() / ctx.world_size:.3f}")
    return total.item() / ctx.world_size


def divides_by_two(ctx, loss):
    """Only rank 0 prints, but the divisor is hard-coded: right on 2 ranks only."""
    total = torch.tensor([float(loss)])
    dist.all_reduce(total)
    if ctx.rank == 0:
        print(f"mean loss {total.item() / 2:.3f}")
    return total.item() / 2


def test_mean_loss_printed_on_every_rank_is_rejected():
    with pytest.raises(ExerciseFailed, match=r"rank\(s\) \[1\] printed too.*if ctx.rank == 0"):
        checks.check_mean_loss(every_rank_prints)


def test_mean_loss_with_a_hard_coded_divisor_passes_two_ranks_and_is_rejected_at_three():
    assert checks.mean_loss_verdict([{"local": 2.0, "value": 3.0, "printed": "mean loss 3.000"},
                                     {"local": 4.0, "value": 3.0, "printed": ""}]) is None  # why 2 ranks alone missed it
    with pytest.raises(ExerciseFailed, match="on 3 ranks rank 0 returned the sum divided by 2"):
        checks.check_mean_loss(divides_by_two)


def test_mean_loss_silent_rank0_is_rejected():
    def silent(ctx, loss):
        total = torch.tensor([float(loss)])
        dist.all_reduce(total)
        return total.item() / ctx.world_size
    with pytest.raises(ExerciseFailed, match="rank 0 should print the mean loss 3"):
        checks.check_mean_loss(silent)


def test_mean_loss_local_value_is_rejected():
    with pytest.raises(ExerciseFailed, match="rank 0 returned its own loss"):
        checks.check_mean_loss(lambda ctx, loss: loss)


def test_mean_loss_with_integer_division_is_rejected():
    """`//` gives the right number whenever the mean is whole: the checker's losses make it 3.5 and 4.5."""
    def floored(ctx, loss):
        total = torch.tensor([float(loss)])
        dist.all_reduce(total)
        if ctx.rank == 0:
            print(f"mean loss {total.item() // ctx.world_size}")
        return total.item() // ctx.world_size
    with pytest.raises(ExerciseFailed, match="expected the mean loss 3.5, got 3.0"):
        checks.check_mean_loss(floored)


def test_mean_loss_printed_by_each_nodes_local_rank_0_is_rejected():
    """`if ctx.local_rank == 0` prints once per node: rank 2 is local rank 0 of the second node at 3 ranks."""
    def per_node(ctx, loss):
        total = torch.tensor([float(loss)])
        dist.all_reduce(total)
        if ctx.local_rank == 0:
            print(f"mean loss {total.item() / ctx.world_size:.3f}")
        return total.item() / ctx.world_size
    with pytest.raises(ExerciseFailed, match=r"rank\(s\) \[2\] printed too.*not ctx.local_rank"):
        checks.check_mean_loss(per_node)
