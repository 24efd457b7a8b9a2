"""What a launch asks for, checked before anything starts: the target (script, module or lab) and every number."""
from __future__ import annotations

import importlib.util
import socket
from dataclasses import dataclass
from pathlib import Path

from labsrc.core.paths import LESSONS
from labsrc.core.world import RequestError

LESSONS_PACKAGE = "labsrc.lessons"
LAB_FILE = "lab"
"""A lesson's torchrun entry, lessons/<lesson>/lab.py, is the lab <lesson>; another, lab_<name>.py, the lab <name>."""


def course_labs() -> dict[str, str]:
    """The course's labs, found by folder: {lab name: module}, from every labsrc/lessons/<lesson>/lab*.py."""
    labs = {}
    for lesson in sorted(path for path in LESSONS.iterdir() if (path / "__init__.py").is_file()):
        for entry in sorted(lesson.glob(f"{LAB_FILE}*.py")):
            if entry.stem == LAB_FILE:
                name = lesson.name
            elif entry.stem.startswith(LAB_FILE + "_"):
                name = entry.stem.removeprefix(LAB_FILE + "_")
            else:
                continue
            labs[name] = f"{LESSONS_PACKAGE}.{lesson.name}.{entry.stem}"
    return dict(sorted(labs.items()))


@dataclass(frozen=True)
class Target:
    """What torchrun runs on each rank: a course lab, a dotted module, or a script by path."""

    kind: str
    """'lab', 'module' or 'script'."""
    name: str
    """The run's name: runs/<name>/<run_id>/."""
    value: str
    """The module to run (lab, module) or the script's absolute path."""

    @property
    def entry_argv(self) -> list[str]:
        """The rank entry's arguments that run this target."""
        return ["--script", self.value] if self.kind == "script" else ["--module", self.value]


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def resolve_target(name) -> Target:
    """A script path (my_ddp.py, dir/x.py), a course lab (setup), or an importable module (pkg.mod)."""
    if not isinstance(name, (str, Path)) or not str(name).strip():
        raise RequestError(f"say what to launch: a script path, a module or a course lab (got {name!r}).")
    text = str(name).strip()
    path = Path(text).expanduser()
    if text.endswith(".py") or "/" in text or path.is_file():
        if not path.is_file():
            raise RequestError(f"no script at {path.resolve()}: check the path (relative paths start from "
                               f"{Path.cwd()}).")
        return Target("script", path.stem, str(path.resolve()))
    labs = course_labs()
    if text in labs:
        return Target("lab", text, labs[text])
    by_module = {module: name for name, module in labs.items()}
    if text in by_module:
        return Target("lab", by_module[text], text)
    if _module_exists(text):
        return Target("module", text.rsplit(".", 1)[-1], text)
    raise RequestError(
        f"{text!r} is not a script, a module or a course lab. Course labs: {', '.join(labs)}. "
        f"Give a script by its path (my_ddp.py) or a module by its dotted name (pkg.module).")


@dataclass(frozen=True)
class Nodes:
    """How many torchrun agents (simulated nodes) to start: a fixed count, or an elastic MIN:MAX range."""

    minimum: int
    maximum: int

    @property
    def spec(self) -> str:
        """torchrun's --nnodes value."""
        return str(self.maximum) if self.minimum == self.maximum else f"{self.minimum}:{self.maximum}"


def parse_nodes(nnodes) -> Nodes:
    """2 -> Nodes(2, 2); "1:2" -> Nodes(1, 2); anything else RequestError."""
    text = str(nnodes).strip()
    parts = text.split(":")
    if isinstance(nnodes, bool) or len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise RequestError(f"nnodes must be a whole number of nodes (2) or a range MIN:MAX (\"1:2\"); "
                           f"got {nnodes!r}.")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1 or high < low:
        raise RequestError(f"nnodes needs 1 <= MIN <= MAX (got {nnodes!r}).")
    return Nodes(low, high)


def check_number(name: str, value, minimum: float, whole: bool = False, strict: bool = False) -> None:
    """RequestError unless value is a number >= minimum (> minimum when strict), whole when asked."""
    kinds = (int,) if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value != value:
        kind = "a whole number" if whole else "a number"
        raise RequestError(f"{name} must be {kind} (got {value!r}).")
    if value < minimum or (strict and value == minimum):
        bound = f"more than {minimum:g}" if strict else f"{minimum:g} or more"
        raise RequestError(f"{name} must be {bound} (got {value!r}).")


def check_port(port, host: str = "127.0.0.1") -> None:
    """RequestError naming the fix unless `port` is in 1024-65535 and free on loopback."""
    check_number("port", port, 1024, whole=True)
    if port > 65535:
        raise RequestError(f"port must be 1024-65535 (got {port}); leave it unset to get a free one.")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise RequestError(
                f"port {port} on {host} is already in use ({exc.strerror}). Leave port unset so a free "
                f"one is chosen, or end the process holding it (`ss -ltnp | grep {port}`)."
            ) from None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the rendezvous of a multi-node run binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def check_profile(profile) -> None:
    from labsrc.core.profiles import PROFILES
    if profile is not None and profile not in PROFILES:
        raise RequestError(f"profile {profile!r} is unknown: use one of {sorted(PROFILES)} or leave it unset.")


def check_args(args) -> list[str]:
    """The target's own arguments as strings; a bare string is refused (it would split into characters)."""
    if isinstance(args, (str, bytes)) or not isinstance(args, (list, tuple)):
        raise RequestError(f"args must be a list of strings, e.g. args=['--epochs', '2'] (got {args!r}).")
    return [str(a) for a in args]


def lab_options_argv(module: str, options: dict, world_size: int) -> list[str]:
    """A course lab's typed options as flags, checked (also against the world size) before anything starts."""
    import importlib
    from labsrc.core.options import LabOptions
    options_class = getattr(importlib.import_module(module), "Options", LabOptions)
    checked = options_class.make(**options)
    checked.check_world(world_size)
    return checked.to_argv()
