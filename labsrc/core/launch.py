"""Run a lab under torchrun from a notebook or a shell: live output, progress, timeouts, and nothing left behind.

    result = launch.run("setup", nproc=2, timeout=60)
    python -m labsrc.launch --nproc 2 --timeout 60 setup -- --hold-s 1
"""
from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from labsrc.core import runs
from labsrc.core.world import BACKEND_ENV, RequestError, validate_request
from labsrc.core.progress import make_progress

RUN_ID_ENV = "LABSRC_RUN_ID"
GRACE_S = 5.0


@dataclass
class RunResult:
    """What a launch hands back: the run directory and everything the ranks recorded there."""

    lab: str
    nproc: int
    run_dir: Path
    returncode: int
    wall_time_s: float
    summary: dict | None
    records: dict[int, list[dict]]
    command: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def of_kind(self, kind: str, rank: int | None = None) -> list[dict]:
        """Records of one kind as dicts, from one rank or from all ranks in rank order."""
        ranks = [rank] if rank is not None else sorted(self.records)
        return [r for k in ranks for r in self.records.get(k, []) if r["kind"] == kind]

    def of(self, record_class: type, rank: int | None = None) -> list:
        """Records of one typed kind (a runs.Record subclass) as instances, rank order."""
        return [record_class.from_dict(r) for r in self.of_kind(record_class.KIND, rank)]


class LaunchError(RuntimeError):
    """A launch that did not succeed; `.result` keeps what the run recorded before it ended."""

    def __init__(self, message: str, result: RunResult | None = None):
        super().__init__(message)
        self.result = result


class RankFailed(LaunchError):
    """A rank raised: `.rank` is the first one that did, `.remote_traceback` its traceback."""

    def __init__(self, message: str, result: RunResult, rank: int | None, remote_traceback: str):
        super().__init__(message, result)
        self.rank = rank
        self.remote_traceback = remote_traceback


class LaunchTimeout(LaunchError):
    """The run outlived its timeout and was ended."""


def lab_module(lab: str) -> str:
    """'setup' -> 'labsrc.labs.setup'; a dotted name is taken as it is."""
    return lab if "." in lab else f"labsrc.labs.{lab}"


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Raise RequestError naming the fix if `port` cannot be bound on loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise RequestError(
                f"port {port} on {host} is already in use ({exc.strerror}). Leave port unset so a free "
                f"one is chosen, or end the process holding it (`ss -ltnp | grep {port}`)."
            ) from None


def torchrun_command(module: str, nproc: int, lab_args: list[str], port: int | None = None) -> list[str]:
    """torchrun on one machine: standalone rendezvous on loopback, a free port unless one is given."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--max-restarts=0", "--monitor-interval=0.1", "--local-addr=127.0.0.1"]
    if port is None:
        command.append("--standalone")
    else:
        command += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    return command + ["-m", module, *lab_args]


def child_environment(nproc: int, run_dir: Path, run_id: str, backend: str | None,
                      profile: str | None, extra: dict | None) -> dict:
    env = dict(os.environ)
    cores = os.cpu_count() or 1
    env.update({
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(max(1, cores // nproc)),  # ranks share the cores instead of fighting
        runs.RUN_DIR_ENV: str(run_dir),
        RUN_ID_ENV: run_id,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                    env.get("PYTHONPATH")])),
    })
    if backend:
        env[BACKEND_ENV] = backend
    if profile:
        env["LABSRC_PROFILE"] = profile
    env.update(extra or {})
    return env


def processes_of_run(run_id: str, root_pid: int | None):
    """Every live process of a run: the launcher's descendants and anything carrying the run's tag."""
    import psutil
    found = {}
    if root_pid is not None:
        try:
            root = psutil.Process(root_pid)
            for proc in [root, *root.children(recursive=True)]:
                found[proc.pid] = proc
        except psutil.NoSuchProcess:
            pass
    for proc in psutil.process_iter():
        if proc.pid in found or proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(RUN_ID_ENV) == run_id:
                found[proc.pid] = proc
        except (psutil.Error, OSError):
            continue
    return list(found.values())


def end_run(run_id: str, root_pid: int | None, grace_s: float = GRACE_S) -> int:
    """Terminate every process of a run, kill what is left after the grace period; return how many."""
    import psutil
    procs = processes_of_run(run_id, root_pid)
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    alive += [p for p in processes_of_run(run_id, None) if p not in alive]
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=2)
    return len(procs)


def _terminate_with_parent() -> None:
    """In the child before exec: torchrun gets SIGTERM if this launcher dies (Linux), and ends its ranks."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _pump(stream, lines: "queue.Queue[str | None]") -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


def _failure(result: RunResult, tail: deque) -> LaunchError:
    errors = runs.read_errors(result.run_dir)
    if not errors:
        last = "".join(tail)
        return LaunchError(
            f"{result.lab} exited with code {result.returncode} and no rank reported an exception "
            f"(killed by a signal, or out of memory?). Last output:\n{last}", result)
    first = min(errors.values(), key=lambda e: e.get("time", 0))
    others = sorted(set(errors) - {first["rank"]})
    also = f" (then rank(s) {others} failed too)" if others else ""
    return RankFailed(
        f"rank {first['rank']} of {result.lab} failed{also}: {first['type']}: {first['message']}\n"
        f"--- traceback of rank {first['rank']} ---\n{first['traceback']}",
        result, first["rank"], first["traceback"])


def lab_options_argv(module: str, options: dict) -> list[str]:
    """A course lab's typed options as flags, checked before anything starts (RequestError if bad)."""
    import importlib
    from labsrc.core.options import LabOptions
    options_class = getattr(importlib.import_module(module), "Options", LabOptions)
    return options_class.make(**options).to_argv()


def run(lab: str, nproc: int = 2, args: list | tuple = (), timeout: float = 300.0,
        backend: str | None = None, profile: str | None = None, port: int | None = None,
        env: dict | None = None, check: bool = True, echo: bool = True,
        runs_root: Path | None = None, **options) -> RunResult:
    """Launch `lab` on `nproc` ranks with torchrun and wait; return its RunResult.

    Output streams live, each line prefixed by its rank. On timeout, interrupt (the notebook's stop
    button, Ctrl-C) or a failed rank, every process of the run is ended: SIGTERM, then SIGKILL after a
    grace period. With check=True a failure raises RankFailed / LaunchTimeout / LaunchError.
    """
    validate_request(nproc, backend)
    if port is not None:
        check_port_free(port)
    module = lab_module(lab)
    name = module.rsplit(".", 1)[-1]
    lab_args = lab_options_argv(module, options) + [str(a) for a in args]
    run_dir = runs.new_run_dir(name, runs_root)
    run_id = run_dir.name
    command = torchrun_command(module, nproc, lab_args, port)
    child_env = child_environment(nproc, run_dir, run_id, backend, profile, env)
    progress = make_progress(name, nproc, run_dir)
    tail: deque = deque(maxlen=40)
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, env=child_env, start_new_session=True,
                            preexec_fn=_terminate_with_parent)
    lines: "queue.Queue[str | None]" = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    timed_out = False
    try:
        stream_open = True
        while stream_open or proc.poll() is None:
            try:
                line = lines.get(timeout=0.1)
                if line is None:
                    stream_open = False
                else:
                    tail.append(line)
                    if echo:
                        print(line, end="", flush=True)
            except queue.Empty:
                pass
            progress.update()
            if time.perf_counter() - start > timeout:
                timed_out = True
                break
    except KeyboardInterrupt:
        count = end_run(run_id, proc.pid)
        progress.close()
        print(f"\nInterrupted: ended {count} process(es) of {name}. Records so far stay in {run_dir}.",
              flush=True)
        raise
    if timed_out:
        end_run(run_id, proc.pid)
    else:
        end_run(run_id, None, grace_s=1.0)  # strays only: a worker a rank left behind
    proc.wait()
    progress.close()
    result = RunResult(name, nproc, run_dir, proc.returncode, time.perf_counter() - start,
                       runs.read_summary(run_dir), runs.read_records(run_dir), command)
    if timed_out:
        error = LaunchTimeout(
            f"{name} ran past its {timeout:g} s timeout and all its processes were ended. What the "
            f"ranks recorded so far is in {run_dir}. Give it a longer timeout, or use a smaller "
            f"profile (LABSRC_PROFILE=ci).", result)
        if check:
            raise error
        result.returncode = result.returncode if result.returncode else -signal.SIGTERM
        return result
    if result.returncode != 0 and check:
        raise _failure(result, tail)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    lab_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, lab_args = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(prog="python -m labsrc.launch", description=__doc__.splitlines()[0])
    parser.add_argument("module", help="lab name (setup) or dotted module (labsrc.labs.x)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the run is ended")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None)
    parser.add_argument("--profile", choices=["ci", "cpu", "gpu"], default=None)
    parser.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    options = parser.parse_args(argv)
    try:
        result = run(options.module, options.nproc, lab_args, options.timeout, options.backend,
                     options.profile, options.port)
    except RequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except LaunchTimeout as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 124
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(f"{result.lab}: {result.nproc} rank(s) finished in {result.wall_time_s:.1f} s; "
          f"records in {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
