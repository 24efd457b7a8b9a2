"""The course's notebooks under classroom load: each one run N times under nbmake while busy processes keep every core
busy at a given factor, optionally beside a neighbour (a second "student" running other notebooks in a loop).

    python tools/load_harness.py --notebooks 00 02 --load 2,4,8 --runs 3 --neighbour 01 04

Each run is the ci profile with the flags of `make test-notebooks`; per run it records pass/fail, wall time, the
first error line of nbmake's report (the assert that failed), the load average seen and the timing claims the
notebook reported without asserting them because its probe found the machine too busy to judge
(`labsrc.core.busy.judged` notes them in the file LABSRC_UNJUDGED_LOG names). Per load it prints a table (notebook,
runs, passes, median and worst wall time, worst over the quiet ci budget of 90 s, in how many runs every timing claim
was asserted, the failure or else the claims left unjudged) and writes
results.csv and results.json into --out (default runs/load/<timestamp>/), with each run's full report in logs/.

Every busy process, the neighbour and whatever they started carry one tag in their environment; however the harness
ends (done, an error, Ctrl-C, SIGTERM) everything tagged is killed. Busy processes also end by themselves when the
harness dies (they watch their parent), and so does the neighbour's loop.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from labsrc.core.busy import UNJUDGED_LOG_ENV  # noqa: E402  (this checkout's labsrc, run as a script)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
BUDGET_S = 90.0
"""A notebook's wall-time budget in the ci profile on a quiet 2-core machine (INSTRUCTORS.md)."""
NOTEBOOK_TIMEOUT = 300
"""nbmake's per-cell timeout, as `make test-notebooks` sets it."""
TAG_ENV = "LABSRC_LOAD_TAG"
HOG = ("import os, sys\nparent = int(sys.argv[1])\n"
       "while os.getppid() == parent:\n    for _ in range(1_000_000):\n        pass\n")
"""A busy loop that ends by itself once its parent (the harness) is gone."""
ANSI = re.compile(r"\x1b\[[0-9;]*m")
ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Timeout)\w*): ?(.*)$")
SUMMARY_LINE = re.compile(r"^FAILED \S+ - (.*)$")


@dataclass
class Run:
    load: float
    run: int
    notebook: str
    passed: bool
    wall_s: float
    failure: str
    load_avg_mean: float
    load_avg_max: float
    neighbour: str
    unjudged: str = ""
    """The timing claims the notebook reported without asserting them (its machine too busy), "; "-separated."""


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def notebook_paths(names: list[str] | None) -> list[Path]:
    """Notebooks named by path, file name or number prefix ("00", "02_collectives"); all of notebooks/ if none."""
    if not names:
        return sorted(NOTEBOOKS.glob("[0-9]*.ipynb"))
    found = []
    for name in names:
        path = Path(name)
        if path.suffix == ".ipynb" and path.exists():
            found.append(path.resolve())
            continue
        matches = sorted(NOTEBOOKS.glob(f"{name}_*.ipynb")) or sorted(NOTEBOOKS.glob(f"{name}*.ipynb"))
        if not matches:
            raise SystemExit(f"no notebook matches {name!r}: give a number (00, 01b), a name (02_collectives) or a "
                             f"path to an .ipynb; the course's notebooks are in {NOTEBOOKS}")
        found.append(matches[0])
    return found


def parse_loads(text: str) -> list[float]:
    try:
        loads = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"--load takes factors separated by commas, e.g. 2,4,8 (0 = no busy processes), got {text!r}")
    if not loads or any(load < 0 for load in loads):
        raise SystemExit(f"--load takes factors >= 0 separated by commas, e.g. 2,4,8, got {text!r}")
    return loads


def nbmake_command(notebook: Path) -> list[str]:
    """`make test-notebooks`' nbmake run of one notebook; its log also timestamps each cell nbclient starts (its
    debug log), so a slow run shows where the time went."""
    return [sys.executable, "-m", "pytest", str(notebook), "--nbmake", f"--nbmake-timeout={NOTEBOOK_TIMEOUT}",
            "-p", "no:cacheprovider", "-o", "log_cli=true", "--log-cli-level=DEBUG",
            "--log-cli-format=%(asctime)s %(message).200s"]


def ci_env(tag: str, runs_dir: Path) -> dict[str, str]:
    """The environment of `make test-notebooks`, this checkout's labsrc, its own runs folder and the tag."""
    env = dict(os.environ, LABSRC_PROFILE="ci", LABSRC_HEADLESS="1", MPLBACKEND="Agg", LABSRC_RUNS=str(runs_dir))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env[TAG_ENV] = tag
    return env


def first_failure(report: str) -> str:
    """The failure of nbmake's report (e.g. "AssertionError: R² 0.41 < 0.6"): its FAILED summary, given whole by
    the first error line it begins (pytest cuts the summary to the terminal's width); else the first error line."""
    lines = [ANSI.sub("", line) for line in report.splitlines()]
    errors = [f"{m.group(1)}: {m.group(2)}".strip().rstrip(":") for m in map(ERROR_LINE.match, lines) if m]
    summaries = [m.group(1).strip() for m in map(SUMMARY_LINE.match, lines) if m]
    if not summaries:
        return errors[0] if errors else ""
    start = summaries[0].removesuffix("...").strip()
    return next((error for error in errors if error.startswith(start)), summaries[0])


def tagged(tag: str) -> list[psutil.Process]:
    """Every process (but this one) whose environment carries the tag."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(TAG_ENV) == tag:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def kill_all(procs: list[psutil.Process], grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL for whatever is left after `grace` seconds."""
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace)


def _end_with_parent() -> None:
    """In a child before exec (Linux): SIGTERM when the harness dies, even by SIGKILL."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def kill_tree(proc: subprocess.Popen) -> None:
    try:
        root = psutil.Process(proc.pid)
        kill_all(root.children(recursive=True) + [root])
    except psutil.Error:
        pass


class Load:
    """`hogs` busy processes and, if notebooks are named, a neighbour's nbmake loop; `stop()` ends them all."""

    def __init__(self, hogs: int, tag: str, neighbour: list[Path], out: Path):
        self.tag, self.procs = tag, []
        env = dict(os.environ, **{TAG_ENV: tag})
        for _ in range(hogs):
            self.procs.append(subprocess.Popen([sys.executable, "-c", HOG, str(os.getpid())], env=env))
        if neighbour:
            command = [sys.executable, __file__, "--neighbour-of", str(os.getpid()), "--out", str(out / "neighbour"),
                       "--notebooks", *map(str, neighbour)]
            self.procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL))

    def stop(self) -> None:
        started = []
        for proc in self.procs:
            try:
                started.append(psutil.Process(proc.pid))
            except psutil.Error:  # already gone
                pass
        kill_all(started)
        kill_all(tagged(self.tag))
        for proc in self.procs:
            proc.wait()


def run_once(notebook: Path, env: dict[str, str], log: Path, timeout: float
             ) -> tuple[bool, float, str, list[float], list[str]]:
    """One nbmake run of the notebook: passed, wall time, the failure line, the load averages seen (every 0.5 s),
    the timing claims it reported without asserting them."""
    log.parent.mkdir(parents=True, exist_ok=True)
    unjudged_log = log.with_suffix(".unjudged.jsonl")
    unjudged_log.unlink(missing_ok=True)
    env = {**env, UNJUDGED_LOG_ENV: str(unjudged_log)}
    loads, start = [], time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(nbmake_command(notebook), env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=_end_with_parent if sys.platform == "linux" else None)
        try:
            while proc.poll() is None:
                loads.append(os.getloadavg()[0])
                if time.perf_counter() - start > timeout:
                    kill_tree(proc)
                    break
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                kill_tree(proc)
    wall = time.perf_counter() - start
    passed = proc.returncode == 0
    failure = "" if passed else (first_failure(log.read_text(errors="replace"))
                                 or (f"harness timeout after {timeout:.0f} s" if wall > timeout
                                     else f"pytest exit {proc.returncode}"))
    unjudged = ([json.loads(line)["claim"] for line in unjudged_log.read_text().splitlines() if line.strip()]
                if unjudged_log.exists() else [])
    return passed, wall, failure, loads or [os.getloadavg()[0]], unjudged


def summarise(runs: list[Run]) -> list[dict]:
    rows = []
    for load in dict.fromkeys(r.load for r in runs):
        for notebook in dict.fromkeys(r.notebook for r in runs if r.load == load):
            mine = [r for r in runs if r.load == load and r.notebook == notebook]
            walls = [r.wall_s for r in mine]
            failures = [r.failure for r in mine if not r.passed]
            unjudged = list(dict.fromkeys(claim for r in mine for claim in r.unjudged.split("; ") if claim))
            rows.append(dict(load=load, notebook=notebook, runs=len(mine), passes=sum(r.passed for r in mine),
                             all_asserted=sum(not r.unjudged for r in mine),
                             median_s=statistics.median(walls), worst_s=max(walls),
                             worst_over_budget=max(walls) / BUDGET_S,
                             load_avg=statistics.median(r.load_avg_mean for r in mine),
                             failure=failures[0] if failures else "",
                             unjudged="; ".join(unjudged)))
    return rows


def table(rows: list[dict], width: int = 70) -> str:
    """One line a notebook. "judged": the runs that asserted every timing claim; the last column is the first
    failure, or else the claims some run only reported ("unjudged: ...")."""
    header = (f"{'notebook':<28} {'runs':>4} {'pass':>4} {'judged':>6} {'median s':>8} {'worst s':>7} {'/90 s':>5} "
              f"{'load':>5}  failed / unjudged")
    lines = [header, "-" * len(header)]
    for row in rows:
        note = row["failure"] or (f"unjudged: {row['unjudged']}" if row["unjudged"] else "")
        note = note if len(note) <= width else note[:width - 1] + "…"
        lines.append(f"{row['notebook']:<28} {row['runs']:>4} {row['passes']:>4} {row['all_asserted']:>6} "
                     f"{row['median_s']:>8.1f} {row['worst_s']:>7.1f} {row['worst_over_budget']:>5.2f} "
                     f"{row['load_avg']:>5.1f}  {note}")
    return "\n".join(lines)


def write_results(out: Path, runs: list[Run]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(Run.__dataclass_fields__))
        writer.writeheader()
        writer.writerows(asdict(r) for r in runs)
    (out / "results.json").write_text(json.dumps(dict(runs=[asdict(r) for r in runs], summary=summarise(runs)),
                                                 indent=1, ensure_ascii=False))


def neighbour_loop(notebooks: list[Path], out: Path, parent: int) -> None:
    """The classroom neighbour: its notebooks under nbmake, over and over, until the harness ends or dies."""
    env = ci_env(os.environ.get(TAG_ENV, ""), out / "runs")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    proc = None
    try:
        while os.getppid() == parent:
            for notebook in notebooks:
                with open(out / "last.log", "w") as log:
                    proc = subprocess.Popen(nbmake_command(notebook), env=env, cwd=ROOT, stdout=log,
                                            stderr=subprocess.STDOUT,
                                            preexec_fn=_end_with_parent if sys.platform == "linux" else None)
                    while proc.poll() is None and os.getppid() == parent:
                        time.sleep(0.5)
                if os.getppid() != parent:
                    break
    finally:
        if proc is not None and proc.poll() is None:
            kill_tree(proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--notebooks", nargs="*", help="numbers, names or paths (default: all in notebooks/)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each notebook at each load (default 3)")
    parser.add_argument("--load", default="2,4,8", help="busy processes per usable core, e.g. 0,2,4,8 (default 2,4,8)")
    parser.add_argument("--neighbour", nargs="*", default=None,
                        help="a neighbour runs these notebooks in a loop beside (no names: 01 04)")
    parser.add_argument("--out", type=Path, help="results folder (default runs/load/<timestamp>/)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before one run is killed (default 900)")
    parser.add_argument("--neighbour-of", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.neighbour_of is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        neighbour_loop(notebook_paths(args.notebooks), args.out, args.neighbour_of)
        return 0
    if args.runs < 1:
        raise SystemExit(f"--runs must be at least 1, got {args.runs}")
    loads, notebooks = parse_loads(args.load), notebook_paths(args.notebooks)
    neighbour = notebook_paths(args.neighbour or ["01", "04"]) if args.neighbour is not None else []
    out = (args.out or ROOT / "runs" / "load" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    tag, cores, runs = os.environ.get(TAG_ENV) or uuid.uuid4().hex, usable_cores(), []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the finally below, as Ctrl-C does
    print(f"{len(notebooks)} notebook(s) x {args.runs} run(s) at load {args.load} x {cores} cores"
          + (f", neighbour running {' '.join(p.stem for p in neighbour)}" if neighbour else "") + f"; results in {out}")
    try:
        for load in loads:
            _one_load(load, cores, args, notebooks, neighbour, out, tag, runs)
    finally:  # whatever is left of the load (an error while it started, a signal between loads)
        kill_all(tagged(tag))
    return 0 if all(r.passed for r in runs) else 1


def _one_load(load: float, cores: int, args: argparse.Namespace, notebooks: list[Path], neighbour: list[Path],
              out: Path, tag: str, runs: list[Run]) -> None:
    hogs = round(load * cores)
    current = Load(hogs, tag, neighbour, out / f"load{load:g}")
    try:
        env = ci_env(tag, out / f"load{load:g}" / "runs")
        for run in range(1, args.runs + 1):
            for notebook in notebooks:
                log = out / f"load{load:g}" / "logs" / f"{notebook.stem}-run{run}.log"
                passed, wall, failure, seen, unjudged = run_once(notebook, env, log, args.timeout)
                runs.append(Run(load, run, notebook.stem, passed, round(wall, 1), failure,
                                round(statistics.mean(seen), 1), round(max(seen), 1),
                                " ".join(p.stem for p in neighbour), "; ".join(unjudged)))
                print(f"  load {load:g} ({hogs} busy) run {run} {notebook.stem}: "
                      f"{'pass' if passed else 'FAIL'} {wall:.0f} s, load avg {max(seen):.1f}"
                      + (f"  {failure}" if failure else "")
                      + (f"  (reported, not asserted: {'; '.join(unjudged)})" if unjudged else ""), flush=True)
                write_results(out, runs)
    finally:
        current.stop()
    print(f"\nload {load:g}x{cores} = {hogs} busy processes" + (" + neighbour" if neighbour else "") + ":")
    print(table([row for row in summarise(runs) if row["load"] == load]) + "\n")


if __name__ == "__main__":
    sys.exit(main())
