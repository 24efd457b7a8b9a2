"""Notebook 12's cases: each planted bug fails as described within its timeout, each fix works (forked ranks, no torchrun)."""
import pytest

from labsrc.core.world import RequestError
from labsrc.lessons.debugging_clinic import (collective_bugs as clinic, launch_bugs as launching,
                                             training_bugs as training)
from labsrc.lessons.debugging_clinic.lab import Options


def test_detail_names_a_shape_mismatch_at_once_and_the_fix_passes():
    broken = clinic.run_case(clinic.mismatched_shape, "broken", debug="DETAIL", timeout_s=3.0)
    assert [o.exception for o in broken] == ["RuntimeError", "RuntimeError"]
    assert all(o.seconds < 3.0 and "TensorShape=[5]" in o.text for o in broken)
    assert {o.debug for o in broken} == {"DETAIL"}, "each rank records the level its group was built at"
    assert all(o.ok for o in clinic.run_case(clinic.mismatched_shape, "fixed", debug="DETAIL", timeout_s=3.0))


def test_monitored_barrier_names_the_missing_rank():
    rank0, rank1 = clinic.run_case(clinic.rank0_only_barrier, "broken", timeout_s=2.0)
    assert not rank0.ok and rank1.ok and "Ranks 1 failed to pass monitoredBarrier" in rank0.message


def in_fresh_interpreter(code: str):
    """Run code in a new Python and return what it prints as JSON: the flight recorder's buffer and OpenMP's
    thread pool are set once per process, so a test after others in this pytest process would inherit them."""
    import json
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_flight_recorder_finds_the_skipped_collective_and_torchfrtrace_refuses_gloo_dumps(tmp_path):
    """The notebook says torchfrtrace (torch 2.14.1) stops with a KeyError on gloo's dumps: when a torch reads
    them, this fails, and the notebook's flight-recorder section can use it instead of first_divergence."""
    import subprocess
    import sys
    divergence = in_fresh_interpreter(
        "import json\n"
        "from labsrc.lessons.debugging_clinic import collective_bugs as clinic\n"
        "from torch._C._distributed_c10d import _dump_fr_trace\n"
        "def dumped(ctx, variant, timeout_s):\n"
        "    outcome = clinic.skipped_collective(ctx, variant, timeout_s)\n"
        f"    open(f'{tmp_path}/trace_{{ctx.rank}}', 'wb').write(_dump_fr_trace())\n"
        "    return outcome\n"
        "outcomes = clinic.run_case(dumped, 'broken', timeout_s=2.0, flight_recorder=True)\n"
        "print(json.dumps(clinic.first_divergence([o.detail['flight_record'] for o in outcomes])))\n")
    assert divergence["entered"] == [0] and divergence["missing"] == [1] and divergence["sizes"] == [[4]]
    frtrace = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path),
                              "--prefix", "trace_"], capture_output=True, text=True, timeout=120)
    assert frtrace.returncode != 0 and "KeyError" in frtrace.stderr, frtrace.stdout[-2000:] + frtrace.stderr[-2000:]


def test_first_divergence_of_equal_records_is_none():
    record = [{"seq": 1, "op": "gloo:all_reduce", "pg_id": 2, "sizes": [[4]], "state": "completed", "timeout_ms": 1}]
    assert clinic.first_divergence([record, record]) is None


def test_first_divergence_is_the_earliest_missed_collective_not_the_last_entry():
    """NCCL-shaped records: rank 0 enqueued seq 3 and 4 after the seq 2 rank 1 skipped."""
    entry = {"op": "gloo:all_reduce", "pg_id": 2, "sizes": [[4]], "state": "scheduled", "timeout_ms": 1}
    rank0 = [dict(entry, seq=seq) for seq in range(5)]
    rank1 = [dict(entry, seq=seq) for seq in range(2)]
    assert clinic.first_divergence([rank0, rank1]) == {"op": "gloo:all_reduce", "seq": 2, "sizes": [[4]],
                                                      "entered": [0], "missing": [1]}


def test_ddp_unused_parameter_fails_and_static_graph_fixes_it():
    broken = clinic.run_case(training.ddp_case, "broken", debug="INFO", timeout_s=5.0)
    assert all("aux.bias, aux.weight" in o.text for o in broken)
    assert all(o.ok for o in clinic.run_case(training.ddp_case, "static_graph", debug="INFO", timeout_s=5.0))


def test_set_epoch_changes_the_order():
    assert training.distinct_orders(training.epoch_orders(32, 3, call_set_epoch=False)) == 1
    assert training.distinct_orders(training.epoch_orders(32, 3, call_set_epoch=True)) == 3


def test_environment_is_restored(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "OFF")
    with clinic.environment(TORCH_DISTRIBUTED_DEBUG="DETAIL", TORCH_FR_BUFFER_SIZE=None):
        import os
        assert os.environ["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    assert os.environ["TORCH_DISTRIBUTED_DEBUG"] == "OFF"


def test_shared_devices_flags_two_ranks_on_one_gpu_uuid():
    reports = [{"rank": 0, "host": "a", "device": "GPU-1"}, {"rank": 1, "host": "a", "device": "GPU-1"},
               {"rank": 2, "host": "b", "device": "GPU-1"}, {"rank": 3, "host": "a", "device": "cpu"}]
    assert launching.shared_devices(reports) == {"a/GPU-1": [0, 1]}


def test_rank_fates_reads_a_vanished_rank(tmp_path):
    from labsrc.core import runs
    for rank in (0, 1):
        runs.note_attempt(tmp_path, rank=rank)
    runs.write_error(tmp_path, 0, RuntimeError("Connection closed by peer"), "tb")
    assert launching.rank_fates(tmp_path) == {0: "raised RuntimeError", 1: "vanished"}


def test_lab_options_refuse_an_unknown_case():
    with pytest.raises(RequestError, match="case 'crash' is unknown"):
        Options.make(case="crash")


def test_matmul_arms_run_with_the_threads_they_ask_for_and_restore_the_count():
    import torch
    measured = in_fresh_interpreter(
        "import json\n"
        "from labsrc.lessons.debugging_clinic import training_bugs as training\n"
        "from labsrc.core.forked import run_ranks\n"
        "print(json.dumps({t: [r['threads'] for r in run_ranks(training.matmul_seconds, 2, args=(t, 64, 2),\n"
        "                                                          timeout_s=60)] for t in (1, 2)}))\n")
    assert measured == {"1": [1, 1], "2": [2, 2]}
    before = torch.get_num_threads()
    assert training.matmul_seconds(None, 1, 32, 1)["threads"] == 1 and torch.get_num_threads() == before


def test_device_report_of_ranks_on_their_own_devices_shares_nothing():
    from labsrc.core.forked import run_ranks
    reports = run_ranks(launching.device_report, 2, timeout_s=30)[0]["reports"]
    assert [report["rank"] for report in reports] == [0, 1] and launching.shared_devices(reports) == {}
