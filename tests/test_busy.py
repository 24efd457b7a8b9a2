"""labsrc.core.busy: the spread of identical timings, and a probe that tells a busy machine from a quiet one."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from labsrc.core import busy
from labsrc.core.paths import REPO


def test_spread_is_the_middle_80_percent_over_the_median():
    assert busy.spread([1.0] * 5) == 0.0
    assert busy.spread([1.0, 1.0, 1.0, 1.0, 2.0]) == pytest.approx(1.0)  # p90 is the 2.0 of five repeats
    with pytest.raises(ValueError, match="at least 3 repeats"):
        busy.spread([1.0, 2.0])


def test_probe_sees_busy_neighbours_as_a_lost_share_of_the_core():
    cores = len(os.sched_getaffinity(0))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3 * cores)]
    try:
        time.sleep(0.5)
        loaded = busy.probe()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert loaded.slowdown > busy.QUIET_SLOWDOWN, loaded
    assert not loaded.quiet and "too busy to judge the fit" in loaded.verdict("the fit")


def test_probe_asks_for_no_more_processes_than_usable_cores():
    with pytest.raises(ValueError, match="usable cores"):
        busy.probe(processes=busy.usable_cores() + 1)


def test_judged_is_the_branch_and_notes_only_the_claims_it_left_unasserted(tmp_path, monkeypatch):
    log = tmp_path / "unjudged.jsonl"
    monkeypatch.setenv(busy.UNJUDGED_LOG_ENV, str(log))
    assert busy.judged("the fit", True) is True
    assert not log.exists()
    assert busy.judged("the bubble", False) is False
    assert busy.judged("the prediction", False) is False
    assert log.read_text().splitlines() == ['{"claim": "the bubble"}', '{"claim": "the prediction"}']
    monkeypatch.delenv(busy.UNJUDGED_LOG_ENV)
    assert busy.judged("the rates", False) is False  # nowhere to note it: only the branch
    assert len(log.read_text().splitlines()) == 2


_WAITER = """import os, sys, threading, time
from labsrc.core.busy import core_wait_since, core_waits
os.sched_setaffinity(0, {{{cpu}}})   # threads started below inherit it
time.sleep(0.05)


spun, counted = threading.Event(), threading.Event()


def spin():
    while time.perf_counter() - start < 0.6:
        pass
    spun.set()
    counted.wait()   # alive until counted: a thread that ended is left out


start, cpu, before = time.perf_counter(), time.process_time(), core_waits()
worker = None
if sys.argv[1] == "spin":
    while time.perf_counter() - start < 0.6:
        pass
elif sys.argv[1] == "thread":   # the main thread sleeps; a second thread computes
    worker = threading.Thread(target=spin)
    worker.start()
    spun.wait()
else:
    for _ in range(30):
        time.sleep(0.02)
wall = time.perf_counter() - start
print(core_wait_since(before) / wall, (time.process_time() - cpu) / wall)
counted.set()
if worker:
    worker.join()
"""


def test_core_wait_counts_the_time_runnable_but_not_running_in_every_thread():
    if busy.core_waits() is None:
        pytest.skip("this kernel keeps no schedstat")
    cpu = min(os.sched_getaffinity(0))
    hog = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range(2)]
    try:
        time.sleep(0.3)
        env = dict(os.environ, PYTHONPATH=str(REPO))
        share = {kind: [float(x) for x in subprocess.run(
                     [sys.executable, "-c", _WAITER.format(cpu=cpu), kind], env=env, capture_output=True, text=True,
                     check=True, timeout=60).stdout.split()] for kind in ("spin", "thread", "sleep")}
    finally:
        for process in hogs:
            process.kill()
            process.wait()
    (spin_waited, spin_ran), (thread_waited, thread_ran), (sleep_waited, _) = \
        share["spin"], share["thread"], share["sleep"]
    # a busy loop sharing one core with two others runs about a third of the time and waits the rest
    assert spin_waited > spin_ran and abs(spin_waited + spin_ran - 1) < 0.15, share
    # the same loop in a second thread while the main thread sleeps: its waits count too
    assert thread_waited > thread_ran and abs(thread_waited + thread_ran - 1) < 0.15, share
    # a process that sleeps waits for the core only when it wakes
    assert sleep_waited < spin_waited / 2, share


def test_core_wait_is_none_where_the_kernel_does_not_count_it(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("/proc/self/task")
    monkeypatch.setattr(busy.os, "listdir", missing)
    assert busy.core_waits() is None and busy.core_wait_since({1: 0.0}) is None
    monkeypatch.undo()
    assert busy.core_wait_since(None) is None

    class Off:   # what the kernel prints with its scheduler accounting off
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return "0 0 0\n"
    monkeypatch.setattr(busy, "open", Off, raising=False)
    assert busy.core_waits() is None
