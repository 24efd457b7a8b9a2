"""A class server's pool: runs lease their own GPUs (fake slots here) or cores, wait in order, free them however they end."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from labsrc import doctor, launch
from labsrc.classroom import pool_setup
from labsrc.core import leases
from labsrc.launch import launcher
from labsrc.launch.command import child_environment
from waiting import wait_until

SHOW = textwrap.dedent("""\
    import json, os, sys, time
    from pathlib import Path
    started = time.time()
    if sys.argv[1].startswith("until:"):  # hold until the test says so (at most 150 s), however slow the others start
        release, deadline = Path(sys.argv[1][len("until:"):]), time.time() + 150
        while not release.exists() and time.time() < deadline:
            time.sleep(0.05)
    else:
        time.sleep(float(sys.argv[1]))
    print(json.dumps({"gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "cores": sorted(os.sched_getaffinity(0)),
                      "omp": os.environ.get("OMP_NUM_THREADS"), "started": started, "ended": time.time()}))
""")
HOLD = textwrap.dedent("""\
    import sys, time
    from pathlib import Path
    from labsrc.core import leases
    pool = leases.load(sys.argv[1])
    with leases.acquire(pool, leases.Need(gpus=int(sys.argv[2])), timeout_s=60) as lease:
        print("held", lease.gpus, flush=True)
        time.sleep(120)
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "show.py"
    path.write_text(SHOW)
    return path


def make_pool(tmp_path, **shape) -> leases.Pool:
    return pool_setup.init(tmp_path / "pool", fake_gpus=True, **shape)


def start_launcher(pool: leases.Pool, script: Path, sleep_s: float | str, output: Path, timeout: float = 150):
    """`python -m labsrc.launch` on one rank in its own process, as a second student's kernel would launch. Its rank
    sleeps `sleep_s` seconds, or with "until:<path>" holds its slot until that file exists."""
    env = dict(os.environ, LABSRC_POOL_DIR=str(pool.directory), LABSRC_RUNS=str(output.parent / "runs"))
    with open(output, "wb") as sink:
        return subprocess.Popen([sys.executable, "-m", "labsrc.launch", "--nproc", "1", "--timeout", str(timeout),
                                 str(script), "--", str(sleep_s)], stdout=sink, stderr=subprocess.STDOUT, env=env)


def finish(procs, outputs) -> list[dict]:
    """Each launcher's exit (0 asserted) and what its rank saw."""
    seen = []
    for proc, output in zip(procs, outputs):
        try:
            assert proc.wait(timeout=200) == 0, output.read_text()
        finally:
            proc.kill()
        lines = [line.split("] ", 1)[1] for line in output.read_text().splitlines() if line.startswith("[rank0]")]
        seen.append(json.loads(lines[0]))
    return seen


def held(pool: leases.Pool) -> list[str]:
    return [slot["name"] for slot in leases.status(pool)["slots"] if slot["held"]]


def rank_running(runs_dir: Path) -> bool:
    """True once a rank of the (only) run under runs_dir is running."""
    for run_dir in runs_dir.glob("*"):
        for process in launch.processes_of_run(run_dir.name, None):
            try:
                if "labsrc.launch.rank_entry" in process.cmdline() and "torch.distributed.run" not in process.cmdline():
                    return True
            except psutil.Error:
                pass
    return False


@pytest.mark.slow
def test_two_runs_at_once_get_their_own_gpu_and_a_third_waits_its_turn(tmp_path, script):
    pool = make_pool(tmp_path, gpus=2, gpus_per_run=1)
    outputs = [tmp_path / f"launcher{i}.txt" for i in range(3)]
    release = tmp_path / "release"   # the first two hold their GPUs until the third is seen waiting
    procs = [start_launcher(pool, script, f"until:{release}", outputs[i]) for i in range(2)]
    try:
        wait_until(lambda: len(held(pool)) == 2, 90, "both runs holding a GPU")
        procs.append(start_launcher(pool, script, 0, outputs[2]))
        wait_until(lambda: "waiting for 1 GPU" in outputs[2].read_text(), 120, "the third run waiting")
        release.touch()
        first, second, third = finish(procs, outputs)
    finally:
        for proc in procs:
            proc.kill()
    assert {first["gpus"], second["gpus"]} == {"0", "1"}, (first, second)
    assert third["gpus"] in ("0", "1")
    waited = outputs[2].read_text()
    assert "waiting for 1 GPU: 2 runs ahead" in waited, waited
    for earlier in (first, second):  # never two runs on one GPU at once
        if earlier["gpus"] == third["gpus"]:
            assert third["started"] >= earlier["ended"], (earlier, third)
    assert list((pool.directory / leases.QUEUE_DIR).iterdir()) == [] and held(pool) == []


@pytest.mark.slow
def test_the_cores_pool_pins_runs_to_disjoint_cores(tmp_path, script):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to lend one to each of two runs")
    pool = make_pool(tmp_path, cores=2, cores_per_run=1)
    outputs = [tmp_path / f"launcher{i}.txt" for i in range(2)]
    first, second = finish([start_launcher(pool, script, 5, output) for output in outputs], outputs)
    assert first["started"] < second["ended"] and second["started"] < first["ended"], "the runs never overlapped"
    assert len(first["cores"]) == len(second["cores"]) == 1 and first["cores"] != second["cores"], (first, second)
    assert set(first["cores"] + second["cores"]) <= set(pool.cores)
    assert first["omp"] == second["omp"] == "1" and first["gpus"] is None


def test_a_killed_holder_frees_its_slot_within_a_second(tmp_path):
    pool = make_pool(tmp_path, gpus=1)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(pool.directory), "1"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().startswith("held"), "the holder never leased"
        assert held(pool) == ["gpu0"]
        note = leases.status(pool)["slots"][0]
        assert note["pid"] == holder.pid and note["user"] and note["since"] <= time.time()
        holder.send_signal(signal.SIGKILL)
        killed = time.perf_counter()
        with leases.acquire(pool, leases.Need(gpus=1), timeout_s=1.0) as lease:
            freed_s = time.perf_counter() - killed
            assert lease.gpus == [0]
    finally:
        holder.kill()
        holder.wait()
    assert freed_s < 1.0


@pytest.mark.slow
def test_a_killed_launcher_frees_its_gpu_once_its_run_has_ended(tmp_path, script):
    pool = make_pool(tmp_path, gpus=1)
    output = tmp_path / "launcher.txt"
    proc = start_launcher(pool, script, 60, output)
    try:
        wait_until(lambda: held(pool) == ["gpu0"], 90, "the run holding gpu0")
        wait_until(lambda: rank_running(tmp_path / "runs" / "show"), 90, "the rank running")
        proc.send_signal(signal.SIGKILL)
        freed_s = wait_until(lambda: held(pool) == [], 15, "gpu0 freed after its launcher was killed")
        run_id = next((tmp_path / "runs" / "show").glob("*")).name
        left = launch.processes_of_run(run_id, None)  # the agents held the lease until their rank was gone
    finally:
        proc.kill()
        proc.wait()
    assert left == [], f"gpu0 was freed while the run still had processes: {left}"
    print(f"gpu0 free {freed_s:.2f} s after the launcher's SIGKILL (its agent ended its rank first)")


def test_waiting_is_in_order_and_all_or_nothing(tmp_path):
    pool = make_pool(tmp_path, gpus=2)
    first, second = leases.acquire(pool, leases.Need(gpus=1), 1), leases.acquire(pool, leases.Need(gpus=1), 1)
    got, messages = {}, {"both": [], "one": []}

    def wait_for(name, count):
        got[name] = leases.acquire(pool, leases.Need(gpus=count), 60,
                                   lambda message, ahead: messages[name].append((message, ahead)), name)
    both = threading.Thread(target=wait_for, args=("both", 2))
    both.start()
    wait_until(lambda: messages["both"], 10, "the first waiter queued")
    one = threading.Thread(target=wait_for, args=("one", 1))
    one.start()
    wait_until(lambda: len(leases.status(pool)["waiting"]) == 2, 10, "the second waiter queued")
    assert messages["both"][0] == ("waiting for 2 GPUs: 2 runs ahead", 2)
    first.release()  # one GPU free: the waiter for one must not jump the queue, the one for two cannot start
    time.sleep(1.0)
    assert got == {} and held(pool) == ["gpu1"]
    assert messages["one"][-1] == ("waiting for 1 GPU: 2 runs ahead", 2)  # the run holding gpu1, one queued
    second.release()
    both.join(10)
    assert sorted(got["both"].gpus) == [0, 1] and "one" not in got
    got["both"].release()
    one.join(10)
    assert len(got["one"].gpus) == 1
    got["one"].release()
    assert held(pool) == [] and leases.status(pool)["waiting"] == []


def test_a_wait_past_the_timeout_says_it_waited_for_the_pool(tmp_path, script, monkeypatch):
    pool = make_pool(tmp_path, gpus=1)
    monkeypatch.setenv(leases.POOL_ENV, str(pool.directory))
    monkeypatch.setenv("LABSRC_RUNS", str(tmp_path / "runs"))
    with leases.acquire(pool, leases.Need(gpus=1), 1, label="someone else"):
        started = time.perf_counter()
        with pytest.raises(launch.LaunchTimeout) as caught:
            launch.run(str(script), nproc=1, args=["0"], timeout=2, echo=False)
        elapsed = time.perf_counter() - started
    message = str(caught.value)
    assert "timed out waiting for the pool" in message and "1 GPU asked, 1 run still ahead" in message, message
    assert "Nothing was started" in message and elapsed < 10
    assert list((pool.directory / leases.QUEUE_DIR).iterdir()) == []
    log = next((tmp_path / "runs" / "show").glob("*/launcher.log")).read_text()
    assert "waiting for 1 GPU: 1 run ahead" in log and "torch.distributed.run" not in log


@pytest.mark.slow
def test_an_interrupt_while_waiting_ends_the_launcher_and_leaves_the_queue(tmp_path, script):
    pool = make_pool(tmp_path, cores=1)
    output = tmp_path / "launcher.txt"
    with leases.acquire(pool, leases.Need(cores=1), 1):
        proc = start_launcher(pool, script, 0, output)
        try:
            wait_until(lambda: "waiting for 1 core: 1 run ahead" in output.read_text(), 180, "the launcher waiting")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=15) == 130, output.read_text()
        finally:
            proc.kill()
    assert list((pool.directory / leases.QUEUE_DIR).iterdir()) == [] and held(pool) == []


def test_without_a_pool_the_launch_environment_is_as_before(tmp_path, monkeypatch):
    monkeypatch.delenv(leases.POOL_ENV, raising=False)
    handed = {}
    monkeypatch.setattr(launcher, "Launch", lambda *args: handed.setdefault("args", args))
    launcher.start("setup", nproc=2, runs_root=tmp_path)
    args = handed["args"]
    run_dir, env, pool, need = args[3], args[5], args[10], args[11]
    assert pool is None and not need
    assert env == child_environment(2, run_dir, run_dir.name, None, None, False, None)
    handed.clear()
    made = make_pool(tmp_path, gpus=2, cores=1)
    monkeypatch.setenv(leases.POOL_ENV, str(made.directory))
    launcher.start("setup", nproc=2, runs_root=tmp_path)
    assert handed["args"][10] == made and handed["args"][11] == leases.Need(gpus=2, cores=1)


def test_a_pool_named_but_missing_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv(leases.POOL_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(launch.RequestError, match="holds no pool.*pool_setup init"):
        launch.run("setup", nproc=2, runs_root=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_a_pool_is_made_only_as_big_as_the_machine_and_reshaped_only_when_free(tmp_path):
    with pytest.raises(leases.PoolError, match="shows 0 GPU"):
        pool_setup.init(tmp_path / "pool", gpus=2, visible_gpus=0)
    with pytest.raises(leases.PoolError, match="may use"):
        pool_setup.init(tmp_path / "pool", cores=len(os.sched_getaffinity(0)) + 1)
    with pytest.raises(leases.PoolError, match="gpus-per-run"):
        pool_setup.init(tmp_path / "pool", gpus=2, gpus_per_run=3, fake_gpus=True)
    pool = make_pool(tmp_path, gpus=2)
    with leases.acquire(pool, leases.Need(gpus=1), 1):
        with pytest.raises(leases.PoolError, match="leased right now"):
            make_pool(tmp_path, gpus=1)
    assert make_pool(tmp_path, gpus=1).gpus == 1


def test_the_doctor_reports_the_pool_its_holders_and_who_waits(tmp_path, monkeypatch, capsys):
    pool = make_pool(tmp_path, gpus=2, gpus_per_run=2)
    monkeypatch.setenv(leases.POOL_ENV, str(pool.directory))
    with leases.acquire(pool, leases.Need(gpus=1), 1, label="setup 2026-run"):
        queued = threading.Event()
        waiter = threading.Thread(target=lambda: leases.acquire(pool, leases.Need(gpus=2), 60,
                                                                lambda *_: queued.set(), "big run").release())
        waiter.start()
        assert queued.wait(10)
        assert doctor.main(["--json"]) == 0
        data = json.loads(capsys.readouterr().out)["pool"]
        assert doctor.main([]) == 0
        text = capsys.readouterr().out
    waiter.join(10)
    assert not waiter.is_alive() and held(pool) == []
    assert [s["held"] for s in data["slots"]] == [True, False]
    assert data["slots"][0]["pid"] == os.getpid() and data["slots"][0]["label"] == "setup 2026-run"
    assert [w["label"] for w in data["waiting"]] == ["big run"] and data["waiting"][0]["need"]["gpus"] == 2
    assert "1 of 2 slot(s) leased, 1 run(s) waiting" in text and "gpu0: " in text and "(pid" in text
    assert "waiting #1:" in text and "for 2 GPUs" in text
    monkeypatch.setenv(leases.POOL_ENV, str(tmp_path / "nowhere"))
    assert doctor.main([]) == 2 and "pool: ERROR" in capsys.readouterr().out


def test_the_launch_cell_and_the_terminal_show_the_wait(tmp_path, capsys):
    pytest.importorskip("ipywidgets")
    from labsrc.core.progress import PlainProgress, WidgetProgress
    cell = WidgetProgress("setup", 2, tmp_path)
    cell.pool_message("waiting for 2 GPUs: 3 runs ahead")
    assert "waiting for 2 GPUs: 3 runs ahead" in cell.header.value
    PlainProgress("setup", 2, tmp_path).pool_message("waiting for 2 GPUs: 3 runs ahead")
    assert "[pool] setup: waiting for 2 GPUs: 3 runs ahead" in capsys.readouterr().out


def test_a_plan_made_on_a_pooled_server_counts_one_runs_share(tmp_path, monkeypatch):
    from labsrc.core import hardware
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to lend one per run")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 8)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    alone = hardware.detect()
    pool = make_pool(tmp_path, gpus=2, gpus_per_run=2, cores=2, cores_per_run=1)
    monkeypatch.setenv(leases.POOL_ENV, str(pool.directory))
    shared = hardware.detect()
    assert (alone.gpus, shared.gpus) == (8, 2) and shared.cpus == 1 < alone.cpus
