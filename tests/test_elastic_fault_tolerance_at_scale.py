"""Lesson 10, section 3: a loader that resumes mid-epoch, a fallback snapshot, the checkpoint interval, DCP's async save."""
import math

import pytest
import torch

from labsrc.core.forked import run_ranks
from labsrc.lessons.elastic_fault_tolerance import at_scale as scale, loader
from labsrc.lessons.elastic_fault_tolerance.snapshot import load_latest, save_keeping, snapshots


@pytest.mark.parametrize("stop_after", [1, 3, 5])
def test_a_distributed_sampler_replays_what_a_stateful_loader_carries_on_from(tmp_path, stop_after):
    plain = loader.distributed_sampler_resume(stop_after=stop_after, rank=1)
    assert plain.replayed == stop_after * loader.BATCH and plain.lost == 0
    stateful = loader.stateful_loader_resume(tmp_path, stop_after=stop_after, rank=1)
    assert (stateful.replayed, stateful.lost) == (0, 0)
    assert sorted(stateful.before + stateful.after) == sorted(stateful.shard)


def test_a_refused_newest_snapshot_falls_back_to_the_one_before(tmp_path):
    for step in (2, 4, 6, 8):
        save_keeping({"step": step, "weights": torch.full((64,), float(step))}, tmp_path, step, keep=2)
    (tmp_path / "snapshot-00000010.pt.tmp").write_bytes(b"torn")  # a crash's leftover is never a snapshot
    assert [p.name for p in snapshots(tmp_path)] == ["snapshot-00000008.pt", "snapshot-00000006.pt"]
    newest = snapshots(tmp_path)[0]
    newest.write_bytes(newest.read_bytes()[:100])
    state, used, refused = load_latest(tmp_path)
    assert state["step"] == 6 and used.name == "snapshot-00000006.pt" and "cut short" in refused[0]
    snapshots(tmp_path)[1].write_bytes(b"x")
    assert load_latest(tmp_path)[0] is None and len(load_latest(tmp_path)[2]) == 2


def test_young_daly_interval_minimises_the_first_order_waste():
    cost, mtbf = 30.0, 3 * 3600.0
    best = scale.young_daly_interval(cost, mtbf)
    assert best == pytest.approx(math.sqrt(2 * cost * mtbf))
    grid = [best * f for f in (0.5, 0.8, 0.95, 1.05, 1.25, 2.0)]
    assert all(scale.waste_fraction(best, cost, mtbf) < scale.waste_fraction(tau, cost, mtbf) for tau in grid)
    with pytest.raises(ValueError):
        scale.young_daly_interval(0, mtbf)


def test_dcp_async_save_stages_a_copy_and_commits_metadata_last(tmp_path):
    ranks = run_ranks(scale.async_save_demo, 2, args=(str(tmp_path / "dcp"), 200_000))
    for result in ranks:
        assert result["loaded_is_at_call"] and result["step"] == 7
        assert result["files"][".metadata"] >= max(result["files"].values())  # written last (ties: one clock tick)
