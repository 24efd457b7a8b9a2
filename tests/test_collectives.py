"""Ring and naive all-reduce equal dist.all_reduce on 2-4 ranks; the ring sends 2(n-1)/n of the data; a broken ring fails."""
import math
import time

import pytest
import torch

from labsrc.core import runs
from labsrc.core.forked import RankError, run_ranks
from labsrc.core.world import RequestError
from labsrc.lessons.collectives import checks, rank_by_rank
from labsrc.lessons.collectives import lab as collectives_lab
from labsrc.techniques import alpha_beta, collectives


def _sizes(world_size):
    """Sizes n divides and sizes it does not, including fewer elements than ranks."""
    return sorted({1, world_size - 1 or 1, world_size + 1, 100 * world_size, 100 * world_size + 1, 257})


def _check(ctx, sizes):
    return checks.check_algorithms(ctx, sizes)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_hand_written_all_reduces_equal_dist_all_reduce(world_size):
    sizes = _sizes(world_size)
    for rows in run_ranks(_check, world_size, args=(sizes,)):
        assert {(r["algorithm"], r["size"]) for r in rows} == {(a, s) for a in collectives.ALGORITHMS for s in sizes}
        assert max(r["max_error"] for r in rows) == 0.0


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bytes_sent_match_the_formulas_exactly(world_size):
    sizes = _sizes(world_size)
    per_rank = run_ranks(_check, world_size, args=(sizes,))
    for size in sizes:
        ring = [next(r for r in rows if (r["algorithm"], r["size"]) == ("ring", size)) for rows in per_rank]
        naive = [next(r for r in rows if (r["algorithm"], r["size"]) == ("naive", size)) for rows in per_rank]
        assert [r["bytes_sent"] for r in ring] == [r["bytes_formula"] for r in ring]
        assert [r["bytes_sent"] for r in naive] == [r["bytes_formula"] for r in naive]
        # All ranks together send 2(n-1) N bytes, whatever the size: 2(n-1)/n of the data per rank on average.
        assert sum(r["bytes_sent"] for r in ring) == 2 * (world_size - 1) * 4 * size
        if size % world_size == 0:
            assert all(r["bytes_sent"] * world_size == 2 * (world_size - 1) * 4 * size for r in ring)
        assert naive[0]["bytes_sent"] == (world_size - 1) * 4 * size
        assert all(r["bytes_sent"] == 4 * size for r in naive[1:])
        if size % world_size == 0:  # busbw x time is the traffic on each link: what every ring rank sent
            seconds = 1e-3
            assert all(alpha_beta.busbw("all_reduce", 4 * size, seconds, world_size) * seconds
                       == pytest.approx(r["bytes_sent"], rel=1e-12) for r in ring)


def test_chunk_sizes_cover_the_tensor_like_tensor_split():
    for size, world_size in [(1, 4), (5, 3), (9, 4), (12, 4), (4099, 3)]:
        pieces = torch.tensor_split(torch.empty(size), world_size)
        assert collectives.chunk_sizes(size, world_size) == [p.numel() for p in pieces]
    assert collectives.ring_bytes_sent(12, 0, 4) == 2 * 3 * 12 // 4 * 4
    assert collectives.ring_bytes_sent(100, 0, 1) == 0


def _tables(ctx):
    return rank_by_rank.collective_tables(ctx)


@pytest.mark.parametrize("world_size", [2, 3])
def test_collective_tables_show_what_each_rank_holds(world_size):
    n = world_size
    for rank, rows in enumerate(run_ranks(_tables, n)):
        after = {row["collective"]: row["after"] for row in rows}
        before = {row["collective"]: row["before"] for row in rows}
        assert after["send_recv"] == ([42.0] if rank == 1 else before["send_recv"])
        assert after["broadcast"] == [0.0]
        assert after["all_reduce"] == [n * (n + 1) / 2]
        assert after["reduce_scatter"] == [float(sum(rank + 10 * other for other in range(n)))]
        assert after["all_gather"] == [float(r) for r in range(n)]
        ran_as = {row["collective"]: row["ran_as"] for row in rows}
        assert ran_as["reduce_scatter"] == "reduce_scatter", "gloo in torch 2.11-2.14 has its own reduce_scatter"
        assert all(ran_as[key] == key for key in after)
        assert all(row["label"] for row in rows), "every row needs a label for the table"


def _talk_to_itself(rank, n):
    return rank, rank


def _receive_from_the_right(rank, n):
    return (rank + 1) % n, (rank + 1) % n


def _reversed_ring(rank, n):
    return (rank + 1) % n, (rank - 1) % n


def test_a_ring_that_talks_to_itself_raises():
    with pytest.raises(RankError):
        run_ranks(checks.broken_ring_error, 2, args=(_talk_to_itself, 8, 5.0), timeout_s=30)


def test_a_ring_whose_messages_never_arrive_raises_within_its_timeout():
    start = time.perf_counter()
    with pytest.raises(RankError, match="[Tt]imed out|Connection closed"):
        run_ranks(checks.broken_ring_error, 3, args=(_receive_from_the_right, 9, 2.0), timeout_s=30)
    assert time.perf_counter() - start < 25, "the broken ring should fail at its 2 s timeout, not hang"


def test_a_ring_turned_backwards_gives_a_wrong_sum():
    errors = run_ranks(checks.broken_ring_error, 3, args=(_reversed_ring, 9, 5.0), timeout_s=30)
    assert max(errors) > 0, "chunks sent the wrong way round must not add up to dist.all_reduce"


def _lab_body(ctx, run_dir):
    records = runs.RecordWriter(run_dir, ctx.rank)
    try:
        options = collectives_lab.Options.make(profile="ci", sizes=(64, 4096, 65536), repeats=3)
        return collectives_lab.collectives_lab(ctx, records, options)
    finally:
        records.close()


def test_lab_records_every_measurement_and_summarises_the_fits(tmp_path):
    summary, _ = run_ranks(_lab_body, 2, args=(tmp_path,))
    assert set(summary["fits"]) == set(summary["fits_median"]) == set(collectives.ALGORITHMS)
    for fit in [*summary["fits"].values(), *summary["fits_median"].values()]:
        assert set(fit) == {"alpha_s", "beta_s_per_byte", "r2"}
        assert all(math.isfinite(fit[key]) for key in ("alpha_s", "beta_s_per_byte"))  # sign: timing, not behaviour
    records = runs.read_records(tmp_path)
    assert summary["sizes"] == [64, 4096, 65536] and summary["repeats"] == 3
    timings = [r for r in records[0] if r["kind"] == collectives_lab.Timing.KIND]
    assert {(r["algorithm"], r["size"]) for r in timings} == {
        (a, s) for a in collectives.ALGORITHMS for s in (64, 4096, 65536)}
    for record in timings:
        assert len(record["repeats_s"]) == 3 and record["calls_per_repeat"] >= 1
        assert record["seconds"] == min(record["repeats_s"]) and record["median_s"] == sorted(record["repeats_s"])[1]
        per_link = collectives.ring_bytes_sent(record["size"], 0, 2) / record["seconds"]  # the sizes: even
        assert record["busbw"] == pytest.approx(per_link, rel=1e-12), "busbw: the bytes a ring rank sends / time"
    assert [r["repeats_s"] for r in timings] == [r["repeats_s"] for r in records[1] if r["kind"] == "timing"]
    assert any(r["kind"] == "check" for r in records[1]) and any(r["kind"] == "table" for r in records[1])


def _check_with_a_wrong_neighbour(ctx, sizes, timeout_s):
    """Patched inside each rank, so forked and fresh ranks alike run the mistake."""
    collectives.neighbours = _receive_from_the_right
    return checks.check_algorithms(ctx, sizes, timeout_s)


def test_a_wrong_default_neighbour_fails_the_check_within_its_timeout():
    """The notebook's acceptance: a mistake in `neighbours` itself fails check_algorithms on 3 ranks, fast."""
    start = time.perf_counter()
    with pytest.raises(RankError, match="[Tt]imed out|Connection closed"):
        run_ranks(_check_with_a_wrong_neighbour, 3, args=([9], 2.0), timeout_s=30)
    assert time.perf_counter() - start < 25, "a wrong neighbour should fail at the 2 s timeout, not hang"


def test_gloo_collectives_use_host_tensors_and_nccl_the_rank_gpu():
    from labsrc.core.world import RankContext
    gloo_on_gpu = RankContext(0, 0, 2, torch.device("cuda", 0), "gloo")
    nccl = RankContext(1, 1, 2, torch.device("cuda", 1), "nccl")
    assert collectives.tensor_device(gloo_on_gpu) == torch.device("cpu")
    assert collectives.tensor_device(nccl) == torch.device("cuda", 1)


def test_options_refuse_what_cannot_be_measured_or_fitted():
    with pytest.raises(RequestError, match="at least two different message sizes"):
        collectives_lab.Options.make(sizes=(256, 256))
    with pytest.raises(RequestError, match="sizes must be more than 0"):
        collectives_lab.Options.make(sizes="0 256")
    with pytest.raises(RequestError, match="repeats must be 0 or more"):
        collectives_lab.Options.make(repeats=-1)
    assert collectives_lab.Options.make(sizes="256,65536").to_argv() == ["--sizes", "256", "65536"]
    assert collectives_lab.Options().pg_timeout_s == 30.0, "a broken ring must fail within 30 s"


def test_fit_sweep_recovers_alpha_and_beta_of_each_algorithm():
    timings = {(name, size): {"seconds": [alpha + 4 * size * beta, 2 * (alpha + 4 * size * beta)]}
               for name, alpha, beta in [("slow", 1e-4, 1e-9), ("fast", 1e-5, 1e-10)]
               for size in (256, 4096, 65536)}
    fits = alpha_beta.fit_sweep(timings, min)
    assert fits["slow"].alpha_s == pytest.approx(1e-4) and fits["slow"].beta_s_per_byte == pytest.approx(1e-9)
    assert fits["fast"].alpha_s == pytest.approx(1e-5) and fits["fast"].r2 == pytest.approx(1.0)
    assert alpha_beta.fit_sweep(timings, max)["slow"].alpha_s == pytest.approx(2e-4)


def test_ring_link_inverts_the_ring_formula_at_the_measured_world_size():
    whole = alpha_beta.AlphaBeta(alpha_s=3e-4, beta_s_per_byte=2e-9, r2=1.0)
    for n in (2, 3, 8):
        link = alpha_beta.ring_link(whole, n)
        for nbytes in (4.0, 4e6):
            assert alpha_beta.ring_allreduce_time_s(nbytes, n, link) == pytest.approx(whole.time_s(nbytes))
    assert alpha_beta.ring_link(whole, 2).alpha_s == pytest.approx(1.5e-4)  # 2(n-1) = 2 messages at n=2


def test_fit_keeps_a_negative_slope_instead_of_clamping_it():
    shrinking = alpha_beta.fit([1e3, 1e6, 1e7], [3e-3, 2e-3, 1e-3])
    assert shrinking.beta_s_per_byte < 0
