"""Notebook 12's cases without a safety net: the no-debug behaviour, a hung rank's stack, torchrun's error file,
static_graph on a changing used set (forked ranks; no torchrun)."""
import json
import multiprocessing
import os
import socket

from labsrc.lessons.debugging_clinic import collective_bugs as clinic, hangs as clinic_hang, training_bugs as training


def test_without_a_debug_mode_shape_aborts_rank0_and_order_waits_the_full_timeout():
    shape = clinic_hang.run_unguarded(clinic.mismatched_shape, "broken", timeout_s=2.0)
    assert shape[0].signal_name == "SIGABRT" and shape[0].outcome is None, shape
    assert shape[1].outcome is not None and not shape[1].outcome.ok, shape
    order = clinic_hang.run_unguarded(clinic.mismatched_order, "broken", timeout_s=2.0)
    assert all(end.exitcode == 0 and end.outcome and not end.outcome.ok for end in order), order
    assert min(end.outcome.seconds for end in order) >= 1.8, "nothing names the bug before the timeout"


def test_unguarded_fixed_case_finishes_on_every_rank():
    ends = clinic_hang.run_unguarded(clinic.mismatched_order, "fixed", timeout_s=2.0)
    assert [(end.exitcode, end.outcome.ok) for end in ends] == [(0, True), (0, True)]


def test_py_spy_and_faulthandler_name_the_blocking_call_and_its_caller():
    seen = clinic_hang.inspect_hang(hang_s=6.0)
    assert seen["py_spy_error"] == "", seen["py_spy_error"]
    assert seen["armed"] == [0], "only the waiting rank armed faulthandler and named its pid"
    frames = [line.split()[0] for line in seen["py_spy"].splitlines() if line.startswith("    ")]
    assert frames[0] == "all_reduce" and "log_metric" in frames[:4], frames
    files = [line.strip() for line in seen["faulthandler"].splitlines() if line.strip().startswith("File")]
    assert files[0].endswith("in all_reduce") and any(line.endswith("in log_metric") for line in files[:4]), files


def _recorded_rank(rank: int, port: int, folder: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_ERROR_FILE=os.path.join(folder, f"error{rank}.json"))
    from labsrc.lessons.debugging_clinic.cases import recorded_failure
    recorded_failure.main(["--fail-rank", "1", "--timeout-s", "5"])


def test_record_writes_the_raising_ranks_traceback_to_torchruns_error_file(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_recorded_rank, args=(rank, port, str(tmp_path))) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join()
    assert ranks[1].exitcode == 1, "the planted exception leaves main (record raises it again)"
    written = json.loads((tmp_path / "error1.json").read_text())["message"]
    assert written["message"].startswith("ValueError: planted: rank 1"), written
    assert "in load_batch" in written["extraInfo"]["py_callstack"], written


def test_failures_reads_every_block_of_torchruns_report():
    report = ("Failures:\n[1]:\n  time      : 2026-11-26_03:34:31\n  host      : h\n  rank      : 1 (local_rank: 1)\n"
              "  exitcode  : -15 (pid: 8)  (SIGTERM)\n  error_file: /t/1/error.json\n  traceback : Traceback\n"
              "  ValueError: planted\n------------------------------\nRoot Cause (first observed failure):\n[0]:\n"
              "  time      : 2026-11-26_03:34:31\n  host      : h\n  rank      : 0 (local_rank: 0)\n"
              "  exitcode  : 1 (pid: 7)\n  error_file: /t/0/error.json\n  traceback : RuntimeError: Connection closed\n"
              "==============================\n")
    found = clinic_hang.failures(report)
    assert [(f["rank"], f["root"]) for f in found] == [(1, False), (0, True)]
    assert "ValueError: planted" in found[0]["traceback"] and "Connection" not in found[0]["traceback"]
    assert clinic_hang.root_cause(report)["exitcode"].startswith("1 ") and clinic_hang.root_cause(report)["rank"] == 0
    assert clinic_hang.root_cause("no report") == {}


def test_static_graph_refuses_a_parameter_used_on_some_steps_and_find_unused_trains():
    static = clinic.run_case(training.alternating_case, "static_graph", debug="INFO", timeout_s=5.0)
    assert all(not o.ok and "Your training graph has changed" in o.message and o.detail["steps_done"] == 1
               for o in static), static
    walked = clinic.run_case(training.alternating_case, "find_unused", debug="INFO", timeout_s=5.0)
    grads = [o.detail["aux_grads"] for o in walked]
    assert all(o.ok for o in walked) and grads[0] == grads[1] and grads[0][0] is None and grads[0][1] is not None
