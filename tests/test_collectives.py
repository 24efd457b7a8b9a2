"""Ring and naive all-reduce equal dist.all_reduce on 2-4 ranks; the ring sends 2(n-1)/n of the data."""
import pytest
import torch
import torch.distributed as dist

from labsrc import collectives
from labsrc.testing import run_ranks


def _check(ctx, sizes):
    return collectives.check_algorithms(ctx, sizes)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_hand_written_all_reduces_equal_dist_all_reduce(world_size):
    sizes = [1, world_size - 1 or 1, world_size + 1, 100 * world_size, 100 * world_size + 1]
    for rows in run_ranks(_check, world_size, args=(sizes,)):
        assert {r["algorithm"] for r in rows} == set(collectives.ALGORITHMS)
        assert max(r["max_error"] for r in rows) == 0.0


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_sends_two_n_minus_one_over_n_of_the_data(world_size):
    size = 1000 * world_size
    for rank, rows in enumerate(run_ranks(_check, world_size, args=([size],))):
        ring = next(r for r in rows if r["algorithm"].startswith("ring"))
        naive = next(r for r in rows if r["algorithm"].startswith("naive"))
        assert ring["bytes_sent"] == 2 * (world_size - 1) * (4 * size) // world_size
        assert naive["bytes_sent"] == (world_size - 1) * 4 * size if rank == 0 else 4 * size


def _tables(ctx):
    return collectives.collective_tables(ctx)


def test_collective_tables_show_what_each_rank_holds():
    rank0, rank1 = run_ranks(_tables, 2)
    after = {row["collective"].split(" (")[0]: row["after"] for row in rank1}
    assert after["send/recv"] == [42.0]
    assert after["broadcast from rank 0"] == [0.0]
    assert after["all_reduce"] == [3.0]
    assert after["reduce_scatter"] == [1.0 + 11.0]
    assert after["all_gather"] == [0.0, 1.0]


def _wrong_neighbour(ctx):
    original = collectives.neighbours
    collectives.neighbours = lambda rank, n: (rank, rank)  # a broken ring: everyone talks to itself
    try:
        tensor = torch.ones(8)
        collectives.ring_all_reduce(tensor, ctx.rank, ctx.world_size)
    finally:
        collectives.neighbours = original
    return tensor.tolist()


def test_a_broken_ring_fails_instead_of_hanging():
    from labsrc.testing import RankError
    with pytest.raises(RankError):
        run_ranks(_wrong_neighbour, 2, timeout_s=30)
