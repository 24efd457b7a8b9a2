"""A class server's students as system accounts: made from a roster (idempotent), reach the course, removed after.

Each new account gets a random first password (chpasswd), printed once and kept in the state directory's
`passwords.txt` (mode 0600, root only); JupyterHub's PAM login checks it like any system password.
"""
from __future__ import annotations

import grp
import json
import os
import pwd
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

USERNAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
GRANTED_FILE = "granted_access.json"


class AccountError(RuntimeError):
    """A roster or an account operation that cannot be done; the message says what to do."""


@dataclass(frozen=True)
class Student:
    name: str
    full_name: str = ""
    email: str = ""
    """The grader's (nbgrader's gradebook); the class server does not use it."""


def read_roster(path) -> list[Student]:
    """Students from a roster: `username[,Full Name[,email]]` a line; blank lines and `#` comments skipped. The
    class server makes the accounts and the grader (labsrc.grading) its gradebook from the same file."""
    students, seen = [], set()
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = [part.strip() for part in line.split(",")]
        if len(fields) > 3:
            raise AccountError(f"{path}:{number}: {line!r} is not `username[,Full Name[,email]]` (more than three "
                               f"fields: a comma in a name?).")
        name, full_name, email = (fields + ["", ""])[:3]
        if not USERNAME.match(name):
            raise AccountError(f"{path}:{number}: {name!r} is not a valid username (lower case letters, digits, "
                               f"'_' or '-', starting with a letter, at most 32).")
        if name in seen:
            raise AccountError(f"{path}:{number}: {name} is listed twice.")
        seen.add(name)
        students.append(Student(name, full_name, email))
    if not students:
        raise AccountError(f"{path} lists no student.")
    return students


def _run(command: list[str], stdin: str | None = None) -> None:
    done = subprocess.run(command, input=stdin, text=True, capture_output=True)
    if done.returncode:
        raise AccountError(f"{' '.join(command[:2])} failed: {done.stderr.strip() or done.stdout.strip()}")


def exists(name: str) -> bool:
    """True when a system account of that name exists."""
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def _members(group: str) -> set[str]:
    try:
        entry = grp.getgrnam(group)
    except KeyError:
        return set()
    return set(entry.gr_mem) | {user.pw_name for user in pwd.getpwall() if user.pw_gid == entry.gr_gid}


def ensure_students(students: list[Student], group: str, passwords_file: Path) -> dict[str, str]:
    """Create the group and each missing account in it, with a random password; {new name: password}.

    An existing account is left as it is (its password too) if it already belongs to the group; an existing
    account outside the group is refused: the roster would otherwise hand a stranger's account to the hub.
    """
    try:
        grp.getgrnam(group)
    except KeyError:
        _run(["groupadd", group])
    members = _members(group)
    strangers = [s.name for s in students if exists(s.name) and s.name not in members]
    if strangers:
        raise AccountError(f"account(s) {strangers} exist already but not in group {group}: rename them in the "
                           f"roster, or add them yourself (usermod -aG {group} NAME) if they are students.")
    created = {}
    for student in students:
        if exists(student.name):
            continue
        _run(["useradd", "--create-home", "--shell", "/bin/bash", "--gid", group,
              "--comment", student.full_name or student.name, student.name])
        created[student.name] = secrets.token_urlsafe(9)
        _run(["chpasswd"], stdin=f"{student.name}:{created[student.name]}\n")
    if created:
        fd = os.open(passwords_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as out:
            out.writelines(f"{name} {password}\n" for name, password in created.items())
    return created


def remove_students(students: list[Student], group: str, state_dir: Path) -> list[str]:
    """Delete the roster's accounts that belong to `group` (with their homes), then the group if empty."""
    members, removed = _members(group), []
    for student in students:
        if student.name in members:
            subprocess.run(["pkill", "-KILL", "-u", student.name], capture_output=True)
            _run(["userdel", "--remove", student.name])
            removed.append(student.name)
    revoke_access(group, state_dir)
    if not _members(group) and group in {g.gr_name for g in grp.getgrall()}:
        _run(["groupdel", group])
    passwords = state_dir / "passwords.txt"
    if passwords.exists():
        kept = [line for line in passwords.read_text().splitlines() if line.split(" ", 1)[0] not in removed]
        passwords.write_text("".join(f"{line}\n" for line in kept))
    return removed


def blocked_directories(paths: list[Path], user: str) -> list[Path]:
    """The directories on the way to `paths` that `user` cannot pass through (checked as that user)."""
    blocked = []
    for path in paths:
        for directory in [*reversed(Path(path).resolve().parents), Path(path).resolve()]:
            if directory in blocked or not directory.is_dir():
                continue
            if subprocess.run(["runuser", "-u", user, "--", "test", "-x", str(directory)]).returncode:
                blocked.append(directory)
                break
    return blocked


def grant_access(directories: list[Path], group: str, state_dir: Path) -> None:
    """Let `group` pass through (not list) each directory: an ACL entry, recorded so that it can be revoked."""
    if shutil.which("setfacl") is None:
        raise AccountError(f"setfacl is missing (apt-get install -y acl), needed to let {group} pass through "
                           f"{', '.join(map(str, directories))}; or install the course where students can read it.")
    granted = _granted(state_dir)
    for directory in directories:
        _run(["setfacl", "--modify", f"g:{group}:x", str(directory)])
        granted.setdefault(group, []).append(str(directory))
    (state_dir / GRANTED_FILE).write_text(json.dumps(granted))


def revoke_access(group: str, state_dir: Path) -> None:
    granted = _granted(state_dir)
    for directory in granted.pop(group, []):
        subprocess.run(["setfacl", "--remove", f"g:{group}", directory], capture_output=True)
    if (state_dir / GRANTED_FILE).exists():
        (state_dir / GRANTED_FILE).write_text(json.dumps(granted))


def _granted(state_dir: Path) -> dict:
    try:
        return json.loads((state_dir / GRANTED_FILE).read_text())
    except (OSError, ValueError):
        return {}
