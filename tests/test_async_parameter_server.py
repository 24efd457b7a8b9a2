"""Lesson 11: the parameter server on forked gloo ranks vs single-process references; staleness, bytes, local SGD."""
import time
from types import SimpleNamespace

import pytest
import torch

from labsrc.core.forked import RankError, run_ranks
from labsrc.core.world import RequestError
from labsrc.lessons.async_parameter_server import analysis, local_sgd as local, server as ps
from labsrc.lessons.async_parameter_server.lab import Options, parameter_server_lab

PROBLEM = ps.Problem(features=8, samples=256, batch=8, seed=3)
LR = 0.2


def server_run(ctx, settings):
    return ps.run(ctx.rank, ps.make_data(PROBLEM), PROBLEM, settings)


def run_mode(mode, workers, gradients=40, **settings):
    ranks = tuple(range(1, workers + 1))
    return run_ranks(server_run, workers + 1, (ps.Settings(mode, ranks, gradients, LR, **settings),))


def sgd_reference(workers: int, rounds: int) -> torch.Tensor:
    """One process: every round, the mean of each worker's gradient on its seeded batch, at the same weights."""
    data, parameters = ps.make_data(PROBLEM), ps.initial_parameters(PROBLEM)
    for step in range(rounds):
        grads = [ps.gradient(*data, parameters, ps.batch_rows(PROBLEM, worker, step)) for worker in
                 range(1, workers + 1)]
        parameters = parameters - LR * torch.stack(grads).mean(0)
    return parameters


def test_one_worker_async_equals_sync_bit_for_bit():
    sync = run_mode("sync", 1)[0]
    asynchronous = run_mode("async", 1)[0]
    assert torch.equal(sync["parameters"], asynchronous["parameters"])
    assert torch.equal(sync["parameters"], sgd_reference(1, 40))
    assert [u["staleness"] for u in asynchronous["updates"]] == [0] * 40


def test_sync_with_two_workers_equals_single_process_averaged_sgd():
    server, first, second = run_mode("sync", 2, delays_s=(0.0, 0.002))
    assert torch.equal(server["parameters"], sgd_reference(2, 20))
    assert {u["staleness"] for u in server["updates"]} == {0}
    assert first["steps"] == second["steps"] == 20


def test_async_run_replays_bit_for_bit_in_one_process():
    server = run_mode("async", 2, gradients=60, delays_s=(0.001, 0.006), jitter=0.5)[0]
    updates = server["updates"]
    assert [u["order"] for u in updates] == list(range(len(updates)))
    assert all(u["staleness"] == u["server_version"] - u["gradient_version"] for u in updates)
    assert max(u["staleness"] for u in updates) > 0, "a slow worker should have pushed stale gradients"
    replayed = analysis.replay(ps.make_data(PROBLEM), PROBLEM, "async", LR, 2, updates)
    assert torch.equal(replayed, server["parameters"])
    assert not torch.equal(replayed, sgd_reference(1, 60)), "staleness should change the trajectory"


def test_replay_detects_a_gradient_labelled_with_the_wrong_version():
    server = run_mode("async", 2, gradients=30, delays_s=(0.001, 0.004))[0]
    updates = [dict(u) for u in server["updates"]]
    shifted = next(u for u in updates if u["gradient_version"] > 0)
    shifted["gradient_version"] -= 1
    replayed = analysis.replay(ps.make_data(PROBLEM), PROBLEM, "async", LR, 2, updates)
    assert not torch.equal(replayed, server["parameters"])


def test_replay_names_a_version_the_server_had_not_reached():
    server = run_mode("async", 1, gradients=6)[0]
    updates = [dict(u) for u in server["updates"]]
    updates[2]["gradient_version"] = 5
    with pytest.raises(ValueError, match="names version 5"):
        analysis.replay(ps.make_data(PROBLEM), PROBLEM, "async", LR, 1, updates)


def test_bounded_staleness_never_exceeds_the_bound_and_rejects_the_rest():
    server = run_mode("bounded", 2, gradients=60, bound=1, delays_s=(0.001, 0.008), jitter=0.2)[0]
    applied = [u for u in server["updates"] if u["applied"]]
    rejected = [u for u in server["updates"] if not u["applied"]]
    assert len(applied) == 60
    assert max(u["staleness"] for u in applied) <= 1
    assert rejected and min(u["staleness"] for u in rejected) > 1
    replayed = analysis.replay(ps.make_data(PROBLEM), PROBLEM, "bounded", LR, 2, server["updates"])
    assert torch.equal(replayed, server["parameters"])


def test_ssp_holds_the_fast_worker_within_the_clock_bound_and_drops_nothing():
    settings = {"gradients": 60, "delays_s": (0.001, 0.008), "jitter": 0.2}
    ssp = run_mode("ssp", 2, clock_bound=1, **settings)[0]
    free = run_mode("async", 2, **settings)[0]
    gaps = [u["clock_gap"] for u in ssp["updates"] if u["clock_gap"] is not None]
    assert max(gaps) <= 1, "a worker went on more than clock_bound clocks ahead of the slowest"
    assert max(gaps) == 1, "SSP held the fast worker before it was clock_bound clocks ahead"
    assert max(u["clock_gap"] for u in free["updates"] if u["clock_gap"] is not None) > 1, "async had no gap to bound"
    assert all(u["applied"] for u in ssp["updates"]) and len(ssp["updates"]) == 60, "SSP drops nothing"
    held = [u for u in ssp["updates"] if u["held"]]
    assert held and sum(u["worker"] == 1 for u in held) > len(held) / 2, "the fast worker waits for the slow one"
    assert analysis.waiting(ssp["updates"])["blocked"] == len(held)
    assert max(u["staleness"] for u in ssp["updates"]) <= (2 - 1) * (2 * 1 + 1)  # (n-1)(2s+1): see notebook 11
    replayed = analysis.replay(ps.make_data(PROBLEM), PROBLEM, "ssp", LR, 2, ssp["updates"])
    assert torch.equal(replayed, ssp["parameters"])


def diloco_on_rank(ctx, steps, every, outer_lr, momentum):
    data = ps.make_data(PROBLEM)
    return (local.diloco(ctx.rank + 1, data, PROBLEM, steps, every, LR, outer_lr, momentum),
            local.local_sgd(ctx.rank + 1, data, PROBLEM, steps, every, LR))


def test_diloco_is_local_sgd_at_outer_lr_one_and_matches_its_reference_with_nesterov():
    plain = run_ranks(diloco_on_rank, 2, (12, 5, 1.0, 0.0))
    torch.testing.assert_close(plain[0][0]["parameters"], plain[0][1]["parameters"])
    outer = run_ranks(diloco_on_rank, 2, (12, 5, 0.7, 0.9))
    assert torch.equal(outer[0][0]["parameters"], outer[1][0]["parameters"]), "workers end on the same parameters"
    assert outer[0][0]["calls"] == local.expected_calls(12, 5)
    reference = local.diloco_reference(ps.make_data(PROBLEM), PROBLEM, (1, 2), 12, 5, LR, 0.7, 0.9)
    torch.testing.assert_close(outer[0][0]["parameters"], reference)
    assert not torch.allclose(outer[0][0]["parameters"], plain[0][0]["parameters"], atol=1e-3)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_bytes_into_the_server_per_round_match_the_formula(workers):
    server = run_mode("sync", workers, gradients=6 * workers)[0]
    traffic = server["traffic"]
    assert traffic.messages_in == 6 * workers
    assert traffic.bytes_in / 6 == analysis.server_bytes_per_round(workers, PROBLEM.features)


def test_allreduce_bytes_per_rank_follow_the_ring_formula():
    for workers in (2, 4, 8):
        assert analysis.allreduce_bytes_per_rank(workers, 64) == 2 * (workers - 1) / workers * 64 * 4
    assert analysis.allreduce_bytes_per_rank(1, 64) == 0


def local_sgd_on_rank(ctx, every, steps):
    return local.local_sgd(ctx.rank + 1, ps.make_data(PROBLEM), PROBLEM, steps, every, LR)


def test_local_sgd_averaging_every_step_is_synchronous_sgd():
    results = run_ranks(local_sgd_on_rank, 2, (1, 12))
    torch.testing.assert_close(results[0]["parameters"], sgd_reference(2, 12))
    assert torch.equal(local.synchronous_sgd(ps.make_data(PROBLEM), PROBLEM, (1, 2), 12, LR), sgd_reference(2, 12))
    assert torch.equal(results[0]["parameters"], results[1]["parameters"])


@pytest.mark.parametrize("every, steps", [(4, 12), (5, 12)])
def test_local_sgd_counts_calls_and_leaves_workers_equal(every, steps):
    results = run_ranks(local_sgd_on_rank, 2, (every, steps))
    assert results[0]["calls"] == results[1]["calls"] == local.expected_calls(steps, every)
    assert results[0]["payload_bytes"] == local.expected_calls(steps, every) * PROBLEM.features * 4
    assert torch.equal(results[0]["parameters"], results[1]["parameters"])
    assert results[0]["curve"][-1][0] == steps
    reference = local.local_sgd_reference(ps.make_data(PROBLEM), PROBLEM, (1, 2), steps, every, LR)
    torch.testing.assert_close(results[0]["parameters"], reference)


def lonely_worker(ctx):
    if ctx.rank == 0:
        time.sleep(3)  # the server never answers
        return None
    start = time.perf_counter()
    with pytest.raises(RuntimeError):
        ps.receive(torch.empty(4), 0, timeout_s=1.0)
    return time.perf_counter() - start


def test_a_receive_nobody_answers_raises_within_its_timeout():
    waited = run_ranks(lonely_worker, 2)[1]
    assert waited < 2.5


def test_admission_check_and_unknown_mode():
    assert ps.within_bound(5, 3, 2) and not ps.within_bound(6, 3, 2)
    with pytest.raises(RankError, match="mode"):
        run_ranks(server_run, 2, (ps.Settings("eventual", (1,), 4, LR),))


@pytest.mark.parametrize("values", [{"backend": "nccl"}, {"bound": -1}, {"jitter": 1.0}, {"average_every": (0,)},
                                    {"gradients": 0}, {"clock_bound": -1}, {"outer_momentum": 1.0}])
def test_options_reject_bad_values(values):
    with pytest.raises(RequestError):
        Options.make(**values)


def test_lab_refuses_fewer_than_three_ranks():
    with pytest.raises(RequestError, match="nproc=3"):
        parameter_server_lab(SimpleNamespace(world_size=2), None, Options.make())
