"""A class server's settings: one TOML file (cluster/classroom/classroom.toml), read into a typed ClassSettings."""
from __future__ import annotations

import ipaddress
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from labsrc.core.paths import REPO

DEFAULT_FILE = REPO / "cluster" / "classroom" / "classroom.toml"
PROXY_DIR = REPO / ".classroom" / "proxy"
PROXY_COMMAND = PROXY_DIR / "node_modules" / ".bin" / "configurable-http-proxy"


class SettingsError(ValueError):
    """A settings file that is missing, malformed or unsafe; the message says what to change."""


@dataclass(frozen=True)
class ClassSettings:
    """What `make class-server` serves, to whom, and how. Relative paths are relative to the checkout."""

    roster: Path = Path("cluster/classroom/roster.example.txt")
    """One student a line: `username` or `username,Full Name`; `#` starts a comment."""
    group: str = "labsrc-students"
    """The Unix group every roster account joins (only its members are ever removed by `remove-students`)."""
    instructors: tuple[str, ...] = ()
    """Existing system accounts made hub admins (they log in with their own password)."""
    ip: str = "127.0.0.1"
    """Where the hub listens: loopback (students come through an ssh tunnel or a reverse proxy) unless opened."""
    port: int = 8000
    tls_cert: Path | None = None
    """A certificate (PEM) to serve HTTPS with tls_key; without both the hub speaks plain HTTP and says so."""
    tls_key: Path | None = None
    plain_http_behind_proxy: bool = False
    """Allow a non-loopback ip without TLS: only behind a reverse proxy that terminates TLS (INSTRUCTORS.md)."""
    state_dir: Path = Path(".classroom/state")
    """The hub's database, cookie secret, proxy token, pid, log and the students' first passwords (mode 0700)."""
    course_folder: str = "labsrc-course"
    """The folder in each student's home that holds their own copy of the notebooks (the server's root)."""
    spawner: str = "local"
    """'local' (LocalProcessSpawner: no memory limit enforced) or 'systemd' (SystemdSpawner: enforced)."""
    mem_limit: str = "4G"
    """Each student's memory: enforced by the systemd spawner; the local spawner only passes MEM_LIMIT on."""
    idle_timeout_s: int = 3600
    """jupyterhub-idle-culler stops a student's server idle this long (their files stay)."""
    profile: str = ""
    """LABSRC_PROFILE for every student ('' lets the course pick from the hardware)."""
    grant_group_traverse: bool = False
    """When the course's Python or checkout sits under a directory students cannot enter (e.g. /root, mode
    0700), give the group the right to pass through it (an ACL entry, setfacl) instead of refusing to start."""
    extra_server_args: tuple[str, ...] = ()
    """More options for each student's jupyterhub-singleuser (e.g. --LabApp.expose_app_in_browser=True)."""
    pool_directory: Path = Path(".classroom/pool")
    """The GPU/core pool (labsrc.core.leases) every student's launches lease from; made when gpus or cores > 0."""
    gpus: int = 0
    gpus_per_run: int = 0
    cores: int = 0
    cores_per_run: int = 1
    fake_gpus: bool = False
    """GPU slots this machine lacks (rehearsals and tests only)."""
    nbgrader_exchange: Path | None = None
    """nbgrader's exchange directory, when the course is graded with nbgrader (written to each student's config)."""
    source: Path = field(default=DEFAULT_FILE, compare=False)
    """The file these settings were read from."""

    @property
    def pooled(self) -> bool:
        return self.gpus > 0 or self.cores > 0

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None and self.tls_key is not None

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.ip).is_loopback

    @property
    def url(self) -> str:
        host = self.ip if self.ip not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"


_PATHS = {"roster", "tls_cert", "tls_key", "state_dir", "pool_directory", "nbgrader_exchange"}


def load(path=None) -> ClassSettings:
    """The settings in `path` (default cluster/classroom/classroom.toml), checked; SettingsError says what is wrong."""
    path = Path(path or DEFAULT_FILE).resolve()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"no class server settings at {path}: copy cluster/classroom/classroom.toml") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path} is not valid TOML: {exc}") from None
    known = {f.name: f for f in fields(ClassSettings) if f.name != "source"}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise SettingsError(f"{path}: unknown setting(s) {unknown}; the known ones are {sorted(known)}.")
    values = {}
    for name, value in data.items():
        _check_type(path, name, value, known[name].default)
        if name in _PATHS:
            value = Path(value) if value else None
            value = value if value is None or value.is_absolute() else REPO / value
        elif name in ("instructors", "extra_server_args"):
            value = tuple(value)
        values[name] = value
    settings = ClassSettings(**values, source=path)
    check(settings)
    return settings


def _check_type(path: Path, name: str, value, default) -> None:
    """A value of the setting's kind (TOML's: a number unquoted, true/false, a list in brackets), or a clear error."""
    if name in _PATHS:
        wanted, ok = "a path in quotes", isinstance(value, str)
    elif isinstance(default, bool):
        wanted, ok = "true or false", isinstance(value, bool)
    elif isinstance(default, int):
        wanted, ok = "a whole number >= 0 (unquoted)", type(value) is int and value >= 0
    elif isinstance(default, tuple):
        wanted, ok = 'a list of strings, e.g. ["a", "b"]', isinstance(value, list) and all(
            isinstance(item, str) for item in value)
    else:
        wanted, ok = "a string in quotes", isinstance(value, str)
    if not ok:
        raise SettingsError(f"{path}: {name} = {value!r} should be {wanted}.")


def check(settings: ClassSettings) -> None:
    """Refuse what cannot work or would expose the students' passwords."""
    try:
        ipaddress.ip_address(settings.ip)
    except ValueError:
        raise SettingsError(f"ip = {settings.ip!r} is not an address: use 127.0.0.1 (loopback) or "
                            f"0.0.0.0 (every interface, with TLS).") from None
    if settings.spawner not in ("local", "systemd"):
        raise SettingsError(f"spawner = {settings.spawner!r}: use 'local' or 'systemd'.")
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise SettingsError("tls_cert and tls_key go together: give both (PEM files) or neither.")
    if not settings.loopback and not settings.tls and not settings.plain_http_behind_proxy:
        raise SettingsError(f"ip = {settings.ip} opens the hub beyond this machine, but without TLS every "
                            f"password crosses the network in clear text. Give tls_cert and tls_key, or put a "
                            f"TLS reverse proxy in front and set plain_http_behind_proxy = true "
                            f"(INSTRUCTORS.md, section 2).")
    for name in ("tls_cert", "tls_key"):
        if getattr(settings, name) is not None and not getattr(settings, name).is_file():
            raise SettingsError(f"{name} = {getattr(settings, name)} does not exist.")
    if not settings.roster.is_file():
        raise SettingsError(f"roster = {settings.roster} does not exist: one student's username a line.")
