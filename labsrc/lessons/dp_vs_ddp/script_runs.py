"""The runs notebook 01b makes of a DDP script: probed on ranks or simulated nodes, and as a plain torchrun command."""
from __future__ import annotations

import contextlib
import io
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

PROBE = "labsrc.lessons.dp_vs_ddp.script_probe"  # runs the script's main() with its torch calls noted


@dataclass
class ProbedRun:
    """One run of a script under the probe: every rank's notes, and what the ranks printed."""

    script: Path
    folder: Path
    """rank<r>.json (the notes) and checkpoint.pt land here."""
    world_size: int
    reports: list[dict | None]
    """[rank] -> its notes (None: the rank wrote none)."""
    output: list[str] = field(default_factory=list)
    """The ranks' printed lines, each prefixed with its rank."""
    wall_time_s: float = 0.0
    returncode: int = 0

    @property
    def checkpoint(self) -> Path:
        return self.folder / "checkpoint.pt"

    @property
    def finished(self) -> bool:
        """Every rank ran its script to the end, without an error."""
        return self.returncode == 0 and all(r and r.get("exited") and not r.get("error") for r in self.reports)


def script_args(backend: str, folder: Path) -> list[str]:
    """The script's own flags: the backend, and where rank 0 writes the checkpoint."""
    return ["--backend", backend, "--checkpoint", str(folder / "checkpoint.pt")]


def read_notes(folder: Path, world_size: int) -> list[dict | None]:
    """[rank] -> the notes the probe wrote for that rank, None where it wrote none."""
    paths = [Path(folder) / f"rank{rank}.json" for rank in range(world_size)]
    return [json.loads(path.read_text()) if path.is_file() else None for path in paths]


def probe_run(script: Path, world_size: int, backend: str, folder: Path, timeout: float, nnodes: int = 1,
              fail: bool = False, echo: bool = False) -> ProbedRun:
    """Run the script on world_size ranks (over nnodes simulated nodes) under the probe; never raises for what the
    script did (an error, a hang ended by the timeout): the notes say how far each rank got.

    fail: the given make_optimizer raises on purpose (the checker's failure run)."""
    from labsrc import launch
    folder = Path(folder)
    probe = ["--report-dir", str(folder), *(["--fail"] if fail else []), str(script), "--",
             *script_args(backend, folder)]
    printed = io.StringIO()  # the run's own lines; the launcher's [progress] lines are left out
    with contextlib.redirect_stdout(printed):
        result = launch.run(PROBE, nproc=world_size // nnodes, nnodes=nnodes, args=probe, timeout=timeout,
                            backend=backend, echo=echo, check=False)
    if echo:
        print("".join(line for line in printed.getvalue().splitlines(keepends=True)
                      if not line.startswith("[progress]")), end="")
    return ProbedRun(Path(script), folder, world_size, read_notes(folder, world_size), result.output,
                     result.wall_time_s, result.returncode)


def plain_torchrun_command(script: Path, nproc: int, args: list[str]) -> list[str]:
    """The script under torchrun on loopback, as one would type it (`python -m torch.distributed.run` is the
    torchrun entry point, here with this Python)."""
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
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise TimeoutError(f"{shown(command)} did not end within {timeout:g} s; its processes were killed") from None
    return process.returncode, output
