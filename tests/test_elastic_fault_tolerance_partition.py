"""Lesson 10b's partition: the timeouts read from the launcher's rendezvous settings, the timeline from records."""
import json
from types import SimpleNamespace

import pytest

from labsrc.launch import ELASTIC_RDZV_CONF
from labsrc.lessons.elastic_fault_tolerance.membership_partition import (Partition, partition_timeline,
                                                                         rendezvous_timeouts)


def test_the_keep_alive_and_last_call_are_the_ones_the_launcher_gives_torchrun():
    found = rendezvous_timeouts("last_call_timeout=30,join_timeout=600,keep_alive_interval=5,keep_alive_max_attempt=3")
    assert (found.keep_alive_interval_s, found.keep_alive_max_attempt, found.last_call_s) == (5.0, 3, 30.0)
    assert found.expiry_s == 15.0
    ours = rendezvous_timeouts()
    assert f"keep_alive_interval={ours.keep_alive_interval_s:g}" in ELASTIC_RDZV_CONF
    assert f"last_call_timeout={ours.last_call_s:g}" in ELASTIC_RDZV_CONF


def write_run(run_dir, cut: float, errors: list[tuple[int, float, int]]):
    """A two-node run cut at `cut`: errors [(rank, time, attempt)], a restart at world 1 at cut+9, steps."""
    for rank, when, attempt in errors:
        (run_dir / f"rank{rank}.error.json").write_text(json.dumps(
            {"rank": rank, "type": "RuntimeError", "message": "Timed out waiting 3000ms for recv", "time": when,
             "attempt": attempt}))
    starts = [(0, 0, 2, cut - 10), (0, 1, 2, cut - 10), (1, 0, 1, cut + 9)]
    (run_dir / "attempts.jsonl").write_text("".join(
        json.dumps({"time": t, "attempt": a, "rank": r, "world_size": w}) + "\n" for a, r, w, t in starts))
    steps = [(2, cut - 1, 0), (3, cut + 12, 1), (4, cut + 13, 1)]
    (run_dir / "rank0.jsonl").write_text("".join(json.dumps(
        {"kind": "train_step", "run": "resumable", "step": s, "world_size": w, "wall": t, "attempt": a, "rank": 0})
        + "\n" for s, t, a in steps for w in [2 if a == 0 else 1]))


def test_the_timeline_counts_from_the_cut_to_the_first_timeout_the_restart_and_the_first_step(tmp_path):
    cut = 1000.0
    write_run(tmp_path, cut, [(0, cut + 3.4, 0), (1, cut + 3.1, 0)])
    partition = Partition("cut link", "", 1, cut, 20.0, True)
    timeline = partition_timeline(SimpleNamespace(run_dir=tmp_path), partition)
    assert timeline.noticed_s == pytest.approx(3.1) and "Timed out" in timeline.error
    assert timeline.reformed_s == pytest.approx(9.0) and timeline.first_step_s == pytest.approx(12.0)
    assert timeline.world_sizes == [2, 1]


def test_a_partition_nobody_noticed_is_said_so(tmp_path):
    write_run(tmp_path, 1000.0, [(0, 1020.0, 1)])  # only a later attempt's error: the first attempt saw nothing
    with pytest.raises(ValueError, match="nobody noticed"):
        partition_timeline(SimpleNamespace(run_dir=tmp_path), Partition("cut link", "", 1, 1000.0, 20.0, True))
