"""The launcher: scripts, modules and labs; restarts and simulated nodes; readable failures; nothing left behind."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from labsrc import launch
from labsrc.core.world import RequestError
from labsrc.launch.cli import main as launch_main
from labsrc.launch.request import course_labs
from labsrc.launch.result import timeout_advice

pytestmark = pytest.mark.slow


@pytest.fixture
def runs(tmp_path, monkeypatch):
    monkeypatch.setenv("LABSRC_RUNS", str(tmp_path / "runs"))
    return tmp_path / "runs"


def wait_for_progress(runs_dir: Path, lab: str, ranks: int, deadline_s: float = 60) -> Path | None:
    """The run directory once every rank has written a progress record, else None."""
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        for run_dir in runs_dir.glob(f"{lab}/*"):
            files = [run_dir / f"rank{r}.jsonl" for r in range(ranks)]
            if all(f.exists() and '"progress"' in f.read_text() for f in files):
                return run_dir
        time.sleep(0.2)
    return None


def test_a_plain_script_launches_by_path_and_its_output_and_status_come_back(runs, tmp_path):
    script = tmp_path / "my_ddp.py"
    script.write_text(textwrap.dedent("""\
        import os, sys
        print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "args", sys.argv[1:])
        print("half a line", end="")
        print(" then the rest")
        sys.exit(3 if "--exit-3" in sys.argv else 0)
    """))
    result = launch.run(str(script), nproc=2, args=["--lr", "0.1"], timeout=120, echo=False)
    assert result.ok and result.lab == "my_ddp" and result.wall_time_s > 0
    for rank in (0, 1):
        assert f"[rank{rank}] rank {rank} of 2 args ['--lr', '0.1']" in result.output
        assert f"[rank{rank}] half a line then the rest" in result.output
    assert len(result.output) == 4, result.output
    failed = launch.run(str(script), nproc=1, args=["--exit-3"], timeout=120, echo=False, check=False)
    assert failed.returncode == 3 and not failed.ok


def test_a_name_that_is_nothing_fails_before_torchrun_listing_the_labs(runs):
    with pytest.raises(RequestError) as caught:
        launch.run("stup", nproc=2)
    for lab in ("setup", "dp_vs_ddp", "collectives"):
        assert lab in str(caught.value) and lab in course_labs()
    with pytest.raises(RequestError, match="no script at"):
        launch.run("missing/my_ddp.py", nproc=2)
    with pytest.raises(RequestError, match="course labs only"):
        launch.run("json.tool", nproc=1, hold_s=1)
    assert not runs.exists() or not any(runs.glob("*/*")), "a run directory was made for a refused launch"


def test_a_restart_finishes_on_the_second_attempt_keeping_both_attempts_records(runs):
    result = launch.run("setup", nproc=2, timeout=150, max_restarts=1, fail_rank=1, fail_attempts=1,
                        echo=False)
    assert result.ok and result.attempts == 2
    assert sorted(result.records_by_attempt) == [0, 1]
    assert {r["attempt"] for r in result.of_kind("allreduce")} == {1}
    first = result.of_kind("allreduce", attempt=0)
    assert [r["received"] for r in first] == [3, 3], "attempt 0's records were lost"
    assert result.summary["sum"] == 3  # 1 + 2: each rank puts in rank + 1


def test_two_nodes_on_one_machine_complete_and_name_both_node_ranks(runs):
    result = launch.run("setup", nproc=1, nnodes=2, timeout=150, echo=False)
    contexts = result.of_kind("context")
    assert sorted(c["node_rank"] for c in contexts) == [0, 1]
    assert {c["world_size"] for c in contexts} == {2}
    assert result.summary["sum"] == 3  # 1 + 2: each rank puts in rank + 1
    assert any(line.startswith("[node1 rank1]") for line in result.output), result.output


def test_losing_a_node_of_an_elastic_run_re_forms_or_ends_leaving_nothing(runs):
    started = launch.start("setup", nproc=1, nnodes="1:2", max_restarts=1, hold_s=8, timeout=150,
                           echo=False, check=False)
    run_dir = wait_for_progress(runs, "setup", ranks=2)
    assert run_dir == started.run_dir, "the two nodes never formed one run"
    started.end_node(1)
    result = started.wait()
    assert launch.processes_of_run(result.run_dir.name, None) == []
    if result.ok:  # re-formed: a later attempt finished on the node left
        assert result.attempts >= 2
        assert {c["world_size"] for c in result.of_kind("context")} == {1}
    else:
        assert result.returncode != 0


def test_a_failing_rank_shows_one_traceback_then_the_log_path(runs, capfd):
    start = time.perf_counter()
    with pytest.raises(launch.RankFailed) as caught:
        launch.run("setup", nproc=2, timeout=90, hold_s=60, fail_rank=1, fail_after_s=1)
    elapsed = time.perf_counter() - start
    shown = capfd.readouterr()
    seen = shown.out + shown.err + str(caught.value)
    failure = caught.value
    assert failure.rank == 1 and "PlantedCrash" in failure.remote_traceback
    assert str(failure).startswith("rank 1 of setup failed")
    assert seen.count("Traceback (most recent call last)") == 1, seen
    log_path = failure.result.run_dir / "launcher.log"
    assert str(failure).rstrip().splitlines()[-1].endswith(str(log_path))
    assert "ChildFailedError" not in seen and "[rank0] contributed 1" in shown.out
    assert "ChildFailedError" in log_path.read_text(), "torchrun's report is missing from launcher.log"
    assert elapsed < 45, f"a crashed rank took {elapsed:.1f} s to be reported"
    assert launch.processes_of_run(failure.result.run_dir.name, None) == []


def test_timeout_ends_every_process(runs):
    with pytest.raises(launch.LaunchTimeout) as caught:
        launch.run("setup", nproc=2, args=["--hold-s", "60"], timeout=12, echo=False)
    result = caught.value.result
    assert launch.processes_of_run(result.run_dir.name, None) == []
    steps = [r["step"] for r in result.of_kind("progress")]
    assert steps, "the records written before the timeout were lost"
    advice = timeout_advice(dict(os.environ))  # the profile the ranks ran in (this test process's)
    assert advice in str(caught.value)
    assert result.ready_s is not None and 0 < result.ready_s < result.wall_time_s


def test_ready_timeout_counts_from_the_moment_every_rank_was_ready(runs):
    with pytest.raises(launch.LaunchTimeout, match="4 s timeout from the moment its ranks were ready") as caught:
        launch.run("setup", nproc=2, hold_s=60, timeout=150, ready_timeout=4, echo=False)
    result = caught.value.result
    held = result.wall_time_s - result.ready_s
    assert 4 <= held < 30, f"ended {held:.1f} s after the ranks were ready (ready_timeout 4 s, hold 60 s)"
    assert result.of_kind("progress") and launch.processes_of_run(result.run_dir.name, None) == []


def test_timeout_advice_suggests_a_smaller_profile_only_when_there_is_one():
    in_ci = timeout_advice({"LABSRC_PROFILE": "ci"})
    assert "smallest profile already" in in_ci and "run the smallest profile" not in in_ci
    for name in ("cpu", "gpu"):
        advice = timeout_advice({"LABSRC_PROFILE": name})
        assert "run the smallest profile: LABSRC_PROFILE=ci" in advice and f"now {name}" in advice
    assert "longer timeout" in timeout_advice({"LABSRC_PROFILE": "nonsense"})


def test_sigint_to_the_shell_launcher_leaves_no_process(runs):
    command = [sys.executable, "-m", "labsrc.launch", "--nproc", "2", "--timeout", "120",
               "setup", "--", "--hold-s", "60"]
    output = runs.parent / "launcher-output.txt"
    with open(output, "wb") as sink:
        # started as a shell starts a background job: SIGINT ignored, which the launcher must undo
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    run_dir = wait_for_progress(runs, "setup", ranks=2)
    assert run_dir is not None, "the run never started"
    proc.send_signal(signal.SIGINT)
    try:  # about 1 s here; the stop's own worst case is 5 s of grace after SIGTERM, then 2 s after SIGKILL
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        launch.end_run(run_dir.name, [proc.pid])
        proc.kill()
        raise AssertionError(f"the launcher did not end 30 s after SIGINT; its output:\n{output.read_text()}")
    assert code == 130, output.read_text()
    time.sleep(0.5)
    assert launch.processes_of_run(run_dir.name, None) == []


def test_two_launches_at_once_do_not_clash_and_both_return_their_records(runs):
    results, errors = [], []

    def one():
        try:
            results.append(launch.run("setup", nproc=2, timeout=150, echo=False))
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert [r.summary["sum"] for r in results] == [3, 3]
    assert results[0].run_dir != results[1].run_dir
    for result in results:
        assert result.ok and sorted(result.records) == [0, 1]
        assert [r["received"] for r in result.of_kind("allreduce")] == [3, 3]
        assert result.run_dir.parent.parent == runs


def test_wait_all_pairs_each_run_with_its_error_and_result(runs):
    started = {"fails": launch.start("setup", nproc=2, fail_rank=1, hold_s=1, timeout=120, echo=False),
               "works": launch.start("setup", nproc=2, timeout=120, echo=False)}
    finished = launch.wait_all(started)
    assert list(finished) == ["fails", "works"]
    error, result = finished["fails"]
    assert isinstance(error, launch.RankFailed) and error.rank == 1 and result is error.result
    assert finished["works"][0] is None and finished["works"][1].summary["sum"] == 3


def test_a_stop_while_waiting_for_several_runs_ends_them_all(runs):
    started = {name: launch.start("setup", nproc=2, hold_s=60, timeout=150, echo=False) for name in ("a", "b", "c")}
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a kernel

    def stop_once_ranks_run():  # the notebook's Stop button, pressed while the first run is waited for
        wait_for_progress(runs, "setup", ranks=2)
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGINT)
    interrupt = threading.Thread(target=stop_once_ranks_run)
    interrupt.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch.wait_all(started)
    finally:
        interrupt.join()
        signal.signal(signal.SIGINT, previous)
    for name, launched in started.items():
        assert launch.processes_of_run(launched.run_id, None) == [], f"run {name} left processes behind"
        assert all(agent.poll() is not None for agent in launched.agents), f"run {name}'s agents still run"


def test_busy_port_is_refused_before_anything_starts(runs):
    import socket
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(RequestError, match=f"port {port}.*in use"):
            launch.run("setup", nproc=2, port=port)
    assert not runs.exists() or not any(runs.glob("*/*")), "a run directory was made for a refused launch"


@pytest.mark.parametrize("settings, message", [
    ({"nproc": 0}, "nproc must be"),
    ({"nproc": 2, "backend": "nccl"}, "NCCL needs"),
    ({"nproc": 64, "backend": "gloo"}, "would only queue for cores"),
    ({"timeout": 0}, "timeout must be more than 0"),
    ({"ready_timeout": -1}, "ready_timeout must be more than 0"),
    ({"max_restarts": -1}, "max_restarts must be 0 or more"),
    ({"nnodes": "2:1"}, "MIN <= MAX"),
    ({"nnodes": "two"}, "nnodes must be"),
    ({"port": 80}, "port must be 1024"),
    ({"profile": "huge"}, "profile 'huge' is unknown"),
    ({"args": "--hold-s 1"}, "args must be a list"),
    ({"hold_s": -1}, "hold_s must be"),
])
def test_impossible_requests_fail_with_advice(runs, settings, message):
    with pytest.raises(RequestError, match=message):
        launch.run("setup", **settings)


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "0", "setup"], "nproc must be"),
    (["--timeout", "-5", "setup"], "timeout must be"),
    (["--max-restarts", "-1", "setup"], "max_restarts must be"),
    (["--nnodes", "3:1", "setup"], "MIN <= MAX"),
    (["--port", "99999", "setup"], "port must be"),
    (["--backend", "mpi", "setup"], "invalid choice"),
    (["--profile", "huge", "setup"], "invalid choice"),
    (["--nproc", "two", "setup"], "invalid int"),
    (["no/such/script.py"], "no script at"),
    (["stup"], "Course labs: "),
])
def test_cli_bad_values_exit_2_with_a_message(runs, capsys, argv, message):
    assert launch_main(argv) == 2
    assert message in capsys.readouterr().err
    assert not runs.exists() or not any(runs.glob("*/*"))



def test_simulated_nodes_sharing_gpus_are_handed_gloo_not_nccl(monkeypatch, tmp_path):
    # Each node's torchrun alone would see one rank and one GPU and pick NCCL, which refuses two ranks of one
    # world on one GPU ("Duplicate GPU detected", seen on an H200): the launcher decides for the whole machine.
    from labsrc.core import world
    from labsrc.launch import launcher
    monkeypatch.setattr(world, "gpu_count", lambda: 4)  # enough GPUs for NCCL by count: still gloo
    handed = {}
    monkeypatch.setattr(launcher, "Launch", lambda *args, **kwargs: handed.setdefault("env", args[5]))
    launcher.start("setup", nproc=1, nnodes=2, runs_root=tmp_path)
    assert handed["env"][world.BACKEND_ENV] == "gloo"
    handed.clear()
    launcher.start("setup", nproc=1, nnodes=1, runs_root=tmp_path)
    assert world.BACKEND_ENV not in handed["env"] or handed["env"][world.BACKEND_ENV] != "gloo"
    with pytest.raises(launch.RequestError, match="simulated nodes share"):
        launcher.start("setup", nproc=1, nnodes=2, backend="nccl", runs_root=tmp_path)
