"""What a launch hands back (RunResult: records by attempt, output, exit status) and how a failed one is reported."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from labsrc.core import runs
from labsrc.core.feedback import Feedback

LOG_FILE = "launcher.log"


@dataclass
class RunResult:
    """A finished run: its directory, exit status, the ranks' output lines and what they recorded."""

    lab: str
    """The run's name (a course lab, a module's or a script's name): runs/<lab>/<run_id>/."""
    nproc: int
    """Ranks per node."""
    run_dir: Path
    returncode: int
    wall_time_s: float
    summary: dict | None
    records: dict[int, list[dict]]
    """{rank: records} of the last attempt."""
    command: list[str] = field(default_factory=list)
    """The torchrun command (of node 0)."""
    output: list[str] = field(default_factory=list)
    """The ranks' output lines, each prefixed with its rank, in the order they arrived."""
    attempts: int = 1
    """How many attempts ran: 1, plus one per torchrun restart."""
    records_by_attempt: dict[int, dict[int, list[dict]]] = field(default_factory=dict)
    """{attempt: {rank: records}}, attempt 0 first."""
    nnodes: str = "1"
    """torchrun's --nnodes: a count or an elastic MIN:MAX range."""
    ready_s: float | None = None
    """Seconds from the launch until every rank was ready (its process group up: its first record written); None
    if they never all were. wall_time_s - ready_s is how long the ranks ran, torchrun's start-up left out."""

    @classmethod
    def collect(cls, lab: str, nproc: int, run_dir: Path, returncode: int, wall_time_s: float,
                command: list[str], output: list[str], attempts: int, nnodes: str) -> "RunResult":
        """Read what the ranks left in run_dir."""
        split = runs.by_attempt(runs.read_records(run_dir))
        last = split[max(split)] if split else {}
        return cls(lab, nproc, run_dir, returncode, wall_time_s, runs.read_summary(run_dir), last, command,
                   output, max(attempts, len(split)), split, nnodes)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def log_path(self) -> Path:
        """launcher.log: torchrun's own output and report, and the ranks' tracebacks."""
        return self.run_dir / LOG_FILE

    def of_kind(self, kind: str, rank: int | None = None, attempt: int | None = None) -> list[dict]:
        """Records of one kind as dicts, from one rank or all ranks in rank order; the last attempt's by default."""
        source = self.records if attempt is None else self.records_by_attempt.get(attempt, {})
        ranks = [rank] if rank is not None else sorted(source)
        return [r for k in ranks for r in source.get(k, []) if r["kind"] == kind]

    def of(self, record_class: type, rank: int | None = None, attempt: int | None = None) -> list:
        """Records of one typed kind (a runs.Record subclass) as instances, rank order."""
        return [record_class.from_dict(r) for r in self.of_kind(record_class.KIND, rank, attempt)]


class LaunchError(Feedback, RuntimeError):
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


class LaunchInterrupted(Feedback, KeyboardInterrupt):
    """The run was stopped (the notebook's stop button, Ctrl-C) and all its processes were ended."""


def last_attempt_errors(result: RunResult) -> dict[int, dict]:
    """The errors ranks died of in the last attempt (an earlier attempt's are history)."""
    errors = runs.read_errors(result.run_dir)
    last = max((e.get("attempt", 0) for e in errors.values()), default=0)
    return {rank: e for rank, e in errors.items() if e.get("attempt", 0) == last}


def failure(result: RunResult) -> LaunchError:
    """The error to raise for a failed run: the first failing rank's traceback once, then where the log is."""
    log_line = f"full log (torchrun's report, every process's output): {result.log_path}"
    errors = last_attempt_errors(result)
    if not errors:
        last = "\n".join(result.output[-20:]) or "(the ranks printed nothing)"
        return LaunchError(
            f"{result.lab} exited with code {result.returncode} and no rank reported an exception (a non-zero "
            f"sys.exit, a signal, or out of memory?). The ranks' last lines:\n{last}\n{log_line}", result)
    first = min(errors.values(), key=lambda e: e.get("time", 0))
    others = sorted(set(errors) - {first["rank"]})
    also = f"; rank(s) {others} failed after it" if others else ""
    attempt = f" on attempt {result.attempts}" if result.attempts > 1 else ""
    return RankFailed(
        f"rank {first['rank']} of {result.lab} failed{attempt}{also}. Its traceback:\n"
        f"{first['traceback'].rstrip()}\n{log_line}",
        result, first["rank"], first["traceback"])


def timeout_advice(env: dict) -> str:
    """What may help after a timeout, for the profile the ranks ran in: a smaller one only if there is one."""
    from labsrc.core.profiles import PROFILE_ENV, ProfileError, pick_profile
    try:
        profile, reason = pick_profile(env)
    except ProfileError:
        return "Give it a longer timeout (timeout=..., in seconds)."
    if profile.name == "ci":
        return (f"It ran in the smallest profile already (ci: {reason}): give it a longer timeout (timeout=..., "
                f"in seconds), all the more on a busy machine, or look at its last lines for a rank that waits.")
    return (f"Give it a longer timeout (timeout=..., in seconds), or run the smallest profile: {PROFILE_ENV}=ci "
            f"(now {profile.name}: {reason}).")
