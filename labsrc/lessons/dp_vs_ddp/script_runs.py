"""The runs notebook 01b's checker makes of a DDP script: by path on ranks, on simulated nodes, with a planted failure."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from labsrc.core.exercises import ExerciseFailed
from labsrc.core.runs import read_errors
from labsrc.launch import LaunchError, LaunchTimeout

FAILURE_ENV = "LABSRC_DDP_SCRIPT_FAIL"  # the scripts' describe() raises when this names a folder (see the script)


def script_args(backend: str, folder: Path) -> list[str]:
    """The script's own flags: the backend, and a folder for its reports and checkpoint."""
    return ["--backend", backend, "--report-dir", str(folder), "--checkpoint", str(folder / "checkpoint.pt")]


def launch_script(script: Path, world_size: int, backend: str, folder: Path, timeout: float, nnodes: int = 1):
    """Run the script by path on world_size ranks (over nnodes simulated nodes) with its report and checkpoint in
    `folder`; its RunResult. A hang or a failed rank becomes an ExerciseFailed that names the usual cause."""
    from labsrc import launch
    try:
        return launch.run(str(script), nproc=world_size // nnodes, nnodes=nnodes, args=script_args(backend, folder),
                          timeout=timeout, backend=backend, echo=False)
    except LaunchTimeout:
        raise ExerciseFailed(
            f"the run did not end by itself within {timeout:g} s (its processes were ended): a rank waits in a "
            "collective the others never join, e.g. an all_reduce or a barrier inside `if rank == 0:`. Every "
            "rank must make the same collective calls in the same order.") from None
    except LaunchError as error:
        raise ExerciseFailed(failure_hint(error, world_size)) from None


def failure_hint(error: LaunchError, world_size: int) -> str:
    """What a failed run says about the script: the failing rank's error, and the usual cause of it."""
    errors = read_errors(error.result.run_dir) if error.result is not None else {}
    first = min(errors.values(), key=lambda e: e.get("time", 0)) if errors else None
    hint = "the script failed; the traceback says where."
    message = first.get("message", "") if first else ""
    if first and first["type"] == "NotImplementedError":
        hint = "your script still has a TODO that raises NotImplementedError: write that part."
    elif first and first["type"] == "ValueError" and "device_ids" in message:
        hint = ("DDP refused device_ids: for a model on the CPU it must be None; device_ids=[local_rank] is for a "
                "model on one GPU (device_ids=[device.index] if device.type == 'cuda' else None).")
    elif first and first["type"] == "ValueError" and "Invalid rank" in message:
        hint = (f"on {world_size} ranks the sampler refused rank {first['rank']} ({message}): num_replicas or rank "
                "is written into the script. Let DistributedSampler(dataset) read both from the process group, "
                "or pass dist.get_world_size() and dist.get_rank().")
    elif first and first["rank"] != 0 and first["type"] in ("FileNotFoundError", "EOFError", "UnpicklingError"):
        hint = (f"rank {first['rank']} could not read the checkpoint ({first['type']}): it read before rank 0 had "
                "finished writing it. Put dist.barrier() between rank 0's torch.save and every rank's torch.load.")
    return f"{hint}\n{error}"


def failure_verdict(script: Path, world_size: int, backend: str, folder: Path, timeout: float) -> str | None:
    """Run the script with describe() raising on every rank: the run must fail with that error, and each rank
    that exited by itself must have destroyed its process group by then (a `finally`)."""
    from labsrc import launch
    result = launch.run(str(script), nproc=world_size, args=script_args(backend, folder / "normal"), timeout=timeout,
                        backend=backend, echo=False, check=False, env={FAILURE_ENV: str(folder)})
    errors = read_errors(result.run_dir)
    planted = [rank for rank, error in errors.items() if error.get("type") == "InjectedFailure"]
    if result.returncode == 0 or not planted:
        return ("the failure run (describe() raising on purpose) did not fail with InjectedFailure: call the given "
                "describe(report, model) inside the try, after training, and let its exception propagate.")
    reports = sorted(folder.glob("rank*.json"))
    if not reports:
        return ("in the failure run no rank got as far as exiting by itself: keep write_report and describe "
                "as given.")
    written = [json.loads(path.read_text()) for path in reports]
    kept = [report["rank"] for report in written if not report.get("group_destroyed")]
    if kept:
        return (f"when training raised, rank(s) {kept} still held the process group at exit: "
                "dist.destroy_process_group() belongs in a `finally:`, so it runs whether the try ended or raised.")
    return None


def plain_torchrun_command(script: Path, nproc: int, args: list[str]) -> list[str]:
    """What `launch.run(script, nproc, args=...)` amounts to, as one would type it: torchrun on loopback
    (`python -m torch.distributed.run` is the torchrun entry point, here with this Python)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(script), *args]


def shown(command: list[str]) -> str:
    """The command as typed in a shell, `torchrun` for the module entry point."""
    if command[1:3] == ["-m", "torch.distributed.run"]:
        command = ["torchrun", *command[3:]]
    return shlex.join(command)


def run_plain(command: list[str], timeout: float) -> tuple[int, str]:
    """Run a torchrun command in its own session; (exit status, its output). On timeout the whole session (the
    agent and its ranks) is killed and TimeoutError says so: nothing is left running."""
    import os
    import signal
    import subprocess
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise TimeoutError(f"{shown(command)} did not end within {timeout:g} s; its processes were killed") from None
    return process.returncode, output
