"""A class server in one command: JupyterHub for the course's students, their accounts and the GPU/core pool.

    python -m labsrc.classroom.server start [--settings FILE]   # accounts, pool, hub in the background
    python -m labsrc.classroom.server run   [--settings FILE]   # the same in the foreground (a systemd unit)
    python -m labsrc.classroom.server stop  [--settings FILE]   # the hub, its proxy and every student's server
    python -m labsrc.classroom.server remove-students [--settings FILE]   # the roster's accounts and homes

Settings: cluster/classroom/classroom.toml (labsrc.classroom.settings). Runs as root: it creates system
accounts, and JupyterHub starts each student's server as that student.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from labsrc.classroom import accounts, pool_setup, settings as class_settings
from labsrc.classroom.hub import HUB_PORT_ENV, PROXY_API_PORT_ENV
from labsrc.classroom.settings import PROXY_COMMAND, ClassSettings
from labsrc.core.leases import PoolError
from labsrc.core.paths import REPO
from labsrc.launch import free_port

CONFIG = REPO / "cluster" / "classroom" / "jupyterhub_config.py"
SETTINGS_ENV = "LABSRC_CLASS_SETTINGS"
START_TIMEOUT_S = 120


class ClassServerError(RuntimeError):
    """Something the class server cannot do as asked; the message says what to do."""


def _check_prerequisites(settings: ClassSettings) -> None:
    if os.geteuid() != 0:
        raise ClassServerError("the class server runs as root: it creates the students' accounts and starts each "
                               "student's server as that student (sudo make class-server).")
    try:
        import jupyterhub  # noqa: F401
        import jupyterhub_idle_culler  # noqa: F401
    except ImportError as exc:
        raise ClassServerError(f"{exc.name} is missing: `make class-server` installs requirements-classroom.txt "
                               f"into the course's venv.") from None
    if settings.spawner == "systemd":
        try:
            import systemdspawner  # noqa: F401
        except ImportError:
            raise ClassServerError("spawner = 'systemd' needs jupyterhub-systemdspawner: `.venv/bin/python -m pip "
                                   "install jupyterhub-systemdspawner` (on a machine that runs systemd), or set "
                                   "spawner = 'local' (mem_limit then not enforced).") from None
    if not os.access(PROXY_COMMAND, os.X_OK):
        raise ClassServerError(f"no configurable-http-proxy at {PROXY_COMMAND}: `make class-server` installs it "
                               f"with npm (Node 18 or newer).")


def tls_statement(settings: ClassSettings) -> str:
    """What the hub's transport is, in words (told, never assumed)."""
    if settings.tls:
        return f"TLS: on (HTTPS with {settings.tls_cert})."
    if settings.loopback:
        return (f"TLS: off. The hub speaks plain HTTP on loopback ({settings.ip}) only: students reach it "
                f"through an ssh tunnel or a TLS reverse proxy on this machine (INSTRUCTORS.md, section 2).")
    return (f"TLS: off here. The hub listens on {settings.ip} in plain HTTP: this is safe only behind the TLS "
            f"reverse proxy the settings say is in front (plain_http_behind_proxy).")


def memory_statement(settings: ClassSettings) -> str:
    if not settings.mem_limit:
        return "memory: no per-student limit."
    if settings.spawner == "systemd":
        return f"memory: {settings.mem_limit} per student, enforced by systemd (SystemdSpawner, a cgroup)."
    return (f"memory: {settings.mem_limit} per student is NOT enforced: the local spawner only passes MEM_LIMIT to "
            f"each server. Set spawner = 'systemd' (pip install jupyterhub-systemdspawner) to enforce it.")


def solutions_statement(settings: ClassSettings, student: str) -> str:
    """Whether the students can read the checkout's solutions/ (checked as one of them), and how to change it."""
    solutions = REPO / "solutions"
    if not solutions.is_dir():
        return f"solutions/: not in this checkout ({solutions}): students cannot read them (nor can the grader)."
    readable = subprocess.run(["runuser", "-u", student, "--", "test", "-r", str(solutions), "-a", "-x",
                               str(solutions)]).returncode == 0
    if not readable:
        return f"solutions/: withheld: {student} cannot read {solutions} (undo: setfacl -x g:{settings.group} " \
               f"{solutions})."
    return (f"solutions/: students can read {solutions} (an untouched exercise stub loads the reference). To "
            f"withhold them in class: setfacl -m g:{settings.group}:--- {solutions} (INSTRUCTORS.md, section 5).")


def prepare(settings: ClassSettings, echo=print, show_passwords: bool = True) -> None:
    """Accounts, the pool and the students' access to the course, each step told through echo as it is done
    (new students' first passwords too, unless show_passwords is False: under systemd the output is the journal,
    which outlives the first login and which more than root may read)."""
    _check_prerequisites(settings)
    state = settings.state_dir
    state.mkdir(parents=True, exist_ok=True)
    os.chmod(state, 0o700)
    echo(tls_statement(settings))
    echo(memory_statement(settings))
    students = accounts.read_roster(settings.roster)
    created = accounts.ensure_students(students, settings.group, state / "passwords.txt")
    for name, password in created.items():
        echo(f"new student {name}: first password {password} (also in {state / 'passwords.txt'})" if show_passwords
             else f"new student {name}: first password in {state / 'passwords.txt'}")
    echo(f"{len(students)} student(s) in group {settings.group} ({len(created)} new).")
    if settings.pooled:
        try:
            pool = pool_setup.init(settings.pool_directory, settings.gpus, settings.cores, settings.gpus_per_run,
                                   settings.cores_per_run, settings.fake_gpus)
        except PoolError as exc:
            raise ClassServerError(f"the pool: {exc}") from None
        echo(f"pool at {pool.directory}: {pool.gpus} GPU slot(s) ({pool.gpus_per_run} per run), "
                     f"{len(pool.cores)} core(s) ({pool.cores_per_run if pool.cores else 0} per run).")
    else:
        echo("pool: none (gpus = cores = 0): students' launches do not lease, and may collide on GPUs.")
    needed = [Path(sys.executable), REPO] + [settings.pool_directory] * settings.pooled
    blocked = accounts.blocked_directories(needed, students[0].name)
    if blocked and not settings.grant_group_traverse:
        raise ClassServerError(
            f"students cannot reach the course: {', '.join(map(str, blocked))} cannot be entered by "
            f"{students[0].name}. Install the course where students can read it (e.g. /opt/labsrc), or set "
            f"grant_group_traverse = true to let group {settings.group} pass through (setfacl).")
    if blocked:
        accounts.grant_access(blocked, settings.group, state)
        echo(f"group {settings.group} may now pass through {', '.join(map(str, blocked))} (ACL).")
    echo(solutions_statement(settings, students[0].name))


def hub_command(settings: ClassSettings) -> tuple[list[str], dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO), **{SETTINGS_ENV: str(settings.source),
                                                    HUB_PORT_ENV: str(free_port()),
                                                    PROXY_API_PORT_ENV: str(free_port())})
    return [sys.executable, "-m", "jupyterhub", "-f", str(CONFIG)], env


def wait_until_up(settings: ClassSettings, hub: subprocess.Popen, log: Path, timeout_s: float) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if hub.poll() is not None:
            raise ClassServerError(f"the hub exited ({hub.returncode}); its log {log} ends:\n"
                                   f"{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"{settings.url}/hub/api", timeout=2)
            return time.perf_counter() - started
        except OSError:
            time.sleep(0.2)
    stop(settings)
    raise ClassServerError(f"the hub did not answer at {settings.url} within {timeout_s:g} s; its log {log}.")


def start(settings: ClassSettings, echo=print) -> float:
    """Prepare, start the hub in the background (its own session), wait until it answers; the start-up seconds."""
    if _hub_pid(settings) is not None:
        raise ClassServerError(f"a hub of these settings runs already (pid {_hub_pid(settings)}): "
                               f"`make class-server-stop` first.")
    prepare(settings, echo)
    command, env = hub_command(settings)
    log = settings.state_dir / "jupyterhub.log"
    with open(log, "ab") as sink:
        hub = subprocess.Popen(command, cwd=settings.state_dir, env=env, stdout=sink, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    seconds = wait_until_up(settings, hub, log, START_TIMEOUT_S)
    echo(f"hub up in {seconds:.1f} s at {settings.url} (log {log}; stop: make class-server-stop).")
    return seconds


def _hub_pid(settings: ClassSettings) -> int | None:
    try:
        pid = int((settings.state_dir / "jupyterhub.pid").read_text().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE  # a zombie has ended; its parent has yet to reap it
    except psutil.NoSuchProcess:
        return False


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:  # ended meanwhile, or not ours to read
        return []


def _students_processes(settings: ClassSettings) -> list[psutil.Process]:
    names = {s.name for s in accounts.read_roster(settings.roster)}
    return [p for p in psutil.process_iter(["username"]) if p.info["username"] in names and _running(p)]


# How long the hub may take to stop one student's server: JupyterHub's LocalProcessSpawner interrupts it, then
# terminates it, then kills it (interrupt_timeout 10 s + term_timeout 5 s + kill_timeout 5 s), one server after
# another, while each server shuts its kernels down; a loaded 2-core machine used up a flat 30 s with two servers.
STOP_PER_SERVER_S = 20
STOP_BASE_S = 30


def stop(settings: ClassSettings, timeout_s: float | None = None) -> list[str]:
    """Stop the hub: it stops every student's server, its proxy and its services. Returns what it left running
    (pid and command line: its own processes and the students'), which is then killed; empty when it cleaned up.

    timeout_s: how long the hub may take before it is killed; by default STOP_BASE_S plus STOP_PER_SERVER_S for
    each student's server running."""
    family = []
    pid = _hub_pid(settings)
    if pid is not None:
        hub = psutil.Process(pid)
        family = [hub, *hub.children(recursive=True)]
        if timeout_s is None:
            servers = [p for p in _students_processes(settings) if "jupyterhub-singleuser" in " ".join(_cmdline(p))]
            timeout_s = STOP_BASE_S + STOP_PER_SERVER_S * len(servers)
        hub.terminate()
        if psutil.wait_procs([hub], timeout=timeout_s)[1]:
            hub.kill()
        psutil.wait_procs(family, timeout=5)  # the proxy and the services end with the hub
    left = {process.pid: process for process in family + _students_processes(settings) if _running(process)}
    described = []
    for process in left.values():
        try:
            described.append(f"{process.pid} {' '.join(process.cmdline())}")
            process.kill()
        except psutil.NoSuchProcess:
            pass
    return described


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsrc.classroom.server", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["start", "run", "stop", "remove-students"])
    parser.add_argument("--settings", default=os.environ.get(SETTINGS_ENV), help="default: " + str(
        class_settings.DEFAULT_FILE.relative_to(REPO)))
    options = parser.parse_args(argv)
    try:
        settings = class_settings.load(options.settings)
        if options.command == "start":
            start(settings)
        elif options.command == "run":
            prepare(settings, lambda line: print(line, flush=True), show_passwords=False)
            command, env = hub_command(settings)
            os.chdir(settings.state_dir)
            os.execvpe(command[0], command, env)
        elif options.command == "stop":
            running = _hub_pid(settings) is not None
            left = stop(settings)
            print(("hub stopped" if running else f"no hub of {settings.source} was running")
                  + "".join(f"\nkilled what it left: {line}" for line in left))
        else:
            removed = accounts.remove_students(accounts.read_roster(settings.roster), settings.group,
                                                     settings.state_dir)
            print(f"removed {len(removed)} account(s) with their homes: {', '.join(removed) or 'none'}.")
    except (ClassServerError, class_settings.SettingsError, accounts.AccountError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
