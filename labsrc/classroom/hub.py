"""JupyterHub's configuration for a class server, from ClassSettings (cluster/classroom/jupyterhub_config.py calls it).

Each student logs in with their system password (PAM), and gets their own JupyterLab running as their own
system user with the course's kernel, their own copy of the notebooks, and LABSRC_POOL_DIR set, so that every
launch leases its GPUs or cores from the server's pool. An idle culler runs as a hub service.
"""
from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

from labsrc.classroom.accounts import read_roster
from labsrc.classroom.settings import PROXY_COMMAND, ClassSettings
from labsrc.core.paths import REPO

HUB_PORT_ENV = "LABSRC_CLASS_HUB_PORT"
PROXY_API_PORT_ENV = "LABSRC_CLASS_PROXY_API_PORT"
NOTEBOOKS = REPO / "notebooks"
LINKED = ("docs", "cluster")  # what the notebooks' links reach (../docs/...), read-only from the checkout
CULLER_SCOPES = ["list:users", "read:users:activity", "read:servers", "delete:servers"]
# nbgrader's instructor tools (the formgrader, "Create Assignment", the course list) hidden from students, whose
# JupyterLab keeps the Assignments list (fetch, validate, submit); user-level config wins over the venv's.
STUDENT_SERVER_CONFIG = {"ServerApp": {"jpserver_extensions": {"nbgrader.server_extensions.formgrader": False,
                                                               "nbgrader.server_extensions.course_list": False}}}
STUDENT_LAB_CONFIG = {"disabledExtensions": {"@jupyter/nbgrader:formgrader": True,
                                             "@jupyter/nbgrader:create-assignment": True,
                                             "@jupyter/nbgrader:course-list": True}}


def home_of(name: str) -> Path:
    return Path(pwd.getpwnam(name).pw_dir)


def copy_notebooks(name: str, course_folder: str, exchange: Path | None = None) -> list[Path]:
    """The course's notebooks, and the scripts beside them, into ~name/<course_folder>/notebooks, owned by the
    student: only those missing (a student's own work is never overwritten; a notebook added to the course
    arrives at the next start),
    beside links to the checkout's docs/ and cluster/ (the notebooks link to them); what it made.

    Called as root (the hub's pre-spawn hook), it writes as the student, in a child process that has dropped to
    their uid and gid: the home is theirs, and a link they left there (e.g. their notebook replaced by a link to
    a system file) must reach only what the student may write, never what root may."""
    entry = pwd.getpwnam(name)
    if os.geteuid() != 0 or entry.pw_uid == 0:
        return _copy_notebooks(entry.pw_dir, course_folder, exchange)
    arguments = json.dumps([entry.pw_dir, course_folder, None if exchange is None else str(exchange)])
    done = subprocess.run([sys.executable, "-c", _AS_STUDENT, arguments], user=entry.pw_uid, group=entry.pw_gid,
                          extra_groups=[], cwd=entry.pw_dir, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "HOME": entry.pw_dir, "PATH": os.defpath})
    if done.returncode:
        raise RuntimeError(f"copying the course's notebooks into {entry.pw_dir} as {name} failed: "
                           f"{done.stderr.strip()[-2000:]}")
    return [Path(path) for path in json.loads(done.stdout)]


_AS_STUDENT = """\
import json, sys
from pathlib import Path
from labsrc.classroom.hub import _copy_notebooks
home, folder, exchange = json.loads(sys.argv[1])
print(json.dumps([str(path) for path in _copy_notebooks(home, folder, exchange and Path(exchange))]))
"""


def _copy_notebooks(home: str, course_folder: str, exchange: Path | None) -> list[Path]:
    """copy_notebooks' work, done by the home's owner (never by root in a student's home)."""
    course = Path(home) / course_folder
    made = []
    for directory in (course, course / "notebooks"):
        if not directory.exists():
            directory.mkdir(mode=0o755)
            made.append(directory)
    # the notebooks and the scripts beside them a lesson launches or a student edits (01b's your_ddp_script.py)
    for notebook in sorted([*NOTEBOOKS.glob("*.ipynb"), *NOTEBOOKS.glob("*.py")]):
        target = course / "notebooks" / notebook.name
        if not target.exists() and not target.is_symlink():
            shutil.copyfile(notebook, target)
            made.append(target)
    for name_linked in LINKED:
        link = course / name_linked
        if not link.is_symlink() and not link.exists():
            link.symlink_to(REPO / name_linked)
            made.append(link)
    jupyter = Path(home) / ".jupyter"
    for path, settings in ((jupyter / "jupyter_server_config.d" / "labsrc-student.json", STUDENT_SERVER_CONFIG),
                           (jupyter / "labconfig" / "page_config.json", STUDENT_LAB_CONFIG)):
        made += _merge_json(path, settings)
    if exchange is not None:
        config = jupyter / "nbgrader_config.py"
        if not config.exists() and not config.is_symlink():
            config.write_text(f"c = get_config()  # noqa\nc.Exchange.root = {str(exchange)!r}\n"
                              "c.Exchange.path_includes_course = True  # as the grader's course (labsrc.grading)\n")
            made.append(config)
    return made


def _merge_json(path: Path, settings: dict) -> list[Path]:
    """Add `settings` to the JSON config at `path` (a student's own keys stay); the folders and file it made."""
    made = [folder for folder in (path.parent.parent, path.parent) if not folder.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    current = json.loads(path.read_text()) if path.exists() else {}
    if not path.exists():
        made.append(path)
    for section, values in settings.items():  # two levels: {"ServerApp": {"jpserver_extensions": {...}}}
        for key, value in values.items():
            if isinstance(value, dict):
                current.setdefault(section, {}).setdefault(key, {}).update(value)
            else:
                current.setdefault(section, {})[key] = value
    path.write_text(json.dumps(current, indent=1) + "\n")
    return made


def environment(settings: ClassSettings) -> dict:
    """What each student's server (and so each kernel and launch) sees beyond JupyterHub's own variables."""
    env = {"PYTHONPATH": str(REPO),
           "LABSRC_RUNS": lambda spawner: str(home_of(spawner.user.name) / settings.course_folder / "runs")}
    if settings.pooled:
        env["LABSRC_POOL_DIR"] = str(settings.pool_directory)
    if settings.profile:
        env["LABSRC_PROFILE"] = settings.profile
    return env


def _read_or_make(path: Path, size: int) -> str:
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(os.urandom(size).hex())
    return path.read_text().strip()


def configure(c, settings: ClassSettings) -> None:
    """Fill JupyterHub's config object `c` (what `jupyterhub -f jupyterhub_config.py` reads)."""
    state = settings.state_dir
    venv_bin = Path(sys.executable).parent
    c.JupyterHub.bind_url = f"{'https' if settings.tls else 'http'}://{settings.ip}:{settings.port}"
    if settings.tls:
        c.JupyterHub.ssl_cert, c.JupyterHub.ssl_key = str(settings.tls_cert), str(settings.tls_key)
    c.JupyterHub.hub_ip = "127.0.0.1"
    c.JupyterHub.hub_port = int(os.environ.get(HUB_PORT_ENV, 8081))
    c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
    c.JupyterHub.pid_file = str(state / "jupyterhub.pid")
    c.JupyterHub.cleanup_servers = True  # stopping the hub stops every student's server
    c.ConfigurableHTTPProxy.command = [str(PROXY_COMMAND)]
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{int(os.environ.get(PROXY_API_PORT_ENV, 8001))}"
    c.ConfigurableHTTPProxy.auth_token = _read_or_make(state / "proxy_token", 32)
    c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")

    c.JupyterHub.authenticator_class = "pam"
    c.PAMAuthenticator.open_sessions = False
    c.Authenticator.allowed_users = {student.name for student in read_roster(settings.roster)}
    c.Authenticator.admin_users = set(settings.instructors)

    if settings.spawner == "systemd":
        c.JupyterHub.spawner_class = "systemdspawner.SystemdSpawner"
        c.SystemdSpawner.unit_name_template = "labsrc-{USERNAME}"
    else:
        c.JupyterHub.spawner_class = "localprocess"
    c.Spawner.cmd = [str(venv_bin / "jupyterhub-singleuser")]
    c.Spawner.notebook_dir = f"~/{settings.course_folder}"
    c.Spawner.default_url = "/lab/tree/notebooks/00_setup.ipynb"
    c.Spawner.args = ["--KernelSpecManager.allowed_kernelspecs=labsrc",
                      "--MappingKernelManager.default_kernel_name=labsrc",
                      f"--LabApp.app_settings_dir={REPO / 'jupyter' / 'settings'}", *settings.extra_server_args]
    c.Spawner.environment = environment(settings)
    c.Spawner.mem_limit = settings.mem_limit or None
    c.Spawner.start_timeout = c.Spawner.http_timeout = 120  # a busy server starts a JupyterLab slowly
    c.Spawner.pre_spawn_hook = lambda spawner: asyncio.to_thread(  # a thread: the hub serves others meanwhile
        copy_notebooks, spawner.user.name, settings.course_folder, settings.nbgrader_exchange)

    c.JupyterHub.services = [{"name": "idle-culler", "command": [
        sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={settings.idle_timeout_s}"]}]
    c.JupyterHub.load_roles = [{"name": "idle-culler", "scopes": CULLER_SCOPES, "services": ["idle-culler"]}]
