"""The launcher: results come back, failures name their rank fast, timeouts and interrupts leave nothing."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from labsrc import launch
from labsrc.core.world import RequestError

pytestmark = pytest.mark.slow


@pytest.fixture
def runs(tmp_path, monkeypatch):
    monkeypatch.setenv("LABSRC_RUNS", str(tmp_path))
    return tmp_path


def test_failing_rank_is_named_with_its_traceback_quickly(runs):
    start = time.perf_counter()
    with pytest.raises(launch.RankFailed) as caught:
        launch.run("setup", nproc=2, args=["--hold-s", "60", "--fail-rank", "1",
                                                     "--fail-after-s", "1"], timeout=90, echo=False)
    elapsed = time.perf_counter() - start
    assert caught.value.rank == 1
    assert "PlantedCrash" in caught.value.remote_traceback
    assert "rank 1" in str(caught.value)
    assert elapsed < 30, f"a crashed rank took {elapsed:.1f} s to be reported"
    assert launch.processes_of_run(caught.value.result.run_dir.name, None) == []


def test_timeout_ends_every_process(runs):
    with pytest.raises(launch.LaunchTimeout) as caught:
        launch.run("setup", nproc=2, args=["--hold-s", "60"], timeout=10, echo=False)
    result = caught.value.result
    assert launch.processes_of_run(result.run_dir.name, None) == []
    steps = [r["step"] for r in result.of_kind("progress")]
    assert steps, "the records written before the timeout were lost"


def test_sigint_to_the_shell_launcher_leaves_no_process(runs):
    command = [sys.executable, "-m", "labsrc.launch", "--nproc", "2", "--timeout", "120",
               "setup", "--", "--hold-s", "60"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    run_dir = None
    while time.time() < deadline:
        found = list(Path(runs).glob("setup/*/rank1.jsonl"))
        if found and "progress" in found[0].read_text():
            run_dir = found[0].parent
            break
        time.sleep(0.2)
    assert run_dir is not None, "the run never started"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=15) == 130
    time.sleep(0.5)
    assert launch.processes_of_run(run_dir.name, None) == []


def test_two_launches_at_once_do_not_clash_and_both_return_their_records(runs):
    results, errors = [], []

    def one():
        try:
            results.append(launch.run("setup", nproc=2, timeout=120, echo=False))
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert [r.summary["sum"] for r in results] == [1, 1]
    assert results[0].run_dir != results[1].run_dir
    for result in results:
        assert result.ok and sorted(result.records) == [0, 1]
        assert [r["received"] for r in result.of_kind("allreduce")] == [1, 1]
        assert result.run_dir.parent.parent == runs


def test_busy_port_is_refused_before_anything_starts(runs):
    import socket
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(RequestError, match=f"port {port}.*in use"):
            launch.run("setup", nproc=2, port=port)
    assert not any(Path(runs).glob("*/*")), "a run directory was made for a refused launch"


@pytest.mark.parametrize("nproc, backend, message", [
    (0, None, "nproc must be"),
    (2, "nccl", "NCCL needs"),
    (64, None, "CPU ranks"),
])
def test_impossible_requests_fail_with_advice(runs, nproc, backend, message):
    with pytest.raises(RequestError, match=message):
        launch.run("setup", nproc=nproc, backend=backend)
